"""One job, start to finish: validate, plan, prepare the dataset, train, verify, upload, report.

Every failure becomes the error contract's shape; the job directory is always removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fluxbooth.artifacts import LocalArtifact, collect_artifacts
from fluxbooth.attempts import (
    JobAttempt,
    attempt_is_live,
    claim_attempt_dir,
    job_swap_dir,
    remove_stale_attempt_dirs,
    remove_stale_swap_dirs,
)
from fluxbooth.clock import JobClock
from fluxbooth.launch_files import child_environment, trainer_config_for, write_launch_files
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.contract.events import StageEvent, StepEvent, TrainerEvent, WarningEvent
from fluxbooth.families import family_named
from fluxbooth.hardware import Hardware, format_bytes, free_disk_bytes, nvme_root, probe_hardware
from fluxbooth.launch import classify_outcome, run_trainer, trainer_command
from fluxbooth.messages import bounded_warnings
from fluxbooth.model_source import ResolvedModel, download_base_model, ensure_room_to_download, resolve_hub_model
from fluxbooth.modelsize import ModelSize
from fluxbooth.plan import Plan, choose_plan, model_size
from fluxbooth.redaction import Redactor
from fluxbooth.settings import TINY_MODEL_NAME, TransferRates, WorkerSettings
from fluxbooth.spec import JobSpec, resolve_job_spec
from fluxbooth.contract.layout import checkpoint_root
from fluxbooth.contract.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from fluxbooth.checkpoints import CheckpointUploader, StoredCheckpoint
    from fluxbooth.dataset import PreparedDataset
    from fluxbooth.request import TrainingRequest

ProgressSink = Callable[[dict[str, Any]], None]
Result = TypeVar("Result")
PROGRESS_MIN_INTERVAL_SECONDS = 2.0
# After a run stopped by its deadline, the trainer's own tail outside the plan's phases: the checkpoint's and the
# export's fixed costs, accelerate's and DeepSpeed's teardown, the launcher's exit.
TRAINER_TEARDOWN_SECONDS = 30.0
TINY_BUILD_TIMEOUT_SECONDS = 600

logger = logging.getLogger(__name__)


# Names that live beside job folders under a model's prefix; a job must never write into them.
RESERVED_JOB_IDS = frozenset({"checkpoints"})


MAX_SAFE_ID_CHARS = 64


def safe_job_id(job_id: object) -> str:
    """A folder and key segment for any JSON value RunPod's `id` may hold (a string, number, list, null).

    Letters, digits, `_` and `-` pass through; anything else, or a cut to MAX_SAFE_ID_CHARS, also gets a short
    hash of the whole id, so two different ids never share a storage folder. No id gives a random one."""
    if job_id is None or job_id == "":
        return uuid.uuid4().hex
    text = job_id if isinstance(job_id, str) else json.dumps(job_id, sort_keys=True, default=str)
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", text[: MAX_SAFE_ID_CHARS * 4])[:MAX_SAFE_ID_CHARS].strip("-")
    if cleaned != text or not isinstance(job_id, str):
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        cleaned = f"{cleaned[: MAX_SAFE_ID_CHARS - 13]}-{digest}".strip("-")
    if cleaned in RESERVED_JOB_IDS:
        cleaned = f"job-{cleaned}"
    return cleaned


@dataclass
class ProgressReporter:
    """Forwards stage changes at once and step updates at most every couple of seconds."""

    sink: ProgressSink | None
    min_interval: float = PROGRESS_MIN_INTERVAL_SECONDS
    _last_sent: float = field(default=0.0, init=False)
    _stage: str = field(default="", init=False)

    def stage(self, name: str, /, **extra: Any) -> None:
        self._stage = name
        self._send({"stage": name, **extra}, force=True)

    def count(self, name: str, done: int, total: int) -> None:
        """Items done of a stage (images prepared, ...): at most every couple of seconds, and the last."""
        self._send({"stage": name, "done": done, "total": total}, force=done >= total)

    def count_from_thread(self, name: str) -> Callable[[int, int], None]:
        """`count` for work running in a thread: the update is handed to the event loop, where the sink runs."""
        loop = asyncio.get_running_loop()
        return lambda done, total: loop.call_soon_threadsafe(self.count, name, done, total)

    def trainer_event(self, event: TrainerEvent) -> None:
        if isinstance(event, StageEvent):
            self.stage(event.stage, **event.details)
        elif isinstance(event, StepEvent):
            step, total = event.step, event.total
            self._send(
                {
                    "stage": "train",
                    "step": step,
                    "total": total,
                    "loss": event.loss,
                    "eta_seconds": round(event.seconds_per_step * (total - step), 1),
                },
                force=step == total,
            )

    def _send(self, payload: dict[str, Any], *, force: bool) -> None:
        now = time.monotonic()
        if self.sink is None or (not force and now - self._last_sent < self.min_interval):
            return
        self._last_sent = now
        try:
            self.sink(payload)
        except Exception:  # progress is best effort; a failing sink must never fail the job
            logger.warning("progress update failed", exc_info=True)


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Build the tiny FLUX pipeline once per cache dir, in a subprocess (this process stays torch-free)."""
    target = cache_dir / "models" / "tiny-flux"
    if (target / "model_index.json").is_file():
        return target
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.tiny", str(target)],
        capture_output=True,
        text=True,
        timeout=TINY_BUILD_TIMEOUT_SECONDS,
        start_new_session=True,
    )
    if completed.returncode != 0 or not (target / "model_index.json").is_file():
        raise FluxboothError(
            ErrorCode.INTERNAL, f"building the tiny model failed: {completed.stderr.strip()[-2000:]}"
        )
    return target


