"""FLUX.2 LoRA under the project's other memory strategies (issue 20): ZeRO-3 with the base partitioned and
offloaded to the CPU, and an nf4-quantised base. The real trainer under `accelerate launch` + DeepSpeed on
the CPU (tests/support/trainer_jobs.py), on the tiny FLUX.2 presets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.models.families import default_lora_targets_of
from fluxbooth.synthetic import build_pipeline, preset
from tests.support.trainer_jobs import TrainerRun, assert_succeeded, make_plan, new_job, read_json

pytestmark = pytest.mark.slow


def family_lora(base: Path) -> LoraSettings:
    return LoraSettings(rank=4, alpha=8.0, target_modules=default_lora_targets_of(base))


@pytest.fixture(scope="module")
def flux2_zero3(tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    base = build_pipeline(preset("tiny-flux2"), tmp_path_factory.mktemp("bases") / "tiny-flux2")
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu")
    run = new_job(
        tmp_path_factory.mktemp("flux2-zero3"),
        base,
        plan=plan,
        steps=2,
        lora=family_lora(base),
        max_sequence_length=256,
        validation_prompts=("a photo of sks dog",),
        validation_inference_steps=2,
    ).launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def klein_nf4(tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    base = build_pipeline(preset("tiny-flux2-klein"), tmp_path_factory.mktemp("bases") / "tiny-flux2-klein")
    run = new_job(
        tmp_path_factory.mktemp("klein-nf4"),
        base,
        plan=make_plan(training_type="lora"),
        steps=2,
        lora=family_lora(base),
        base_precision="nf4",
        validation_prompts=("a photo of sks dog",),
        validation_inference_steps=2,
    ).launch()
    assert_succeeded(run)
    return run


def test_a_flux2_lora_trains_under_zero3_with_the_base_partitioned_on_the_cpu(flux2_zero3: TrainerRun) -> None:
    metrics = flux2_zero3.metrics
    assert (metrics["zero_stage"], metrics["offload_param"], metrics["transformer_loading"]["method"]) == (
        3,
        "cpu",
        "zero3_init",
    )
    assert metrics["transformer_loading"]["partition_devices"] == ["cpu"]
    assert all(math.isfinite(event["loss"]) for event in flux2_zero3.of_kind("step"))


def test_a_flux2_klein_lora_trains_and_validates_over_an_nf4_base(klein_nf4: TrainerRun) -> None:
    metrics = klein_nf4.metrics
    assert (metrics["base_precision"], metrics["transformer_loading"]["method"]) == ("nf4", "quantised_layer_by_layer")
    index = read_json(klein_nf4.output_dir / "validation" / "validation.json")
    assert [image["steps"] for image in index["images"]] == [2]
    assert klein_nf4.artifact("lora_diffusers").is_file()
