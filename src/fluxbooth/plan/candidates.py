"""The candidates for a job: every strategy (training type, base precision, ZeRO stage, offload) with
its predicted memory per phase, time per phase and fit, and the pick among them. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from fluxbooth.contract.names import FUSED_ADAFACTOR_CLASS, normalise_optimizer_name
from fluxbooth.contract.precision import BASE_PRECISIONS, QUANTISED_PRECISIONS
from fluxbooth.host.hardware import Hardware
from fluxbooth.messages import format_bytes
from fluxbooth.plan.container_limits import memlock_problem, memlock_ratio
from fluxbooth.plan.memory import DISK_MARGIN, GPU_MARGIN, HOST_MARGIN, compute_dtype_bytes, estimate_memory
from fluxbooth.plan.timing import mixed_seconds_per_step, phase_seconds
from fluxbooth.plan.types import (
    ALTERNATIVE_LORA_RANK,
    Candidate,
    JobShape,
    MemoryEstimate,
    Offload,
    Strategy,
)
from fluxbooth.request.fused import fused_pass_conflicts
from fluxbooth.request.spec import JobSpec
from fluxbooth.settings import DatasetLimits
from fluxbooth.sizing import ModelSize

PHASE_VERBS = {
    "loading": "loading the transformer",
    "caching": "caching embeddings",
    "class_images": "generating class images",
    "training": "training",
    "validation": "rendering validation images",
    "export": "exporting",
}
# The class that steps each optimizer when DeepSpeed offloads it to the CPU (or NVMe).
OFFLOADED_OPTIMIZER_CLASSES = {
    "adamw": "DeepSpeedCPUAdam",
    "adam": "DeepSpeedCPUAdam",
    "adagrad": "DeepSpeedCPUAdagrad",
    "lion": "DeepSpeedCPULion",
    "sgd": "SGD",
    "adafactor": "Adafactor",
}
# Not offloaded, with or without DeepSpeed: the trainer's own (torch's fused AdamW and Adam, train/lion.py's Lion),
# handed to DeepSpeed as a client optimizer; DeepSpeed's GPU kernels would need nvcc to build.
TORCH_OPTIMIZER_CLASSES = {
    "adamw": "AdamW",
    "adam": "Adam",
    "adagrad": "Adagrad",
    "lion": "Lion",
    "sgd": "SGD",
    "adafactor": "Adafactor",
}
# kohya's FLUX full fine-tune: bf16 weights, Adafactor fused into the backward pass, no DeepSpeed, one process.
FUSED_STRATEGY = Strategy("full", False, 0, "none", "none", fused_backward_pass=True)
# The same with the trained blocks in pinned host RAM, streamed in as the passes reach them (kohya's --blocks_to_swap).
FUSED_SWAP_STRATEGY = Strategy("full", False, 0, "none", "none", block_swap=True, fused_backward_pass=True)


# Activation checkpointing the planner weighs when the request leaves it unset (Strategy.checkpoint_every): none,
# every 4th, 3rd or 2nd block, every block; the memory each needs grows from the last to the first.
CHECKPOINT_GRANULARITIES = (0, 4, 3, 2, 1)


def as_job(
    job: JobSpec | JobShape, instance_images: int | None = None, bucket_mix: Mapping[tuple[int, int], int] | None = None
) -> JobShape:
    """The `JobShape` of a job spec (a shape as it is). Before the dataset is fetched its image count and shapes
    are unknown: the planner then sizes for the dataset cap, every image at each size; with the prepared
    dataset, `bucket_mix` is its real one."""
    if isinstance(job, JobShape):
        return job
    bound = instance_images if instance_images is not None else DatasetLimits.max_images
    return JobShape.from_spec(job, instance_images=bound, bucket_mix=bucket_mix)


def strategies_for(
    training_type: str, use_deepspeed: bool, has_nvme: bool, base_precision: str = "bf16", *, block_swap: bool = False
) -> list[Strategy]:
    """Every strategy worth considering, in the order ties are broken (simplest first). `block_swap`: also
    LoRA with its frozen base streamed block by block from host RAM (a GPU and gradient checkpointing)."""
    swapped = []
    if block_swap and training_type == "lora":
        # The trainer's own swapper (train/blockswap.py), outside DeepSpeed's partitioning: ZeRO-2 at most.
        swapped = [Strategy("lora", False, 0, "none", "none", base_precision, block_swap=True)]
        if use_deepspeed:
            swapped = [
                Strategy("lora", True, 2, optimizer, "none", base_precision, block_swap=True)
                for optimizer in ("none", "cpu")
            ]
    if base_precision in QUANTISED_PRECISIONS:
        # A quantised base stays out of ZeRO-3 (train/quantize.py refuses it: its partitioning would gather
        # and cast the codes, and DeepSpeed ignores offload_param below ZeRO-3): whole on each GPU, or swapped.
        if not use_deepspeed:
            return [Strategy("lora", False, 0, "none", "none", base_precision), *swapped]
        return [Strategy("lora", True, 2, optimizer, "none", base_precision) for optimizer in ("none", "cpu")] + swapped
    if not use_deepspeed:
        return [Strategy(training_type, False, 0, "none", "none"), *swapped]
    layouts: list[tuple[int, Offload, Offload]] = [
        (2, "none", "none"),
        (2, "cpu", "none"),
        (3, "none", "none"),
        (3, "cpu", "none"),
        (3, "cpu", "cpu"),
    ]
    if has_nvme:
        # DeepSpeed offloads to NVMe only under ZeRO-3 (ZeRO-Infinity).
        layouts += [(3, "nvme", "none"), (3, "nvme", "cpu")]
        if training_type == "full":
            # A frozen LoRA base swapped to NVMe runs DeepSpeed 0.19 out of swap buffers under gradient
            # checkpointing (the trainer refuses it); LoRA's base fits in host RAM wherever FLUX trains anyway.
            layouts.append((3, "nvme", "nvme"))
    return [Strategy(training_type, True, stage, optimizer, param) for stage, optimizer, param in layouts] + swapped


def base_precisions_for(training_type: str, requested: str) -> tuple[str, ...]:
    if training_type == "full":
        return ("bf16",)
    return BASE_PRECISIONS if requested == "auto" else (requested,)


def checkpointing_for(strategy: Strategy, job: JobShape) -> tuple[int, ...]:
    """The granularities `strategy` is weighed at: the request's (`true` every block, `false` none), or, unset,
    every one of CHECKPOINT_GRANULARITIES; swapped blocks need every block recomputed (train/blockswap.py)."""
    if strategy.block_swap or job.gradient_checkpointing is True:
        return (1,)
    if job.gradient_checkpointing is False:
        return (0,)
    return CHECKPOINT_GRANULARITIES


def requested_stage(job: JobShape) -> int | None:
    return None if job.zero_stage in (None, "auto") else int(job.zero_stage)


def honours_request(strategy: Strategy, job: JobShape) -> bool:
    """The request's training type, base precision, `zero_stage` and `offload` (the optimizer's
    offload target; `none` also rules out offloading the parameters and swapping the base's blocks) are honoured."""
    if strategy.training_type != job.training_type:
        return False
    if job.offload == "none" and (strategy.offload_param != "none" or strategy.block_swap):
        return False
    if strategy.fused_backward_pass:
        return job.fused_backward_pass is not False and not fused_pass_changes(job)
    if job.fused_backward_pass is True:
        return False
    if job.training_type == "lora" and job.base_precision not in ("auto", strategy.base_precision):
        return False
    if not strategy.use_deepspeed:
        return not job.use_deepspeed
    stage = requested_stage(job)
    if stage is not None and stage != strategy.zero_stage:
        return False
    return job.offload in ("auto", strategy.offload_optimizer)


