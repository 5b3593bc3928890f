"""The runpod SDK's own local API server (`python handler.py --rp_serve_api`) in a subprocess, over real HTTP:
the environment it runs under (what the image sets, this checkout's source first on the path) and the server.

The fixtures are registered in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.support.s3server import free_tcp_port

SERVER_START_TIMEOUT_SECONDS = 120.0
REQUEST_TIMEOUT_SECONDS = 120.0


@dataclass
class ApiServer:
    """The SDK's development API server, running handler.py in a subprocess."""

    base_url: str
    log_path: Path

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            return response.status, json.loads(response.read())


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the API server exited early:\n{log_path.read_text()[-3000:]}"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listened on port {port} within {SERVER_START_TIMEOUT_SECONDS} s")


@pytest.fixture
def api_env() -> dict[str, str]:
    """What the image sets, plus this checkout's source first on the path."""
    return {"RUNPOD_LOG_LEVEL": "INFO", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}


def start_api_server(env: dict[str, str], tmp_path: Path) -> Iterator[ApiServer]:
    port = free_tcp_port()
    log_path = tmp_path / "api.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "handler.py", "--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_for_port(port, server, log_path)
            yield ApiServer(f"http://127.0.0.1:{port}", log_path)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
