"""The `does_not_fit` message: the closest strategy's needs against what the worker has, smaller versions
of the same job that would fit, and other strategies that would. Never the strategy the job already uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fluxbooth.host.container_limits import MEMLOCK_FIX
from fluxbooth.host.hardware import Hardware
from fluxbooth.messages import format_bytes
from fluxbooth.plan.candidates import (
    describe_candidate,
    evaluate_candidates,
    fused_pass_changes,
    pick,
    resource_ratios,
    shortfall,
)
from fluxbooth.plan.types import Candidate, JobShape
from fluxbooth.sizing import ModelSize


def job_variants(job: JobShape) -> list[tuple[str, JobShape]]:
    """Smaller versions of a job, in the order a person would try them."""
    variants = []
    changes = fused_pass_changes(job)
    if job.fused_backward_pass is False:
        changes.append("fused_backward_pass 'auto'")
    if job.training_type == "full" and changes:
        # The same job as the fused Adafactor pass runs it (no gradient buffer, no fp32 master weights).
        fused = replace(
            job,
            gradient_accumulation_steps=1,
            optimizer="adafactor",
            optimizer_named=True,
            mixed_precision="bf16",
            zero_stage="auto",
            offload="auto",
            fused_backward_pass="auto",
        )
        variants.append((" and ".join(changes), fused))
    if job.gradient_checkpointing is False:
        variants.append(("gradient_checkpointing true", replace(job, gradient_checkpointing=True)))
    if job.batch_size > 1:
        variants.append(
            (
                "batch_size 1",
                replace(
                    job, batch_size=1, gradient_accumulation_steps=job.gradient_accumulation_steps * job.batch_size
                ),
            )
        )
    if job.training_type == "lora" and job.base_precision in ("bf16", "fp8"):
        variants.append(("base_precision 'auto'", replace(job, base_precision="auto")))
    if max(job.resolution) > 512:
        variants.append(("resolution 512x512", replace(job, resolution=(512, 512))))
    return variants


def _fitting_variants(job: JobShape, hardware: Hardware, model: ModelSize) -> list[str]:
    found = []
    for change, variant in job_variants(job):
        candidate = pick(evaluate_candidates(variant, hardware, model, include_alternatives=False))
        if candidate is not None:
            found.append(f"{change} ({describe_candidate(candidate)})")
    return found


def _machine(hardware: Hardware) -> str:
    if hardware.accelerator == "cpu":
        return (
            f"this worker has no GPU ({'; '.join(hardware.notes) or 'nvidia-smi found none'}), so everything "
            f"must fit in host RAM: {format_bytes(hardware.host_available_bytes)} available"
        )
    return (
        f"this worker has {hardware.gpu_count}x {format_bytes(hardware.gpu_memory_bytes)} GPU and "
        f"{format_bytes(hardware.host_available_bytes)} host RAM available"
    )


def _last_resort(job: JobShape, closest: Candidate, hardware: Hardware) -> str:
    """What is left to try when no strategy and no smaller job fits: only what the job does not do yet,
    and more of only the resources the closest strategy is short of."""
    short = {name for name, ratio in resource_ratios(closest.estimate, hardware).items() if ratio > 1}
    options = []
    if short & {"gpu", "host"}:
        options.append("use a larger GPU or more host RAM")
    if "locked memory" in short:
        options.append(MEMLOCK_FIX)
    if "disk" in short:
        options.append(f"free disk space at {hardware.work_dir} or point FLUXBOOTH_WORK_DIR at a larger volume")
    if short & {"gpu", "host"} and max(job.resolution) > 512:
        options.append("lower the resolution")
    if short & {"gpu", "host"} and job.training_type == "full":
        options.append("use LoRA")
    if not options:
        options.append("use a larger GPU or more host RAM")
    if len(options) == 1:
        return options[0]
    return ", ".join(options[:-1]) + " or " + options[-1]


def refusal_message(candidates: Sequence[Candidate], hardware: Hardware, model: ModelSize, job: JobShape) -> str:
    requested = [candidate for candidate in candidates if candidate.honours_request]
    closest = min(requested, key=lambda candidate: shortfall(candidate.estimate, hardware))
    width, height = job.resolution
    kind = "full fine-tune" if job.training_type == "full" else f"LoRA rank {job.lora_rank}"
    message = (
        f"{kind} of {model.name} at {width}x{height}, batch {job.batch_size}, does not fit: {_machine(hardware)}. "
        f"Closest: {describe_candidate(closest)} — {closest.reason}"
    )
    alternatives = [candidate for candidate in candidates if candidate.fits and not candidate.honours_request]
    variants = _fitting_variants(job, hardware, model)
    if variants:
        message += ". The same job fits with " + "; or ".join(variants[:2])
    if alternatives:
        best = sorted(alternatives, key=lambda candidate: candidate.seconds_per_step)[:2]
        message += ". Would fit: " + "; ".join(
            f"{describe_candidate(candidate)} (≈{format_bytes(candidate.estimate.gpu_bytes)} GPU, "
            f"≈{format_bytes(candidate.estimate.host_bytes)} host)"
            for candidate in best
        )
        message += " — set training_type/base_precision/zero_stage/offload accordingly"
    elif not variants:
        message += f". No strategy fits; {_last_resort(job, closest, hardware)}"
    return message
