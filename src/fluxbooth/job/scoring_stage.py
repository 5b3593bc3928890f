"""Stage "score": the validation renders scored for likeness to the photos after training, by
`python -m fluxbooth.likeness` in a process of its own (this side imports only the contract's scoring interface,
fluxbooth.contract.scoring), and, when the request keeps the best step, that step's LoRA made the main artifact.

The scorer runs under the supervisor (supervisor.py), as the trainer does: in its own session, its output redacted
into `scoring.log` in the job folder, and killed when only the time kept for the report and the uploads is left.
Whatever goes wrong with it (no scorer, a crash, no time, a result that cannot be read), the section says so as
`unavailable` and the job goes on.

The one rule for keeping a step: the chosen step's LoRA takes the final LoRA's place (`lora/`, the same artifact
names), and the final weights move beside it with `final_` in front of their folder, names and kinds
(`final_lora/`, `final_lora`, `final_lora_comfyui`), as the EMA's carry `ema_`.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from fluxbooth.contract.events import DoneEvent
from fluxbooth.contract.layout import LORA_FOLDER, VALIDATION_FOLDER, step_folder_name
from fluxbooth.contract.scoring import (
    LIKENESS_RESULT_NAME,
    SCORING_INPUT_NAME,
    STEP_LORAS_FOLDER,
    ScoringInput,
    read_likeness_section,
    unavailable_section,
)
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.job.model_process import model_process_environment, run_model_process
from fluxbooth.job.planned import PlannedJob, seconds_left, upload_reserve
from fluxbooth.redaction import Redactor
from fluxbooth.settings import WorkerSettings

logger = logging.getLogger(__name__)

SCORING_MODULE = "fluxbooth.likeness"
SCORING_LOG_NAME = "scoring.log"
# The scorer is asked to stop this long before it is killed: time to write what it scored and exit.
SCORING_WIND_DOWN_SECONDS = 15.0
# Between SIGTERM and SIGKILL once its time is up: it has already had its stop time.
SCORING_KILL_GRACE_SECONDS = 2.0
# The rule for keeping a validation step's LoRA (the module docstring).
FINAL_PREFIX = "final_"


def scoring_command(input_path: Path, output_path: Path) -> list[str]:
    return [sys.executable, "-m", SCORING_MODULE, "--input", str(input_path), "--output", str(output_path)]


def scoring_seconds(job: PlannedJob) -> float:
    """What is left of the deadline for scoring: the time kept for the uploads (the deadline module's reserve) and
    the report's predicted time stay free."""
    report = dict(job.plan.phases).get("report")
    return seconds_left(job) - upload_reserve(job) - (report.seconds if report is not None else 0.0)


async def run_scoring(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    seconds: float,
    redact: Redactor,
    output_path: Path,
) -> dict[str, Any]:
    """Run the scoring `command` for at most `seconds` and read the section it wrote; `unavailable` with the reason
    when it had no time, failed, or was killed."""
    if seconds <= 0:
        return unavailable_section("the job deadline left no time to score the renders")
    reason = await run_model_process(
        command,
        env=env,
        cwd=cwd,
        seconds=seconds,
        redact=redact,
        log_path=cwd / SCORING_LOG_NAME,
        kill_grace_seconds=SCORING_KILL_GRACE_SECONDS,
        name="the scoring process",
        timed_out=f"scoring did not finish in the {seconds:.0f} s the job deadline left it (the report and uploads "
        "keep the rest)",
    )
    return read_likeness_section(output_path) if reason is None else unavailable_section(reason)


async def score_renders(
    job: PlannedJob, trainer: TrainerConfig, settings: WorkerSettings, job_dir: Path
) -> dict[str, Any]:
    """The likeness section of this job's renders: the scoring input written to the job folder, the scoring process
    run and its section read back."""
    seconds = scoring_seconds(job)
    input_path, output_path = job_dir / SCORING_INPUT_NAME, job_dir / LIKENESS_RESULT_NAME
    ScoringInput(
        photos_dir=trainer.instance_dir,
        validation_dir=str(Path(trainer.output_dir) / VALIDATION_FOLDER),
        subject_type=job.spec.subject_type,
        fidelity_prompts=job.spec.fidelity_prompts,
        keep_best_step=job.spec.keep_best_step,
        final_step=trainer.optimisation.steps,
        stop_at_unix_seconds=time.time() + seconds - SCORING_WIND_DOWN_SECONDS,
    ).write(input_path)
    return await run_scoring(
        scoring_command(input_path, output_path),
        env=model_process_environment(settings.environ),
        cwd=job_dir,
        seconds=seconds,
        redact=Redactor(settings.secret_values),
        output_path=output_path,
    )


def keep_best_step(
    section: dict[str, Any], output_dir: Path, artifacts: Sequence[Mapping[str, Any]], final_step: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the section, the trainer's artifacts) with the selected validation step's LoRA made the main one and the
    final weights kept beside it (the rule in the module docstring); unchanged when no earlier step was selected or
    its LoRA is missing. The section says which step's weights the main artifacts hold (`main_weights_step`)."""
    selected = section.get("selected_step")
    step_folder = (
        output_dir / STEP_LORAS_FOLDER / step_folder_name(selected) / LORA_FOLDER if isinstance(selected, int) else None
    )
    if step_folder is None or selected == final_step:
        return {**section, "main_weights_step": final_step}, [dict(artifact) for artifact in artifacts]
    if not step_folder.is_dir():
        note = f"step {selected}'s LoRA was not saved, so the final weights stay the main artifacts"
        logger.warning("likeness: %s", note)
        return {**section, "main_weights_step": final_step, "main_weights_note": note}, [
            dict(artifact) for artifact in artifacts
        ]
    (output_dir / LORA_FOLDER).rename(output_dir / f"{FINAL_PREFIX}{LORA_FOLDER}")
    shutil.move(str(step_folder), str(output_dir / LORA_FOLDER))
    kept: list[dict[str, Any]] = []
    for artifact in artifacts:
        kept.append(dict(artifact))
        if str(artifact["path"]).startswith(f"{LORA_FOLDER}/"):
            kept.append(
                {
                    **artifact,
                    "name": f"{FINAL_PREFIX}{artifact['name']}",
                    "kind": f"{FINAL_PREFIX}{artifact['kind']}",
                    "path": f"{FINAL_PREFIX}{artifact['path']}",
                }
            )
    return {**section, "main_weights_step": selected, "final_weights_folder": f"{FINAL_PREFIX}{LORA_FOLDER}"}, kept


async def scoring_stage(
    job: PlannedJob,
    trainer: TrainerConfig,
    settings: WorkerSettings,
    job_dir: Path,
    done: DoneEvent,
    stage: Callable[[str], AbstractContextManager[None]],
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the likeness section, the trainer's artifacts to verify and upload) after the trainer's `done`: the renders
    scored inside the job's `stage("score")`, then with keep_best_step the best step's LoRA made the main artifact.
    No section when the job does not score, when its run stopped for the deadline (no final renders, no time), or
    when the trainer failed after its export (no final renders)."""
    artifacts = [dict(artifact) for artifact in done.artifacts]
    if not job.spec.likeness or done.metrics.get("stopped_for_deadline") or done.metrics.get("failed_after_export"):
        return None, artifacts
    with stage("score"):
        section = await score_renders(job, trainer, settings, job_dir)
        if not job.spec.keep_best_step:
            return section, artifacts
        return keep_best_step(section, Path(trainer.output_dir), artifacts, trainer.optimisation.steps)
