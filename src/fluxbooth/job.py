"""One job, start to finish: validate, plan, prepare the dataset, train, verify, upload, report.

Every failure becomes the error contract's shape; the job directory is always removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fluxbooth.artifacts import collect_artifacts
from fluxbooth.attempts import (
    JobAttempt, attempt_is_live, claim_attempt_dir, remove_stale_attempt_dirs, remove_stale_swap_dirs, safe_job_id,
)
from fluxbooth.checkpoints import (
    CheckpointUploader, StoredCheckpoint, check_resume_checkpoint, checkpoint_uploader, download_checkpoint,
    find_resume_checkpoint, job_checkpoint_record, trainer_checkpoint_root, with_resume_hint,
)
from fluxbooth.clock import JobClock
from fluxbooth.contract.events import TrainerEvent, WarningEvent
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.dataset import PreparedDataset, prepare_dataset
from fluxbooth.dataset.controls import check_validation_images_used, fetch_validation_images
from fluxbooth.deadline import stopped_for_deadline, trainer_deadline, trainer_stop_time
from fluxbooth.disk_space import ensure_disk_for_training
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.families import family_named
from fluxbooth.hardware import nvme_root, probe_hardware
from fluxbooth.launch import classify_outcome, run_trainer, trainer_command
from fluxbooth.launch_files import child_environment, trainer_config_for, write_launch_files
from fluxbooth.model_source import (
    download_base_model, ensure_room_to_download, pending_download_bytes, resolve_base_model,
)
from fluxbooth.plan import choose_plan, model_size
from fluxbooth.planned_job import PlannedJob, replan_for_dataset, require_time_to_stop, with_job_swap_dir
from fluxbooth.progress import ProgressReporter, ProgressSink
from fluxbooth.quote import quote_job
from fluxbooth.redaction import Redactor
from fluxbooth.report import ReportInputs, make_report, report_artifacts, sheet_images
from fluxbooth.request import TrainingRequest, parse_request
from fluxbooth.result import JobResult
from fluxbooth.scoring_stage import scoring_stage
from fluxbooth.settings import WorkerSettings
from fluxbooth.spec import resolve_job_spec
from fluxbooth.storage import local_output_warning, require_usable_storage
from fluxbooth.threads import in_thread
from fluxbooth.upload import upload_artifacts

logger = logging.getLogger(__name__)


@dataclass
class JobStages:
    """The running job's stages: each reported as it starts and timed (the result's `metrics.seconds`)."""

    reporter: ProgressReporter
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str, /, **extra: Any) -> Iterator[None]:
        """Report the stage `name` (with `extra`), and record its seconds when it completes."""
        self.reporter.stage(name, **extra)
        started = time.monotonic()
        yield
        self.seconds[name] = _elapsed(started)


def _elapsed(since: float) -> float:
    return round(time.monotonic() - since, 3)


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
            warnings.extend(await in_thread(
                check_resume_checkpoint, resume_checkpoint, job_checkpoint_record(spec, size.family), spec.steps
            ))
        deadline = float(spec.deadline_seconds)
        # Before the dataset is fetched its size is unknown: planned for the fewest images a dataset may hold, so
        # only a job that no dataset could make fit is refused here. replan_for_dataset sizes it for the real one.
        plan = await in_thread(functools.partial(
            choose_plan, spec, hardware, size, deadline_seconds=deadline,
            instance_images=settings.dataset_limits.min_images, download_bytes=pending_download_bytes(model),
            transfer_rates=settings.transfer_rates,
        ))
        ensure_room_to_download(model, plan.predicted_disk_bytes, settings.work_root)
        warnings.extend(plan.warnings)
        if plan.nvme_path:
            is_live = functools.partial(attempt_is_live, settings.work_root)
            for stale in await in_thread(remove_stale_swap_dirs, Path(plan.nvme_path), is_live):
                logger.warning("job %s: removed a stale DeepSpeed swap folder %s", job_id, stale)
    return PlannedJob(request, spec, model, size, hardware, with_job_swap_dir(plan, job_dir), deadline, started,
                      resume_checkpoint, warnings, transfer_rates=settings.transfer_rates)


async def _trainer_config(
    job: PlannedJob, settings: WorkerSettings, stages: JobStages, job_dir: Path, dataset: PreparedDataset,
    base_model: str, validation_images: tuple[Path, ...],
) -> TrainerConfig:
    """The trainer's config, with the checkpoint to resume from downloaded to a local folder."""
    trainer = trainer_config_for(
        job.spec, job.plan, base_model=base_model, instance_dir=dataset.instance_dir,
        class_dir=dataset.class_dir, job_dir=job_dir, class_image_cache_dir=settings.cache_dir / "class-images",
        control_dir=dataset.control_dir, validation_images=validation_images,
    )
    resume_folder = None
    if job.resume_checkpoint is not None:
        stages.reporter.stage("resume", checkpoint=job.resume_checkpoint.uri)
        resume_folder = str(await in_thread(download_checkpoint, job.resume_checkpoint, trainer_checkpoint_root(trainer)))
    # The base model's download and the checkpoint's took their time too: never a launch already due to stop.
    require_time_to_stop(job)
    # The trainer only ever sees a local folder: the request's URI or `latest` is resolved above. It checkpoints
    # as the plan says (the request's checkpointing_steps, or the planner's for a run near its deadline).
    return dataclasses.replace(
        trainer, resume_from=resume_folder, checkpointing_steps=job.plan.checkpointing_steps,
        stop_at_unix_seconds=trainer_stop_time(job),
    )


