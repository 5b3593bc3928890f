"""A job is planned twice: before its dataset arrives (for the fewest images a dataset may hold, so only what no
dataset could fit is refused then) and again with the prepared images, before the base model is downloaded
and the trainer starts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.dataset import PreparedDataset
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job import run as job_module
from fluxbooth.job.planned import PlannedJob, replan_for_dataset
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.plan import Plan
from fluxbooth.progress import ProgressReporter
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from tests.support.factories import make_dataset_zip, to_base64


@pytest.fixture
def settings(worker_env: dict[str, str], model_cache_dir: Path) -> WorkerSettings:
    ensure_tiny_model(model_cache_dir)
    return WorkerSettings.from_environ(worker_env)


def tiny_lora_job(**overrides: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "dataset": to_base64(make_dataset_zip(4)),
        "instance_prompt": "a photo of sks dog",
        "training_type": "lora",
        "steps": 1,
        "resolution": "64x64",
        **overrides,
    }


def plan_stage(job_input: dict[str, Any], settings: WorkerSettings, tmp_path: Path) -> PlannedJob:
    stages = job_module.JobStages(ProgressReporter(lambda payload: None))
    request = parse_request(job_input)
    return asyncio.run(job_module._plan_job(request, "job-1", settings, stages, tmp_path / "job"))


def prepared(instance_images: int, tmp_path: Path) -> PreparedDataset:
    return PreparedDataset(
        instance_dir=tmp_path,
        class_dir=None,
        instance_images=instance_images,
        class_images=0,
        captions=0,
        skipped={},
        smaller_than_resolution=0,
    )


def test_a_four_image_one_step_lora_job_is_planned_before_its_dataset_arrives(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    # At the default 1024², sized for the worker's 1,000-image cap, this plan was refused ("caching ≈87 min"). No
    # validation renders: the default ones at 1024² on this CPU would take longer than the deadline on their own.
    job_input = tiny_lora_job(validation_prompts=[])
    del job_input["resolution"]

    planned = plan_stage(job_input, settings, tmp_path)

    assert planned.plan.training_type == "lora"


def caching_seconds(plan: Plan) -> float:
    return dict(plan.phases)["caching"].seconds


def test_the_plan_is_made_again_for_the_images_that_arrived(settings: WorkerSettings, tmp_path: Path) -> None:
    planned = plan_stage(tiny_lora_job(), settings, tmp_path)
    early = caching_seconds(planned.plan)

    replanned = replan_for_dataset(planned, prepared(300, tmp_path), tmp_path / "job")

    # Caching encodes every image: 100 times the early plan's three images.
    assert caching_seconds(replanned.plan) == pytest.approx(100 * early, rel=0.2)


def test_a_dataset_too_large_for_the_deadline_is_refused_before_launch(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    planned = plan_stage(tiny_lora_job(timeout_seconds=60), settings, tmp_path)
    # The time left when the dataset is ready: the few images the early plan assumed would have fitted.
    planned = dataclasses.replace(planned, started=time.monotonic())

    with pytest.raises(FluxboothError) as refused:
        replan_for_dataset(planned, prepared(1000, tmp_path), tmp_path / "job")

    assert refused.value.code is ErrorCode.DOES_NOT_FIT
    assert "(caching ≈3 min)" in refused.value.message and "beyond the job deadline" in refused.value.message


def test_a_job_whose_stop_time_has_passed_when_its_dataset_is_ready_is_timeout_before_launch(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    planned = plan_stage(tiny_lora_job(timeout_seconds=60), settings, tmp_path)
    # 20 s left: the tiny run itself fits, the reserves kept for stopping it cleanly (a tenth of the deadline for
    # the uploads, the trainer's 30 s teardown) do not.
    planned = dataclasses.replace(planned, started=time.monotonic() - 40)

    with pytest.raises(FluxboothError) as refused:
        replan_for_dataset(planned, prepared(4, tmp_path), tmp_path / "job")

    assert refused.value.code is ErrorCode.TIMEOUT
    message = refused.value.message
    assert message.startswith("the job deadline of 60 s leaves ≈20 s after the stages before training")
    assert "the trainer would start with its stop time already past" in message
    assert "teardown 30 s" in message and "uploads 6 s" in message
    assert refused.value.details["seconds_left"] == pytest.approx(20, abs=2)
