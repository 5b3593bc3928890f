"""The job's stages that take more than a call, for run.py's stage list: the dataset (fetched, stored, checked),
the trainer's config (with the checkpoint to resume from), and the report with the uploads; and `JobStages`, which
reports each stage as it starts and times it. Each reads the job spec, never the request."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxbooth.clock import JobClock
from fluxbooth.contract.events import TrainerEvent
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.dataset import PreparedDataset, prepare_dataset
from fluxbooth.dataset.controls import check_validation_images_used, fetch_validation_images
from fluxbooth.job.deadline import trainer_stop_time
from fluxbooth.job.launch_files import job_checkpoint_dir, trainer_config_for
from fluxbooth.job.planned import PlannedJob, require_time_to_stop
from fluxbooth.job.threads import in_thread
from fluxbooth.models.families import distilled_base_warning, family_named, read_model_index
from fluxbooth.progress import ProgressReporter
from fluxbooth.report import ReportInputs, make_report, report_artifacts, sheet_images
from fluxbooth.settings import WorkerSettings
from fluxbooth.storage.artifacts import collect_artifacts
from fluxbooth.storage.checkpoints import download_checkpoint
from fluxbooth.storage.upload import upload_artifacts

if TYPE_CHECKING:
    from fluxbooth.dataset.checks import DatasetChecks


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
        self.seconds[name] = elapsed(started)


def elapsed(since: float) -> float:
    """Seconds since `since` (time.monotonic()), as the result reports them."""
    return round(time.monotonic() - since, 3)


@dataclass(frozen=True)
class JobInputs:
    """What the dataset stage prepared: the images, the validation control images, the dataset check's findings."""

    dataset: PreparedDataset
    validation_images: tuple[Path, ...]
    checks: DatasetChecks
    # The prepared images whose caption the captioner wrote (fluxbooth.job.captioning_stage).
    captioned: frozenset[str] = frozenset()

    def summary(self, captioning: str) -> dict[str, object]:
        """The result's `dataset`: the prepared dataset's summary, with the captioned photos counted when the
        request asked for captions."""
        summary = self.dataset.summary()
        if captioning != "off":
            summary["captioned"] = len(self.captioned)
        return summary


async def dataset_stage(
    job: PlannedJob, settings: WorkerSettings, stages: JobStages, job_dir: Path, clock: JobClock
) -> JobInputs:
    """The dataset and the validation control images fetched and stored (each download inside the job's one
    `clock`), then checked: the findings become the job's warnings, or (strict) refuse it."""
    # The dataset checks measure images with numpy, which the handler process loads only once a job needs it.
    from fluxbooth.dataset.checks import check_prepared, enforce

    spec = job.spec.dataset
    check_validation_images_used(spec, family_named(job.size.family))
    with stages.stage("dataset"):
        dataset = await in_thread(
            functools.partial(prepare_dataset, on_image=stages.reporter.count_from_thread("dataset"), clock=clock),
            spec,
            job_dir,
            settings.dataset_limits,
        )
        # The validation control images are fetched and checked like the dataset, before the base model is downloaded.
        validation_images = await in_thread(fetch_validation_images, spec, job_dir, settings.dataset_limits, clock)
    with stages.stage("checks"):
        checks = await in_thread(
            functools.partial(check_prepared, on_image=stages.reporter.count_from_thread("checks")),
            dataset,
            spec.resolution.training_shape,
            spec.checks,
        )
    job.warnings.extend(checks.warnings())
    enforce(checks)
    clock.check("preparing the dataset")
    return JobInputs(dataset, validation_images, checks)


async def trainer_config(
    job: PlannedJob, settings: WorkerSettings, stages: JobStages, job_dir: Path, inputs: JobInputs
) -> TrainerConfig:
    """The trainer's config, with the checkpoint to resume from downloaded to a local folder."""
    resume_folder = None
    if job.resume_checkpoint is not None:
        stages.reporter.stage("resume", checkpoint=job.resume_checkpoint.uri)
        resume_folder = str(await in_thread(download_checkpoint, job.resume_checkpoint, job_checkpoint_dir(job_dir)))
    # The base model is on disk now (downloaded, cached or baked): its model_index.json says whether it is distilled.
    distilled = distilled_base_warning(
        job.size.family, read_model_index(job.model.folder), job.spec.export.base_model_name
    )
    if distilled is not None:
        job.warnings.append(distilled)
    # The base model's download and the checkpoint's took their time too: never a launch already due to stop.
    require_time_to_stop(job)
    # The trainer only ever sees a local folder: the request's URI or `latest` is resolved above.
    return trainer_config_for(
        job.spec,
        job.plan,
        base_model=str(job.model.folder),
        instance_dir=inputs.dataset.instance_dir,
        class_dir=inputs.dataset.class_dir,
        job_dir=job_dir,
        class_image_cache_dir=settings.cache_dir / "class-images",
        control_dir=inputs.dataset.control_dir,
        validation_images=inputs.validation_images,
        resume_from=resume_folder,
        stop_at_unix_seconds=trainer_stop_time(job),
    )


async def report_and_upload(
    job: PlannedJob,
    trainer: TrainerConfig,
    settings: WorkerSettings,
    stages: JobStages,
    job_id: str,
    *,
    inputs: JobInputs,
    events: list[TrainerEvent],
    likeness: dict[str, Any] | None,
    announced: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The report drawn from the trainer's `events` and the scored `likeness`, then the trainer's `announced`
    artifacts and the report's files uploaded to the job's store: the stored artifacts."""
    output_dir = Path(trainer.output_dir)
    with stages.stage("report"):
        report = await in_thread(
            make_report,
            ReportInputs(
                job.spec.export.model_name,
                events,
                output_dir,
                sheet_images(inputs.dataset, job.spec.dataset.caption_default, inputs.checks.flags(), inputs.captioned),
                job.spec.dataset.resolution.training_shape,
                likeness,
            ),
        )
        job.warnings.extend(report.warnings)

    with stages.stage("upload"):
        artifacts = await in_thread(collect_artifacts, output_dir, announced)
        artifacts += report_artifacts(report, output_dir)
        return await in_thread(upload_artifacts, artifacts, settings, job.spec.export.model_name, job_id)
