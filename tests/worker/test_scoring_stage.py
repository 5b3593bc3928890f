"""The job's "score" stage (fluxbooth.job.scoring_stage): the scoring process run in its own session and read back, every
way it can fail turned into an `unavailable` section (never a failed job), and the kept step's LoRA made the main
artifact with the final weights beside it under `final_`.

The scoring processes here are real Python processes: one that is not there, one that hangs, one that writes a
section, one that prints a secret."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.scoring import LIKENESS_RESULT_NAME, PROXY_NOTE, STEP_LORAS_FOLDER
from fluxbooth.job.model_process import model_location_environment, model_process_environment
from fluxbooth.job.run import run_job
from fluxbooth.job.scoring_stage import SCORING_LOG_NAME, keep_best_step, run_scoring
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.redaction import MASK, Redactor
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from fluxbooth.storage.artifacts import collect_artifacts
from tests.conftest import REPO_ROOT
from tests.support.factories import make_dataset_zip, to_base64

SECRET = "hf_secret_token_value"
LORA_FILES = ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors")
FINAL_ARTIFACTS = [
    {"name": "lora", "path": "lora/pytorch_lora_weights.safetensors", "kind": "lora_diffusers"},
    {"name": "lora_comfyui", "path": "lora/lora_comfyui.safetensors", "kind": "lora_comfyui"},
    {"name": "validation_index", "path": "validation/validation.json", "kind": "validation_index"},
]


def score(tmp_path: Path, source: str, seconds: float = 30, secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    command = [sys.executable, "-c", source, str(tmp_path / LIKENESS_RESULT_NAME)]
    return asyncio.run(
        run_scoring(
            command,
            env=model_process_environment({"PATH": "/usr/bin:/bin"}),
            cwd=tmp_path,
            seconds=seconds,
            redact=Redactor(secrets),
            output_path=tmp_path / LIKENESS_RESULT_NAME,
        )
    )


# ---- the scoring process ----------------------------------------------------------------------------------------


def test_a_missing_scoring_module_leaves_the_section_unavailable_with_the_reason(tmp_path: Path) -> None:
    section = asyncio.run(
        run_scoring(
            [sys.executable, "-m", "no_such_scoring_module"],
            env=model_process_environment({"PATH": "/usr/bin:/bin"}),
            cwd=tmp_path,
            seconds=30,
            redact=Redactor(()),
            output_path=tmp_path / LIKENESS_RESULT_NAME,
        )
    )

    assert section["status"] == "unavailable"
    assert section["reason"].startswith("the scoring process failed (exit status 1): ")
    assert "No module named no_such_scoring_module" in section["reason"]
    assert (section["steps"], section["selected_step"], section["note"]) == ([], None, PROXY_NOTE)


def test_a_scoring_process_that_outlives_its_time_is_killed_and_the_section_says_so(tmp_path: Path) -> None:
    started = time.monotonic()

    section = score(tmp_path, "import time; time.sleep(120)", seconds=1)

    assert section["status"] == "unavailable"
    assert section["reason"] == (
        "scoring did not finish in the 1 s the job deadline left it (the report and uploads keep the rest)"
    )
    assert time.monotonic() - started < 20


def test_no_time_left_means_no_scoring_process(tmp_path: Path) -> None:
    section = score(tmp_path, "import sys; open(sys.argv[1], 'w').write('{}')", seconds=0)

    assert section["reason"] == "the job deadline left no time to score the renders"
    assert not (tmp_path / LIKENESS_RESULT_NAME).exists()


def test_the_section_the_scoring_process_writes_is_read_back(tmp_path: Path) -> None:
    written = {"status": "scored", "steps": [{"step": 0}], "selected_step": None, "note": PROXY_NOTE}

    section = score(tmp_path, f"import json, sys; json.dump({written!r}, open(sys.argv[1], 'w'))")

    assert section == written


def test_a_scoring_process_that_exits_cleanly_without_a_result_leaves_the_section_unavailable(tmp_path: Path) -> None:
    section = score(tmp_path, "pass")

    assert (section["status"], section["reason"]) == ("unavailable", "the scoring process wrote no result")


def test_the_scoring_log_in_the_job_folder_is_redacted(tmp_path: Path) -> None:
    score(tmp_path, f"import sys; print('token {SECRET}', file=sys.stderr); sys.exit(2)", secrets=(SECRET,))

    log = (tmp_path / SCORING_LOG_NAME).read_text()
    assert f"token {MASK}" in log and SECRET not in log


WORKER_ENVIRON = {
    "HF_HOME": "/cache/hf",
    "HF_TOKEN": SECRET,
    "FLUXBOOTH_LIKENESS_DINO": "/models/dino",
    "BUCKET_SECRET_ACCESS_KEY": "k",
    "HOME": "/root",
    "PATH": "/usr/bin",
    "RUNPOD_AI_API_KEY": "runpod-key",
}


def test_the_model_locations_are_the_workers_model_variables_without_a_secret() -> None:
    assert model_location_environment(WORKER_ENVIRON) == {
        "HF_HOME": "/cache/hf",
        "FLUXBOOTH_LIKENESS_DINO": "/models/dino",
        "HOME": "/root",
    }


def test_the_scoring_process_sees_the_model_locations_and_the_hub_token_but_no_storage_or_runpod_secret() -> None:
    env = model_process_environment(WORKER_ENVIRON)

    assert (env["FLUXBOOTH_LIKENESS_DINO"], env["HF_TOKEN"]) == ("/models/dino", SECRET)
    assert "BUCKET_SECRET_ACCESS_KEY" not in env and "RUNPOD_AI_API_KEY" not in env


# ---- keeping the best step ---------------------------------------------------------------------------------------


def safetensors_bytes(value: float) -> bytes:
    data = struct.pack("<f", value)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    return struct.pack("<Q", len(header)) + header + data


def write_lora(folder: Path, value: float) -> None:
    folder.mkdir(parents=True)
    for name in LORA_FILES:
        (folder / name).write_bytes(safetensors_bytes(value))


@pytest.fixture
def output_dir(tmp_path: Path) -> Path:
    """The trainer's output: the final LoRA (step 6), the LoRAs of validation steps 2 and 4, validation.json."""
    output = tmp_path / "output"
    write_lora(output / "lora", 6.0)
    for step in (2, 4):
        write_lora(output / STEP_LORAS_FOLDER / f"step-{step:06d}" / "lora", float(step))
    (output / "validation").mkdir()
    (output / "validation" / "validation.json").write_text("{}")
    return output


