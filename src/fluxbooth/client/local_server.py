"""What a `--url` server offers, read from its own OpenAPI description, and a wait that shows itself.

The runpod SDK's local API server (`python handler.py --rp_serve_api`, runpod/serverless/modules/rp_fastapi.py)
offers POST /run, /runsync, /status/{job_id} and /stream/{job_id}, and no /cancel. Its /run only stores the job;
the first /status runs it and answers once it is over, so no progress reaches a client (the worker draws it in
the server's own output), and /stream answers only for a generator handler, at the end too. Once a /status has
started the job, nothing but stopping the server ends it: the job is not stopped when the client goes away.
RunPod's hosted API, and servers that speak its protocol, answer /status at once with the progress so far.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests

from fluxbooth.progress import format_duration

# The title rp_fastapi.py gives its app (TITLE there); the SDK is not imported here: the client needs only this.
SDK_DEVELOPMENT_API_TITLE = "Development Worker API"
OPENAPI_PATH = "openapi.json"
PROBE_TIMEOUT_SECONDS = (3.0, 5.0)  # connect, read: the description is small and the server is near
HEARTBEAT_SECONDS = 30.0

Reply = TypeVar("Reply")


@dataclass(frozen=True)
class ServerRoutes:
    """What a --url server said about itself; a server without an OpenAPI description is taken to speak RunPod's
    protocol (progress in /status, a /cancel)."""

    sdk_development_api: bool = False
    has_cancel: bool = True
    # The probe's connection was refused: nothing listened at the URL when the client started.
    refused: bool = False

    def submit_note(self) -> str | None:
        """The line said once at submit time when this server cannot report progress."""
        if not self.sdk_development_api:
            return None
        return (
            "the runpod SDK's local server answers /status only when the job is over: the worker's progress is "
            "drawn in that server's output, not here (this prints the time waited)"
        )

    def no_cancel(self, job_id: str) -> str:
        """What Ctrl-C tells about a job on a server without /cancel."""
        return (
            f"interrupted; the local server has no /cancel, so job {job_id} runs on there until it ends "
            "(stop that server, Ctrl-C where it runs, to end the job now)"
        )


def probe_routes(base_url: str, session: requests.Session) -> ServerRoutes:
    """Ask the server for its OpenAPI description; any failure means "no description", never an error: the
    calls that follow report an unreachable server with their own retries and message."""
    url = f"{base_url.rstrip('/')}/{OPENAPI_PATH}"
    try:
        response = session.get(url, timeout=PROBE_TIMEOUT_SECONDS, allow_redirects=False)
        description = response.json() if response.status_code == 200 else None
    except requests.ConnectionError as error:
        return ServerRoutes(refused="refused" in str(error).lower())
    except (requests.RequestException, ValueError, RecursionError):
        return ServerRoutes()
    if not isinstance(description, dict) or not isinstance(description.get("paths"), dict):
        return ServerRoutes()
    info = description.get("info")
    title = str(info.get("title", "")) if isinstance(info, dict) else ""
    paths = [str(path) for path in description["paths"]]
    return ServerRoutes(
        sdk_development_api=SDK_DEVELOPMENT_API_TITLE in title,
        has_cancel=any(path.startswith("/cancel") for path in paths),
    )


def start_hint(base_url: str) -> str:
    """How to start the local server the URL names."""
    port = urlsplit(base_url).port or 8000
    return f"nothing listens at {base_url}: start the local server with `python handler.py --rp_serve_api --rp_api_port {port}`"


def answer_with_heartbeat(
    call: Callable[[], Reply],
    say: Callable[[str], None],
    every_seconds: float = HEARTBEAT_SECONDS,
    clock: Callable[[], float] = time.monotonic,
) -> Reply:
    """`call()`'s answer, saying every `every_seconds` how long it has been awaited. The call runs in a daemon
    thread so that Ctrl-C (raised here, in the main thread) ends the client at once instead of waiting for it."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["reply"] = call()
        except BaseException as error:  # handed to the caller, in its thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="fluxbooth-status", daemon=True)
    started = clock()
    thread.start()
    thread.join(every_seconds)
    while thread.is_alive():
        say(f"waiting for the local server: {format_duration(clock() - started)}")
        thread.join(every_seconds)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["reply"]  # type: ignore[no-any-return]
