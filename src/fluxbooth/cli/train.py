"""`python -m fluxbooth train`: run one request outside RunPod; prints the result JSON, exits 1 when the job
failed. Progress goes to stderr (a bar on a terminal, plain lines otherwise); `--verbose` adds the full log."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.jsonfiles import MAX_REQUEST_BYTES, read_json_file
from fluxbooth.progress import ProgressBar
from fluxbooth.settings import WorkerSettings


def add_train_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("train", help="run one training request (JSON file) outside RunPod")
    parser.add_argument("request", type=Path, help='JSON file: the request\'s input object, or {"input": {...}}')
    parser.add_argument("--job-id", default=None, help="job id used in storage keys (default: random)")
    parser.add_argument(
        "--verbose", action="store_true", help="log everything (the trainer's own output included) on stderr"
    )


def run_train_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    # Deferred: the worker's job (asyncio, dataset, storage) loads only when train runs, not for plan or doctor.
    import asyncio

    from fluxbooth.job.run import run_job

    try:
        document = read_json_file(arguments.request, max_bytes=MAX_REQUEST_BYTES)
    except (OSError, ValueError) as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"request file {arguments.request}: {error}") from None
    job_input = (
        document["input"]
        if isinstance(document, dict) and set(document) <= {"input", "id"} and "input" in document
        else document
    )
    # The progress lines are what a person watches; the full log would bury them, so it is opt-in.
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    progress = ProgressBar.for_stream(sys.stderr)
    try:
        result = asyncio.run(
            run_job(
                job_input, job_id=arguments.job_id, settings=WorkerSettings.from_environ(environ), progress=progress
            )
        )
    finally:
        progress.close()
    out.write(json.dumps(result, indent=2) + "\n")
    return EXIT_FAILED if "error" in result else EXIT_OK
