"""The optimizers the trainer builds itself when DeepSpeed does not offload the optimizer (no nvcc needed): torch's
fused AdamW and train/lion.py's Lion take the steps of the DeepSpeed kernels they replace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
from fluxbooth.train.lion import SLICE_ELEMENTS, Lion
from fluxbooth.train.optim import build_optimizer
from tests.support import optimizer_probe
from tests.support.guide_job import GUIDE_TRAINER
from tests.support.regroup import regrouped
from tests.support.trainer_jobs import free_port


def lion_by_the_formula(
    weight: torch.Tensor, gradients: list[torch.Tensor], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.Tensor:
    """Lion's update as the paper writes it, one step per gradient, in float64."""
    weight, momentum = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    beta1, beta2 = betas
    for gradient in gradients:
        interpolated = beta1 * momentum + (1 - beta1) * gradient.double()
        weight = weight * (1 - lr * weight_decay) - lr * torch.sign(interpolated)
        momentum = beta2 * momentum + (1 - beta2) * gradient.double()
    return weight


def lion_steps(weight: torch.Tensor, gradients: list[torch.Tensor], **hyperparameters: Any) -> torch.Tensor:
    parameter = torch.nn.Parameter(weight.clone())
    optimizer = Lion([parameter], **hyperparameters)
    for gradient in gradients:
        parameter.grad = gradient.clone()
        optimizer.step()
    return parameter.detach()


def test_lion_steps_by_the_sign_of_the_interpolated_momentum_with_decoupled_weight_decay() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator)
    gradients = [torch.randn(64, 32, generator=generator) for _ in range(4)]

    stepped = lion_steps(weight, gradients, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)

    expected = lion_by_the_formula(weight, gradients, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    torch.testing.assert_close(stepped.double(), expected, rtol=1e-6, atol=1e-6)


def test_lion_leaves_a_weight_without_gradient_or_momentum_where_weight_decay_puts_it() -> None:
    weight = torch.tensor([0.5, -2.0])

    stepped = lion_steps(weight, [torch.zeros(2)], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)

    assert stepped.tolist() == pytest.approx([0.5 * (1 - 1e-3), -2.0 * (1 - 1e-3)])


def test_lion_steps_a_parameter_larger_than_its_slices_as_a_whole() -> None:
    # ZeRO-2 hands the optimizer one flat partition: the update walks it in slices to keep its scratch small.
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(2 * SLICE_ELEMENTS + 5, generator=generator)
    gradients = [torch.randn(weight.shape, generator=generator) for _ in range(2)]

    stepped = lion_steps(weight, gradients, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)

    expected = lion_by_the_formula(weight, gradients, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    torch.testing.assert_close(stepped.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "implementation"), [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)])
def test_without_a_deepspeed_optimizer_block_adam_is_torchs_fused_kernel_with_the_same_hyperparameters(
    name: str, implementation: type[torch.optim.Optimizer]
) -> None:
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    config = regrouped(GUIDE_TRAINER, optimizer=name)

    optimizer = build_optimizer(name, parameters, config, {"zero_optimization": {"stage": 2}})

    assert type(optimizer) is implementation
    group = optimizer.param_groups[0]
    assert group["fused"] is True
    expected = OPTIMIZER_HYPERPARAMETERS[name]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        config.optimisation.learning_rate,
        expected["betas"],
        expected["eps"],
        expected["weight_decay"],
    )


def test_without_a_deepspeed_optimizer_block_lion_is_the_trainers_own_with_the_same_hyperparameters() -> None:
    config = regrouped(GUIDE_TRAINER, optimizer="lion")

    optimizer = build_optimizer(
        "lion", [torch.nn.Parameter(torch.zeros(3))], config, {"zero_optimization": {"stage": 2}}
    )

    assert type(optimizer) is Lion
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (
        config.optimisation.learning_rate,
        (0.9, 0.99),
        0.01,
    )


@pytest.fixture(scope="module")
def probe(tiny_base: Path, torch_extensions_dir: Path) -> dict[str, Any]:
    """Both implementations of each optimizer on the tiny transformer under ZeRO-2 (tests/support/optimizer_probe.py)."""
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.optimizer_probe", str(tiny_base), str(free_port())],
        capture_output=True, text=True, timeout=900, check=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir)},
    )  # fmt: skip
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_torch_fused_adamw_takes_deepspeed_cpu_adams_steps_under_zero2(probe: dict[str, Any]) -> None:
    adamw = probe["adamw"]

    assert adamw["classes"] == {"deepspeed": "DeepSpeedCPUAdam", "torch": "AdamW"}
    assert adamw["largest_step"] > 100 * 1e-5 * adamw["largest_weight"]  # the steps are far above the tolerance
    assert adamw["max_abs_difference"] <= optimizer_probe.TOLERANCE * adamw["largest_weight"]


@pytest.mark.slow
def test_torch_lion_takes_deepspeed_cpu_lions_steps_under_zero2(probe: dict[str, Any]) -> None:
    lion = probe["lion"]

    assert lion["classes"] == {"deepspeed": "DeepSpeedCPULion", "torch": "Lion"}
    assert lion["largest_step"] > 100 * 1e-5 * lion["largest_weight"]
    # Lion steps by a sign: where the interpolated momentum is within a rounding of zero, the two kernels' last bit
    # (DeepSpeed fuses the multiply-add) can give opposite signs, a 2·lr difference in that one weight on that step.
    # Every other weight agrees within float tolerance.
    assert lion["elements_beyond_tolerance"] <= 1e-4 * lion["parameters"]
    assert lion["max_abs_difference"] <= 2 * optimizer_probe.LEARNING_RATE * optimizer_probe.STEPS
