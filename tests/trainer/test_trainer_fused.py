"""The full fine-tune with Adafactor fused into the backward pass on bf16 weights, without DeepSpeed
(train/fused_adafactor.py): the real trainer on the tiny FLUX model under the real `accelerate launch`
(tests/support/trainer_jobs.py). It trains, exports every full format, learns as the ZeRO-2 AdamW run does, and a
resumed run ends on the uninterrupted run's weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.fixed_noise_loss import OVERFIT_LOSS_RATIO
from tests.support.trainer_jobs import (
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

    transformer = FluxTransformer2DModel.from_pretrained(
        fused_run.artifact("diffusers_transformer"), torch_dtype=torch.float32
    )
    image = render(load_pipeline(tiny_base, transformer=transformer))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_the_fused_run_frees_its_model_and_optimizer_before_export(fused_run: TrainerRun) -> None:
    assert fused_run.metrics["alive_at_export"] == []


def test_a_fused_run_with_gradient_accumulation_is_refused_before_training(tiny_base: Path, tmp_path: Path) -> None:
    run = fused_job(tmp_path / "job", tiny_base, gradient_accumulation_steps=2).launch()

    assert_refused(run, "invalid_config", "fused_backward_pass: gradient_accumulation_steps must be 1, not 2")


# --------------------------------------------------------------------------------------------------
# Checkpoints and resume
# --------------------------------------------------------------------------------------------------
# The checkpoint holds the bf16 weights and Adafactor's state (float32 factored second moments, each
# parameter's step count); the stochastic rounding draws from (seed, parameter, step count), and the batch,
# noise and sigmas of a step from (seed, step). So, unlike DeepSpeedCPUAdam's resume (tests/
# test_trainer_checkpoints.py), a resumed fused run replays the uninterrupted one bit for bit.

RESUME_SETTINGS = {"steps": 4, "checkpointing_steps": 2, "lr_scheduler": "cosine", "lr_warmup_steps": 1}


@pytest.fixture(scope="module")
def fused_resume(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    root = tmp_path_factory.mktemp("fused-resume")
    uninterrupted = fused_job(root / "uninterrupted", tiny_base, **RESUME_SETTINGS).launch()
    assert_succeeded(uninterrupted)
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]
    resumed = fused_job(root / "resumed", tiny_base, resume_from=checkpoint, **RESUME_SETTINGS).launch()
    assert_succeeded(resumed)
    return uninterrupted, resumed


def test_a_resumed_fused_run_continues_with_the_uninterrupted_runs_losses_and_rates(
    fused_resume: tuple[TrainerRun, TrainerRun],
) -> None:
    uninterrupted, resumed = fused_resume
    assert resumed.metrics["resumed_from_step"] == 2
    replayed = [(event["step"], event["loss"], event["lr"]) for event in uninterrupted.of_kind("step")][2:]
    assert [(event["step"], event["loss"], event["lr"]) for event in resumed.of_kind("step")] == replayed


def test_a_resumed_fused_run_ends_on_the_uninterrupted_runs_weights(
    fused_resume: tuple[TrainerRun, TrainerRun],
) -> None:
    uninterrupted, resumed = fused_resume
    name = "diffusion_pytorch_model.safetensors"
    a = load_file(uninterrupted.artifact("diffusers_transformer") / name)
    b = load_file(resumed.artifact("diffusers_transformer") / name)
    assert a.keys() == b.keys()
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


def test_the_fused_checkpoint_holds_bf16_weights_and_float32_adafactor_state(
    fused_resume: tuple[TrainerRun, TrainerRun],
) -> None:
    uninterrupted, _ = fused_resume
    (checkpoint,) = [Path(event["path"]) for event in uninterrupted.of_kind("checkpoint")]
    weights = load_file(checkpoint / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    states = list(optimizer["state"].values())
    assert len(states) == len(weights)
    assert {state["step"] for state in states} == {2}
    factored = [state for state in states if "exp_avg_sq_row" in state]
    assert factored and all(
        state["exp_avg_sq_row"].dtype == state["exp_avg_sq_col"].dtype == torch.float32 for state in factored
    )


def test_a_fused_checkpoint_is_not_resumed_by_a_run_without_the_fused_pass(
    fused_resume: tuple[TrainerRun, TrainerRun], tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, _ = fused_resume
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]

    run = new_job(tmp_path / "job", tiny_base, plan=FUSED_PLAN, resume_from=checkpoint, **RESUME_SETTINGS).launch()

    assert_refused(run, "resume_failed", "was made with fused_backward_pass=True, this run has False")


# --------------------------------------------------------------------------------------------------
# Learning: over-fitting one image, next to the ZeRO-2 AdamW run
# --------------------------------------------------------------------------------------------------
# The setup of tests/trainer/test_trainer_prior.py's over-fitting test (tiny model, one 64x64 image, seed 7, 40 steps,
# lr 1e-3), fixed-noise loss before and after (`learning_check`). Measured on the shared 2-core CI machine:
# ZeRO-2 + DeepSpeedCPUAdam 1.4195 -> 1.0117, fused Adafactor on bf16 weights 1.4195 -> 1.0119.


def test_the_fused_run_lowers_the_fixed_noise_loss_as_the_zero2_adamw_run_does(tiny_base: Path, tmp_path: Path) -> None:
    settings = {"images": 1, "steps": 40, "learning_rate": 1e-3, "measure_fixed_noise_loss": True}
    fused = fused_job(tmp_path / "fused", tiny_base, **settings).launch()
    zero2 = new_job(tmp_path / "zero2", tiny_base, **settings).launch()

    assert_succeeded(fused)
    assert_succeeded(zero2)
    assert (fused.metrics["optimizer"], zero2.metrics["optimizer"]) == ("FusedBackwardAdafactor", "DeepSpeedCPUAdam")
    fused_loss, zero2_loss = fused.metrics["fixed_noise_loss"], zero2.metrics["fixed_noise_loss"]
    assert fused_loss["start"] == zero2_loss["start"]
    assert fused_loss["end"] < OVERFIT_LOSS_RATIO * fused_loss["start"], fused_loss
    assert zero2_loss["end"] < OVERFIT_LOSS_RATIO * zero2_loss["start"], zero2_loss
    assert fused_loss["end"] == pytest.approx(zero2_loss["end"], rel=0.05)
