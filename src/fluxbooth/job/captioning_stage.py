"""Stage "caption": with `captioning: "missing"`, each training photo without a caption file captioned before
training by `python -m fluxbooth.captions` in a process of its own (this side imports only the contract's
interface, fluxbooth.contract.captioning), so that its memory is free before the base model loads.

The captioner runs under the supervisor, as the scorer does: its own session, its output redacted into
`captioning.log` in the job folder, killed when its time is up. Its time is what the deadline leaves beyond the
plan's predicted run and the reserves for stopping the trainer cleanly: captioning never takes the training's time.
Whatever goes wrong (no model, a crash, no time, a caption without the trigger word), those photos train on the
instance prompt and one warning says why. A caption the user sent is never touched: only photos without a `.txt`
are listed, and a caption is written only where no `.txt` exists.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.contract.captioning import (
    CAPTION_SUFFIX,
    CAPTIONING_INPUT_NAME,
    CAPTIONING_OUTPUT_NAME,
    CaptioningInput,
    caption_model,
    captioning_command,
    read_captioning_output,
    unavailable_output,
)
from fluxbooth.contract.captions import MAX_CAPTION_CHARS, contains_word
from fluxbooth.dataset import PreparedDataset
from fluxbooth.dataset.guards import ensure_inside
from fluxbooth.job.model_process import model_process_environment, run_model_process
from fluxbooth.job.planned import PlannedJob, seconds_left, stop_reserves
from fluxbooth.job.stages import JobStages
from fluxbooth.redaction import Redactor
from fluxbooth.settings import WorkerSettings

logger = logging.getLogger(__name__)

CAPTIONING_LOG_NAME = "captioning.log"
# The captioner is asked to stop this long before it is killed: time to write what it captioned and exit.
CAPTIONING_WIND_DOWN_SECONDS = 10.0
CAPTIONING_KILL_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class CaptioningOutcome:
    """What the stage did: the prepared images it captioned, and the warning when some could not be."""

    captioned: frozenset[str] = frozenset()
    warning: str | None = None


def uncaptioned_images(dataset: PreparedDataset) -> list[str]:
    """The prepared instance images without a caption file, in upload order."""
    return [
        name
        for name in dataset.uploaded_names
        if not (dataset.instance_dir / name).with_suffix(CAPTION_SUFFIX).exists()
    ]


def captioning_seconds(job: PlannedJob) -> float:
    """What the deadline leaves for captioning: the time left less the plan's predicted run and the reserves for a
    clean stop, so captioning never shortens the training the plan promised."""
    planned = job.plan.predicted_total_seconds or 0.0
    return seconds_left(job) - planned - sum(stop_reserves(job).values())


def accepted_captions(output: dict[str, Any], images: list[str], trigger_word: str | None) -> dict[str, str]:
    """The output's captions that may be trained on: for a listed image, a non-blank string within the caption
    bound, holding the trigger word when there is one (the job's guarantee, whatever the captioner did)."""
    captions = output.get("captions") or {}
    accepted = {}
    for name in images:
        caption = captions.get(name)
        if not isinstance(caption, str) or not caption.strip() or len(caption) > MAX_CAPTION_CHARS:
            continue
        if trigger_word and not contains_word(caption, trigger_word):
            continue
        accepted[name] = " ".join(caption.split())
    return accepted


def write_captions(captions: dict[str, str], dataset: PreparedDataset, job_dir: Path) -> frozenset[str]:
    """Each caption beside its image, never over a caption file that is there (the user's)."""
    written = set()
    for name, caption in captions.items():
        target = ensure_inside((dataset.instance_dir / name).with_suffix(CAPTION_SUFFIX), job_dir)
        try:
            with target.open("x", encoding="utf-8") as caption_file:
                caption_file.write(caption + "\n")
        except FileExistsError:
            continue
        written.add(name)
    return frozenset(written)


def fallback_warning(output: dict[str, Any], listed: int, captioned: int) -> str | None:
    """One warning for the photos that train on the instance prompt instead, saying why; None when none does."""
    missing = listed - captioned
    if missing == 0:
        return None
    if output.get("status") == "unavailable":
        reason = str(output.get("reason") or "no reason given")
    else:
        reason = "its captions for them were empty, too long, or lacked the trigger word"
    return f"captioning: {missing} of {listed} photos without a caption file train on the instance prompt: {reason}"


async def run_captioner(
    job: PlannedJob, settings: WorkerSettings, job_dir: Path, photos_dir: Path, images: list[str]
) -> dict[str, Any]:
    """The captioning process run on `images` in the time the deadline leaves it; its output, or an `unavailable`
    one saying why there is none."""
    seconds = captioning_seconds(job)
    if seconds <= CAPTIONING_WIND_DOWN_SECONDS:
        return unavailable_output("the job deadline left no time beyond the planned training to caption the photos")
    model, revision = caption_model(settings.caption_model)
    input_path, output_path = job_dir / CAPTIONING_INPUT_NAME, job_dir / CAPTIONING_OUTPUT_NAME
    CaptioningInput(
        photos_dir=str(photos_dir),
        images=tuple(images),
        model=model,
        revision=revision,
        trigger_word=job.spec.dataset.trigger_word,
        class_noun=job.spec.class_noun,
        subject_type=job.spec.subject_type,
        seed=job.spec.optimisation.seed,
        stop_at_unix_seconds=time.time() + seconds - CAPTIONING_WIND_DOWN_SECONDS,
    ).write(input_path)
    reason = await run_model_process(
        captioning_command(input_path, output_path),
        env=model_process_environment(settings.environ),
        cwd=job_dir,
        seconds=seconds,
        redact=Redactor(settings.secret_values),
        log_path=job_dir / CAPTIONING_LOG_NAME,
        kill_grace_seconds=CAPTIONING_KILL_GRACE_SECONDS,
        name="the captioning process",
        timed_out=f"the captioner did not finish in the {seconds:.0f} s the deadline left it",
    )
    output = read_captioning_output(output_path)
    return output if reason is None else unavailable_output(reason, output.get("captions"))


async def captioning_stage(
    job: PlannedJob, settings: WorkerSettings, stages: JobStages, job_dir: Path, dataset: PreparedDataset
) -> CaptioningOutcome:
    """The photos without a caption file captioned (the module docstring), when the request asks for it."""
    if job.spec.dataset.captioning != "missing":
        return CaptioningOutcome()
    if dataset.control_dir is not None:
        return CaptioningOutcome(
            warning="captioning: image pairs are not captioned (an edit's caption says what changes, which a "
            "description of one photo cannot); each pair trains on its caption file or the instance prompt"
        )
    images = uncaptioned_images(dataset)
    if not images:
        return CaptioningOutcome()
    with stages.stage("caption", images=len(images)):
        output = await run_captioner(job, settings, job_dir, dataset.instance_dir, images)
        accepted = accepted_captions(output, images, job.spec.dataset.trigger_word)
        captioned = write_captions(accepted, dataset, job_dir)
    warning = fallback_warning(output, len(images), len(captioned))
    if warning is not None:
        logger.warning("%s", warning)
    return CaptioningOutcome(captioned, warning)
