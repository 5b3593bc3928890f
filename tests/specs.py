"""Job specs for tests: a request resolved as the worker resolves it (fluxbooth.spec), for FLUX.1-dev unless
another sized model is given, with the endpoint's default settings."""

from __future__ import annotations

from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size
from fluxbooth.request import TrainingRequest
from fluxbooth.settings import WorkerSettings
from fluxbooth.spec import JobSpec, resolve_job_spec


def job_spec(request: TrainingRequest, model: ModelSize | None = None) -> JobSpec:
    return resolve_job_spec(request, model or model_size(FLUX_DEV_NAME), WorkerSettings.from_environ({}))