def resolve_base_model(requested: str | None, settings: WorkerSettings, revision: str | None = None) -> ResolvedModel:
    """A local folder for the base model, known before the dataset is fetched: the built-in tiny model, an
    absolute path, or a hub id found in a cache on this worker or (downloads on) pending a download."""
    name = requested or settings.default_base_model
    field = "input.base_model" if requested else "base_model (the endpoint's default, FLUXBOOTH_BASE_MODEL)"
    if revision is not None and (name == TINY_MODEL_NAME or name.startswith("/")):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input.base_model_revision: pins a revision of a Hugging Face id, but the base model {name} is "
            "not one; leave base_model_revision out",
        )
    if name == TINY_MODEL_NAME:
        return ResolvedModel(folder=ensure_tiny_model(settings.cache_dir), source="built-in tiny model")
    if name.startswith("/"):
        path = Path(name)
        if not (path / "transformer" / "config.json").is_file():
            raise FluxboothError(
                ErrorCode.INVALID_INPUT,
                f"{field}: {name} is not a diffusers FLUX folder (no transformer/config.json)",
            )
        return ResolvedModel(folder=path, source="local folder")
    return resolve_hub_model(name, revision, settings.environ, field)


async def _complete_base_model(
    model: ResolvedModel, settings: WorkerSettings, reporter: ProgressReporter, deadline_at: float,
    seconds: dict[str, float],
) -> str:
    """The base model's folder for the trainer, downloading what is pending (stage `download`)."""
    if model.pending is not None:
        reporter.stage("download", bytes_done=0, bytes_total=model.pending.bytes_total)
        started = time.monotonic()
        await download_base_model(
            model, settings.environ, lambda update: reporter.stage("download", **update), reporter.min_interval,
            deadline_at,
        )
        seconds["download"] = _elapsed(started)
    return str(model.folder)


def _elapsed(since: float) -> float:
    return round(time.monotonic() - since, 3)


async def _in_thread(function: Callable[..., Result], *args: Any) -> Result:
    """Blocking work (model build, downloads, image decoding, hashing, uploads) runs in a thread, so the
    event loop keeps serving the runpod SDK's job-stop channel. When the job is cancelled meanwhile,
    the thread is waited for before re-raising: it writes into the job directory, which goes next."""
    work = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # the cancellation is what the caller must see
            await work
        raise


def _filesystem_free_bytes(paths: list[Path]) -> int:
    """Free bytes summed over the distinct filesystems holding `paths` (or their nearest existing parents)."""
    free_by_device: dict[int, int] = {}
    for path in paths:
        existing = path.absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free_by_device[os.stat(existing).st_dev] = free_disk_bytes(existing)
    return sum(free_by_device.values())


def ensure_disk_for_training(plan: Plan, work_root: Path) -> None:
    """The planner checked the disk before the dataset was unpacked; the dataset now takes its share, so
    check again, right before training, against what the trainer will write (caches, checkpoints,
    exported weights, offload swap)."""
    places = [work_root] + ([Path(plan.nvme_path)] if plan.nvme_path else [])
    free = _filesystem_free_bytes(places)
    if plan.predicted_disk_bytes > free:
        where = " and ".join(str(place) for place in places)
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: training needs about {format_bytes(plan.predicted_disk_bytes)} (caches, checkpoints and the "
            f"exported weights) but only {format_bytes(free)} are free under {where}; free disk space or "
            "give the worker a bigger volume (FLUXBOOTH_WORK_DIR)",
            details={"needed_bytes": plan.predicted_disk_bytes, "free_bytes": free},
        )


