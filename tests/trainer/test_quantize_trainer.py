"""LoRA over an fp8 or nf4 base through the real trainer: `accelerate launch`, DeepSpeed ZeRO-2 on the CPU
accelerator, the tiny FLUX model. Each module-scoped fixture is one run; the tests read what it produced.

The residency run trains as the planner plans a FLUX.1-dev LoRA over an nf4 base on a 16 GiB A4000 (ZeRO-2,
nothing offloaded, the base whole on the GPU), and its class images (prior preservation, generated) and validation
renders (during training and at the end) must never put the whole bf16 transformer on the accelerator. Each render announces the transformer it renders
with (`stage` events with status `rendering`), as the trainer holds it at that moment."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.support.trainer_jobs import (
    TEST_LORA,
    TrainerRun,
    assert_refused,
    assert_succeeded,
    base_image,
    lora_pipeline,
    make_plan,
    new_job,
    render,
)

pytestmark = pytest.mark.slow

QUANTISED_BLOCK_LINEARS = 40  # the tiny model: 2 double blocks x 14 Linears, 2 single blocks x 6


@pytest.fixture(scope="module")
def lora_fp8(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    job = new_job(
        tmp_path_factory.mktemp("lora-fp8"),
        tiny_base,
        plan=make_plan(training_type="lora"),
        steps=3,
        base_precision="fp8",
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def plan_for_a_16_gib_card() -> Any:
    """The planner's plan for a FLUX.1-dev LoRA over an nf4 base with generated class images and validation on
    an A4000 (left to choose, it streams a bf16 base's blocks instead: tests/trainer/test_blockswap_trainer.py)."""
    from fluxbooth.host.hardware import GIB, hypothetical_hardware
    from fluxbooth.plan import JobShape, choose_plan
    from fluxbooth.sizing import FLUX_DEV_NAME, model_size

    job = JobShape(
        training_type="lora", base_precision="nf4", num_instance_images=4, with_prior_preservation=True,
        num_class_images=2, validation_prompts=1, validation_steps=2,
    )  # fmt: skip
    card = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=16 * GIB, host_memory_bytes=62 * GIB, disk_bytes=200 * GIB, gpu_name="NVIDIA RTX A4000"
    )
    return choose_plan(job, card, model_size(FLUX_DEV_NAME))


def test_the_plan_for_a_16_gib_card_keeps_an_nf4_base_whole_on_the_gpu() -> None:
    plan = plan_for_a_16_gib_card()
    assert (plan.base_precision, plan.zero_stage, plan.offload_param, plan.block_swap) == ("nf4", 2, "none", False)


@pytest.fixture(scope="module")
def lora_nf4(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    planned = plan_for_a_16_gib_card()
    job = new_job(
        tmp_path_factory.mktemp("lora-nf4"),
        tiny_base,
        plan=make_plan(training_type="lora", zero_stage=planned.zero_stage, offload_param=planned.offload_param),
        steps=4,
        base_precision=planned.base_precision,
        with_prior_preservation=True,
        num_class_images=2,
        validation_prompts=("a photo of sks dog",),
        validation_steps=2,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def renders(run: TrainerRun, stage: str) -> list[dict[str, Any]]:
    return [event for event in run.of_kind("stage") if event["stage"] == stage and event.get("status") == "rendering"]


@pytest.mark.parametrize(("run_name", "precision"), [("lora_fp8", "fp8"), ("lora_nf4", "nf4")])
def test_lora_over_a_quantised_base_trains_under_deepspeed(
    run_name: str, precision: str, request: pytest.FixtureRequest
) -> None:
    run: TrainerRun = request.getfixturevalue(run_name)
    assert run.metrics["base_precision"] == precision
    assert run.metrics["zero_stage"] == 2
    assert run.metrics["optimizer"] == "DeepSpeedCPUAdam"
    assert all(math.isfinite(event["loss"]) for event in run.of_kind("step"))


@pytest.mark.parametrize(("run_name", "precision"), [("lora_fp8", "fp8"), ("lora_nf4", "nf4")])
def test_the_base_was_loaded_quantised_layer_by_layer(
    run_name: str, precision: str, request: pytest.FixtureRequest
) -> None:
    loading = request.getfixturevalue(run_name).metrics["transformer_loading"]
    assert loading["method"] == "quantised_layer_by_layer"
    assert loading["quantised_layers"] == {precision: QUANTISED_BLOCK_LINEARS}
    assert loading["full_precision_block_linears"] == 0


@pytest.mark.parametrize("run_name", ["lora_fp8", "lora_nf4"])
def test_lora_file_loads_onto_the_bf16_base_in_diffusers_and_changes_its_output(
    run_name: str, request: pytest.FixtureRequest, tiny_base: Path
) -> None:
    run: TrainerRun = request.getfixturevalue(run_name)
    image = render(lora_pipeline(tiny_base, run.artifact("lora_diffusers")))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def lora_keys_over_the_bf16_base(base: Path) -> set[str]:
    """The adapter keys diffusers writes for the same LoRA settings trained over the bf16 base."""
    from diffusers import FluxTransformer2DModel
    from peft.utils import get_peft_model_state_dict

    from fluxbooth.train.model import add_lora_adapter

    transformer = FluxTransformer2DModel.from_pretrained(base, subfolder="transformer")
    add_lora_adapter(transformer, TEST_LORA)
    return {f"transformer.{key}" for key in get_peft_model_state_dict(transformer)}


@pytest.mark.parametrize("run_name", ["lora_fp8", "lora_nf4"])
def test_lora_file_has_the_adapter_keys_of_a_lora_over_the_bf16_base(
    run_name: str, request: pytest.FixtureRequest, tiny_base: Path
) -> None:
    keys = set(load_file(request.getfixturevalue(run_name).artifact("lora_diffusers")))
    assert {key for key in keys if ".lora_A." in key or ".lora_B." in key} == lora_keys_over_the_bf16_base(tiny_base)


def test_class_images_are_rendered_by_a_quantised_transformer(lora_nf4: TrainerRun) -> None:
    [announced] = renders(lora_nf4, "cache")
    transformer = announced["transformer"]
    assert transformer["quantised_layers"] == {"nf4": QUANTISED_BLOCK_LINEARS}
    assert transformer["full_precision_block_linears"] == 0


def test_validation_renders_use_the_quantised_training_transformer(lora_nf4: TrainerRun) -> None:
    announced = renders(lora_nf4, "validate")
    assert [event.get("step") for event in announced] == [2, None]  # during training, then the final render
    for event in announced:
        assert event["transformer"]["quantised_layers"] == {"nf4": QUANTISED_BLOCK_LINEARS}
        assert event["transformer"]["full_precision_block_linears"] == 0
        assert event["transformer"]["lora_layers"] > 0


def test_validation_images_are_written(lora_nf4: TrainerRun) -> None:
    names = {entry["name"] for entry in lora_nf4.done["artifacts"]}
    assert {"validation_00", "validation_step000002_00"} <= names


def test_full_fine_tune_over_a_quantised_base_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path, tiny_base, plan=make_plan(training_type="full"), steps=1, base_precision="fp8").launch()
    assert_refused(
        run,
        "invalid_config",
        "base_precision 'fp8' stores a frozen base and only works with training_type 'lora'",
    )
