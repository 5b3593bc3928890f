"""The job's one deadline split around the trainer: when the trainer must stop at a step boundary, how long it may
run before it is killed, the time kept for verifying and uploading afterwards, and the `timeout` of a run the
trainer stopped for its deadline."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.planned import PlannedJob, seconds_left, stop_reserves, upload_reserve

if TYPE_CHECKING:
    from fluxbooth.storage.checkpoints import CheckpointUploader


def trainer_stop_time(job: PlannedJob) -> float:
    """When the trainer stops at a step boundary (seconds since the epoch): early enough that the step in flight,
    the checkpoint, the export, the report and the uploads the plan predicts, and the trainer's own teardown, fit
    before the trainer is killed (`trainer_deadline`)."""
    return time.time() + seconds_left(job) - sum(stop_reserves(job).values())


def trainer_deadline(job: PlannedJob) -> float:
    """What is left of the deadline for the trainer, keeping time to verify and upload afterwards."""
    left = seconds_left(job) - upload_reserve(job)
    if left <= 0:
        raise FluxboothError(
            ErrorCode.TIMEOUT,
            f"the job deadline of {job.deadline:.0f} s was used up before training began; raise timeout_seconds "
            "(or FLUXBOOTH_JOB_DEADLINE_SECONDS on the endpoint)",
        )
    return left


def stopped_for_deadline(
    job: PlannedJob, metrics: dict[str, Any], stored: list[dict[str, Any]], uploader: CheckpointUploader | None
) -> FluxboothError:
    """`timeout` for a run the trainer stopped at its stop time: the weights trained so far are stored, and so is
    the checkpoint a resubmitted job continues from. The worker is fine: no refresh."""
    reached, total = int(metrics.get("steps_done", 0)), job.spec.optimisation.steps
    checkpoints = uploader.uploaded if uploader is not None else []
    kept = f"the weights trained so far ({len(stored)} artifacts) are stored"
    if checkpoints:
        how = (
            f'and so is the checkpoint {checkpoints[-1]}; resubmit the same request with "resume_from": "latest" to '
            f"train the remaining {total - reached} steps"
        )
    else:
        how = "but its checkpoint could not be stored (see warnings), so a resubmitted job starts over"
    return FluxboothError(
        ErrorCode.TIMEOUT,
        f"the job deadline of {job.deadline:.0f} s came at step {reached}/{total}: {kept}, {how}, or raise "
        "timeout_seconds (and the endpoint's execution timeout)",
        refresh_worker=False,
        details={
            "step": reached,
            "steps": total,
            "artifacts": stored,
            "checkpoints": checkpoints,
            "latest_checkpoint": checkpoints[-1] if checkpoints else None,
            "resume_from": "latest" if checkpoints else None,
            "warnings": job.warnings,
        },
    )