def _upload_all(
    artifacts: list[LocalArtifact], settings: WorkerSettings, model_name: str, job_id: str
) -> list[dict[str, Any]]:
    from fluxbooth.storage import open_store, preserve_on_volume

    store = open_store(settings, model_name, job_id)
    try:
        return [store.upload(artifact.path, artifact.name, sha256=artifact.sha256).to_dict() for artifact in artifacts]
    except FluxboothError as error:
        keep_dir = settings.volume_dir
        if keep_dir is None:
            raise FluxboothError(
                error.code,
                f"{error.message}. No persistent volume is mounted (FLUXBOOTH_VOLUME_DIR), so the weights "
                "could not be kept; mount a network volume to keep them on upload failures",
                refresh_worker=error.refresh_worker,
            ) from error
        kept = preserve_on_volume([artifact.path for artifact in artifacts], keep_dir, model_name, job_id)
        raise FluxboothError(
            error.code,
            f"{error.message}. The trained weights were kept at {kept} on the persistent volume",
            refresh_worker=error.refresh_worker,
            details={"kept_at": str(kept)},
        ) from error


def _checkpoint_root(trainer: TrainerConfig) -> Path:
    """Where the trainer writes (and looks for) checkpoint-N folders: its own default when unset."""
    return checkpoint_root(trainer.checkpoint_dir, trainer.output_dir)


def _checkpoint_uploader(
    trainer: TrainerConfig, settings: WorkerSettings, model_name: str, job_dir: Path
) -> CheckpointUploader | None:
    if not trainer.checkpointing_steps and trainer.stop_at_unix_seconds is None:
        return None
    from fluxbooth.checkpoints import CheckpointUploader
    from fluxbooth.storage import open_checkpoint_store

    store = open_checkpoint_store(settings, model_name)
    return CheckpointUploader(
        store, _checkpoint_root(trainer), staging_root=job_dir / "checkpoint-uploads", keep=settings.checkpoints_keep
    )


def _with_resume_hint(failure: FluxboothError, uploader: CheckpointUploader | None) -> FluxboothError:
    """A job cut short by its deadline can be resubmitted: say so when a checkpoint made it to storage."""
    if uploader is None or not uploader.uploaded:
        return failure
    return FluxboothError(
        failure.code,
        f"{failure.message}. The checkpoint {uploader.uploaded[-1]} is stored: resubmit the job with "
        '"resume_from": "latest" to continue from it',
        refresh_worker=failure.refresh_worker,
        details={**failure.details, "latest_checkpoint": uploader.uploaded[-1]},
    )


def _stopped_for_deadline(
    job: PlannedJob, metrics: dict[str, Any], stored: list[dict[str, Any]], uploader: CheckpointUploader | None
) -> FluxboothError:
    """`timeout` for a run the trainer stopped at its stop time: the weights trained so far are stored, and so is
    the checkpoint a resubmitted job continues from. The worker is fine: no refresh."""
    reached, total = int(metrics.get("steps_done", 0)), job.request.steps
    checkpoints = uploader.uploaded if uploader is not None else []
    kept = f"the weights trained so far ({len(stored)} artifacts) are stored"
    if checkpoints:
        how = (f"and so is the checkpoint {checkpoints[-1]}; resubmit the same request with \"resume_from\": \"latest\" to "
               f"train the remaining {total - reached} steps")
    else:
        how = "but its checkpoint could not be stored (see warnings), so a resubmitted job starts over"
    return FluxboothError(
        ErrorCode.TIMEOUT,
        f"the job deadline of {job.deadline:.0f} s came at step {reached}/{total}: {kept}, {how}, or raise "
        "timeout_seconds (and the endpoint's execution timeout)",
        refresh_worker=False,
        details={
            "step": reached, "steps": total, "artifacts": stored, "checkpoints": checkpoints,
            "latest_checkpoint": checkpoints[-1] if checkpoints else None,
            "resume_from": "latest" if checkpoints else None, "warnings": job.warnings,
        },
    )


