"""Job specs for tests: a request resolved as the worker resolves it (fluxbooth.request.spec), for FLUX.1-dev unless
another sized model is given, with the endpoint's default settings."""

from __future__ import annotations

from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.request.model import TrainingRequest
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size


def job_spec(request: TrainingRequest, model: ModelSize | None = None) -> JobSpec:
    return resolve_job_spec(request, model or model_size(FLUX_DEV_NAME), WorkerSettings.from_environ({}))


def gpu_machine(gpu_gib: float, host_gib: float, gpus: int = 1, disk_gib: float = 500) -> Hardware:
    """A hypothetical H100-named machine with these sizes, for the planner's tests."""
    return hypothetical_hardware(
        gpus=gpus,
        gpu_memory_bytes=int(gpu_gib * GIB),
        host_memory_bytes=int(host_gib * GIB),
        disk_bytes=int(disk_gib * GIB),
        gpu_name="NVIDIA H100 80GB HBM3",
    )
