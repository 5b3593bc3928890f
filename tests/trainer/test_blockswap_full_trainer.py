"""Block swapping of trained weights through the real trainer (`accelerate launch` without DeepSpeed, the CPU as
the accelerator, the tiny FLUX model): the fused Adafactor full fine-tune with its blocks swapped ends on the
unswapped run's weights, bit for bit, in its export, its checkpoint and its EMA (which read the weights after the
swapper wrote them back); the trainer refuses block swapping for a full fine-tune without the fused pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.trainer_jobs import TrainerRun, assert_refused, assert_succeeded, make_plan, new_job

pytestmark = pytest.mark.slow

FUSED_PLAN = make_plan(use_deepspeed=False, zero_stage=0, offload_optimizer="none")
FUSED = {"fused_backward_pass": True, "optimizer": "adafactor"}
# A checkpoint and EMA updates after steps whose last backward left a trained block on the device; the final
# validation renders the exported transformer with its blocks swapped.
SETTINGS = {"steps": 4, "checkpointing_steps": 2, "validation_prompts": ("a photo of sks dog",), "ema_decay": 0.5}
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def runs(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    root = tmp_path_factory.mktemp("fused-block-swap")
    unswapped = new_job(root / "unswapped", tiny_base, plan=FUSED_PLAN, **FUSED, **SETTINGS).launch()
    assert_succeeded(unswapped)
    swapped = new_job(root / "swapped", tiny_base, plan=FUSED_PLAN, block_swap=True, **FUSED, **SETTINGS).launch()
    assert_succeeded(swapped)
    return unswapped, swapped


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def test_the_fused_run_with_swapped_blocks_swaps_its_trained_weights(runs: tuple[TrainerRun, TrainerRun]) -> None:
    _, swapped = runs
    loading = swapped.metrics["transformer_loading"]
    assert (loading["method"], swapped.metrics["optimizer"]) == ("block_swap", "FusedBackwardAdafactor")
    assert loading["block_swap"]["trained_weights_swapped"] is True
    assert [event["loss"] for event in swapped.of_kind("step")] == [event["loss"] for event in runs[0].of_kind("step")]


def test_the_swapped_run_frees_its_model_and_its_pinned_blocks_before_export(
    runs: tuple[TrainerRun, TrainerRun],
) -> None:
    assert runs[1].metrics["alive_at_export"] == []


def test_the_swapped_run_renders_its_final_validation_image(runs: tuple[TrainerRun, TrainerRun]) -> None:
    assert "validation_00" in {entry["name"] for entry in runs[1].done["artifacts"]}


def test_the_swapped_runs_exported_transformer_equals_the_unswapped_runs(runs: tuple[TrainerRun, TrainerRun]) -> None:
    unswapped, swapped = runs
    a = load_file(unswapped.artifact("diffusers_transformer") / WEIGHTS_FILE)
    b = load_file(swapped.artifact("diffusers_transformer") / WEIGHTS_FILE)
    assert differing(a, b) == []


def test_the_swapped_runs_checkpoint_equals_the_unswapped_runs(runs: tuple[TrainerRun, TrainerRun]) -> None:
    (a,), (b,) = ([Path(event["path"]) for event in run.of_kind("checkpoint")] for run in runs)
    assert differing(load_file(a / "model.safetensors"), load_file(b / "model.safetensors")) == []


def test_the_swapped_runs_ema_equals_the_unswapped_runs(runs: tuple[TrainerRun, TrainerRun]) -> None:
    unswapped, swapped = runs
    a = load_file(unswapped.artifact("ema_diffusers_transformer") / WEIGHTS_FILE)
    b = load_file(swapped.artifact("ema_diffusers_transformer") / WEIGHTS_FILE)
    assert differing(a, b) == []


def test_block_swap_for_a_full_fine_tune_without_the_fused_pass_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path, tiny_base, plan=FUSED_PLAN, steps=1, block_swap=True).launch()

    assert_refused(
        run,
        "invalid_config",
        "block_swap with training_type 'full' needs fused_backward_pass: each block's weights are stepped during its "
        "backward, before the block leaves the device; a full fine-tune without it keeps every weight's gradient "
        "until the optimizer step after the backward",
    )
