"""`python -m fluxbooth submit --url` against the runpod SDK's own local API server (`python handler.py
--rp_serve_api`, a real worker with the fault-injecting trainer): the client says at submit time that this server
answers only when the job is over and then says the time waited, Ctrl-C says the server has no /cancel and
exits 130, and a loopback URL where nothing listens exits 6 within seconds, saying how to start the server.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fluxbooth.client import ExitCode, Submission, submit
from fluxbooth.client.local_server import ServerRoutes, probe_routes
from fluxbooth.settings import TINY_MODEL_NAME
from tests.conftest import REPO_ROOT
from tests.support.factories import make_image
from tests.support.handler_api_server import ApiServer, start_api_server
from tests.support.s3server import refusing_port
from tests.support.submit_client import default_sigint

CLIENT_WAIT_SECONDS = 120
# A job whose trainer fails at once: the worker still fetches the photos, plans and launches, a few seconds.
CRASHING_JOB = {
    "model_name": "sks-toy",
    "base_model": TINY_MODEL_NAME,
    "instance_prompt": "a photo of sks toy fault:crash",
    "steps": 2,
    "resolution": 64,
}
NO_PROGRESS_NOTE = (
    "the runpod SDK's local server answers /status only when the job is over: the worker's progress is drawn in "
    "that server's output, not here (this prints the time waited)\n"
)


@pytest.fixture
def local_api(fake_env: dict[str, str], api_env: dict[str, str], tmp_path: Path) -> Iterator[ApiServer]:
    yield from start_api_server({**fake_env, **api_env}, tmp_path)


def photo_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for index in range(3):
        make_image(folder / f"toy{index}.jpg", size=(96, 96), color=(60 * index, 120, 180))
    return folder


def client_command(photos: Path, request: Path, url: str, out: Path) -> list[str]:
    words = ["submit", str(photos), "--request", str(request), "--url", url, "--out", str(out)]
    return [sys.executable, "-m", "fluxbooth", *words]


def client_env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT / "src")}


def test_the_sdk_local_server_is_known_by_its_openapi_description(local_api: ApiServer) -> None:
    import requests

    assert probe_routes(local_api.base_url, requests.Session()) == ServerRoutes(
        sdk_development_api=True, has_cancel=False
    )


def test_a_local_server_is_said_at_submit_to_report_only_at_the_end_and_the_wait_shows(
    local_api: ApiServer, tmp_path: Path
) -> None:
    stream = io.StringIO()
    submission = Submission(
        str(photo_folder(tmp_path)), CRASHING_JOB, tmp_path / "out", local_api.base_url, heartbeat_seconds=0.5
    )
    outcome = submit(submission, {}, stream)
    text = stream.getvalue()
    assert outcome.exit_code == ExitCode.FAILED, text
    assert text.count(NO_PROGRESS_NOTE) == 1
    assert text.index("submitted to") < text.index(NO_PROGRESS_NOTE) < text.index("waiting for the local server: 0:0")
    assert "failed: trainer_failed: " in outcome.message


def test_ctrl_c_on_a_local_server_says_it_has_no_cancel_and_exits_130(local_api: ApiServer, tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(CRASHING_JOB))
    command = client_command(photo_folder(tmp_path), request, local_api.base_url, tmp_path / "out")
    with subprocess.Popen(
        command,
        env=client_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=default_sigint,
    ) as client:
        assert client.stderr is not None
        for line in client.stderr:
            if line == NO_PROGRESS_NOTE:
                break
        client.send_signal(signal.SIGINT)
        rest = client.stderr.read()
        assert client.wait(CLIENT_WAIT_SECONDS) == ExitCode.INTERRUPTED
    assert "interrupted; the local server has no /cancel, so job test-" in rest
    assert "runs on there until it ends (stop that server, Ctrl-C where it runs, to end the job now)" in rest


def test_a_loopback_url_that_refuses_the_connection_exits_6_within_15_seconds(tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(CRASHING_JOB))
    with refusing_port() as port:
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        completed = subprocess.run(
            client_command(photo_folder(tmp_path), request, url, tmp_path / "out"),
            env=client_env(),
            capture_output=True,
            text=True,
            timeout=CLIENT_WAIT_SECONDS,
        )
        elapsed = time.monotonic() - started
    assert completed.returncode == ExitCode.API, completed.stderr
    assert elapsed < 15, f"{elapsed:.1f} s"
    assert f"cannot reach {url}/run: ConnectionError" in completed.stderr
    assert (
        f"nothing listens at {url}: start the local server with `python handler.py --rp_serve_api --rp_api_port {port}`"
        in completed.stderr
    )
