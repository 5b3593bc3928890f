"""`python -m fluxbooth plan`, run: the request, the machine and the model sized, the worker's choice reported
(as a table, or --json); exits 1 when the worker would refuse the job. `--runpod-gpu all` plans the job on every
RunPod type (every_gpu), `--runpod-gpu list` lists the types."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.cli.plan.every_gpu import ALL_GPUS, run_every_gpu
from fluxbooth.cli.plan.machine import apply_runpod_preset
from fluxbooth.cli.plan.report import job_report, sized_job
from fluxbooth.cli.plan.table import plan_table
from fluxbooth.plan.runpod_gpus import preset_list, preset_table

LIST_GPUS = "list"


def run_plan(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    typed = arguments.runpod_gpu.strip().lower() if arguments.runpod_gpu is not None else None
    if typed == LIST_GPUS:
        out.write(json.dumps(preset_list(), indent=2) + "\n" if arguments.json else preset_table())
        return EXIT_OK
    if typed == ALL_GPUS:
        return run_every_gpu(arguments, environ, out)
    gpu = apply_runpod_preset(arguments)
    report = job_report(sized_job(arguments, environ), arguments, environ, gpu)
    if arguments.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        plan_table(report, out)
    return EXIT_OK if report["plan"] is not None else EXIT_FAILED
