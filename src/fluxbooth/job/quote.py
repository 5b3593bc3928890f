"""The plan report: what `python -m fluxbooth plan --json` prints and a `dry_run` job answers. Every candidate
strategy, the chosen one with each phase's predicted memory and time, the deadline check, and, when the
endpoint sets a price per hour, the predicted cost. One owner for the CLI and the worker; no torch here.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fluxbooth.clock import JobClock
from fluxbooth.dataset.remote_count import DatasetCount, count_dataset
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import Hardware, probe_hardware
from fluxbooth.messages import format_bytes
from fluxbooth.models.source import pending_download_bytes, resolve_base_model
from fluxbooth.plan import JobShape, as_job, check_job, choose_plan, evaluate_candidates, model_size, pick
from fluxbooth.request.model import TrainingRequest
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import TransferRates, WorkerSettings
from fluxbooth.sizing import ModelSize
from fluxbooth.storage.checkpoints import find_resume_checkpoint

SECONDS_PER_HOUR = 3600
COST_DECIMALS = 4  # a tiny job costs fractions of a cent


def describe_hardware(hardware: Hardware) -> str:
    if hardware.gpus:
        gpu = f"{hardware.gpu_count}x {hardware.gpus[0].name} ({format_bytes(hardware.gpu_memory_bytes)})"
    else:
        gpu = "no GPU"
    return (
        f"{gpu}, {format_bytes(hardware.host_available_bytes)} host RAM, {hardware.cpu_count} CPUs, "
        f"{format_bytes(hardware.disk_free_bytes)} disk [{hardware.source}]"
    )


def job_summary(job: JobShape) -> dict[str, Any]:
    return {
        "training_type": job.training_type,
        "lora_rank": job.lora_rank,
        "base_precision": job.base_precision,
        "resolution": list(job.resolution),
        "batch_size": job.batch_size,
        "gradient_accumulation_steps": job.gradient_accumulation_steps,
        "steps": job.steps,
        "instance_images": job.num_instance_images,
        "class_images": job.num_class_images,
        "mixed_precision": job.mixed_precision,
        "gradient_checkpointing": job.gradient_checkpointing,
        "zero_stage": job.zero_stage,
        "offload": job.offload,
        "use_deepspeed": job.use_deepspeed,
        # The renders (the base model's round before the first step with likeness) and their scoring: the plan's
        # "validation" and "scoring" phases time them.
        "validation_prompts": job.validation_prompts,
        "validation_rounds": job.validation_rounds,
        "likeness": job.likeness,
        "keep_best_step": job.keep_best_step,
    }


def predicted_cost(predicted_seconds: float, price_per_hour: float) -> dict[str, float]:
    """The whole job's predicted time at the endpoint's price per worker-hour, in the price's currency."""
    return {
        "price_per_hour": price_per_hour,
        "predicted_seconds": round(predicted_seconds, 1),
        "predicted_cost": round(predicted_seconds / SECONDS_PER_HOUR * price_per_hour, COST_DECIMALS),
    }


