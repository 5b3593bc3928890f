"""One job, start to finish: validate, plan, prepare the dataset, train, verify, upload, report.

Every failure becomes the error contract's shape; the job directory is always removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import traceback
from pathlib import Path
from typing import Any

from fluxbooth.clock import JobClock
from fluxbooth.contract.events import TrainerEvent, WarningEvent
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.disk import ensure_disk_for_training
from fluxbooth.host.hardware import Hardware, nvme_root, probe_hardware
from fluxbooth.job.attempts import (
    JobAttempt,
    attempt_is_live,
    claim_attempt_dir,
    remove_stale_attempt_dirs,
    remove_stale_swap_dirs,
    safe_job_id,
)
from fluxbooth.job.captioning_stage import captioning_stage
from fluxbooth.job.deadline import stopped_for_deadline, trainer_deadline
from fluxbooth.job.launch import run_trainer, trainer_command
from fluxbooth.job.launch_files import child_environment, write_launch_files
from fluxbooth.job.op_builds import build_seconds, extensions_dir, launch_details, ops_to_build
from fluxbooth.job.planned import PlannedJob, replan_for_dataset, with_job_swap_dir
from fluxbooth.job.quote import quote_job
from fluxbooth.job.result import JobResult
from fluxbooth.job.scoring_stage import scoring_stage
from fluxbooth.job.stages import JobStages, dataset_stage, elapsed, report_and_upload, trainer_config
from fluxbooth.job.threads import in_thread
from fluxbooth.job.trainer_failures import classify_outcome, kept_after_export
from fluxbooth.models.source import (
    ResolvedModel,
    download_base_model,
    ensure_room_to_download,
    pending_download_bytes,
    resolve_base_model,
)
from fluxbooth.plan import Plan, choose_plan, model_size
from fluxbooth.progress import ProgressReporter, ProgressSink
from fluxbooth.redaction import Redactor
from fluxbooth.request.model import TrainingRequest, parse_request
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import ModelSize
from fluxbooth.storage.checkpoints import (
    CheckpointUploader,
    StoredCheckpoint,
    check_resume_checkpoint,
    checkpoint_uploader,
    find_resume_checkpoint,
    job_checkpoint_record,
    with_resume_hint,
)
from fluxbooth.storage.stores import local_output_warning, require_usable_storage

logger = logging.getLogger(__name__)


async def _plan_job(
    request: TrainingRequest, job_id: str, settings: WorkerSettings, stages: JobStages, job_dir: Path
) -> PlannedJob:
    """Base model, resume point, hardware and plan: every check that needs no dataset."""
    started = time.monotonic()
    warnings = list(request.warnings())
    for warning in warnings:
        logger.warning("job %s: %s", job_id, warning)
    require_usable_storage(settings)

    with stages.stage("plan"):
        model = await in_thread(resolve_base_model, request.base_model, settings, request.base_model_revision)
        job_dir.mkdir(parents=True, exist_ok=True)
        resume_checkpoint: StoredCheckpoint | None = None
        if request.resume_from:
            resume_checkpoint, resume_warnings = await in_thread(
                find_resume_checkpoint, request.resume_from, settings, request.model_name
            )
            warnings.extend(resume_warnings)
        hardware = await in_thread(probe_hardware, job_dir, settings.environ)
        # Sizing and planning take a while for a big model (its configs are bounded first): off the event loop.
        size = await in_thread(model_size, str(model.folder))
        spec = resolve_job_spec(request, size, settings)
        if resume_checkpoint is not None:
            # Another base, another LoRA shape or a step past `steps`: refused before any download or GPU time.
            warnings.extend(
                await in_thread(
                    check_resume_checkpoint,
                    resume_checkpoint,
                    job_checkpoint_record(spec, size.family),
                    spec.optimisation.steps,
                )
            )
        plan, ops, extensions = await _first_plan(spec, hardware, size, model, settings)
        ensure_room_to_download(model, plan.predicted_disk_bytes, settings.work_root)
        warnings.extend(plan.warnings)
        if plan.nvme_path:
            is_live = functools.partial(attempt_is_live, settings.work_root)
            for stale in await in_thread(remove_stale_swap_dirs, Path(plan.nvme_path), is_live):
                logger.warning("job %s: removed a stale DeepSpeed swap folder %s", job_id, stale)
    return PlannedJob(
        spec,
        model,
        size,
        hardware,
        with_job_swap_dir(plan, job_dir),
        float(spec.deadline_seconds),
        started,
        resume_checkpoint,
        warnings,
        transfer_rates=settings.transfer_rates,
        ops_to_build=ops,
        extensions_dir=extensions,
    )


async def _first_plan(
    spec: JobSpec, hardware: Hardware, size: ModelSize, model: ResolvedModel, settings: WorkerSettings
) -> tuple[Plan, tuple[str, ...], Path]:
    """The plan before the dataset is fetched, the DeepSpeed ops its trainer must still build, and their folder."""
    # The dataset's size is unknown yet: planned for the fewest images a dataset may hold, so only a job that no
    # dataset could make fit is refused here. replan_for_dataset sizes it for the real one.
    plan_for = functools.partial(
        choose_plan,
        spec,
        hardware,
        size,
        deadline_seconds=float(spec.deadline_seconds),
        instance_images=settings.dataset_limits.min_images,
        download_bytes=pending_download_bytes(model),
        transfer_rates=settings.transfer_rates,
    )
    plan = await in_thread(plan_for)
    extensions = extensions_dir(settings)
    ops = await in_thread(ops_to_build, plan, extensions)
    if ops:
        # Counted where the trainer builds them, while it loads: the deadline check and checkpointing see them.
        plan = await in_thread(functools.partial(plan_for, op_build_seconds=build_seconds(ops)))
    return plan, ops, extensions


async def _train(
    job: PlannedJob, trainer: TrainerConfig, settings: WorkerSettings, stages: JobStages, job_dir: Path
) -> tuple[Any, CheckpointUploader | None]:
    """Launch files, `accelerate launch`, checkpoints uploaded as they are made; the successful outcome."""
    # After the dataset and the checkpoint to resume from have taken their share of the disk.
    ensure_disk_for_training(job.plan.predicted_disk_bytes, job.plan.nvme_path, settings.work_root)
    files = write_launch_files(job_dir, job.plan, trainer)
    env = child_environment(
        job.plan,
        settings.environ,
        cpu_count=job.hardware.cpu_count,
        torch_extensions_dir=job.extensions_dir or extensions_dir(settings),
        debug=job.spec.debug,
    )
    deadline_seconds = trainer_deadline(job)
    # Until the trainer's first event: `accelerate launch` starting the trainer (imports, process group).
    # With the ops the trainer JIT-builds first, named: minutes before its first event on a fresh environment.
    stages.reporter.stage("launch", **launch_details(job.spec.optimisation.steps, job.ops_to_build))
    uploader = checkpoint_uploader(trainer, settings, job.spec.export.model_name, job_dir)

    def on_trainer_event(event: TrainerEvent) -> None:
        stages.reporter.trainer_event(event)
        if uploader is not None:
            uploader.on_trainer_event(event)

    try:
        outcome = await run_trainer(
            trainer_command(files, job.plan, job.hardware.cpu_count, settings.trainer_module),
            env=env,
            cwd=job_dir,
            deadline_seconds=deadline_seconds,
            redact=Redactor(settings.secret_values),
            on_event=on_trainer_event,
            log_path=job_dir / "trainer.log",
        )
    except BaseException:
        if uploader is not None:
            await uploader.abandon()
        raise
    # Also after a failed or timed-out run: its checkpoints are what a resubmitted job resumes from.
    if uploader is not None:
        await uploader.finish()
        job.warnings.extend(uploader.warnings)
    # The trainer's own time, from its launch to its exit.
    stages.seconds["train"] = round(outcome.seconds, 3)
    failure = classify_outcome(outcome, job.plan, job.deadline)
    if failure is not None:
        kept = kept_after_export(outcome, failure)
        if kept is None:
            raise with_resume_hint(failure, uploader)
        outcome = kept
    return outcome, uploader


async def _run(
    job_input: Any, job_id: str, settings: WorkerSettings, stages: JobStages, job_dir: Path
) -> dict[str, Any]:
    request = parse_request(job_input)
    if request.dry_run:
        return await in_thread(quote_job, request, settings, job_dir)
    job = await _plan_job(request, job_id, settings, stages, job_dir)
    # Every download (the dataset, each validation image, the base model) runs inside the job's one deadline.
    clock = JobClock(job.started, job.deadline)
    inputs = await dataset_stage(job, settings, stages, job_dir, clock)
    job = await in_thread(replan_for_dataset, job, inputs.dataset, job_dir)
    # Before the base model's download and the trainer: the captioner's memory is free before FLUX loads.
    captioning = await captioning_stage(job, settings, stages, job_dir, inputs.dataset)
    if captioning.warning is not None:
        job.warnings.append(captioning.warning)
    inputs = dataclasses.replace(inputs, captioned=captioning.captioned)
    if job.model.pending is not None:
        with stages.stage("download", bytes_done=0, bytes_total=job.model.pending.bytes_total):
            await download_base_model(
                job.model,
                settings.environ,
                lambda update: stages.reporter.stage("download", **update),
                stages.reporter.min_interval,
                clock.deadline_at,
            )
    trainer = await trainer_config(job, settings, stages, job_dir, inputs)
    outcome, uploader = await _train(job, trainer, settings, stages, job_dir)
    trainer_metrics = dict(outcome.done.metrics)
    likeness, announced = await scoring_stage(job, trainer, settings, job_dir, outcome.done, stages.stage)
    stored = await report_and_upload(
        job,
        trainer,
        settings,
        stages,
        job_id,
        inputs=inputs,
        events=outcome.events,
        likeness=likeness,
        announced=announced,
    )
    stages.seconds["total"] = elapsed(job.started)
    if (disk_warning := local_output_warning(settings)) is not None:
        logger.warning("job %s: %s", job_id, disk_warning)
        job.warnings.append(disk_warning)

    if trainer_metrics.get("stopped_for_deadline"):
        raise stopped_for_deadline(job, trainer_metrics, stored, uploader)
    trainer_warnings = [event.message for event in outcome.events if isinstance(event, WarningEvent)]
    return JobResult(
        model_name=job.spec.export.model_name,
        artifacts=stored,
        plan=job.plan,
        export_formats=trainer.export.formats,
        trainer_metrics=trainer_metrics,
        stage_seconds=stages.seconds,
        dataset=inputs.summary(job.spec.dataset.captioning),
        checks=inputs.checks.to_dict(),
        checkpoints=uploader.uploaded if uploader is not None else [],
        warnings=job.warnings + trainer_warnings,
        likeness=likeness,
    ).to_dict()


async def run_job(
    job_input: Any, *, job_id: str | None, settings: WorkerSettings, progress: ProgressSink | None = None
) -> dict[str, Any]:
    """Run one job and return the result or error dict. Raises only `asyncio.CancelledError`.

    `job_input` and `job_id` may be any JSON value: a wrong one gets the error contract, never an exception."""
    safe_id = safe_job_id(job_id)
    attempt: JobAttempt | None = None
    redact = Redactor(settings.secret_values)
    try:
        for stale in remove_stale_attempt_dirs(settings.work_root):
            logger.warning("job %s: removed the folder of a run that is gone: %s", safe_id, stale)
        attempt = claim_attempt_dir(settings.work_root, safe_id)
        result = await _run(job_input, safe_id, settings, JobStages(ProgressReporter(progress)), attempt.path)
        redacted: dict[str, Any] = redact.tree(result)
        return redacted
    except FluxboothError as error:
        logger.error("job %s failed: %s", safe_id, redact(f"{error.code.value}: {error.message}"))
        redacted = redact.tree(error.to_result())
        return redacted
    except asyncio.CancelledError:
        logger.warning("job %s cancelled", safe_id)
        raise
    except Exception as error:  # the caller must get the contract's shape, never a traceback
        logger.error("job %s crashed:\n%s", safe_id, redact(traceback.format_exc()))
        return FluxboothError(
            ErrorCode.INTERNAL, redact(f"internal error ({type(error).__name__}): {error}")
        ).to_result()
    finally:
        if attempt is not None:
            attempt.remove(nvme_root(settings.environ))
