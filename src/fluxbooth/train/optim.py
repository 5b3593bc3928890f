"""Optimizer and learning-rate schedule.

The optimizer is DeepSpeed's when its JSON has an `optimizer` block: launch_files.py writes one only when
DeepSpeed offloads the optimizer (adamw/adam/adagrad/lion become its host C++ DeepSpeedCPUAdam/CPUAdagrad/
CPULion). Otherwise it is the trainer's own, handed to DeepSpeed as a client optimizer: torch's fused AdamW/Adam
(torch ships the kernel; DeepSpeed's FusedAdam would need nvcc to build), Adagrad, SGD, Adafactor, and the Lion
in train/lion.py. The schedule is the trainer's own LambdaLR
(`learning_rate_factor`) unless a hand-written DeepSpeed JSON brings a `scheduler` block: DeepSpeed builds
and steps it next to its own optimizer; next to a torch optimizer the trainer steps it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import DummyOptim, DummyScheduler
from transformers.optimization import Adafactor

from fluxbooth.contract.names import (
    DEEPSPEED_OPTIMIZER_TYPES,
    OPTIMIZER_HYPERPARAMETERS,
    SUPPORTED_LR_SCHEDULERS,
    SUPPORTED_OPTIMIZERS,
    normalise_optimizer_name,
)
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.fused_adafactor import build_fused_adafactor
from fluxbooth.train.lion import Lion

# Without an optimizer block, an offloaded torch optimizer is replaced by accelerate (map_pytorch_optim_to_deepspeed):
# AdamW and Adam by DeepSpeedCPUAdam in the matching mode, Adagrad by DeepSpeedCPUAdagrad (the same updates);
# every other class by DeepSpeedCPUAdam, which would train with another optimizer than the one asked for.
SWAPPED_FOR_THEIR_DEEPSPEED_CPU_KERNEL = ("adamw", "adam", "adagrad")


def validated_optimizer_name(config: TrainerConfig, deepspeed_config: dict[str, Any] | None) -> str:
    name = normalise_optimizer_name(config.optimisation.optimizer)
    if name not in SUPPORTED_OPTIMIZERS:
        raise TrainerFailure(
            "invalid_config",
            f"optimizer {config.optimisation.optimizer!r} is not supported; use one of {list(SUPPORTED_OPTIMIZERS)}",
        )
    block = (deepspeed_config or {}).get("optimizer")
    if block is None and name not in SWAPPED_FOR_THEIR_DEEPSPEED_CPU_KERNEL and _offloads_optimizer(deepspeed_config):
        if (deepspeed_config or {}).get("zero_force_ds_cpu_optimizer", True) is not False:
            # accelerate would replace the torch optimizer by DeepSpeedCPUAdam without a word.
            raise TrainerFailure(
                "invalid_config",
                f"optimizer {name!r} is a torch optimizer and the DeepSpeed JSON offloads the optimizer without "
                '"zero_force_ds_cpu_optimizer": false, so it would be swapped for DeepSpeedCPUAdam; add that '
                f"setting to run {name!r} on the CPU, or choose one of {sorted(SWAPPED_FOR_THEIR_DEEPSPEED_CPU_KERNEL)}",
            )
    if block is not None:
        declared = str(block.get("type", ""))
        if DEEPSPEED_OPTIMIZER_TYPES.get(name, "").lower() != declared.lower():
            # Never train with a different optimizer than the one asked for.
            raise TrainerFailure(
                "invalid_config",
                f"train.json asks for optimizer {name!r} but the DeepSpeed JSON defines {declared!r}; "
                "make them agree (DeepSpeed's block only supports "
                f"{sorted(DEEPSPEED_OPTIMIZER_TYPES)}, leave it out for the others)",
            )
    if config.optimisation.lr_scheduler not in SUPPORTED_LR_SCHEDULERS:
        raise TrainerFailure(
            "invalid_config",
            f"lr_scheduler {config.optimisation.lr_scheduler!r} is not supported; use one of {list(SUPPORTED_LR_SCHEDULERS)}",
        )
    return name


def _offloads_optimizer(deepspeed_config: dict[str, Any] | None) -> bool:
    zero = (deepspeed_config or {}).get("zero_optimization", {})
    return str(zero.get("offload_optimizer", {}).get("device", "none")) != "none"


def build_optimizer(
    name: str, parameters: Sequence[torch.nn.Parameter], config: TrainerConfig, deepspeed_config: dict[str, Any] | None
) -> Any:
    """`accelerate.utils.DummyOptim` when the DeepSpeed JSON has an optimizer block (DeepSpeed then builds
    it: DeepSpeedCPUAdam when the optimizer is offloaded), else the trainer's optimizer, which accelerate hands
    to DeepSpeed as a client optimizer; Adafactor fused into the backward pass when train.json asks for it
    (train/fused_adafactor.py)."""
    if config.memory.fused_backward_pass:
        return build_fused_adafactor(parameters, config)
    if deepspeed_config is not None and "optimizer" in deepspeed_config:
        default_decay = OPTIMIZER_HYPERPARAMETERS["adamw"]["weight_decay"]
        weight_decay = deepspeed_config["optimizer"].get("params", {}).get("weight_decay", default_decay)
        return DummyOptim(list(parameters), lr=config.optimisation.learning_rate, weight_decay=weight_decay)
    hyperparameters: dict[str, Any] = dict(OPTIMIZER_HYPERPARAMETERS.get(name, {}))
    torch_classes: dict[str, Any] = {
        "adamw": torch.optim.AdamW,
        "adam": torch.optim.Adam,
        "adagrad": torch.optim.Adagrad,
        "sgd": torch.optim.SGD,
        "lion": Lion,
    }
    if name in ("adamw", "adam"):
        # torch's one-kernel step (CUDA and CPU): the same update and the same two fp32 states as DeepSpeed's
        # FusedAdam, without a CUDA op to compile.
        hyperparameters["fused"] = True
    if name in torch_classes:
        return torch_classes[name](parameters, lr=config.optimisation.learning_rate, **hyperparameters)
    if name == "adafactor":
        return Adafactor(parameters, lr=config.optimisation.learning_rate, **hyperparameters)
    raise TrainerFailure(
        "invalid_config", f"optimizer {name!r} is not supported; use one of {list(SUPPORTED_OPTIMIZERS)}"
    )


def learning_rate_factor(config: TrainerConfig) -> Callable[[int], float]:
    """Multiplier of the base learning rate after `step` optimizer steps: linear warm-up, then constant or cosine to 0."""
    warmup = max(0, config.optimisation.lr_warmup_steps)
    total = max(1, config.optimisation.steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if config.optimisation.lr_scheduler == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def schedule_stepped_by_deepspeed(optimizer: Any, deepspeed_config: dict[str, Any] | None) -> bool:
    """Whether DeepSpeed builds and steps the schedule (on accumulation boundaries, saved in its checkpoints).

    It does for a `scheduler` block and next to its own optimizer (DummyOptim). Next to a torch optimizer
    accelerate hands DeepSpeed only DeepSpeed's schedule classes, so the trainer steps its LambdaLR itself."""
    if deepspeed_config is None:
        return False
    return "scheduler" in deepspeed_config or isinstance(optimizer, DummyOptim)


