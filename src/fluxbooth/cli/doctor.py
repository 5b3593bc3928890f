"""`python -m fluxbooth doctor`: is this machine ready to train; exits 1 when a check fails."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.job.doctor import DoctorOptions, doctor_passed, run_doctor


def add_doctor_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check that this machine can train: DeepSpeed ops, accelerate, CUDA/bf16, configs, RAM, disk, model, bucket",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="a machine without a GPU is not a failure")
    parser.add_argument(
        "--build-ops", action="store_true", help="JIT-build DeepSpeed ops that are not built yet (minutes)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_doctor_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    results = run_doctor(environ, DoctorOptions(allow_cpu=arguments.allow_cpu, build_ops=arguments.build_ops))
    passed = doctor_passed(results)
    if arguments.json:
        out.write(json.dumps({"ok": passed, "checks": [result.to_dict() for result in results]}, indent=2) + "\n")
    else:
        width = max(len(result.name) for result in results)
        for result in results:
            out.write(f"{result.status.upper():4}  {result.name.ljust(width)}  {result.detail}\n")
        out.write("\n" + ("all checks passed\n" if passed else "some checks FAILED\n"))
    return EXIT_OK if passed else EXIT_FAILED
