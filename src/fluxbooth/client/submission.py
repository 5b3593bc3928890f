"""Submit a training job, follow it to its end, and fetch what it made: `submit(...)`, the function behind
`python -m fluxbooth submit`.

Order: the request is checked here first (the worker's own model, so a typo costs nothing), the photos are
packed and sent inline or through the bucket, /run, then /status until a terminal status (COMPLETED, FAILED,
CANCELLED, TIMED_OUT), each with its own exit code. Ctrl-C while following cancels the job through /cancel.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from fluxbooth.client.api import JobApi
from fluxbooth.client.artifacts import download_all
from fluxbooth.client.dataset import dataset_fields, read_photos, run_body
from fluxbooth.client.errors import ClientError, ExitCode
from fluxbooth.progress import ProgressBar
from fluxbooth.request import TrainingRequest, describe_validation_error

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
RESULT_FILE = "result.json"


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
            f"the request file holds {', '.join(present)}: leave the dataset out, the client sends PHOTOS", ExitCode.USAGE
        )
    try:
        TrainingRequest.model_validate({**job_input, "dataset_url": PLACEHOLDER_DATASET_URL})
    except ValidationError as error:
        raise ClientError(describe_validation_error(error), ExitCode.USAGE) from None


def execution_policy(job_input: Mapping[str, Any]) -> dict[str, int] | None:
    """RunPod's per-job policy: an execution timeout a little beyond the job's own deadline, when it has one."""
    seconds = job_input.get("timeout_seconds")
    if not isinstance(seconds, int):
        return None
    return {"executionTimeout": (seconds + EXECUTION_MARGIN_SECONDS) * 1000}


def describe_failure(reply: Mapping[str, Any]) -> str:
    """The worker's error string (JSON with code, message, details) as one readable paragraph."""
    raw = reply.get("error")
    try:
        error = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return str(raw)
    if not isinstance(error, dict) or "code" not in error:
        return str(raw)
    text = f"{error['code']}: {error.get('message', '')}"
    details = error.get("details") or {}
    for name in ("latest_checkpoint", "kept_at", "exit_status"):
        if name in details:
            text += f"\n  {name}: {details[name]}"
    if "log_tail" in details:
        text += "\n  log tail:\n    " + "\n    ".join(str(details["log_tail"]).splitlines()[-15:])
    return text


@dataclass
class _Follower:
    """Polls /status, drawing the worker's progress payloads, until the job reaches a terminal status."""

    api: JobApi
    job_id: str
    poll_seconds: float
    stream: TextIO
    bar: ProgressBar
    _last_status: str | None = None
    _last_payload: Any = None

    def follow(self) -> dict[str, Any]:
        while True:
            reply = self.api.status(self.job_id)
            status = str(reply.get("status", ""))
            if status in TERMINAL_EXIT_CODES:
                self.bar.close()
                return reply
            self._show(status, reply)
            self.api.sleep(self.poll_seconds)

    def _show(self, status: str, reply: Mapping[str, Any]) -> None:
        payload = reply.get("output")
        if status == "IN_PROGRESS" and isinstance(payload, dict) and payload != self._last_payload:
            self._last_payload = payload
            self.bar(payload)
        elif status != self._last_status:
            self.bar.close()
            self.stream.write(f"{status.lower().replace('_', ' ')}\n" if status else "waiting\n")
        self._last_status = status


def _cancel(api: JobApi, job_id: str, say: Callable[[str], None]) -> Outcome:
    say(f"\nCtrl-C: cancelling job {job_id} through /cancel")
    try:
        reply = api.cancel(job_id)
    except ClientError as error:
        return Outcome(ExitCode.INTERRUPTED, f"interrupted; cancelling job {job_id} failed: {error.message}; "
                       "it may still be running (cancel it in the console, or stop the worker)", job_id)
    return Outcome(ExitCode.INTERRUPTED, f"interrupted; job {job_id} is {reply.get('status', 'being cancelled')}",
                   job_id, str(reply.get("status")))


def _finish(reply: Mapping[str, Any], submission: Submission, job_id: str, say: Callable[[str], None]) -> Outcome:
    status = str(reply["status"])
    code = TERMINAL_EXIT_CODES[status]
    if status == "FAILED":
        return Outcome(code, f"job {job_id} failed: {describe_failure(reply)}", job_id, status, reply.get("error"))
    if status == "CANCELLED":
        return Outcome(code, f"job {job_id} was cancelled (from the console, the API or the endpoint)", job_id, status)
    if status == "TIMED_OUT":
        return Outcome(code, f"job {job_id} timed out: RunPod stopped it at the execution timeout; raise the "
                       "endpoint's execution timeout or the request's timeout_seconds", job_id, status)
    output = reply.get("output")
    submission.out_dir.mkdir(parents=True, exist_ok=True)
    (submission.out_dir / RESULT_FILE).write_text(json.dumps(output, indent=2) + "\n")
    artifacts = output.get("artifacts", []) if isinstance(output, dict) else []
    say(f"job {job_id} completed; downloading {len(artifacts)} artifact(s) into {submission.out_dir}")
    try:
        files = download_all(artifacts, submission.out_dir, say)
    except ClientError as error:
        return Outcome(error.exit_code, error.message, job_id, status, output)
    for warning in (output.get("warnings") or []) if isinstance(output, dict) else []:
        say(f"warning: {warning}")
    return Outcome(code, f"done: {len(files)} file(s) in {submission.out_dir}, each sha256 verified", job_id, status, output, files)


def submit(submission: Submission, environ: Mapping[str, str], stream: TextIO | None = None, api: JobApi | None = None) -> Outcome:
    """Run one submission to its end. Never raises for a failure it can describe: the Outcome carries it."""
    out = stream or sys.stderr

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    policy = execution_policy(submission.job_input)
    client = api or JobApi(
        submission.base_url, submission.api_key, status_answers_at_once=submission.status_answers_at_once
    )
    if policy and client.status_timeout_seconds is None:
        client.status_timeout_seconds = policy["executionTimeout"] / 1000
    try:
        check_request(submission.job_input)
        source = read_photos(submission.photos)
        extra = {"policy": policy, "webhook": submission.webhook}
        fields, how = dataset_fields(source, submission.job_input, extra, environ)
        say(how)
        queued = client.run(run_body({**submission.job_input, **fields}, policy, submission.webhook))
    except ClientError as error:
        return Outcome(error.exit_code, error.message)
    job_id = str(queued["id"])
    follower = _Follower(client, job_id, submission.poll_seconds, out, ProgressBar.for_stream(out))
    try:
        say(f"job {job_id} submitted to {submission.base_url}" + (f" (executionTimeout {policy['executionTimeout']} ms)" if policy else ""))
        reply = follower.follow()
    except KeyboardInterrupt:
        follower.bar.close()
        return _cancel(client, job_id, say)
    except ClientError as error:
        return Outcome(error.exit_code, f"following job {job_id}: {error.message}", job_id)
    return _finish(reply, submission, job_id, say)
