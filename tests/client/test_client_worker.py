"""`python -m fluxbooth submit` against a real worker: `python handler.py --rp_serve_api` (the runpod SDK's own
local API server, over real HTTP) with moto's S3 server as the bucket. A folder of photos ends with the LoRA
files downloaded and their sha256 verified; a zip too big for the /run body travels through the bucket; a worker
without a bucket hands out file:// artifacts; a failing job ends the client with the worker's error.

The SDK's server runs the job inside the first /status request and answers when the job is over; each job
here must have run exactly once (a client that re-sent /status would have run it twice).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.client import BaseClient
from PIL import Image

from fluxbooth.client import ExitCode
from fluxbooth.client.dataset import RUNPOD_RUN_BODY_LIMIT_BYTES
from fluxbooth.settings import TINY_MODEL_NAME
from tests.conftest import REPO_ROOT
from tests.support.factories import make_image
from tests.support.handler_api_server import ApiServer, start_api_server

CLIENT_TIMEOUT_SECONDS = 900
# The runpod SDK logs `<job id> | Started.` each time it runs a job (rp_job.run_job, at INFO).
JOB_STARTED = " | Started."


def write_photos(folder: Path, count: int = 3, side: int = 96) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        make_image(folder / f"toy{index}.jpg", size=(side, side), color=(60 * index, 120, 180))
    (folder / "toy0.txt").write_text("a photo of sks toy on the floor")
    return folder


def write_noise_photos(folder: Path, total_bytes: int) -> Path:
    """PNGs of random pixels (incompressible), together larger than `total_bytes`."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = random.Random(7)
    written, index = 0, 0
    while written <= total_bytes:
        pixels = bytes(generator.getrandbits(8) for _ in range(900 * 900 * 3))
        path = folder / f"noise{index}.png"
        Image.frombytes("RGB", (900, 900), pixels).save(path, format="PNG")
        written += path.stat().st_size
        index += 1
    return folder


def request_file(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "request.json"
    path.write_text(
        json.dumps(
            {
                "model_name": "sks-toy",
                "base_model": TINY_MODEL_NAME,
                "instance_prompt": "a photo of sks toy",
                "steps": 2,
                "resolution": 64,
                "seed": 42,
                **fields,
            }
        )
    )
    return path


def run_client(
    api: ApiServer, photos: Path, request: Path, out: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "fluxbooth",
        "submit",
        str(photos),
        "--request",
        str(request),
        "--url",
        api.base_url,
        "--out",
        str(out),
    ]
    return subprocess.run(
        command,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_SECONDS,
    )


def assert_every_artifact_downloaded_verified(out: Path) -> list[str]:
    result = json.loads((out / "result.json").read_text())
    names = []
    for artifact in result["artifacts"]:
        body = (out / artifact["name"]).read_bytes()
        assert (len(body), hashlib.sha256(body).hexdigest()) == (artifact["bytes"], artifact["sha256"]), artifact[
            "name"
        ]
        names.append(artifact["name"])
    return names


@pytest.fixture
def bucket_api(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], api_env: dict[str, str], tmp_path: Path
) -> Iterator[ApiServer]:
    yield from start_api_server({**worker_env, **s3_bucket_env, **api_env}, tmp_path)


@pytest.mark.slow
def test_a_folder_of_photos_trains_a_lora_whose_files_are_downloaded_and_verified(
    bucket_api: ApiServer, s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    photos = write_photos(tmp_path / "photos")
    request = request_file(tmp_path, training_type="lora", trigger_word="sks")
    out = tmp_path / "lora"
    completed = run_client(bucket_api, photos, request, out, s3_bucket_env)
    assert completed.returncode == ExitCode.COMPLETED, completed.stderr[-4000:]
    names = assert_every_artifact_downloaded_verified(out)
    assert {"lora/pytorch_lora_weights.safetensors", "lora/lora_comfyui.safetensors"} <= set(names)
    assert "sha256 ok" in completed.stderr and "done: " in completed.stderr
    assert bucket_api.log_path.read_text().count(JOB_STARTED) == 1, "the job ran more than once"


def test_without_a_bucket_the_file_uris_are_downloaded_and_verified(
    fake_env: dict[str, str], api_env: dict[str, str], tmp_path: Path
) -> None:
    server = start_api_server({**fake_env, **api_env}, tmp_path)
    api = next(server)
    try:
        completed = run_client(api, write_photos(tmp_path / "photos"), request_file(tmp_path), tmp_path / "out", {})
    finally:
        server.close()
    assert completed.returncode == ExitCode.COMPLETED, completed.stderr[-4000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert all(artifact["uri"].startswith("file://") for artifact in result["artifacts"])
    assert "transformer/diffusion_pytorch_model.safetensors" in assert_every_artifact_downloaded_verified(
        tmp_path / "out"
    )
    assert api.log_path.read_text().count(JOB_STARTED) == 1, "the job ran more than once"


def test_a_zip_too_big_for_the_run_body_travels_through_the_bucket(
    fake_env: dict[str, str],
    api_env: dict[str, str],
    s3_bucket_env: dict[str, str],
    s3_client: BaseClient,
    tmp_path: Path,
) -> None:
    photos = write_noise_photos(tmp_path / "photos", RUNPOD_RUN_BODY_LIMIT_BYTES * 3 // 4)
    worker = {**fake_env, **s3_bucket_env, **api_env, "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1"}
    server = start_api_server(worker, tmp_path)
    api = next(server)
    try:
        completed = run_client(api, photos, request_file(tmp_path), tmp_path / "out", s3_bucket_env)
    finally:
        server.close()
    assert completed.returncode == ExitCode.COMPLETED, completed.stderr[-4000:]
    assert f"uploaded to s3://{s3_bucket_env['BUCKET_NAME']}" in completed.stderr
    keys = [item["Key"] for item in s3_client.list_objects_v2(Bucket=s3_bucket_env["BUCKET_NAME"])["Contents"]]
    assert [key for key in keys if "/uploads/" in key and key.endswith("/dataset.zip")]
    assert_every_artifact_downloaded_verified(tmp_path / "out")


def test_a_zip_too_big_without_a_bucket_is_refused_naming_the_bucket_variables(tmp_path: Path) -> None:
    photos = write_noise_photos(tmp_path / "photos", RUNPOD_RUN_BODY_LIMIT_BYTES * 3 // 4)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fluxbooth",
            "submit",
            str(photos),
            "--request",
            str(request_file(tmp_path)),
            "--url",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "out"),
        ],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_SECONDS,
    )
    assert completed.returncode == ExitCode.USAGE
    assert "too big for RunPod's 10 MB /run body once base64-encoded" in completed.stderr
    assert "set BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY" in completed.stderr


def test_a_failing_job_ends_the_client_with_the_workers_error_code(
    fake_env: dict[str, str], api_env: dict[str, str], tmp_path: Path
) -> None:
    server = start_api_server({**fake_env, **api_env}, tmp_path)
    api = next(server)
    try:
        request = request_file(tmp_path, instance_prompt="a photo of sks toy fault:crash")
        completed = run_client(api, write_photos(tmp_path / "photos"), request, tmp_path / "out", {})
    finally:
        server.close()
    assert completed.returncode == ExitCode.FAILED, completed.stderr[-4000:]
    assert "failed: trainer_failed: " in completed.stderr
    assert "RuntimeError" in completed.stderr  # the log tail travels in the error's details
    assert not (tmp_path / "out" / "result.json").exists()
