"""Figures the README and docs/memory.md quote, computed by the planner so each has one owner (tests check
that the text quotes the computed value). No torch here."""

from __future__ import annotations

from fluxbooth.host.hardware import hypothetical_hardware
from fluxbooth.plan.candidates import strategies_for
from fluxbooth.plan.memory import estimate_memory
from fluxbooth.plan.types import JobShape
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size


def full_finetune_host_bytes(model: ModelSize | None = None) -> int:
    """The least host RAM a full fine-tune of `model` (FLUX.1-dev by default) needs on one GPU.

    A full fine-tune's training state (fp32 master weights, gradients, Adam states) fits no single card, so its
    optimizer must be offloaded: to the CPU, as the worker does without an NVMe path. Of those strategies the one
    with the smallest host peak counts, at the request's defaults (1024², batch 1, bf16, checkpointing) and sized
    for the dataset cap, as the planner sizes a job before its dataset arrives.
    """
    model = model or model_size(FLUX_DEV_NAME)
    job = JobShape(training_type="full")
    # One GPU; how much memory it has does not change what the host holds.
    card = hypothetical_hardware(gpus=1, gpu_memory_bytes=0, host_memory_bytes=0, disk_bytes=0, cpu_count=1)
    offloaded = [
        strategy
        for strategy in strategies_for("full", use_deepspeed=True, has_nvme=False)
        if strategy.offload_optimizer == "cpu"
    ]
    return min(estimate_memory(strategy, model, job, card, job.mixed_precision).host_bytes for strategy in offloaded)
