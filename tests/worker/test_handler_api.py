"""Errors RunPod understands, over real HTTP against the runpod SDK's own local API server
(`python handler.py --rp_serve_api`): an invalid job is HTTP 200, status FAILED, and `error` is one JSON
string carrying the contract's code, message, details and refresh_worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError, error_for_the_wire
from tests.support.fake_trainer_jobs import job_input
from tests.support.handler_api_server import ApiServer, start_api_server
from tests.support.quiet_http import QuietHTTPServer

STEPS_MESSAGE = "invalid request: input.steps: Input should be a valid integer"


@pytest.fixture
def api_server(worker_env: dict[str, str], api_env: dict[str, str], tmp_path: Path) -> Iterator[ApiServer]:
    yield from start_api_server({**worker_env, **api_env}, tmp_path)


def an_invalid_job() -> dict[str, Any]:
    """What a new user tries first: the guide's fields with a typo in a number."""
    return {"input": {"model_name": "sks-dog", "instance_prompt": "a photo of sks dog", "steps": "many"}}


def test_runsync_answers_an_invalid_job_with_http_200_and_status_failed(api_server: ApiServer) -> None:
    status, reply = api_server.post("/runsync", an_invalid_job())
    print("POST /runsync ->", status, json.dumps(reply))  # the README quotes this captured reply
    assert status == 200
    assert reply["status"] == "FAILED"
    assert reply["id"].startswith("test-")
    assert set(reply) == {"id", "status", "error"}


def test_the_error_string_carries_the_code_message_and_refresh_worker(api_server: ApiServer) -> None:
    _, reply = api_server.post("/runsync", an_invalid_job())
    assert isinstance(reply["error"], str)
    assert json.loads(reply["error"]) == {"code": "invalid_input", "message": STEPS_MESSAGE, "refresh_worker": False}


def test_run_then_status_reports_the_same_failure(api_server: ApiServer) -> None:
    status, queued = api_server.post("/run", an_invalid_job())
    assert (status, queued["status"]) == (200, "IN_PROGRESS")
    status, reply = api_server.post(f"/status/{queued['id']}")
    print(f"POST /status/{queued['id']} ->", status, json.dumps(reply))
    assert (status, reply["id"], reply["status"]) == (200, queued["id"], "FAILED")
    assert json.loads(reply["error"])["code"] == "invalid_input"
    assert json.loads(reply["error"])["message"] == STEPS_MESSAGE


def test_an_input_that_is_not_an_object_is_invalid_input_not_a_server_error(api_server: ApiServer) -> None:
    status, reply = api_server.post("/runsync", {"input": {"dataset": ["not", "a", "string"], "model_name": 7}})
    assert (status, reply["status"]) == (200, "FAILED")
    error = json.loads(reply["error"])
    assert error["code"] == "invalid_input"
    assert error["message"].startswith("invalid request: ")
    assert "input.model_name" in error["message"] and "input.dataset" in error["message"]


# --- the wire shape itself ---------------------------------------------------------------------------


def test_details_travel_inside_the_error_string() -> None:
    failure = FluxboothError(ErrorCode.UPLOAD_FAILED, "uploading failed", details={"kept_at": "/runpod-volume/x"})
    wire = error_for_the_wire(failure.to_result())
    assert wire == {
        "error": '{"code": "upload_failed", "message": "uploading failed", "details": {"kept_at": "/runpod-volume/x"}, '
        '"refresh_worker": false}',
        "refresh_worker": False,
    }


def test_refresh_worker_stays_beside_the_string_for_the_sdk() -> None:
    wire = error_for_the_wire(FluxboothError(ErrorCode.TRAINER_FAILED, "the trainer died").to_result())
    assert wire["refresh_worker"] is True
    assert json.loads(wire["error"])["refresh_worker"] is True


def test_a_successful_result_passes_unchanged() -> None:
    result = {"model_name": "sks", "artifacts": [], "warnings": []}
    assert error_for_the_wire(result) is result


# --- a job that trains: /run, /status and the webhook ---------------------------------------------------


@pytest.fixture
def webhook_bodies() -> Iterator[tuple[str, list[Any]]]:
    """A webhook receiver over HTTP: its URL, and every JSON body POSTed to it."""
    received: list[Any] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            received.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            return

    server = QuietHTTPServer(Receiver).start()
    yield f"{server.base_url}/done", received
    server.stop()


@pytest.mark.slow
def test_run_then_status_trains_and_posts_the_output_to_the_webhook(
    fake_env: dict[str, str], api_env: dict[str, str], webhook_bodies: tuple[str, list[Any]], tmp_path: Path
) -> None:
    webhook_url, received = webhook_bodies
    server = start_api_server({**fake_env, **api_env}, tmp_path)
    api = next(server)
    try:
        _, queued = api.post("/run", {"input": job_input(), "webhook": webhook_url})
        status, reply = api.post(f"/status/{queued['id']}")
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.close()
    assert (status, reply["status"]) == (200, "COMPLETED"), reply
    assert "transformer/diffusion_pytorch_model.safetensors" in [
        artifact["name"] for artifact in reply["output"]["artifacts"]
    ]
    assert received == [{"output": reply["output"]}]


# --- the deadline: refused before anything is fetched ----------------------------------------------------


def test_a_job_the_plan_says_will_overrun_is_refused_with_the_numbers_over_the_api(
    worker_env: dict[str, str], api_env: dict[str, str], tmp_path: Path
) -> None:
    server = start_api_server({**worker_env, **api_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "60"}, tmp_path)
    api = next(server)
    try:
        # No dataset can be fetched: the URL's host does not resolve, so a job that got that far would say so.
        job = {**job_input(steps=200), "dataset_url": "https://fluxbooth-nowhere.invalid/photos.zip"}
        job.pop("dataset")
        status, reply = api.post("/runsync", {"input": job})
    finally:
        server.close()
    assert (status, reply["status"]) == (200, "FAILED"), reply
    error = json.loads(reply["error"])
    assert error["code"] == "does_not_fit"
    assert (
        error["message"].startswith("steps: 200 steps at ≈") and "beyond the job deadline of 1 min" in error["message"]
    )
    assert error["details"]["deadline_seconds"] == 60 and error["details"]["estimated_seconds"] > 60
    assert f"about {error['details']['steps_that_fit']} steps" in error["message"]
    assert f"timeout_seconds {error['details']['timeout_that_fits']}" in error["message"]