def effective_precision(job: JobShape, hardware: Hardware) -> tuple[str, list[str]]:
    precision = job.mixed_precision
    notes: list[str] = []
    if hardware.accelerator == "cpu" and precision == "fp16":
        notes.append("mixed_precision: fp16 is not reliable on DeepSpeed's CPU accelerator; using bf16")
        precision = "bf16"
    elif hardware.accelerator == "cuda" and precision == "bf16" and not hardware.bf16_supported:
        notes.append(
            f"mixed_precision: {hardware.gpus[0].name} has no bf16 support (compute capability < 8.0); "
            "using fp16, which FLUX may overflow"
        )
        precision = "fp16"
    return precision, notes


def headroom(margin: float) -> str:
    """The margin a fit keeps beyond the prediction, as a refusal names it: " + 10 % headroom"."""
    return f" + {round(margin * 100)} % headroom"


def fit_reason(estimate: MemoryEstimate, hardware: Hardware) -> str:
    """Why a candidate does not fit, resource by resource, each need with the margin it must keep (a need
    below what the worker has can still be short of it once the margin is added); empty when it fits."""
    problems = []
    on_cpu = hardware.accelerator == "cpu"
    if not on_cpu and estimate.gpu_bytes * (1 + GPU_MARGIN) > hardware.gpu_memory_bytes:
        phase = max(estimate.phase_gpu_bytes, key=lambda name: estimate.phase_gpu_bytes[name], default="training")
        problems.append(
            f"needs ≈{format_bytes(estimate.gpu_bytes)} per GPU{headroom(GPU_MARGIN)}, has "
            f"{format_bytes(hardware.gpu_memory_bytes)} (peak while {PHASE_VERBS.get(phase, phase)})"
        )
    if estimate.host_bytes * (1 + HOST_MARGIN) > hardware.host_available_bytes:
        problems.append(
            f"needs ≈{format_bytes(estimate.host_bytes)} host RAM{headroom(HOST_MARGIN)}, has "
            f"{format_bytes(hardware.host_available_bytes)} available"
        )
    work_disk = estimate.disk_bytes - estimate.nvme_bytes
    if work_disk * (1 + DISK_MARGIN) > hardware.disk_free_bytes:
        problems.append(
            f"needs ≈{format_bytes(work_disk)} disk at {hardware.work_dir}{headroom(DISK_MARGIN)}, has "
            f"{format_bytes(hardware.disk_free_bytes)}"
        )
    if estimate.nvme_bytes and estimate.nvme_bytes * (1 + DISK_MARGIN) > (hardware.nvme_free_bytes or 0):
        problems.append(
            f"needs ≈{format_bytes(estimate.nvme_bytes)} at the offload path{headroom(DISK_MARGIN)}, has "
            f"{format_bytes(hardware.nvme_free_bytes or 0)}"
        )
    if locked := memlock_problem(estimate, hardware):
        problems.append(locked)
    return "; ".join(problems)


