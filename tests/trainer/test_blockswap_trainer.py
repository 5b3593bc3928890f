"""Block swapping through the real trainer (`accelerate launch`, DeepSpeed ZeRO-2 on the CPU accelerator, the
tiny FLUX model): a LoRA over a block-swapped bf16 base trains, renders its class images and validation images
with its blocks swapped, and exports a LoRA that diffusers loads; the trainer refuses block swapping where it
cannot work."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.trainer_jobs import (
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

TINY_BLOCKS = 4  # 2 double-stream, 2 single-stream


@pytest.fixture(scope="module")
def swapped(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    job = new_job(
        tmp_path_factory.mktemp("lora-block-swap"),
        tiny_base,
        plan=make_plan(training_type="lora", offload_optimizer="none"),
        steps=4,
        block_swap=True,
        with_prior_preservation=True,
        num_class_images=2,
        validation_prompts=("a photo of sks dog",),
        validation_steps=2,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def test_a_lora_over_a_block_swapped_base_trains_under_deepspeed(swapped: TrainerRun) -> None:
    assert swapped.metrics["zero_stage"] == 2
    assert all(math.isfinite(event["loss"]) for event in swapped.of_kind("step"))


def test_the_base_is_built_in_host_ram_and_its_blocks_handed_to_the_swapper(swapped: TrainerRun) -> None:
    loading = swapped.metrics["transformer_loading"]
    assert loading["method"] == "block_swap"
    assert loading["block_swap"]["blocks"] == TINY_BLOCKS
    assert 0 < loading["block_swap"]["largest_block_bytes"] < loading["block_swap"]["host_bytes"]


def test_class_images_and_validation_images_are_rendered_with_swapped_blocks(swapped: TrainerRun) -> None:
    names = {entry["name"] for entry in swapped.done["artifacts"]}
    assert {"validation_00", "validation_step000002_00"} <= names
    rendering = [event for event in swapped.of_kind("stage") if event.get("status") == "rendering"]
    assert [event["stage"] for event in rendering] == ["cache", "validate", "validate"]


def test_the_exported_lora_loads_onto_the_bf16_base_in_diffusers_and_changes_its_output(
    swapped: TrainerRun, tiny_base: Path
) -> None:
    image = render(lora_pipeline(tiny_base, swapped.artifact("lora_diffusers")))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_block_swap_without_gradient_checkpointing_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(
        tmp_path,
        tiny_base,
        plan=make_plan(training_type="lora"),
        steps=1,
        block_swap=True,
        checkpoint_every=0,
    ).launch()
    assert_refused(
        run,
        "invalid_config",
        "block_swap needs gradient_checkpointing: without it the backward keeps every block's weights on the device",
    )
