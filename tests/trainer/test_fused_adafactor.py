"""Adafactor fused into the backward pass (fluxbooth.train.fused_adafactor), on the CPU without a trainer:
the update equals transformers' own Adafactor step on the same gradients, the bf16 rounding is unbiased,
the state survives a checkpoint in float32, and what the pass cannot do is refused with the reason."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers.optimization import Adafactor

from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.fused_adafactor import (
    FusedBackwardAdafactor,
    check_fused_backward_pass,
    stochastic_round_to_bf16,
)
from tests.support.regroup import regrouped
from tests.support.trainer_jobs import make_plan, make_trainer_config

KOHYA_SETTINGS = OPTIMIZER_HYPERPARAMETERS["adafactor"]
LEARNING_RATE = 1e-2


def small_model(dtype: torch.dtype) -> torch.nn.Module:
    """Matrices (factored second moment), vectors (full second moment), and a chain for backprop."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    ).to(dtype)


def loss_of(model: torch.nn.Module, seed: int) -> torch.Tensor:
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    return model(inputs.to(next(model.parameters()).dtype)).float().pow(2).mean()


def fused_steps(model: torch.nn.Module, steps: int, **settings: object) -> FusedBackwardAdafactor:
    optimizer = FusedBackwardAdafactor(model.parameters(), lr=LEARNING_RATE, seed=7, **{**KOHYA_SETTINGS, **settings})
    for step in range(steps):
        loss_of(model, step).backward()
        optimizer.step()
    return optimizer


def unfused_steps(model: torch.nn.Module, steps: int, clip_each_parameter: float | None = None) -> Adafactor:
    optimizer = Adafactor(model.parameters(), lr=LEARNING_RATE, **KOHYA_SETTINGS)
    for step in range(steps):
        loss_of(model, step).backward()
        if clip_each_parameter is not None:
            for parameter in model.parameters():
                torch.nn.utils.clip_grad_norm_([parameter], clip_each_parameter)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


# --------------------------------------------------------------------------------------------------
# The update is transformers' Adafactor's
# --------------------------------------------------------------------------------------------------


def test_one_fused_step_on_bf16_weights_equals_transformers_adafactor_step_with_rounding_off() -> None:
    fused, unfused = small_model(torch.bfloat16), small_model(torch.bfloat16)

    fused_steps(fused, 1, stochastic_rounding=False)
    unfused_steps(unfused, 1)

    for (name, a), b in zip(fused.named_parameters(), unfused.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b), name


def test_fused_steps_on_fp32_weights_equal_transformers_adafactor_steps_to_float_tolerance() -> None:
    fused, unfused = small_model(torch.float32), small_model(torch.float32)
    before = copy.deepcopy(unfused)

    fused_steps(fused, 3)
    unfused_steps(unfused, 3)

    for (name, a), b, base in zip(fused.named_parameters(), unfused.parameters(), before.parameters(), strict=True):
        assert not torch.equal(b, base), name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_the_fused_pass_leaves_no_gradient_behind() -> None:
    model = small_model(torch.bfloat16)
    optimizer = FusedBackwardAdafactor(model.parameters(), lr=LEARNING_RATE, seed=7, **KOHYA_SETTINGS)

    loss_of(model, 0).backward()

    assert all(parameter.grad is None for parameter in model.parameters())
    assert len(optimizer.state) == len(list(model.parameters()))
    optimizer.step()


