"""The job spec (fluxbooth.request.spec): the request resolved once for the sized base model; the planner, the launch files
and the trainer read it and fill in nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import FUSED_ADAFACTOR_LEARNING_RATE
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.job.launch_files import trainer_config_for, write_launch_files
from fluxbooth.models.families import KONTEXT_LORA_TARGETS
from fluxbooth.plan import as_job, choose_plan
from fluxbooth.plan.timing import phase_seconds
from fluxbooth.plan.types import Strategy
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import FLUX_DEV_NAME, FLUX_SCHNELL_NAME, model_size
from tests.conftest import REPO_ROOT
from tests.support.guide_job import LORA_PLAN
from tests.support.specs import job_spec

H100 = hypothetical_hardware(
    gpus=1,
    gpu_memory_bytes=80 * GIB,
    host_memory_bytes=256 * GIB,
    disk_bytes=500 * GIB,
    cpu_count=16,
    gpu_name="NVIDIA H100 80GB HBM3",
)
# The fields of train.json that hold null because what they name is absent (no class images, no checkpoints, no
# EMA, ...), never because the trainer is to fill them in.
ABSENT_IN_A_PLAIN_LORA = {
    "class_dir",
    "prompts.class_prompt",
    "checkpoints.every",
    "checkpoints.dir",
    "checkpoints.resume_from",
    "optimisation.ema_decay",
    "class_image_cache_dir",
    "validation.steps",
    "control_dir",
    "stop_at_unix_seconds",
    "validation.step_loras_dir",
}


def lora_request(**fields: Any) -> dict[str, Any]:
    return {
        "model_name": "m",
        "dataset_url": "https://example.com/d.zip",
        "instance_prompt": "a photo of sks dog",
        **fields,
    }


def written_train_json(spec: JobSpec, tmp_path: Path, base_model: str = "/models/flux") -> dict[str, Any]:
    trainer = trainer_config_for(
        spec, LORA_PLAN, base_model=base_model, instance_dir=tmp_path / "i", class_dir=None, job_dir=tmp_path
    )
    return json.loads(write_launch_files(tmp_path, LORA_PLAN, trainer).trainer_config.read_text())


def null_fields(values: dict[str, Any], prefix: str = "") -> set[str]:
    """Every field of a train.json (nested ones by their dotted path) that holds null."""
    nulls = set()
    for name, value in values.items():
        if isinstance(value, dict):
            nulls |= null_fields(value, f"{prefix}{name}.")
        elif value is None:
            nulls.add(prefix + name)
    return nulls


def sampling_of(train_json: dict[str, Any]) -> tuple[object, ...]:
    return tuple(
        train_json["sampling"][name]
        for name in (
            "max_sequence_length",
            "validation_inference_steps",
            "validation_guidance_scale",
            "class_image_inference_steps",
        )
    )


# ---- nothing left for the trainer to fill ------------------------------------------------------------------


def test_the_demos_train_json_holds_null_only_where_something_is_absent(tiny_base: Path, tmp_path: Path) -> None:
    demo = parse_request(json.loads((REPO_ROOT / "test_input.json").read_text())["input"])
    train_json = written_train_json(job_spec(demo, model_size(str(tiny_base))), tmp_path, str(tiny_base))

    assert null_fields(train_json) == ABSENT_IN_A_PLAIN_LORA


def test_the_demos_train_json_carries_the_tiny_models_sampling(tiny_base: Path, tmp_path: Path) -> None:
    demo = parse_request(json.loads((REPO_ROOT / "test_input.json").read_text())["input"])
    train_json = written_train_json(job_spec(demo, model_size(str(tiny_base))), tmp_path, str(tiny_base))

    assert sampling_of(train_json) == (512, 28, 3.5, 28)


def test_a_lora_with_every_default_writes_a_train_json_without_a_trigger_word_and_nothing_else_null(
    tmp_path: Path,
) -> None:
    train_json = written_train_json(job_spec(parse_request(lora_request())), tmp_path)

    assert null_fields(train_json) == ABSENT_IN_A_PLAIN_LORA | {"prompts.trigger_word"}


def test_a_lora_with_every_default_writes_flux_devs_lora_and_sampling(tmp_path: Path) -> None:
    train_json = written_train_json(job_spec(parse_request(lora_request())), tmp_path)

    assert (train_json["optimisation"]["learning_rate"], train_json["lora"]["rank"], train_json["lora"]["alpha"]) == (
        1e-4,
        16,
        16.0,
    )
    assert sampling_of(train_json) == (512, 28, 3.5, 28)
    assert train_json["export"]["formats"] == ["diffusers", "comfyui"]


# ---- resolution, one object end to end ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resolution", "written", "expected"),
    [
        (1024, [1024], Resolution(sizes=(1024,))),
        ("768x1024", "768x1024", Resolution(fixed=(768, 1024))),
        ([1024, 512, 768], [512, 768, 1024], Resolution(sizes=(512, 768, 1024))),
    ],
)
def test_resolution_round_trips_through_train_json_unchanged(
    resolution: object, written: object, expected: Resolution, tmp_path: Path
) -> None:
    spec = job_spec(parse_request(lora_request(resolution=resolution)))
    trainer = trainer_config_for(
        spec, LORA_PLAN, base_model="/models/flux", instance_dir=tmp_path / "i", class_dir=None, job_dir=tmp_path
    )
    path = write_launch_files(tmp_path, LORA_PLAN, trainer).trainer_config

    assert json.loads(path.read_text())["resolution"] == written
    assert spec.resolution == trainer.resolution == TrainerConfig.read(path).resolution == expected


# ---- FLUX.1-schnell is planned with its own sampling ------------------------------------------------------


def test_a_schnell_job_is_planned_with_schnells_4_sampling_steps() -> None:
    spec = job_spec(parse_request(lora_request(validation_prompts=["a sks dog"])), model_size(FLUX_SCHNELL_NAME))

    job = as_job(spec)

    assert (job.validation_inference_steps, job.class_image_inference_steps) == (4, 4)


def test_a_dev_job_is_planned_with_devs_28_sampling_steps() -> None:
    job = as_job(job_spec(parse_request(lora_request(validation_prompts=["a sks dog"]))))

    assert (job.validation_inference_steps, job.class_image_inference_steps) == (28, 28)


def test_schnells_validation_renders_are_timed_at_4_steps_not_devs_28() -> None:
    model = model_size(FLUX_SCHNELL_NAME)
    job = as_job(job_spec(parse_request(lora_request(validation_prompts=["a sks dog"])), model), 10)
    strategy = Strategy("lora", True, 2, "none", "none")

    def validation_seconds(steps: int) -> float:
        return phase_seconds(strategy, model, replace(job, validation_inference_steps=steps), H100, 10**7, 0.5)[
            "validation"
        ]

    assert (
        phase_seconds(strategy, model, job, H100, 10**7, 0.5)["validation"]
        == validation_seconds(4)
        < validation_seconds(28)
    )


def test_the_plan_of_a_schnell_job_predicts_a_shorter_validation_than_the_same_job_sampled_like_dev() -> None:
    model = model_size(FLUX_SCHNELL_NAME)
    job = as_job(job_spec(parse_request(lora_request(validation_prompts=["a sks dog"])), model), 10)

    schnell = dict(choose_plan(job, H100, model).phases)["validation"].seconds
    like_dev = dict(choose_plan(replace(job, validation_inference_steps=28), H100, model).phases)["validation"].seconds

    assert schnell < like_dev


# ---- the defaults the spec fills in -------------------------------------------------------------------------


def test_a_lora_without_targets_gets_its_model_familys() -> None:
    spec = job_spec(parse_request(lora_request()), model_size("black-forest-labs/FLUX.1-Kontext-dev"))

    assert spec.lora.target_modules == KONTEXT_LORA_TARGETS


def test_named_lora_targets_are_kept() -> None:
    assert job_spec(parse_request(lora_request(lora_target_modules=["to_q", "to_k"]))).lora.target_modules == (
        "to_q",
        "to_k",
    )


def test_a_full_fine_tune_without_a_learning_rate_gets_2e_6_and_kohyas_rate_for_the_fused_pass() -> None:
    spec = job_spec(parse_request(lora_request(training_type="full")))

    assert (spec.optimisation.learning_rate, spec.fused_pass_learning_rate) == (2e-6, FUSED_ADAFACTOR_LEARNING_RATE)


def test_a_named_learning_rate_is_kept_for_the_fused_pass_too() -> None:
    spec = job_spec(parse_request(lora_request(training_type="full", learning_rate=3e-6)))

    assert (spec.optimisation.learning_rate, spec.fused_pass_learning_rate) == (3e-6, 3e-6)


def test_without_timeout_seconds_the_deadline_is_the_endpoints() -> None:
    settings = WorkerSettings.from_environ({"FLUXBOOTH_JOB_DEADLINE_SECONDS": "3300"})
    spec = resolve_job_spec(parse_request(lora_request()), model_size(FLUX_DEV_NAME), settings)

    assert (spec.deadline_seconds, spec.deadline_from_request) == (3300, False)


def test_timeout_seconds_is_the_deadline() -> None:
    spec = job_spec(parse_request(lora_request(timeout_seconds=1800)))

    assert (spec.deadline_seconds, spec.deadline_from_request) == (1800, True)


def test_without_base_model_the_exports_name_the_endpoints_default() -> None:
    settings = WorkerSettings.from_environ({"FLUXBOOTH_BASE_MODEL": FLUX_SCHNELL_NAME})
    spec = resolve_job_spec(parse_request(lora_request()), model_size(FLUX_SCHNELL_NAME), settings)

    assert spec.export.base_model_name == FLUX_SCHNELL_NAME


def test_a_full_fine_tune_exports_its_diffusers_transformer_by_default() -> None:
    assert job_spec(parse_request(lora_request(training_type="full"))).export.formats == ("diffusers",)
