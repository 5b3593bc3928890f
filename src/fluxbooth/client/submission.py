"""Submit a training job, follow it to its end, and fetch what it made: `submit(...)`, the function behind
`python -m fluxbooth submit`.

Order: the request is checked here first (the worker's own model, so a typo costs nothing), the photos are
packed and sent inline or through the bucket, /run, then /status until a terminal status (COMPLETED, FAILED,
CANCELLED, TIMED_OUT), each with its own exit code. Ctrl-C while following cancels the job through /cancel.
A --url server is asked what it offers first (fluxbooth.client.local_server): the runpod SDK's local server
answers /status only at the end and has no /cancel, and the client says so instead of staying silent.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from fluxbooth.client.api import RUNPOD_API_BASE, JobApi, is_loopback
from fluxbooth.client.artifacts import RESULT_FILE, RESUME_REQUEST_FILE, checked_artifacts, download_all
from fluxbooth.client.dataset import dataset_fields, left_out_line, read_photos, run_body
from fluxbooth.client.errors import ClientError, ExitCode
from fluxbooth.client.local_server import (
    HEARTBEAT_SECONDS,
    ServerRoutes,
    answer_with_heartbeat,
    probe_routes,
    start_hint,
)
from fluxbooth.errors import ErrorCode
from fluxbooth.progress import ProgressBar
from fluxbooth.request.model import TrainingRequest
from fluxbooth.request.problems import describe_validation_error

# RunPod's execution timeout counts from when a worker takes the job; the worker's own deadline
# (timeout_seconds) must end it first, so that a job out of time still reports and keeps its work.
EXECUTION_MARGIN_SECONDS = 300
DEFAULT_POLL_SECONDS = 2.0
TERMINAL_EXIT_CODES = {
    "COMPLETED": ExitCode.COMPLETED,
    "FAILED": ExitCode.FAILED,
    "CANCELLED": ExitCode.CANCELLED,
    "TIMED_OUT": ExitCode.TIMED_OUT,
}
DATASET_FIELDS = ("dataset", "dataset_url")
PLACEHOLDER_DATASET_URL = "https://example.com/dataset.zip"


@dataclass(frozen=True)
class Submission:
    """One job to submit: the photos (folder, zip or link), the request without its dataset, where to put the
    files, and where to send it (an endpoint's base URL: https://api.runpod.ai/v2/ID, or a local server)."""

    photos: str
    job_input: Mapping[str, Any]
    out_dir: Path
    base_url: str
    api_key: str | None = None
    webhook: str | None = None
    poll_seconds: float = DEFAULT_POLL_SECONDS
    # RunPod's hosted API answers /status at once; the SDK's local server only when the job is over.
    status_answers_at_once: bool = False
    # Where api_key came from: named when the server refuses it, and in the resubmission a `timeout` prints.
    key_source: str = "RUNPOD_API_KEY"
    # How often the wait for a server that answers only at the end (the SDK's local one) says the time waited.
    heartbeat_seconds: float = HEARTBEAT_SECONDS


@dataclass
class Outcome:
    """How a submission ended."""

    exit_code: ExitCode
    message: str
    job_id: str | None = None
    status: str | None = None
    result: Any = None
    files: list[Path] = field(default_factory=list)


def check_request(job_input: Mapping[str, Any]) -> None:
    """Refuse a request the worker would refuse, before anything is uploaded or paid for."""
    present = [name for name in DATASET_FIELDS if name in job_input]
    if present:
        raise ClientError(
            f"the request file holds {', '.join(present)}: leave the dataset out, the client sends PHOTOS",
            ExitCode.USAGE,
        )
    try:
        TrainingRequest.model_validate({**job_input, "dataset_url": PLACEHOLDER_DATASET_URL})
    except ValidationError as error:
        raise ClientError(describe_validation_error(error), ExitCode.USAGE) from None


def prepare_out_dir(out_dir: Path) -> None:
    """Create --out before anything is paid for: a job whose files cannot be saved is not worth sending."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ClientError(f"--out {out_dir}: cannot create it: {error.strerror or error}", ExitCode.USAGE) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ClientError(f"--out {out_dir}: cannot write there; choose a folder you can write", ExitCode.USAGE)


def execution_policy(job_input: Mapping[str, Any]) -> dict[str, int] | None:
    """RunPod's per-job policy: an execution timeout a little beyond the job's own deadline, when it has one."""
    seconds = job_input.get("timeout_seconds")
    if not isinstance(seconds, int):
        return None
    return {"executionTimeout": (seconds + EXECUTION_MARGIN_SECONDS) * 1000}


def worker_error(reply: Mapping[str, Any]) -> dict[str, Any] | None:
    """The worker's error (RunPod carries it as a JSON string: code, message, details), or None when it is not
    one; `details` is always an object."""
    raw = reply.get("error")
    try:
        error = json.loads(raw) if isinstance(raw, str) else raw
    except (ValueError, RecursionError):
        return None
    if not isinstance(error, dict) or "code" not in error:
        return None
    return {**error, "details": error.get("details") if isinstance(error.get("details"), dict) else {}}


def describe_failure(reply: Mapping[str, Any]) -> str:
    """The worker's error string (JSON with code, message, details) as one readable paragraph."""
    error = worker_error(reply)
    if error is None:
        return str(reply.get("error"))[:2000]
    text = f"{error['code']}: {error.get('message', '')}"
    details = error["details"]
    for name in ("latest_checkpoint", "kept_at", "exit_status"):
        if name in details:
            text += f"\n  {name}: {details[name]}"
    if "log_tail" in details:
        text += "\n  log tail:\n    " + "\n    ".join(str(details["log_tail"]).splitlines()[-15:])
    return text


@dataclass
class _Follower:
    """Polls /status, drawing the worker's progress payloads, until the job reaches a terminal status; on a server
    that answers only at the end, says the time waited instead."""

    api: JobApi
    job_id: str
    poll_seconds: float
    stream: TextIO
    bar: ProgressBar
    routes: ServerRoutes = field(default_factory=ServerRoutes)
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    _last_status: str | None = None
    _last_payload: Any = None

    def follow(self) -> dict[str, Any]:
        while True:
            reply = self._ask()
            status = str(reply.get("status", ""))
            if status in TERMINAL_EXIT_CODES:
                self.bar.close()
                return reply
            self._show(status, reply)
            self.api.sleep(self.poll_seconds)

    def _ask(self) -> dict[str, Any]:
        if not self.routes.sdk_development_api:
            return self.api.status(self.job_id)
        return answer_with_heartbeat(lambda: self.api.status(self.job_id), self._say, self.heartbeat_seconds)

    def _say(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def _show(self, status: str, reply: Mapping[str, Any]) -> None:
        payload = reply.get("output")
        if status == "IN_PROGRESS" and isinstance(payload, dict) and payload != self._last_payload:
            self._last_payload = payload
            self.bar(payload)
        elif status != self._last_status:
            self.bar.close()
            self.stream.write(f"{status.lower().replace('_', ' ')}\n" if status else "waiting\n")
        self._last_status = status


def _cancel(api: JobApi, job_id: str, say: Callable[[str], None], routes: ServerRoutes) -> Outcome:
    if not routes.has_cancel:
        return Outcome(ExitCode.INTERRUPTED, routes.no_cancel(job_id), job_id)
    say(f"\nCtrl-C: cancelling job {job_id} through /cancel")
    try:
        reply = api.cancel(job_id)
    except ClientError as error:
        return Outcome(
            ExitCode.INTERRUPTED,
            f"interrupted; cancelling job {job_id} failed: {error.message}; "
            "it may still be running (cancel it in the console, or stop the worker)",
            job_id,
        )
    return Outcome(
        ExitCode.INTERRUPTED,
        f"interrupted; job {job_id} is {reply.get('status', 'being cancelled')}",
        job_id,
        str(reply.get("status")),
    )


def _write_json(path: Path, document: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as error:
        raise ClientError(f"cannot write {path}: {error.strerror or error}", ExitCode.DOWNLOAD) from error


def resubmission(submission: Submission) -> str:
    """The command that resubmits this job from its latest checkpoint, its request saved beside the artifacts."""
    request = submission.out_dir / RESUME_REQUEST_FILE
    _write_json(request, {**submission.job_input, "resume_from": "latest"})
    runpod = f"{RUNPOD_API_BASE}/"
    if submission.base_url.startswith(runpod):
        where = ["--endpoint", submission.base_url.removeprefix(runpod)]
    else:
        where = ["--url", submission.base_url]
        where += ["--url-api-key-env", submission.key_source] if submission.api_key else []
    words = [
        "python",
        "-m",
        "fluxbooth",
        "submit",
        submission.photos,
        "--request",
        str(request),
        *where,
        "--out",
        str(submission.out_dir),
    ]
    return shlex.join(words)


def _timed_out(error: Mapping[str, Any], submission: Submission, job_id: str, say: Callable[[str], None]) -> Outcome:
    """The worker's `timeout`: fetch what it kept (the weights so far), and say how to continue from its checkpoint."""
    details = error["details"]
    message = f"job {job_id} timed out on the worker: {error['code']}: {error.get('message', '')}"
    files: list[Path] = []
    try:
        artifacts = checked_artifacts(details.get("artifacts"), "error.details.artifacts")
        if artifacts:
            say(
                f"job {job_id} timed out; the worker kept {len(artifacts)} artifact(s): downloading them into "
                f"{submission.out_dir}"
            )
            files = download_all(artifacts, submission.out_dir, say, is_loopback(submission.base_url))
            message += (
                f"\nthe {len(files)} artifact(s) the worker kept are in {submission.out_dir}, each sha256 verified"
            )
        if details.get("resume_from") == "latest":
            message += (
                '\nto train the remaining steps from its checkpoint, resubmit with "resume_from": "latest" '
                f"(and more time):\n  {resubmission(submission)}"
            )
    except ClientError as failure:
        return Outcome(failure.exit_code, f"{message}\n{failure.message}", job_id, "FAILED", dict(error), files)
    return Outcome(ExitCode.TIMED_OUT, message, job_id, "FAILED", dict(error), files)


def _completed(output: Any, submission: Submission, job_id: str, say: Callable[[str], None]) -> Outcome:
    status = "COMPLETED"
    if not isinstance(output, dict):
        return Outcome(
            ExitCode.DOWNLOAD,
            f"job {job_id} completed, but its result is {type(output).__name__}, not an "
            "object with artifacts; the worker's answer is malformed",
            job_id,
            status,
            output,
        )
    try:
        artifacts = checked_artifacts(output.get("artifacts"), "artifacts")
        _write_json(submission.out_dir / RESULT_FILE, output)
        say(f"job {job_id} completed; downloading {len(artifacts)} artifact(s) into {submission.out_dir}")
        files = download_all(artifacts, submission.out_dir, say, is_loopback(submission.base_url))
    except ClientError as error:
        return Outcome(error.exit_code, error.message, job_id, status, output)
    warnings = output.get("warnings")
    for warning in warnings if isinstance(warnings, list) else []:
        say(f"warning: {str(warning)[:2000]}")
    return Outcome(
        ExitCode.COMPLETED,
        f"done: {len(files)} file(s) in {submission.out_dir}, each sha256 verified",
        job_id,
        status,
        output,
        files,
    )


def _finish(reply: Mapping[str, Any], submission: Submission, job_id: str, say: Callable[[str], None]) -> Outcome:
    status = str(reply["status"])
    code = TERMINAL_EXIT_CODES[status]
    if status == "FAILED":
        error = worker_error(reply)
        if error is not None and error["code"] == ErrorCode.TIMEOUT:
            return _timed_out(error, submission, job_id, say)
        return Outcome(code, f"job {job_id} failed: {describe_failure(reply)}", job_id, status, reply.get("error"))
    if status == "CANCELLED":
        return Outcome(code, f"job {job_id} was cancelled (from the console, the API or the endpoint)", job_id, status)
    if status == "TIMED_OUT":
        return Outcome(
            code,
            f"job {job_id} timed out: RunPod stopped it at the execution timeout; raise the "
            "endpoint's execution timeout or the request's timeout_seconds",
            job_id,
            status,
        )
    return _completed(reply.get("output"), submission, job_id, say)


def _routes(submission: Submission, client: JobApi) -> ServerRoutes:
    """What the server offers: RunPod's hosted API is known; a --url server is asked."""
    if submission.status_answers_at_once or submission.base_url.startswith(f"{RUNPOD_API_BASE}/"):
        return ServerRoutes()
    return probe_routes(submission.base_url, client.session)


def submit(
    submission: Submission, environ: Mapping[str, str], stream: TextIO | None = None, api: JobApi | None = None
) -> Outcome:
    """Run one submission to its end. Never raises for a failure it can describe: the Outcome carries it."""
    out = stream or sys.stderr

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    policy = execution_policy(submission.job_input)
    routes = ServerRoutes()
    try:
        client = api or JobApi(
            submission.base_url,
            submission.api_key,
            submission.key_source,
            status_answers_at_once=submission.status_answers_at_once,
        )
        if policy and client.status_timeout_seconds is None:
            client.status_timeout_seconds = policy["executionTimeout"] / 1000
        check_request(submission.job_input)
        prepare_out_dir(submission.out_dir)
        source = read_photos(submission.photos)
        extra = {"policy": policy, "webhook": submission.webhook}
        fields, how = dataset_fields(source, submission.job_input, extra, environ)
        say(how)
        if (left_out := left_out_line(source)) is not None:
            say(left_out)
        routes = _routes(submission, client)
        queued = client.run(run_body({**submission.job_input, **fields}, policy, submission.webhook))
    except ClientError as error:
        hint = f"\n{start_hint(submission.base_url)}" if routes.refused and is_loopback(submission.base_url) else ""
        return Outcome(error.exit_code, error.message + hint)
    if routes.refused:  # it started while /run was retried: ask again what it offers
        routes = _routes(submission, client)
    job_id = str(queued["id"])
    bar = ProgressBar.for_stream(out)
    follower = _Follower(client, job_id, submission.poll_seconds, out, bar, routes, submission.heartbeat_seconds)
    try:
        say(
            f"job {job_id} submitted to {submission.base_url}"
            + (f" (executionTimeout {policy['executionTimeout']} ms)" if policy else "")
        )
        if (note := routes.submit_note()) is not None:
            say(note)
        reply = follower.follow()
    except KeyboardInterrupt:
        follower.bar.close()
        return _cancel(client, job_id, say, routes)
    except ClientError as error:
        return Outcome(error.exit_code, f"following job {job_id}: {error.message}", job_id)
    return _finish(reply, submission, job_id, say)