def test_each_parameters_gradient_is_clipped_to_max_grad_norm_on_its_own() -> None:
    fused, unfused = small_model(torch.float32), small_model(torch.float32)

    fused_steps(fused, 2, max_grad_norm=1e-3)
    unfused_steps(unfused, 2, clip_each_parameter=1e-3)

    for (name, a), b in zip(fused.named_parameters(), unfused.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_the_second_moment_of_a_matrix_is_factored_into_float32_rows_and_columns() -> None:
    model = small_model(torch.bfloat16)
    optimizer = fused_steps(model, 1)

    state = optimizer.state[model[0].weight]
    assert state["exp_avg_sq_row"].shape == (32,) and state["exp_avg_sq_col"].shape == (16,)
    assert state["exp_avg_sq_row"].dtype == torch.float32
    assert "exp_avg" not in state  # beta1 None: no first moment
    assert optimizer.state[model[0].bias]["exp_avg_sq"].shape == (32,)


# --------------------------------------------------------------------------------------------------
# Stochastic rounding
# --------------------------------------------------------------------------------------------------
# 1 + 2^-7 is the bf16 value after 1.0 (8 significant bits); a float32 a quarter of the way between them
# rounds to 1.0 when rounded to nearest, every time: a bias of a quarter ulp. Stochastically it rounds up
# with probability 1/4. 400 000 draws: the standard error of the mean is sqrt(p(1-p)/n) ulp = 0.0007 ulp.
ULP_AT_ONE = 2.0**-7
DRAWS = 400_000


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased_over_many_draws(sign: float) -> None:
    value = sign * (1.0 + 0.25 * ULP_AT_ONE)
    source = torch.full((DRAWS,), value, dtype=torch.float32)

    rounded = stochastic_round_to_bf16(source, torch.Generator().manual_seed(0)).float()

    assert set(rounded.unique().tolist()) == {sign * 1.0, sign * (1.0 + ULP_AT_ONE)}
    bias_in_ulps = (rounded.double().mean() - value).item() / ULP_AT_ONE
    assert abs(bias_in_ulps) < 0.005
    assert abs((source.to(torch.bfloat16).double().mean() - value).item() / ULP_AT_ONE) == pytest.approx(0.25)


def test_stochastic_rounding_is_unbiased_for_values_spread_over_many_binades() -> None:
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(64, generator=generator) * torch.logspace(-6, 3, 64)
    source = values.repeat(20_000, 1)

    rounded = stochastic_round_to_bf16(source, generator).double()

    # bf16 keeps 8 significant bits: one ulp is 2^(exponent - 8) with frexp's mantissa in [0.5, 1).
    ulp = torch.pow(2.0, (torch.frexp(values).exponent - 8).double())
    bias_in_ulps = (rounded.mean(dim=0) - values.double()).abs() / ulp
    assert float(bias_in_ulps.max()) < 0.02


def test_stochastic_rounding_keeps_values_that_bf16_holds_exactly() -> None:
    exact = torch.tensor([0.0, 1.0, -2.5, 3.140625, 1e-30], dtype=torch.float32).to(torch.bfloat16).float()

    rounded = stochastic_round_to_bf16(exact.repeat(1000), torch.Generator().manual_seed(0))

    assert torch.equal(rounded.float(), exact.repeat(1000))


def test_an_update_far_below_one_ulp_survives_stochastic_rounding_on_average() -> None:
    weights = torch.ones(DRAWS, dtype=torch.bfloat16)
    update = 0.01 * ULP_AT_ONE

    nearest = (weights.float() + update).to(torch.bfloat16)
    stochastic = stochastic_round_to_bf16(weights.float() + update, torch.Generator().manual_seed(3))

    assert torch.equal(nearest, weights)
    assert (stochastic.double().mean() - 1.0).item() == pytest.approx(update, rel=0.15)


def test_the_rounding_draw_is_a_function_of_the_seed_and_the_step() -> None:
    first, second = small_model(torch.bfloat16), small_model(torch.bfloat16)

    fused_steps(first, 2)
    fused_steps(second, 2)

    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def test_state_loaded_from_a_checkpoint_stays_float32_and_continues_as_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = small_model(torch.bfloat16)
    fused_steps(uninterrupted, 3)
    resumed = small_model(torch.bfloat16)
    optimizer = fused_steps(resumed, 2)
    torch.save({"model": resumed.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "checkpoint.pt")

    restarted = small_model(torch.bfloat16)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    restarted.load_state_dict(saved["model"])
    optimizer = FusedBackwardAdafactor(restarted.parameters(), lr=LEARNING_RATE, seed=7, **KOHYA_SETTINGS)
    optimizer.load_state_dict(saved["optimizer"])
    assert optimizer.state[restarted[0].weight]["exp_avg_sq_row"].dtype == torch.float32
    loss_of(restarted, 2).backward()
    optimizer.step()

    assert all(torch.equal(a, b) for a, b in zip(uninterrupted.parameters(), restarted.parameters(), strict=True))


def test_after_loading_a_checkpoint_the_hooks_step_with_the_rate_the_schedule_sets() -> None:
    model = small_model(torch.bfloat16)
    saved = fused_steps(model, 1).state_dict()
    optimizer = FusedBackwardAdafactor(model.parameters(), lr=LEARNING_RATE, seed=7, **KOHYA_SETTINGS)
    optimizer.load_state_dict(saved)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    before = copy.deepcopy(model)

    loss_of(model, 1).backward()
    optimizer.step()
    scheduler.step()

    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters(), strict=True))


# --------------------------------------------------------------------------------------------------
# What the fused pass refuses
# --------------------------------------------------------------------------------------------------


def fused_config(**overrides: object) -> object:
    settings = {"fused_backward_pass": True, "optimizer": "adafactor", **overrides}
    return make_trainer_config(Path("/job"), Path("/base"), make_plan(use_deepspeed=False), **settings)


def test_gradient_accumulation_is_refused_with_the_reason() -> None:
    with pytest.raises(TrainerFailure) as refused:
        check_fused_backward_pass(fused_config(gradient_accumulation_steps=2), None, 1)

    assert refused.value.code == "invalid_config"
    assert refused.value.message == (
        "fused_backward_pass: gradient_accumulation_steps must be 1, not 2: each weight is stepped as soon as its "
        "gradient exists, and accumulating would need the gradient buffer the pass exists to avoid"
    )


def test_deepspeed_several_processes_and_other_optimizers_are_refused_together() -> None:
    config = regrouped(fused_config(), optimizer="adamw")

    with pytest.raises(TrainerFailure) as refused:
        check_fused_backward_pass(config, {"zero_optimization": {"stage": 2}}, 2)

    assert refused.value.message == (
        "fused_backward_pass: it steps with Adafactor, not 'adamw'; it runs without DeepSpeed (DeepSpeed's engine "
        "owns the gradients and the step); it runs in one process, not 2: data parallelism reduces gradients "
        "after the hooks step them"
    )


def test_a_lora_or_fp16_run_cannot_use_the_fused_pass() -> None:
    config = fused_config(training_type="lora", mixed_precision="fp16")

    with pytest.raises(TrainerFailure) as refused:
        check_fused_backward_pass(config, None, 1)

    assert "training_type 'full'" in refused.value.message
    assert "mixed_precision must be 'bf16', not 'fp16'" in refused.value.message


def test_a_run_without_the_fused_pass_is_not_checked() -> None:
    check_fused_backward_pass(
        regrouped(fused_config(), fused_backward_pass=False, gradient_accumulation_steps=4), None, 2
    )
