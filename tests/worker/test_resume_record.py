"""A checkpoint records what it was trained on (base model, family, training type, LoRA shape), and a resume that
does not match it, or that starts at or past the requested steps, or whose COMPLETE index holds absurd numbers, is
`invalid_input` naming resume_from at the plan stage: before the dataset, the base model or the GPU are touched."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.checkpoint_record import (
    CHECKPOINT_RECORD_NAME,
    COMPLETE_MARKER,
    CheckpointRecord,
    CompleteIndex,
)
from fluxbooth.contract.layout import CHECKPOINT_STATE_NAME
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job import run as job_module
from fluxbooth.job.planned import PlannedJob
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.progress import ProgressReporter
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from fluxbooth.storage.checkpoints import job_checkpoint_record, upload_checkpoint
from fluxbooth.storage.stores import open_checkpoint_store
from tests.support.factories import make_dataset_zip, to_base64

MODEL = "sks-dog"


@pytest.fixture
def settings(worker_env: dict[str, str], model_cache_dir: Path) -> WorkerSettings:
    ensure_tiny_model(model_cache_dir)
    return WorkerSettings.from_environ(worker_env)


def lora_job(**overrides: Any) -> dict[str, Any]:
    return {
        "model_name": MODEL,
        "base_model": TINY_MODEL_NAME,
        "dataset": to_base64(make_dataset_zip(4)),
        "instance_prompt": "a photo of sks dog",
        "training_type": "lora",
        "steps": 10,
        "resolution": "64x64",
        **overrides,
    }


def plan_stage(job_input: dict[str, Any], settings: WorkerSettings, tmp_path: Path) -> PlannedJob:
    stages = job_module.JobStages(ProgressReporter(lambda payload: None))
    return asyncio.run(job_module._plan_job(parse_request(job_input), "job-1", settings, stages, tmp_path / "job"))


def refusal(job_input: dict[str, Any], settings: WorkerSettings, tmp_path: Path) -> FluxboothError:
    with pytest.raises(FluxboothError) as refused:
        plan_stage(job_input, settings, tmp_path)
    return refused.value


def this_jobs_record(settings: WorkerSettings, tmp_path: Path, **overrides: Any) -> CheckpointRecord:
    planned = plan_stage(lora_job(**overrides), settings, tmp_path / "first")
    return job_checkpoint_record(planned.spec, planned.size.family)


def store_checkpoint(settings: WorkerSettings, tmp_path: Path, step: int, record: CheckpointRecord | None) -> Path:
    """A checkpoint-<step> folder as the trainer leaves it (its state file, its record unless None), uploaded
    under the model's checkpoint prefix with its COMPLETE index; returns the stored folder's COMPLETE."""
    folder = tmp_path / "made" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_STATE_NAME).write_text(json.dumps({"step": step, "training_type": "lora"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    if record is not None:
        (folder / CHECKPOINT_RECORD_NAME).write_text(record.to_json())
    upload_checkpoint(open_checkpoint_store(settings, MODEL), folder, step)
    return settings.output_dir / MODEL / "checkpoints" / f"checkpoint-{step}" / COMPLETE_MARKER


def test_latest_trained_on_another_base_model_is_refused_naming_both(settings: WorkerSettings, tmp_path: Path) -> None:
    record = dataclasses.replace(this_jobs_record(settings, tmp_path), base_model="black-forest-labs/FLUX.1-dev")
    store_checkpoint(settings, tmp_path, 4, record)

    error = refusal(lora_job(resume_from="latest"), settings, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith("input.resume_from: ")
    assert (
        f"checkpoint-4 was trained on base_model 'black-forest-labs/FLUX.1-dev', this job's is '{TINY_MODEL_NAME}'"
        in error.message
    )


def test_latest_with_another_lora_shape_is_refused_naming_the_difference(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    store_checkpoint(settings, tmp_path, 4, this_jobs_record(settings, tmp_path, lora_rank=8))

    error = refusal(lora_job(resume_from="latest", lora_rank=16), settings, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert "lora_rank 8 (this job: 16)" in error.message


def test_latest_on_the_same_base_and_shape_is_planned_without_warnings(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    store_checkpoint(settings, tmp_path, 4, this_jobs_record(settings, tmp_path))

    planned = plan_stage(lora_job(resume_from="latest"), settings, tmp_path)

    assert planned.resume_checkpoint is not None and planned.resume_checkpoint.step == 4
    assert not [warning for warning in planned.warnings if "resume_from" in warning]


def test_a_checkpoint_at_or_past_the_requested_steps_is_refused_before_launch(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    store_checkpoint(settings, tmp_path, 12, this_jobs_record(settings, tmp_path))

    error = refusal(lora_job(resume_from="latest", steps=10), settings, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith("input.resume_from: ")
    assert "checkpoint-12 is at step 12, not before this job's steps=10: steps is the total" in error.message


@pytest.mark.parametrize("step", [-1, 10**12, 2.5, "4", 1e400, None])
def test_a_complete_index_with_an_absurd_step_is_invalid_input_naming_resume_from(
    settings: WorkerSettings, tmp_path: Path, step: Any
) -> None:
    marker = store_checkpoint(settings, tmp_path, 4, this_jobs_record(settings, tmp_path))
    index = json.loads(marker.read_text())
    marker.write_text(json.dumps({**index, "step": step}))

    error = refusal(lora_job(resume_from="latest"), settings, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith(f"input.resume_from: the {COMPLETE_MARKER} index of ")
    assert "is unreadable (step is" in error.message


@pytest.mark.parametrize("size", [-5, 2**60, 3.5])
def test_a_complete_index_with_an_absurd_file_size_is_invalid_input_naming_resume_from(
    settings: WorkerSettings, tmp_path: Path, size: Any
) -> None:
    marker = store_checkpoint(settings, tmp_path, 4, this_jobs_record(settings, tmp_path))
    index = json.loads(marker.read_text())
    index["files"][0]["bytes"] = size
    marker.write_text(json.dumps(index))

    error = refusal(lora_job(resume_from="latest"), settings, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith(f"input.resume_from: the {COMPLETE_MARKER} index of ")


def test_a_checkpoint_from_before_the_record_is_accepted_with_a_warning(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    store_checkpoint(settings, tmp_path, 4, record=None)

    planned = plan_stage(lora_job(resume_from="latest"), settings, tmp_path)

    assert planned.resume_checkpoint is not None and planned.resume_checkpoint.step == 4
    assert any(
        warning.startswith("resume_from: ")
        and "was made before checkpoints recorded their base model, so it is "
        f"assumed to be trained on '{TINY_MODEL_NAME}'"
        in warning
        for warning in planned.warnings
    ), planned.warnings


def test_the_complete_index_reads_back_what_it_wrote() -> None:
    index = CompleteIndex(step=3, files={"a/b.pt": (12, "0" * 64)})

    assert CompleteIndex.from_json(index.to_json()) == index


def test_a_record_reads_back_what_it_wrote() -> None:
    record = CheckpointRecord("base", "flux1", "lora", lora_rank=4, lora_alpha=4.0, lora_targets=("to_q", "to_k"))

    assert CheckpointRecord.from_json(record.to_json()) == record