def scored(selected: int | None) -> dict[str, Any]:
    return {"status": "scored", "steps": [], "selected_step": selected, "selection": "why", "note": PROXY_NOTE}


def test_the_selected_steps_lora_becomes_the_main_artifact_and_the_final_one_stays_beside_it(output_dir: Path) -> None:
    section, artifacts = keep_best_step(scored(4), output_dir, FINAL_ARTIFACTS, final_step=6)

    stored = {artifact.name: artifact for artifact in collect_artifacts(output_dir, artifacts)}
    assert {name: artifact.kind for name, artifact in stored.items()} == {
        "lora/pytorch_lora_weights.safetensors": "lora_diffusers",
        "lora/lora_comfyui.safetensors": "lora_comfyui",
        "final_lora/pytorch_lora_weights.safetensors": "final_lora_diffusers",
        "final_lora/lora_comfyui.safetensors": "final_lora_comfyui",
        "validation/validation.json": "validation_index",
    }
    assert stored["lora/lora_comfyui.safetensors"].path.read_bytes() == safetensors_bytes(4.0)
    assert stored["final_lora/lora_comfyui.safetensors"].path.read_bytes() == safetensors_bytes(6.0)
    assert (section["main_weights_step"], section["final_weights_folder"], section["selection"]) == (
        4,
        "final_lora",
        "why",
    )


@pytest.mark.parametrize("selected", [None, 6], ids=["no-step-passed-the-guards", "the-final-step"])
def test_without_an_earlier_selected_step_the_final_weights_stay_main(output_dir: Path, selected: int | None) -> None:
    section, artifacts = keep_best_step(scored(selected), output_dir, FINAL_ARTIFACTS, final_step=6)

    assert artifacts == FINAL_ARTIFACTS
    assert (output_dir / "lora" / LORA_FILES[0]).read_bytes() == safetensors_bytes(6.0)
    assert section["main_weights_step"] == 6 and "final_weights_folder" not in section


def test_a_selected_step_without_its_saved_lora_keeps_the_final_weights_and_says_why(output_dir: Path) -> None:
    section, artifacts = keep_best_step(scored(3), output_dir, FINAL_ARTIFACTS, final_step=6)

    assert artifacts == FINAL_ARTIFACTS
    assert (section["main_weights_step"], section["main_weights_note"]) == (
        6,
        "step 3's LoRA was not saved, so the final weights stay the main artifacts",
    )


# ---- a whole job whose scoring cannot run ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_job_whose_renders_cannot_be_scored_succeeds_with_the_likeness_section_unavailable(
    worker_env: dict[str, str],
    model_cache_dir: Path,
) -> None:
    # The stand-in trainer renders nothing: whatever the scoring process is, it has nothing to score.
    ensure_tiny_model(model_cache_dir)
    # This checkout's fluxbooth (src/) and its tests package, in the trainer's and the scoring process's environment.
    pythonpath = os.pathsep.join((str(REPO_ROOT / "src"), str(REPO_ROOT)))
    env = {**worker_env, "PYTHONPATH": pythonpath, "FLUXBOOTH_TRAINER_MODULE": "tests.support.fake_trainer_module"}
    job_input = {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "dataset": to_base64(make_dataset_zip(3)),
        "instance_prompt": "a photo of sks dog",
        "steps": 2,
        "resolution": 64,
    }
    result = asyncio.run(run_job(job_input, job_id="unscored", settings=WorkerSettings.from_environ(env)))

    assert "error" not in result, result
    assert result["likeness"]["status"] == "unavailable" and result["likeness"]["reason"]
    assert "score" in result["metrics"]["seconds"]