def build_scheduler(
    optimizer: Any, config: TrainerConfig, deepspeed_config: dict[str, Any] | None, num_processes: int
) -> Any:
    """The schedule object to hand to `accelerator.prepare` when `schedule_stepped_by_deepspeed`, else a
    LambdaLR to step by hand: build that one on `innermost_optimizer` of the prepared optimizer."""
    if deepspeed_config is not None and "scheduler" in deepspeed_config:
        # accelerate divides total_num_steps by the process count when it fills "auto"; ours are optimizer steps.
        return DummyScheduler(
            optimizer,
            total_num_steps=config.optimisation.steps * num_processes,
            warmup_num_steps=max(1, config.optimisation.lr_warmup_steps),
        )
    factor = learning_rate_factor(config)
    if isinstance(optimizer, DummyOptim):
        # DeepSpeed builds the optimizer; it also builds and steps this schedule on accumulation boundaries.
        return DummyScheduler(
            optimizer,
            lr_scheduler_callable=lambda real_optimizer: torch.optim.lr_scheduler.LambdaLR(real_optimizer, factor),
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer that really steps, unwrapped from accelerate's and DeepSpeed's wrappers.

    ZeRO-1/2 wrap it in DeepSpeedZeroOptimizer, ZeRO-3 in DeepSpeedZeroOptimizer_Stage3, fp16 in a loss
    scaler, accelerate in AcceleratedOptimizer/DeepSpeedOptimizerWrapper; the innermost `.optimizer` is it.
    The wrappers share its `param_groups`, so a schedule on it sets the rate they step with.
    """
    current = optimizer
    for _ in range(8):
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    return current


def optimizer_class_name(optimizer: Any) -> str:
    return type(innermost_optimizer(optimizer)).__name__
