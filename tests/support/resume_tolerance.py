"""How close a resumed run's weights must come to the uninterrupted run's: the trainer's checkpoint tests and the
worker's deadline tests compare them."""

from __future__ import annotations

import torch

# A resumed run replays the uninterrupted one: the batch, noise and sigmas of a step are pure
# functions of (seed, step), and the checkpoint restores weights, fp32 master weights, Adam moments,
# the schedule and the step. One difference remains, measured by tests/trainer/test_trainer_checkpoints.py:
# DeepSpeedCPUAdam's C++ kernel keeps beta^t as a running float product during a run but recomputes it with pow() after a restart
# (csrc/includes/cpu_adam.h, IncrementStep), so the first resumed update can differ in the last bit
# of an fp32 master weight (measured: Adam moments bit-identical, master weights 1 fp32 ulp apart),
# which can flip the rounding of a bf16 weight. Later steps carry that on; Adam divides by sqrt(v),
# so for weights whose gradient is near zero it moves the update by a fraction of the learning rate.
# Measured after two resumed steps: full fine-tune within 1 bf16 ulp, LoRA within 0.03 x lr.
# Tolerance: one bf16 ulp, or a tenth of one step's learning rate.


def close_after_resume(a: torch.Tensor, b: torch.Tensor, learning_rate: float) -> bool:
    a, b = a.float(), b.float()
    larger = torch.maximum(a.abs(), b.abs())
    ulp = torch.pow(2.0, (torch.frexp(larger).exponent - 8).float())  # bf16 keeps 8 significant bits
    return bool(((a - b).abs() <= torch.clamp(ulp, min=0.1 * learning_rate)).all())