def plan_report(
    spec: JobSpec,
    *,
    hardware: Hardware,
    model: ModelSize,
    dataset: DatasetCount,
    deadline_source: str,
    price_per_hour: float | None = None,
    gpu_name_given: str | None = None,
    download_bytes: int = 0,
    transfer_rates: TransferRates | None = None,
) -> dict[str, Any]:
    """Every strategy for the job `spec` on `hardware`, and the chosen plan: the
    phases' peaks and times, the estimated run, the cost when `price_per_hour` is set. A job nothing fits, or
    one the deadline check refuses, has `plan` None and the `does_not_fit` error in `error`. The report names the
    image count it planned for and where it came from (`dataset.source`: the dataset's zip, its URL, the
    worker's cap, or the `--instance-images` flag), and the spec's deadline with where it came from."""
    # The base model's pending download and the upload are phases of the run like the others.
    job = replace(
        as_job(spec, dataset.instance_images),
        download_bytes=download_bytes,
        transfer_rates=transfer_rates or TransferRates(),
    )
    check_job(job, model)
    candidates = evaluate_candidates(job, hardware, model)
    report: dict[str, Any] = {
        "chosen": None,
        "plan": None,
        "error": None,
        "accelerator": hardware.accelerator,
        "hardware": hardware.to_dict(),
        "hardware_summary": describe_hardware(hardware),
        "gpu_name": {"given": gpu_name_given, "matched": hardware.gpus[0].name} if gpu_name_given else None,
        "model": model.to_dict(),
        "job": job_summary(job),
        "instance_images": dataset.instance_images,
        "instance_images_source": dataset.source,
        "deadline_seconds": spec.deadline_seconds,
        "deadline_source": deadline_source,
        "base_model_download_bytes": download_bytes,
        "candidates": [candidate.to_dict() for candidate in candidates],
        "warnings": list(spec.warnings),
    }
    try:
        plan = choose_plan(job, hardware, model, deadline_seconds=spec.deadline_seconds)
    except FluxboothError as error:
        if error.code is not ErrorCode.DOES_NOT_FIT:
            raise
        report["error"] = {"code": error.code.value, "message": error.message, "details": error.details}
        return report
    report["plan"] = plan.to_dict()
    report["warnings"] += list(plan.warnings)
    report["estimated_run_seconds"] = round((plan.predicted_seconds_per_step or 0) * job.steps)
    chosen = pick(candidates)
    report["chosen"] = chosen.to_dict() if chosen is not None else None
    if price_per_hour is not None:
        report["cost"] = predicted_cost(plan.predicted_total_seconds or 0.0, price_per_hour)
    return report


def dry_run_answer(
    spec: JobSpec,
    settings: WorkerSettings,
    *,
    hardware: Hardware,
    model: ModelSize,
    dataset: DatasetCount,
    download_bytes: int = 0,
) -> dict[str, Any]:
    """What a `dry_run` job answers: the report above for this worker, with the endpoint's price, planned for
    the images of the dataset sent (`dataset`, remote_count.count_dataset: counted from the zip's directory, or
    the worker's cap when it could not be, `instance_images_note` saying why) and the base model's pending
    download. A job that nothing fits, or that the deadline check refuses, is refused as the real job would be
    (`does_not_fit`), the report in its details."""
    report = plan_report(
        spec,
        hardware=hardware,
        model=model,
        dataset=dataset,
        deadline_source="timeout_seconds" if spec.deadline_from_request else "FLUXBOOTH_JOB_DEADLINE_SECONDS",
        price_per_hour=settings.price_per_hour,
        download_bytes=download_bytes,
        transfer_rates=settings.transfer_rates,
    )
    report["instance_images_note"] = dataset.note
    refusal = report.pop("error")
    if refusal is not None:
        raise FluxboothError(ErrorCode.DOES_NOT_FIT, refusal["message"], details={"plan_report": report})
    return {"model_name": spec.export.model_name, "dry_run": True, **report}


def quote_job(
    request: TrainingRequest, settings: WorkerSettings, job_dir: Path, started: float | None = None
) -> dict[str, Any]:
    """A dry run's answer: planned from the base model's configs on this machine and the images the
    dataset's zip lists (its directory only), before anything else is fetched or launched. It refuses what the
    real job refuses before training (the resume point it names, the dataset's zip), by the same checks, and its
    requests end by the job's deadline, counted from `started` (time.monotonic(); default: now)."""
    started = time.monotonic() if started is None else started
    model = resolve_base_model(request.base_model, settings, request.base_model_revision)
    size = model_size(str(model.folder))
    spec = resolve_job_spec(request, size, settings)
    if request.resume_from:
        _, resume_warnings = find_resume_checkpoint(request.resume_from, settings, request.model_name)
        spec = replace(spec, warnings=(*spec.warnings, *resume_warnings))
    dataset = count_dataset(spec.dataset, settings.dataset_limits, JobClock(started, spec.deadline_seconds))
    job_dir.mkdir(parents=True, exist_ok=True)
    return dry_run_answer(
        spec,
        settings,
        hardware=probe_hardware(job_dir, settings.environ),
        model=size,
        dataset=dataset,
        download_bytes=pending_download_bytes(model),
    )
