"""A stand-in for RunPod's public queue API (https://api.runpod.ai/v2/ENDPOINT_ID/...), over real HTTP, for
what the runpod SDK's local API server cannot do: it has no /cancel, no IN_QUEUE, no progress in /status, no
CANCELLED or TIMED_OUT, and no API key.

It speaks RunPod's documented protocol (docs.runpod.io, serverless/endpoints/operation-reference): POST /run
answers `{"id", "status": "IN_QUEUE"}`; GET or POST /status/JOB_ID answers `{"id", "status", "delayTime",
"executionTime", "output"?, "error"?}` with status IN_QUEUE, IN_PROGRESS (its `output` the worker's latest
progress_update payload), COMPLETED, FAILED, CANCELLED or TIMED_OUT; POST /cancel/JOB_ID answers
`{"id", "status": "CANCELLED"}`; a missing or wrong key is HTTP 401, an unknown endpoint HTTP 404.
Each job follows a script: the status replies to give, one per /status call, the last one repeated.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.quiet_http import QuietHTTPServer

ENDPOINT_ID = "fluxbooth-endpoint"
API_KEY = "rpa_TESTKEY"


@dataclass
class RunPodApi:
    """One endpoint: the replies each new job will give, and every call received."""

    script: list[dict[str, Any]] = field(default_factory=lambda: [{"status": "COMPLETED", "output": {"artifacts": []}}])
    runs: list[dict[str, Any]] = field(default_factory=list)
    status_calls: list[str] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    # Each call's Authorization header (None when it carried none), in order: what a server could learn.
    authorizations: list[str | None] = field(default_factory=list)
    # Seconds the first /status call waits before answering (a slow or stalled connection).
    first_status_delay_seconds: float = 0.0
    base_url: str = ""
    _replies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint_url(self) -> str:
        return f"{self.base_url}/v2/{ENDPOINT_ID}"

    def _run(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            job_id = f"job-{len(self.runs) + 1}"
            self.runs.append(body)
            self._replies[job_id] = [dict(reply) for reply in self.script]
        return {"id": job_id, "status": "IN_QUEUE"}

    def _status(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            self.status_calls.append(job_id)
            delay = self.first_status_delay_seconds if len(self.status_calls) == 1 else 0.0
        time.sleep(delay)
        with self._lock:
            replies = self._replies.get(job_id)
            if replies is None:
                return None
            reply = replies.pop(0) if len(replies) > 1 else replies[0]
        return {"id": job_id, "delayTime": 1200, "executionTime": 3400, **reply}

    def _cancel(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            if job_id not in self._replies:
                return None
            self.cancels.append(job_id)
            self._replies[job_id] = [{"status": "CANCELLED"}]
        return {"id": job_id, "status": "CANCELLED"}

    def answer(self, method: str, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.authorizations.append(authorization)
        parts = [part for part in urlsplit(path).path.split("/") if part]
        if len(parts) < 3 or parts[0] != "v2":
            return 404, {"error": "not found"}
        if authorization not in {f"Bearer {API_KEY}", API_KEY}:
            return 401, {"error": "Unauthorized"}
        if parts[1] != ENDPOINT_ID:
            return 404, {"error": "endpoint not found"}
        operation, rest = parts[2], parts[3:]
        if operation == "run" and method == "POST" and not rest:
            return 200, self._run(json.loads(body or b"{}"))
        if operation in {"status", "cancel"} and len(rest) == 1:
            reply = (
                self._status(rest[0]) if operation == "status" else self._cancel(rest[0]) if method == "POST" else None
            )
            return (404, {"error": "job not found"}) if reply is None else (200, reply)
        return 404, {"error": "not found"}


def _handler_for(api: RunPodApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self._serve("POST")

        def _serve(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, reply = api.answer(method, self.path, self.headers.get("Authorization"), body)
            encoded = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            self.wfile.write(encoded)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            return

    return Handler


@pytest.fixture
def runpod_api() -> Iterator[RunPodApi]:
    api = RunPodApi()
    server = QuietHTTPServer(_handler_for(api)).start()
    api.base_url = server.base_url
    yield api
    server.stop()
