"""The job as planned: what the plan stage decided before the dataset arrived, and the plan made again for the
prepared dataset in the time left."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import Hardware
from fluxbooth.job.attempts import job_swap_dir
from fluxbooth.job.op_builds import build_seconds, ops_to_build
from fluxbooth.models.source import ResolvedModel, pending_download_bytes
from fluxbooth.plan import Plan, choose_plan
from fluxbooth.request.spec import JobSpec
from fluxbooth.settings import TransferRates
from fluxbooth.sizing import ModelSize

if TYPE_CHECKING:
    from fluxbooth.dataset import PreparedDataset
    from fluxbooth.storage.checkpoints import StoredCheckpoint


@dataclass(frozen=True)
class PlannedJob:
    """What the plan stage decided, before any dataset byte is fetched; the later stages read it (the spec, never
    the request), and the re-plan for the prepared dataset makes a new one. `warnings` is the job's list of
    warnings so far: each stage adds its own to it."""

    # The request resolved for the sized base model: what the planner, the dataset stage and the trainer's config
    # read.
    spec: JobSpec
    model: ResolvedModel
    size: ModelSize
    hardware: Hardware
    plan: Plan
    deadline: float
    started: float
    resume_checkpoint: StoredCheckpoint | None
    warnings: list[str]
    transfer_rates: TransferRates = field(default_factory=TransferRates)
    # The DeepSpeed ops the trainer must JIT-build first (job/op_builds.py), and the folder it builds them in.
    ops_to_build: tuple[str, ...] = ()
    extensions_dir: Path | None = None


# After a run stopped by its deadline, the trainer's own tail outside the plan's phases: the checkpoint's and the
# export's fixed costs, accelerate's and DeepSpeed's teardown, the launcher's exit.
TRAINER_TEARDOWN_SECONDS = 30.0


def seconds_left(job: PlannedJob) -> float:
    return job.deadline - (time.monotonic() - job.started)


def stop_reserves(job: PlannedJob) -> dict[str, float]:
    """The seconds kept between the trainer's stop time and the job's deadline, by what they are for."""
    return {
        "uploads": upload_reserve(job),
        "checkpoint, export and report": job.plan.predicted_stop_reserve_seconds or 0.0,
        # The stop is checked between steps: the step in flight when the stop time comes finishes first.
        "one step": job.plan.predicted_seconds_per_step or 0.0,
        "teardown": TRAINER_TEARDOWN_SECONDS,
    }


def require_time_to_stop(job: PlannedJob) -> None:
    """`timeout` when the trainer's stop time is already past: the stages before training used the time its clean
    stop needs. Checked before the base model is downloaded and again before the launch."""
    left, reserves = seconds_left(job), stop_reserves(job)
    if left > sum(reserves.values()):
        return
    shown = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in reserves.items())
    raise FluxboothError(
        ErrorCode.TIMEOUT,
        f"the job deadline of {job.deadline:.0f} s leaves ≈{max(0.0, left):.0f} s after the stages before training, "
        f"less than the ≈{sum(reserves.values()):.0f} s kept to stop the trainer cleanly ({shown}): the trainer "
        "would start with its stop time already past; raise timeout_seconds (or FLUXBOOTH_JOB_DEADLINE_SECONDS on "
        "the endpoint)",
        details={
            "deadline_seconds": round(job.deadline),
            "seconds_left": round(max(0.0, left), 1),
            "stop_reserve_seconds": {name: round(seconds, 1) for name, seconds in reserves.items()},
        },
    )


def upload_reserve(job: PlannedJob) -> float:
    return min(300.0, 0.1 * job.deadline)


def with_job_swap_dir(plan: Plan, job_dir: Path) -> Plan:
    """NVMe offload swaps into a folder of this attempt's own under the NVMe root."""
    if not plan.nvme_path:
        return plan
    return dataclasses.replace(plan, nvme_path=str(job_swap_dir(Path(plan.nvme_path), job_dir.name)))


def replan_for_dataset(job: PlannedJob, dataset: PreparedDataset, job_dir: Path) -> PlannedJob:
    """The plan made again with the prepared images, in the time left, before the base model is downloaded and
    the trainer starts: a 4-image job is sized for 4 images, and a job the real dataset cannot fit is refused
    with its numbers while no GPU time has been spent (`does_not_fit` when the run itself is too long for the time
    left, `timeout` when the time left cannot hold the reserves for stopping the trainer cleanly). The job as first
    planned is left as it was."""
    left = seconds_left(job)
    plan = choose_plan(
        job.spec,
        job.hardware,
        job.size,
        deadline_seconds=left,
        instance_images=dataset.instance_images,
        bucket_mix=dataset.bucket_mix,
        download_bytes=pending_download_bytes(job.model),
        transfer_rates=job.transfer_rates,
        op_build_seconds=build_seconds(job.ops_to_build),
    )
    ops = ops_to_build(plan, job.extensions_dir) if job.extensions_dir is not None else job.ops_to_build
    # The first plan's warnings stand for the guesses it made; this one's say what will run.
    warnings = [warning for warning in job.warnings if warning not in job.plan.warnings]
    warnings.extend(warning for warning in plan.warnings if warning not in warnings)
    replanned = dataclasses.replace(job, plan=with_job_swap_dir(plan, job_dir), warnings=warnings, ops_to_build=ops)
    # The plan counts the run's phases; the trainer's stop time also keeps the reserves for a clean stop.
    require_time_to_stop(replanned)
    return replanned
