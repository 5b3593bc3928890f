"""Choosing how a job runs: the fastest candidate that fits in every phase and finishes before the
deadline, or `does_not_fit` before anything is downloaded or a GPU is touched. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import Hardware
from fluxbooth.plan.candidates import (
    as_job,
    effective_precision,
    evaluate_candidate,
    evaluate_candidates,
    optimizer_for,
    pick,
    requested_stage,
)
from fluxbooth.plan.checks import auto_checkpointing, check_job, deadline_check
from fluxbooth.plan.container_limits import container_notes, nccl_shm_disabled
from fluxbooth.plan.refusal import refusal_message
from fluxbooth.plan.timing import deadline_stop_reserve_seconds, gpu_spec_for
from fluxbooth.plan.types import Candidate, JobShape, Plan, Strategy
from fluxbooth.request.spec import JobSpec
from fluxbooth.settings import TransferRates
from fluxbooth.sizing import ModelSize


def _request_warnings(job: JobShape, hardware: Hardware) -> list[str]:
    warnings: list[str] = []
    if hardware.gpus and not gpu_spec_for(hardware)[1]:
        warnings.append(
            f"GPU {hardware.gpus[0].name!r} is not in the planner's table; times assume an RTX A4000-class "
            "card (76.7 TFLOPS bf16, PCIe 4.0), so they may be far off"
        )
    if not job.use_deepspeed and (job.zero_stage != "auto" or job.offload not in ("auto", "none")):
        warnings.append("zero_stage/offload are ignored because use_deepspeed is false")
    return warnings


def _check_offload(job: JobShape, hardware: Hardware) -> None:
    if job.offload == "nvme" and not hardware.nvme_path:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            "offload: 'nvme' needs an offload directory on fast disk; set FLUXBOOTH_NVME_PATH on the "
            "worker, or use offload 'cpu' or 'auto'",
        )
    if job.offload == "nvme" and requested_stage(job) in (1, 2):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            "offload: DeepSpeed offloads to NVMe only under ZeRO-3; set zero_stage to 3 or 'auto'",
        )


def choose_plan(
    spec_or_job: JobSpec | JobShape,
    hardware: Hardware,
    model: ModelSize,
    *,
    deadline_seconds: float | None = None,
    instance_images: int | None = None,
    bucket_mix: Mapping[tuple[int, int], int] | None = None,
    download_bytes: int | None = None,
    transfer_rates: TransferRates | None = None,
    op_build_seconds: float | None = None,
) -> Plan:
    """The fastest strategy that fits with a margin, or `does_not_fit` with the numbers and the
    nearest strategies that would fit. `spec_or_job` is the job spec (fluxbooth.request.spec) or a hand-built
    JobShape. `deadline_seconds` defaults to the request's `timeout_seconds`; `instance_images` to
    the dataset cap (the count is unknown before the dataset is fetched). Once the dataset is prepared,
    plan again with its `instance_images` and `bucket_mix` (PreparedDataset's): samples per training shape,
    so memory is sized for the largest bucket it holds and time for its mix. `download_bytes`: the base model's
    bytes still to download (0: cached), timed at `transfer_rates` (the worker's) with the upload; unset, a
    JobShape's own (a spec's: nothing to download, the default rates). `op_build_seconds`: the DeepSpeed ops the
    trainer must still JIT-build, counted in its loading phase (host/op_cache.py)."""
    job = as_job(spec_or_job, instance_images, bucket_mix)
    if download_bytes is not None:
        job = replace(job, download_bytes=download_bytes)
    if transfer_rates is not None:
        job = replace(job, transfer_rates=transfer_rates)
    if op_build_seconds is not None:
        job = replace(job, op_build_seconds=op_build_seconds)
    check_job(job, model)
    precision, warnings = effective_precision(job, hardware)
    warnings += _request_warnings(job, hardware)
    if not job.use_deepspeed:
        job = replace(job, zero_stage="auto", offload="auto")
    _check_offload(job, hardware)
    candidates = evaluate_candidates(job, hardware, model)
    chosen = pick(candidates)
    if chosen is None:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            refusal_message(candidates, hardware, model, job),
            details={
                "gpu_memory_bytes": hardware.gpu_memory_bytes,
                "host_available_bytes": hardware.host_available_bytes,
                "alternatives": [candidate.to_dict() for candidate in candidates if candidate.fits][:3],
            },
        )
    deadline = deadline_seconds if deadline_seconds is not None else job.timeout_seconds
    warnings += deadline_check(chosen, job, deadline)
    checkpointing_steps, checkpoint_warnings = auto_checkpointing(chosen, job, deadline)
    warnings += checkpoint_warnings
    job = replace(job, checkpointing_steps=checkpointing_steps)
    if chosen.estimate.cache_encoders_on_cpu:
        warnings.append(
            "the text encoders and VAE do not fit the GPU next to the CUDA context; embeddings and "
            "latents are cached on the CPU (slower start)"
        )
    return plan_from(chosen, job, hardware, precision, warnings)


def plan_from(candidate: Candidate, job: JobShape, hardware: Hardware, precision: str, warnings: list[str]) -> Plan:
    strategy = candidate.strategy
    on_cpu = hardware.accelerator == "cpu"
    processes = 1 if on_cpu else hardware.gpu_count
    trainable = int(candidate.estimate.breakdown["trainable_params"])
    return Plan(
        accelerator="cpu" if on_cpu else "cuda",
        num_processes=processes,
        training_type=strategy.training_type,  # type: ignore[arg-type]
        use_deepspeed=strategy.use_deepspeed,
        zero_stage=strategy.zero_stage,
        offload_optimizer=strategy.offload_optimizer,
        offload_param=strategy.offload_param,
        mixed_precision=precision,  # type: ignore[arg-type]
        gradient_checkpointing=strategy.checkpoint_every > 0,
        checkpoint_every=strategy.checkpoint_every,
        optimizer=optimizer_for(strategy, job.optimizer),
        predicted_gpu_bytes=candidate.estimate.gpu_bytes,
        predicted_host_bytes=candidate.estimate.host_bytes,
        predicted_disk_bytes=candidate.estimate.disk_bytes,
        nvme_path=hardware.nvme_path if "nvme" in (strategy.offload_optimizer, strategy.offload_param) else None,
        warnings=(*warnings, *container_notes(candidate.estimate, hardware, processes)),
        nccl_shm_disable=nccl_shm_disabled(hardware, processes),
        predicted_seconds_per_step=round(candidate.seconds_per_step, 4),
        cache_encoders_on_cpu=candidate.estimate.cache_encoders_on_cpu,
        base_precision=strategy.base_precision,
        block_swap=strategy.block_swap,
        phases=candidate.phases(),
        predicted_total_seconds=round(candidate.total_seconds, 1),
        fused_backward_pass=strategy.fused_backward_pass,
        checkpointing_steps=job.checkpointing_steps,
        trainable_params=trainable,
        predicted_stop_reserve_seconds=round(
            deadline_stop_reserve_seconds(candidate.phase_seconds, job, trainable),
            1,
        ),
    )


def plan_for_strategy(
    strategy: Strategy,
    spec_or_job: JobSpec | JobShape,
    hardware: Hardware,
    model: ModelSize,
    *,
    instance_images: int | None = None,
) -> Plan:
    """The plan for one given strategy with its predictions, without checking that it fits:
    for benchmarks and hand launches that must run a particular strategy."""
    job = replace(as_job(spec_or_job, instance_images), training_type=strategy.training_type)
    if job.gradient_checkpointing is not None:
        # The request's checkpointing over the strategy's default (every block).
        strategy = replace(strategy, checkpoint_every=1 if job.gradient_checkpointing else 0)
    precision, warnings = effective_precision(job, hardware)
    candidate = evaluate_candidate(strategy, job, hardware, model, precision, honours=True)
    return plan_from(candidate, job, hardware, precision, warnings)
