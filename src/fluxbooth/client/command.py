"""`python -m fluxbooth submit`: the command line of the client (fluxbooth.client.submission).

The client's modules (requests, the zip packer) are imported only when `submit` runs, so the other
subcommands start as fast as before."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

from fluxbooth.client.errors import ClientError, ExitCode
from fluxbooth.jsonfiles import MAX_REQUEST_BYTES, read_json_file

if TYPE_CHECKING:
    from fluxbooth.client.submission import Submission

API_KEY_VARIABLE = "RUNPOD_API_KEY"
ENDPOINT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Flags for the request fields people change most; each overrides the request file.
FIELD_FLAGS = (
    ("--model-name", "model_name", str),
    ("--instance-prompt", "instance_prompt", str),
    ("--trigger-word", "trigger_word", str),
    ("--steps", "steps", int),
    ("--timeout-seconds", "timeout_seconds", int),
)


def add_submit_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "submit",
        help="submit photos and a request to an endpoint, follow the job, download its files",
        description="Exit codes: 0 completed and verified, 1 job failed, 2 bad input, 3 cancelled, 4 timed out, "
        "5 download or sha256 check failed, 6 endpoint unreachable or refused, 130 Ctrl-C (job cancelled).",
    )
    parser.add_argument("photos", help="a folder of photos (captions beside them as .txt), a .zip, or an https:// link")
    parser.add_argument("--request", type=Path, required=True, help="JSON file: the job's input without its dataset")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help=f"RunPod endpoint ID (reads {API_KEY_VARIABLE})")
    where.add_argument(
        "--url",
        help="base URL of a local `python handler.py --rp_serve_api` (http://host:8000); "
        f"no API key is sent to it unless --url-api-key-env names one ({API_KEY_VARIABLE} is never "
        "sent there by default)",
    )
    parser.add_argument(
        "--url-api-key-env",
        metavar="NAME",
        default=None,
        help="with --url: send the key in environment variable NAME to that server (only over https, or http to "
        "localhost)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder the artifacts are downloaded into")
    parser.add_argument("--webhook", default=None, help="URL RunPod POSTs the result to as well")
    parser.add_argument("--poll-seconds", type=float, default=None, help=argparse.SUPPRESS)
    for flag, name, kind in FIELD_FLAGS:
        parser.add_argument(flag, dest=name, type=kind, default=None, help=f"sets the request's {name}")
    parser.set_defaults(handler=run_submit_command)


def read_request(path: Path) -> dict[str, Any]:
    """The job's input: the file's object, or the `input` of `{"input": {...}}`; a file that is not UTF-8 JSON
    within the size and nesting bounds is a one-line usage error."""
    try:
        document = read_json_file(path, max_bytes=MAX_REQUEST_BYTES)
    except OSError as error:
        raise ClientError(f"request file {path}: {error.strerror or error}", ExitCode.USAGE) from None
    except UnicodeDecodeError as error:
        raise ClientError(
            f"request file {path}: not UTF-8 text (byte {error.start}); save it as UTF-8 JSON", ExitCode.USAGE
        ) from None
    except ValueError as error:
        raise ClientError(f"request file {path}: {error}", ExitCode.USAGE) from None
    if isinstance(document, dict) and set(document) == {"input"}:
        document = document["input"]
    if not isinstance(document, dict):
        raise ClientError(f"request file {path}: expected a JSON object with the training fields", ExitCode.USAGE)
    return document


def submission_from(arguments: argparse.Namespace, environ: Mapping[str, str]) -> Submission:
    # deferred: every subcommand builds this parser, and only `submit` needs the HTTP client behind these
    from fluxbooth.client.submission import Submission

    job_input = read_request(arguments.request)
    job_input.update(
        {name: getattr(arguments, name) for _, name, _ in FIELD_FLAGS if getattr(arguments, name) is not None}
    )
    base_url, api_key, key_source = _destination(arguments, environ)
    polling = {"poll_seconds": arguments.poll_seconds} if arguments.poll_seconds is not None else {}
    return Submission(
        photos=arguments.photos,
        job_input=job_input,
        out_dir=arguments.out,
        base_url=base_url,
        api_key=api_key,
        webhook=arguments.webhook,
        status_answers_at_once=bool(arguments.endpoint),
        key_source=key_source,
        **polling,
    )


def _destination(arguments: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str | None, str]:
    """Where the job goes, the key sent there (if any) and the variable it came from. RUNPOD_API_KEY goes only to
    RunPod's API; a --url server gets a key only when --url-api-key-env names one, and only over https or to
    localhost (JobApi refuses anything else). A --url whose host the parsers read differently is refused with or
    without a key: that host also decides whether file:// artifacts are read."""
    from fluxbooth.client.api import endpoint_url, host_problem, key_may_go_to  # deferred, as in submission_from

    if arguments.endpoint:
        if arguments.url_api_key_env:
            raise ClientError("--url-api-key-env goes with --url; --endpoint reads RUNPOD_API_KEY", ExitCode.USAGE)
        if not ENDPOINT_ID.fullmatch(arguments.endpoint):
            raise ClientError(
                f"--endpoint {arguments.endpoint!r}: an endpoint ID is letters, digits, - and _ "
                "(the ID in the console's endpoint URL)",
                ExitCode.USAGE,
            )
        api_key = environ.get(API_KEY_VARIABLE, "").strip()
        if not api_key:
            raise ClientError(f"--endpoint needs {API_KEY_VARIABLE} set to a RunPod API key", ExitCode.USAGE)
        return endpoint_url(arguments.endpoint), api_key, API_KEY_VARIABLE
    url = arguments.url
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = urlsplit("")
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ClientError(f"--url {url!r}: give an http:// or https:// URL with a host", ExitCode.USAGE)
    problem = host_problem(url)
    if problem is not None:
        raise ClientError(f"--url {url!r}: {problem}", ExitCode.USAGE)
    name = arguments.url_api_key_env
    if not name:
        return url, None, ""
    api_key = environ.get(name, "").strip()
    if not api_key:
        raise ClientError(f"--url-api-key-env {name}: the variable {name} is not set", ExitCode.USAGE)
    if not key_may_go_to(url):
        raise ClientError(
            f"--url {url}: the key in {name} is sent only over https, or over http to this machine "
            "(localhost); use an https:// URL",
            ExitCode.USAGE,
        )
    return url, api_key, name


def run_submit_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    from fluxbooth.client.submission import submit  # deferred, as in submission_from

    try:
        submission = submission_from(arguments, environ)
    except ClientError as error:
        sys.stderr.write(f"error: {error.message}\n")
        return int(error.exit_code)
    try:
        outcome = submit(submission, environ, sys.stderr)
    except KeyboardInterrupt:
        # Before /run answered: no job id to cancel. One may have been queued if /run was already sent.
        sys.stderr.write("interrupted before the job was submitted (if /run was already sent, check the endpoint)\n")
        return int(ExitCode.INTERRUPTED)
    sys.stderr.write(("" if outcome.exit_code is ExitCode.COMPLETED else "error: ") + outcome.message + "\n")
    if outcome.job_id:
        out.write(
            json.dumps({"id": outcome.job_id, "status": outcome.status, "exit_code": int(outcome.exit_code)}) + "\n"
        )
    return int(outcome.exit_code)
