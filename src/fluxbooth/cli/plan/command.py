"""`python -m fluxbooth plan`, run: the request, the machine and the model sized, the worker's choice reported
(as a table, or --json); exits 1 when the worker would refuse the job."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.cli.plan.job_request import (
    base_model_from, deadline_source, download_bytes, instance_images, validated_request,
)
from fluxbooth.cli.plan.machine import apply_runpod_preset, hardware_from
from fluxbooth.cli.plan.table import plan_table
from fluxbooth.plan import model_size
from fluxbooth.plan.runpod_gpus import preset_list, preset_table, quote_price
from fluxbooth.quote import plan_report
from fluxbooth.settings import WorkerSettings
from fluxbooth.spec import resolve_job_spec


def run_plan(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    if arguments.runpod_gpu is not None and arguments.runpod_gpu.strip().lower() == "list":
        out.write(json.dumps(preset_list(), indent=2) + "\n" if arguments.json else preset_table())
        return EXIT_OK
    gpu = apply_runpod_preset(arguments)
    settings = WorkerSettings.from_environ(environ)
    price_per_hour, price_source = quote_price(gpu, settings.price_per_hour, gpus=arguments.gpus or 1)
    request = validated_request(arguments)
    dataset = instance_images(arguments, request, settings)
    hardware = hardware_from(arguments, settings, environ)
    base_model = base_model_from(request, settings)
    model = model_size(base_model)
    spec = resolve_job_spec(request, model, settings)
    report = plan_report(
        spec,
        hardware=hardware,
        model=model,
        dataset=dataset,
        deadline_source=deadline_source(spec),
        price_per_hour=price_per_hour,
        gpu_name_given=arguments.gpu_name,
        download_bytes=download_bytes(arguments, base_model, model),
        transfer_rates=settings.transfer_rates,
    )
    if gpu is not None:
        report["runpod_gpu"] = gpu.to_dict()
    if "cost" in report:
        report["cost"]["price_source"] = price_source
    report["instance_images_note"] = dataset.note
    if arguments.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        plan_table(report, out)
    return EXIT_OK if report["plan"] is not None else EXIT_FAILED
