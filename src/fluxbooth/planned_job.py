"""The job as planned: what the plan stage decided before the dataset arrived, and the plan made again for the
prepared dataset in the time left."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fluxbooth.attempts import job_swap_dir
from fluxbooth.hardware import Hardware
from fluxbooth.model_source import ResolvedModel, pending_download_bytes
from fluxbooth.sizing import ModelSize
from fluxbooth.plan import Plan, choose_plan
from fluxbooth.settings import TransferRates
from fluxbooth.spec import JobSpec

if TYPE_CHECKING:
    from fluxbooth.checkpoints import StoredCheckpoint
    from fluxbooth.dataset import PreparedDataset
    from fluxbooth.request import TrainingRequest


@dataclass(frozen=True)
class PlannedJob:
    """What the plan stage decided, before any dataset byte is fetched; the later stages read it, and the re-plan
    for the prepared dataset makes a new one. `warnings` is the job's list of warnings so far: each stage adds its
    own to it."""

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
    transfer_rates: TransferRates = field(default_factory=TransferRates)


def with_job_swap_dir(plan: Plan, job_dir: Path) -> Plan:
    """NVMe offload swaps into a folder of this attempt's own under the NVMe root."""
    if not plan.nvme_path:
        return plan
    return dataclasses.replace(plan, nvme_path=str(job_swap_dir(Path(plan.nvme_path), job_dir.name)))


def replan_for_dataset(job: PlannedJob, dataset: PreparedDataset, job_dir: Path) -> PlannedJob:
    """The plan made again with the prepared images, in the time left, before the base model is downloaded and
    the trainer starts: a 4-image job is sized for 4 images, and a job the real dataset cannot fit is refused
    with its numbers while no GPU time has been spent. The job as first planned is left as it was."""
    left = job.deadline - (time.monotonic() - job.started)
    plan = choose_plan(
        job.spec, job.hardware, job.size, deadline_seconds=left, instance_images=dataset.instance_images,
        bucket_mix=dataset.bucket_mix, download_bytes=pending_download_bytes(job.model), transfer_rates=job.transfer_rates,
    )
    # The first plan's warnings stand for the guesses it made; this one's say what will run.
    warnings = [warning for warning in job.warnings if warning not in job.plan.warnings]
    warnings.extend(warning for warning in plan.warnings if warning not in warnings)
    return dataclasses.replace(job, plan=with_job_swap_dir(plan, job_dir), warnings=warnings)