async def _train(
    job: PlannedJob, trainer: TrainerConfig, settings: WorkerSettings, stages: JobStages, job_dir: Path
) -> tuple[Any, CheckpointUploader | None]:
    """Launch files, `accelerate launch`, checkpoints uploaded as they are made; the successful outcome."""
    # After the dataset and the checkpoint to resume from have taken their share of the disk.
    ensure_disk_for_training(job.plan, settings.work_root)
    files = write_launch_files(job_dir, job.plan, trainer)
    extensions = settings.environ.get("TORCH_EXTENSIONS_DIR") or settings.cache_dir / "torch_extensions"
    env = child_environment(
        job.plan, settings.environ, cpu_count=job.hardware.cpu_count, torch_extensions_dir=Path(extensions),
        debug=job.spec.debug,
    )
    deadline_seconds = trainer_deadline(job)
    # Until the trainer's first event: `accelerate launch` starting the trainer (imports, process group).
    stages.reporter.stage("launch", steps=job.spec.steps)
    uploader = checkpoint_uploader(trainer, settings, job.request.model_name, job_dir)

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
        raise with_resume_hint(failure, uploader)
    assert outcome.done is not None
    return outcome, uploader


async def _run(
    job_input: Any, job_id: str, settings: WorkerSettings, stages: JobStages, job_dir: Path
) -> dict[str, Any]:
    # The dataset checks measure images with numpy, which the handler process loads only once a job needs it.
    from fluxbooth.dataset.checks import check_prepared, enforce

    request = parse_request(job_input)
    if request.dry_run:
        return await in_thread(quote_job, request, settings, job_dir)
    job = await _plan_job(request, job_id, settings, stages, job_dir)
    check_validation_images_used(job.request, family_named(job.size.family))

    # Every download (the dataset, each validation image) runs inside the job's one deadline.
    clock = JobClock(job.started, job.deadline)
    with stages.stage("dataset"):
        dataset = await in_thread(
            functools.partial(prepare_dataset, on_image=stages.reporter.count_from_thread("dataset"), clock=clock),
            job.request, job_dir, settings.dataset_limits,
        )
        # The validation control images are fetched and checked like the dataset, before the base model is downloaded.
        validation_images = await in_thread(
            fetch_validation_images, job.request, job_dir, settings.dataset_limits, clock
        )
    training_shape = job.request.resolution.training_shape
    with stages.stage("checks"):
        checks = await in_thread(
            functools.partial(check_prepared, on_image=stages.reporter.count_from_thread("checks")),
            dataset, training_shape, job.request.dataset_checks,
        )
    job.warnings.extend(checks.warnings())
    enforce(checks)
    clock.check("preparing the dataset")
    job = await in_thread(replan_for_dataset, job, dataset, job_dir)
    if job.model.pending is not None:
        with stages.stage("download", bytes_done=0, bytes_total=job.model.pending.bytes_total):
            await download_base_model(
                job.model, settings.environ, lambda update: stages.reporter.stage("download", **update),
                stages.reporter.min_interval, clock.deadline_at,
            )
    trainer = await _trainer_config(job, settings, stages, job_dir, dataset, str(job.model.folder), validation_images)
    outcome, uploader = await _train(job, trainer, settings, stages, job_dir)
    trainer_metrics = dict(outcome.done.metrics)
    likeness, announced = await scoring_stage(job, trainer, settings, job_dir, outcome.done, stages.stage)

    with stages.stage("report"):
        report = await in_thread(make_report, ReportInputs(
            job.request.model_name, outcome.events, Path(trainer.output_dir),
            sheet_images(dataset, job.request.instance_prompt, checks.flags()), training_shape, likeness,
        ))
        job.warnings.extend(report.warnings)

    with stages.stage("upload"):
        artifacts = await in_thread(collect_artifacts, Path(trainer.output_dir), announced)
        artifacts += report_artifacts(report, Path(trainer.output_dir))
        stored = await in_thread(upload_artifacts, artifacts, settings, job.request.model_name, job_id)
    stages.seconds["total"] = _elapsed(job.started)
    if (disk_warning := local_output_warning(settings)) is not None:
        logger.warning("job %s: %s", job_id, disk_warning)
        job.warnings.append(disk_warning)

    if trainer_metrics.get("stopped_for_deadline"):
        raise stopped_for_deadline(job, trainer_metrics, stored, uploader)
    trainer_warnings = [event.message for event in outcome.events if isinstance(event, WarningEvent)]
    return JobResult(
        model_name=job.request.model_name, artifacts=stored, plan=job.plan, export_formats=trainer.export_formats,
        trainer_metrics=trainer_metrics, stage_seconds=stages.seconds, dataset=dataset.summary(),
        checks=checks.to_dict(), checkpoints=uploader.uploaded if uploader is not None else [],
        warnings=job.warnings + trainer_warnings, likeness=likeness,
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
        return redact.tree(result)
    except FluxboothError as error:
        logger.error("job %s failed: %s", safe_id, redact(f"{error.code.value}: {error.message}"))
        return redact.tree(error.to_result())
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
