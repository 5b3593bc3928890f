"""plan's report on one machine: what plan sizes once whatever the machine (SizedJob), and the worker's answer
for it on the machine the hardware flags describe."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fluxbooth.cli.plan.job_request import (
    base_model_from,
    deadline_source,
    download_bytes,
    instance_images,
    validated_request,
)
from fluxbooth.cli.plan.machine import hardware_from
from fluxbooth.dataset.remote_count import DatasetCount
from fluxbooth.job.quote import plan_report
from fluxbooth.plan import model_size
from fluxbooth.plan.runpod_gpus import RunpodGpu, quote_price
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import ModelSize


@dataclass(frozen=True)
class SizedJob:
    """What plan sizes once, whatever the machine: the worker's settings, the job spec, the model, the images."""

    settings: WorkerSettings
    spec: JobSpec
    base_model: str
    model: ModelSize
    dataset: DatasetCount


def sized_job(arguments: argparse.Namespace, environ: Mapping[str, str]) -> SizedJob:
    settings = WorkerSettings.from_environ(environ)
    request = validated_request(arguments)
    dataset = instance_images(arguments, dataset_spec(request), settings)
    base_model = base_model_from(request, settings)
    model = model_size(base_model)
    return SizedJob(settings, resolve_job_spec(request, model, settings), base_model, model, dataset)


def job_report(
    job: SizedJob, arguments: argparse.Namespace, environ: Mapping[str, str], gpu: RunpodGpu | None
) -> dict[str, Any]:
    """plan's report for `job` on the machine the hardware flags (a RunPod type's preset filled in) describe."""
    price_per_hour, price_source = quote_price(gpu, job.settings.price_per_hour, gpus=arguments.gpus or 1)
    report = plan_report(
        job.spec,
        hardware=hardware_from(arguments, job.settings, environ),
        model=job.model,
        dataset=job.dataset,
        deadline_source=deadline_source(job.spec),
        price_per_hour=price_per_hour,
        gpu_name_given=arguments.gpu_name,
        download_bytes=download_bytes(arguments, job.base_model, job.model),
        transfer_rates=job.settings.transfer_rates,
    )
    if gpu is not None:
        report["runpod_gpu"] = gpu.to_dict()
    if "cost" in report:
        report["cost"]["price_source"] = price_source
    report["instance_images_note"] = job.dataset.note
    return report