@dataclass
class PlannedJob:
    """What the plan stage decided, before any dataset byte is fetched; the later stages read it."""

    request: TrainingRequest
    # The request resolved for the sized base model: what the planner and the trainer's config read.
    spec: JobSpec
    model: ResolvedModel
    size: ModelSize
    hardware: Hardware
    plan: Plan
    deadline: float
    started: float
    resume_checkpoint: StoredCheckpoint | None
    warnings: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    transfer_rates: TransferRates = field(default_factory=TransferRates)


async def _plan_job(
    request: TrainingRequest, job_id: str, settings: WorkerSettings, reporter: ProgressReporter, job_dir: Path
) -> PlannedJob:
    """Base model, resume point, hardware and plan: every check that needs no dataset."""
    from fluxbooth.storage import require_usable_storage

    started = time.monotonic()
    warnings = list(request.warnings())
    for warning in warnings:
        logger.warning("job %s: %s", job_id, warning)
    require_usable_storage(settings)

    reporter.stage("plan")
    model = await _in_thread(resolve_base_model, request.base_model, settings, request.base_model_revision)
    job_dir.mkdir(parents=True, exist_ok=True)
    resume_checkpoint: StoredCheckpoint | None = None
    if request.resume_from:
        from fluxbooth.checkpoints import find_resume_checkpoint

        resume_checkpoint, resume_warnings = await _in_thread(
            find_resume_checkpoint, request.resume_from, settings, request.model_name
        )
        warnings.extend(resume_warnings)
    hardware = await _in_thread(probe_hardware, job_dir, settings.environ)
    # Sizing and planning take a while for a big model (its configs are bounded first): off the event loop.
    size = await _in_thread(model_size, str(model.folder))
    spec = resolve_job_spec(request, size, settings)
    deadline = float(spec.deadline_seconds)
    # Before the dataset is fetched its size is unknown: planned for the fewest images a dataset may hold, so
    # only a job that no dataset could make fit is refused here. _replan_for_dataset sizes it for the real one.
    plan = await _in_thread(functools.partial(
        choose_plan, spec, hardware, size, deadline_seconds=deadline, instance_images=settings.dataset_limits.min_images,
        download_bytes=_pending_download_bytes(model), transfer_rates=settings.transfer_rates,
    ))
    ensure_room_to_download(model, plan.predicted_disk_bytes, settings.work_root)
    warnings.extend(plan.warnings)
    if plan.nvme_path:
        def is_live(attempt_name: str) -> bool:
            return attempt_is_live(settings.work_root, attempt_name)

        for stale in await _in_thread(remove_stale_swap_dirs, Path(plan.nvme_path), is_live):
            logger.warning("job %s: removed a stale DeepSpeed swap folder %s", job_id, stale)
    planned = PlannedJob(request, spec, model, size, hardware, _with_job_swap_dir(plan, job_dir), deadline, started,
                         resume_checkpoint, warnings, transfer_rates=settings.transfer_rates)
    planned.seconds["plan"] = _elapsed(started)
    return planned


def _pending_download_bytes(model: ResolvedModel) -> int:
    """Bytes of the base model still to download before training (its resolved file list); 0 when cached."""
    return model.pending.bytes_total if model.pending is not None else 0


def quote_job(request: TrainingRequest, settings: WorkerSettings, job_dir: Path) -> dict[str, Any]:
    """A dry run (fluxbooth.quote): planned from the base model's configs on this machine and the images the
    dataset's zip lists (its directory only), before anything else is fetched or launched."""
    from fluxbooth.quote import dry_run_answer

    from fluxbooth.dataset.remote_count import count_dataset

    model = resolve_base_model(request.base_model, settings, request.base_model_revision)
    dataset = count_dataset(request, settings.dataset_limits)
    job_dir.mkdir(parents=True, exist_ok=True)
    size = model_size(str(model.folder))
    return dry_run_answer(
        resolve_job_spec(request, size, settings), settings, hardware=probe_hardware(job_dir, settings.environ), model=size,
        dataset=dataset,
        download_bytes=_pending_download_bytes(model),
    )


def _with_job_swap_dir(plan: Plan, job_dir: Path) -> Plan:
    """NVMe offload swaps into a folder of this attempt's own under the NVMe root."""
    if not plan.nvme_path:
        return plan
    return dataclasses.replace(plan, nvme_path=str(job_swap_dir(Path(plan.nvme_path), job_dir.name)))


