"""A stand-in for RunPod's job queue, over real HTTP, for running `python handler.py` as RunPod runs it.

RunPod's queue cannot be reached from here. This server speaks the protocol the runpod SDK's worker loop
uses (runpod/serverless/modules/rp_job.py, rp_http.py, rp_ping.py): the worker GETs its job from
RUNPOD_WEBHOOK_GET_JOB (200 with `{"id", "input"}`, or 204 when there is none), long-polls the stop channel
(the same URL with /job-stop/), POSTs progress (`{"status": "IN_PROGRESS", ...}`) and its result to
RUNPOD_WEBHOOK_POST_OUTPUT, and pings RUNPOD_WEBHOOK_PING. Everything it receives is recorded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote_plus, urlsplit

import pytest

from tests.support.quiet_http import QuietHTTPServer

WORKER_ID = "fluxbooth-test-worker"
# The stop channel is a long poll; answering "nothing" at once would make the SDK spin.
STOP_POLL_SECONDS = 1.0


@dataclass
class RunPodQueue:
    """One endpoint's queue, holding the jobs to hand out and what the worker sent back."""

    jobs: list[dict[str, Any]] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def worker_environment(self) -> dict[str, str]:
        """The variables RunPod sets in a serverless worker, pointing at this queue."""
        return {
            "RUNPOD_POD_ID": WORKER_ID,
            "RUNPOD_WEBHOOK_GET_JOB": f"{self.base_url}/v2/endpoint/job-take/$ID?gpu=test",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{self.base_url}/v2/endpoint/job-done/{WORKER_ID}/$ID?gpu=test",
            "RUNPOD_WEBHOOK_PING": f"{self.base_url}/v2/endpoint/ping/{WORKER_ID}?gpu=test",
            "RUNPOD_AI_API_KEY": "test-api-key",
            "RUNPOD_PING_INTERVAL": "60000",
        }

    def wait_for_result(self, job_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if job_id in self.results:
                    return self.results[job_id]
            time.sleep(0.2)
        raise TimeoutError(f"no result for job {job_id} within {timeout} s")

    def _take(self) -> dict[str, Any] | None:
        with self._lock:
            if not self.jobs:
                return None
            job = self.jobs.pop(0)
            self.taken.append(job["id"])
            return job

    def _record(self, path: str, body: dict[str, Any]) -> None:
        job_id = unquote_plus(path.rstrip("/").rsplit("/", 1)[-1])
        with self._lock:
            if body.get("status") == "IN_PROGRESS":
                self.progress.append(body)
            else:
                self.results[job_id] = body


def _handler_for(queue: RunPodQueue) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = urlsplit(self.path).path
            if "/job-take/" in path:
                job = queue._take()
                if job is None:
                    self._answer(204)
                else:
                    self._answer(200, json.dumps(job).encode())
            elif "/job-stop/" in path:
                time.sleep(STOP_POLL_SECONDS)
                self._answer(204)
            else:
                self._answer(200, b"{}")

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            queue._record(urlsplit(self.path).path, json.loads(body.decode()))
            self._answer(200, b"{}")

        def _answer(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            if body:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            return

    return Handler


@pytest.fixture
def runpod_queue() -> Iterator[RunPodQueue]:
    queue = RunPodQueue()
    server = QuietHTTPServer(_handler_for(queue)).start()
    queue.base_url = server.base_url
    yield queue
    server.stop()