def shortfall(estimate: MemoryEstimate, hardware: Hardware) -> tuple[int, float]:
    """How far a candidate is from fitting: how many resources are short, then the worst
    need/available ratio — so a strategy short only of host RAM is closer than one short of both."""
    ratios = list(resource_ratios(estimate, hardware).values())
    return sum(ratio > 1 for ratio in ratios), max(ratios)


def resource_ratios(estimate: MemoryEstimate, hardware: Hardware) -> dict[str, float]:
    """Need (with its margin) over what the worker has, per resource: above 1 is short."""
    ratios = {
        "host": estimate.host_bytes * (1 + HOST_MARGIN) / max(1, hardware.host_available_bytes),
        "disk": (estimate.disk_bytes - estimate.nvme_bytes) * (1 + DISK_MARGIN) / max(1, hardware.disk_free_bytes),
    }
    if hardware.accelerator == "cuda":
        ratios["gpu"] = estimate.gpu_bytes * (1 + GPU_MARGIN) / max(1, hardware.gpu_memory_bytes)
    if (locked := memlock_ratio(estimate, hardware)) is not None:
        ratios["locked memory"] = locked
    return ratios


def evaluate_candidate(
    strategy: Strategy, job: JobShape, hardware: Hardware, model: ModelSize, precision: str, *, honours: bool
) -> Candidate:
    estimate = estimate_memory(strategy, model, job, hardware, precision)
    trainable = int(estimate.breakdown["trainable_params"])  # a count, in the breakdown of (float) bytes
    step = mixed_seconds_per_step(strategy, model, job, hardware, trainable, compute_dtype_bytes(precision))
    reason = fit_reason(estimate, hardware)
    return Candidate(
        strategy=strategy,
        estimate=estimate,
        seconds_per_step=step,
        fits=not reason,
        reason=reason or "fits",
        lora_rank=job.lora_rank if strategy.training_type == "lora" else None,
        honours_request=honours,
        phase_seconds=phase_seconds(
            strategy, model, replace(job, mixed_precision=precision), hardware, trainable, step
        ),
    )