def _replan_for_dataset(job: PlannedJob, dataset: PreparedDataset, job_dir: Path) -> None:
    """The plan made again with the prepared images, in the time left, before the base model is downloaded and
    the trainer starts: a 4-image job is sized for 4 images, and a job the real dataset cannot fit is refused
    with its numbers while no GPU time has been spent."""
    left = job.deadline - (time.monotonic() - job.started)
    plan = choose_plan(
        job.spec, job.hardware, job.size, deadline_seconds=left, instance_images=dataset.instance_images,
        bucket_mix=dataset.bucket_mix, download_bytes=_pending_download_bytes(job.model), transfer_rates=job.transfer_rates,
    )
    # The first plan's warnings stand for the guesses it made; this one's say what will run.
    job.warnings = [warning for warning in job.warnings if warning not in job.plan.warnings]
    job.warnings.extend(warning for warning in plan.warnings if warning not in job.warnings)
    job.plan = _with_job_swap_dir(plan, job_dir)


async def _trainer_config(
    job: PlannedJob, settings: WorkerSettings, reporter: ProgressReporter, job_dir: Path, dataset: PreparedDataset,
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
        from fluxbooth.checkpoints import download_checkpoint

        reporter.stage("resume", checkpoint=job.resume_checkpoint.uri)
        resume_folder = str(await _in_thread(download_checkpoint, job.resume_checkpoint, _checkpoint_root(trainer)))
    # The trainer only ever sees a local folder: the request's URI or `latest` is resolved above. It checkpoints
    # as the plan says (the request's checkpointing_steps, or the planner's for a run near its deadline).
    return dataclasses.replace(
        trainer, resume_from=resume_folder, checkpointing_steps=job.plan.checkpointing_steps,
        stop_at_unix_seconds=_trainer_stop_time(job),
    )


def _trainer_stop_time(job: PlannedJob) -> float:
    """When the trainer stops at a step boundary (seconds since the epoch): early enough that the step in flight,
    the checkpoint, the export, the report and the uploads the plan predicts, and the trainer's own teardown, fit
    before the trainer is killed (`_trainer_deadline`)."""
    kill_in = job.deadline - (time.monotonic() - job.started) - _upload_reserve(job)
    # The stop is checked between steps: the step in flight when the stop time comes finishes first.
    in_flight = job.plan.predicted_seconds_per_step or 0.0
    reserve = (job.plan.predicted_stop_reserve_seconds or 0.0) + in_flight + TRAINER_TEARDOWN_SECONDS
    return time.time() + kill_in - reserve


def _upload_reserve(job: PlannedJob) -> float:
    return min(300.0, 0.1 * job.deadline)


def _trainer_deadline(job: PlannedJob) -> float:
    """What is left of the deadline for the trainer, keeping time to verify and upload afterwards."""
    trainer_deadline = job.deadline - (time.monotonic() - job.started) - _upload_reserve(job)
    if trainer_deadline <= 0:
        raise FluxboothError(
            ErrorCode.TIMEOUT,
            f"the job deadline of {job.deadline:.0f} s was used up before training began; raise timeout_seconds "
            "(or FLUXBOOTH_JOB_DEADLINE_SECONDS on the endpoint)",
        )
    return trainer_deadline


async def _train(
    job: PlannedJob, trainer: TrainerConfig, settings: WorkerSettings, reporter: ProgressReporter, job_dir: Path
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
    trainer_deadline = _trainer_deadline(job)
    # Until the trainer's first event: `accelerate launch` starting the trainer (imports, process group).
    reporter.stage("launch", steps=job.spec.steps)
    uploader = _checkpoint_uploader(trainer, settings, job.request.model_name, job_dir)

    def on_trainer_event(event: TrainerEvent) -> None:
        reporter.trainer_event(event)
        if uploader is not None:
            uploader.on_trainer_event(event)

    try:
        outcome = await run_trainer(
            trainer_command(files, job.plan, job.hardware.cpu_count, settings.trainer_module),
            env=env,
            cwd=job_dir,
            deadline_seconds=trainer_deadline,
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
    job.seconds["train"] = round(outcome.seconds, 3)
    failure = classify_outcome(outcome, job.plan, job.deadline)
    if failure is not None:
        raise _with_resume_hint(failure, uploader)
    assert outcome.done is not None
    return outcome, uploader


async def _run(
    job_input: Any, job_id: str, settings: WorkerSettings, reporter: ProgressReporter, job_dir: Path
) -> dict[str, Any]:
    from fluxbooth.dataset import prepare_dataset
    from fluxbooth.dataset.checks import check_prepared, enforce
    from fluxbooth.dataset.controls import check_validation_images_used, fetch_validation_images
    from fluxbooth.report import ReportInputs, make_report, report_artifacts, sheet_images
    from fluxbooth.request import parse_request
    from fluxbooth.storage import local_output_warning

    request = parse_request(job_input)
    if request.dry_run:
        return await _in_thread(quote_job, request, settings, job_dir)
    job = await _plan_job(request, job_id, settings, reporter, job_dir)
    check_validation_images_used(job.request, family_named(job.size.family))

    reporter.stage("dataset")
    stage_started = time.monotonic()
    # Every download (the dataset, each validation image) runs inside the job's one deadline.
    clock = JobClock(job.started, job.deadline)
    dataset = await _in_thread(
        functools.partial(prepare_dataset, on_image=reporter.count_from_thread("dataset"), clock=clock),
        job.request, job_dir, settings.dataset_limits,
    )
    # The validation control images are fetched and checked like the dataset, before the base model is downloaded.
    validation_images = await _in_thread(
        fetch_validation_images, job.request, job_dir, settings.dataset_limits, clock
    )
    job.seconds["dataset"] = _elapsed(stage_started)
    reporter.stage("checks")
    stage_started = time.monotonic()
    training_shape = job.request.resolution.training_shape
    checks = await _in_thread(
        functools.partial(check_prepared, on_image=reporter.count_from_thread("checks")),
        dataset, training_shape, job.request.dataset_checks,
    )
    job.seconds["checks"] = _elapsed(stage_started)
    job.warnings.extend(checks.warnings())
    enforce(checks)
    clock.check("preparing the dataset")
    await _in_thread(_replan_for_dataset, job, dataset, job_dir)
    base_model = await _complete_base_model(job.model, settings, reporter, job.started + job.deadline, job.seconds)
    trainer = await _trainer_config(job, settings, reporter, job_dir, dataset, base_model, validation_images)
    outcome, uploader = await _train(job, trainer, settings, reporter, job_dir)

    reporter.stage("report")
    stage_started = time.monotonic()
    report = await _in_thread(make_report, ReportInputs(
        job.request.model_name, outcome.events, Path(trainer.output_dir),
        sheet_images(dataset, job.request.instance_prompt, checks.flags()), training_shape,
    ))
    job.warnings.extend(report.warnings)
    job.seconds["report"] = _elapsed(stage_started)

    reporter.stage("upload")
    stage_started = time.monotonic()
    artifacts = await _in_thread(collect_artifacts, Path(trainer.output_dir), outcome.done.artifacts)
    artifacts += report_artifacts(report, Path(trainer.output_dir))
    stored = await _in_thread(_upload_all, artifacts, settings, job.request.model_name, job_id)
    job.seconds["upload"] = _elapsed(stage_started)
    job.seconds["total"] = _elapsed(job.started)
    if (disk_warning := local_output_warning(settings)) is not None:
        logger.warning("job %s: %s", job_id, disk_warning)
        job.warnings.append(disk_warning)

    trainer_metrics = dict(outcome.done.metrics)
    if trainer_metrics.get("stopped_for_deadline"):
        raise _stopped_for_deadline(job, trainer_metrics, stored, uploader)
    trainer_warnings = [event.message for event in outcome.events if isinstance(event, WarningEvent)]
    return {
        "model_name": job.request.model_name,
        "artifacts": stored,
        "plan": {**job.plan.to_dict(), "export_formats": list(trainer.export_formats)},
        "metrics": {**trainer_metrics, "seconds": {**trainer_metrics.get("seconds", {}), **job.seconds}},
        "dataset": {**dataset.summary(), "checks": checks.to_dict()},
        "checkpoints": uploader.uploaded if uploader is not None else [],
        "warnings": bounded_warnings(job.warnings + trainer_warnings),
    }


async def run_job(
    job_input: Any,
    *,
    job_id: str | None,
    settings: WorkerSettings,
    progress: ProgressSink | None = None,
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
        result = await _run(job_input, safe_id, settings, ProgressReporter(progress), attempt.path)
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
            swap_root = nvme_root(settings.environ)
            if swap_root is not None:
                shutil.rmtree(job_swap_dir(swap_root, attempt.name), ignore_errors=True)
            attempt.remove()