def evaluate_candidates(
    spec_or_job: JobSpec | JobShape, hardware: Hardware, model: ModelSize, *, include_alternatives: bool = True
) -> list[Candidate]:
    """Every strategy for this job on this machine, with predicted memory, time and fit. With
    `include_alternatives`, the other training type is evaluated too (LoRA at rank 16 over every base
    precision for a full fine-tune), so a refusal can say what would fit instead."""
    job = as_job(spec_or_job)
    precision, _ = effective_precision(job, hardware)
    has_nvme = bool(hardware.nvme_path)
    # Swapping blocks saves GPU memory only where there is one, and needs each block recomputed in the backward.
    swap = hardware.accelerator == "cuda" and job.gradient_checkpointing is not False
    plans: list[tuple[Strategy, int]] = []
    for base in base_precisions_for(job.training_type, job.base_precision):
        plans += [
            (s, job.lora_rank)
            for s in strategies_for(job.training_type, job.use_deepspeed, has_nvme, base, block_swap=swap)
        ]
    if fused_pass_possible(hardware, precision) and (job.training_type == "full" or include_alternatives):
        plans += [(FUSED_STRATEGY, job.lora_rank)] + ([(FUSED_SWAP_STRATEGY, job.lora_rank)] if swap else [])
    if job.use_deepspeed and requested_stage(job) == 1:
        plans.insert(0, (Strategy(job.training_type, True, 1, "none", "none"), job.lora_rank))
        plans.insert(1, (Strategy(job.training_type, True, 1, "cpu", "none"), job.lora_rank))
    if include_alternatives:
        other = "lora" if job.training_type == "full" else "full"
        rank = ALTERNATIVE_LORA_RANK if other == "lora" else job.lora_rank
        for base in base_precisions_for(other, "auto"):
            plans += [(s, rank) for s in strategies_for(other, True, has_nvme, base, block_swap=swap)]
    candidates = []
    for strategy, rank in plans:
        honours = honours_request(strategy, job) and rank == job.lora_rank
        granularities = checkpointing_for(strategy, job)
        # The most checkpointed first: what does not fit with it fits with none of the others, which saves
        # evaluating them (the planner runs often, and refusals re-plan every variant).
        first = evaluate_candidate(
            replace(strategy, checkpoint_every=granularities[-1]),
            replace(job, lora_rank=rank),
            hardware,
            model,
            precision,
            honours=honours,
        )
        candidates.append(first)
        if first.fits and honours:
            candidates += [
                evaluate_candidate(
                    replace(strategy, checkpoint_every=every),
                    replace(job, lora_rank=rank),
                    hardware,
                    model,
                    precision,
                    honours=honours,
                )
                for every in granularities[:-1]
            ]
    fastest = min(candidate.seconds_per_step for candidate in candidates)
    return [replace(candidate, relative_speed=fastest / candidate.seconds_per_step) for candidate in candidates]


def pick(candidates: Iterable[Candidate]) -> Candidate | None:
    """The fastest candidate that honours the request and fits; ties go to the simpler one."""
    eligible = [candidate for candidate in candidates if candidate.honours_request and candidate.fits]
    if not eligible:
        return None
    return min(enumerate(eligible), key=lambda item: (round(item[1].seconds_per_step, 9), item[0]))[1]


def describe_candidate(candidate: Candidate) -> str:
    text = candidate.strategy.describe()
    if candidate.lora_rank is not None:
        text = text.replace("LoRA", f"LoRA rank {candidate.lora_rank}", 1)
    return text


def fused_pass_possible(hardware: Hardware, precision: str) -> bool:
    """The fused pass keeps bf16 weights and steps inside one process's backward: bf16, one GPU or the CPU."""
    return precision == "bf16" and (hardware.accelerator == "cpu" or hardware.gpu_count == 1)


def fused_pass_changes(job: JobShape) -> list[str]:
    """The request settings a full fine-tune would have to change to run the fused pass (none: it may)."""
    stage = requested_stage(job)
    conflicts = fused_pass_conflicts(
        gradient_accumulation_steps=job.gradient_accumulation_steps,
        optimizer=job.optimizer,
        optimizer_named=job.optimizer_named,
        mixed_precision=job.mixed_precision,
        zero_stage="auto" if stage is None else stage,
        offload=job.offload,
    )
    return [conflict.change for conflict in conflicts]


def optimizer_for(strategy: Strategy, optimizer: str = "adamw") -> str:
    """The optimizer class that will step (what the trainer's metrics.optimizer reports)."""
    if strategy.fused_backward_pass:
        return FUSED_ADAFACTOR_CLASS
    name = normalise_optimizer_name(optimizer)
    if strategy.offload_optimizer != "none":
        return OFFLOADED_OPTIMIZER_CLASSES.get(name, name)
    return TORCH_OPTIMIZER_CLASSES.get(name, name)
