"""The spine, end to end with real parts: the tiny FLUX model trained by the real trainer under
`accelerate launch` + DeepSpeed ZeRO-2 CPU offload, weights uploaded to a real S3 server (moto over
HTTP), driven in-process, through `python handler.py --test_input`, and through the runpod SDK's
local API server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from botocore.client import BaseClient

from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from tests.conftest import REPO_ROOT
from tests.support.s3server import free_tcp_port

pytestmark = pytest.mark.slow

HANDLER_TIMEOUT_SECONDS = 900


def demo_input() -> dict[str, Any]:
    """The demo job (a LoRA) as a full fine-tune: these tests follow the whole transformer through ZeRO-2."""
    return {**json.loads((REPO_ROOT / "test_input.json").read_text())["input"], "training_type": "full"}


def object_bytes(client: BaseClient, bucket: str, uri: str) -> bytes:
    prefix = f"s3://{bucket}/"
    assert uri.startswith(prefix), uri
    return client.get_object(Bucket=bucket, Key=uri[len(prefix) :])["Body"].read()


def assert_artifacts_landed_byte_identical(result: dict[str, Any], client: BaseClient, bucket: str) -> None:
    assert result["artifacts"], "no artifacts in the result"
    for artifact in result["artifacts"]:
        body = object_bytes(client, bucket, artifact["uri"])
        assert (len(body), hashlib.sha256(body).hexdigest()) == (artifact["bytes"], artifact["sha256"]), artifact[
            "name"
        ]


def test_demo_job_trains_with_zero2_cpu_offload_and_lands_in_the_bucket(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    settings = WorkerSettings.from_environ({**worker_env, **s3_bucket_env})
    progress: list[dict[str, Any]] = []
    result = asyncio.run(run_job(demo_input(), job_id="e2e-inproc", settings=settings, progress=progress.append))

    assert "error" not in result, result
    plan = result["plan"]
    assert (plan["use_deepspeed"], plan["zero_stage"], plan["offload_optimizer"], plan["offload_param"]) == (
        True,
        2,
        "cpu",
        "none",
    )
    assert result["metrics"]["optimizer"] == "DeepSpeedCPUAdam"
    assert result["metrics"]["steps"] == 8
    assert math.isfinite(result["metrics"]["final_loss"])
    assert_artifacts_landed_byte_identical(result, s3_client, s3_bucket_env["BUCKET_NAME"])
    assert {"plan", "dataset", "train", "upload"} <= {update["stage"] for update in progress}
    assert any(update.get("step") == 8 and update.get("total") == 8 for update in progress)
    assert list((tmp_path / "work").iterdir()) == [], "the job directory was not removed"


def test_uploaded_weights_differ_from_the_base_and_reload_in_diffusers(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    settings = WorkerSettings.from_environ({**worker_env, **s3_bucket_env})
    result = asyncio.run(run_job(demo_input(), job_id="e2e-reload", settings=settings))
    assert "error" not in result, result
    download = tmp_path / "downloaded"
    for artifact in result["artifacts"]:
        target = download / artifact["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(artifact["url"], timeout=30) as response:  # the presigned URL works
            target.write_bytes(response.read())
    trained = FluxTransformer2DModel.from_pretrained(download / "transformer")
    base_dir = Path(worker_env["FLUXBOOTH_CACHE_DIR"]) / "models" / "tiny-flux"
    base = FluxTransformer2DModel.from_pretrained(base_dir, subfolder="transformer")
    trained_state, base_state = trained.state_dict(), base.state_dict()
    assert trained_state.keys() == base_state.keys()
    assert any(not torch.equal(trained_state[name].float(), base_state[name].float()) for name in base_state)
    pipeline = FluxPipeline.from_pretrained(base_dir, transformer=trained)
    image = pipeline("a photo of sks toy", height=64, width=64, num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (64, 64, 3)


def test_python_handler_with_test_input_completes(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient
) -> None:
    completed = subprocess.run(
        [sys.executable, "handler.py", "--test_input", (REPO_ROOT / "test_input.json").read_text()],
        cwd=REPO_ROOT,
        env={**worker_env, **s3_bucket_env},
        capture_output=True,
        text=True,
        timeout=HANDLER_TIMEOUT_SECONDS,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    # The SDK cuts its own "Job result" log line at 4,096 characters; the handler logs the whole result locally.
    result_line = next(line for line in output.splitlines() if "fluxbooth.job.result: result " in line)
    result = json.loads(result_line.split("fluxbooth.job.result: result ", 1)[1])
    assert (result["plan"]["zero_stage"], result["plan"]["offload_optimizer"]) == (2, "cpu")
    assert_artifacts_landed_byte_identical(result, s3_client, s3_bucket_env["BUCKET_NAME"])
    # The demo is what people deploy this for: a LoRA with a trigger word, and nothing to warn about.
    names = {artifact["name"] for artifact in result["artifacts"]}
    assert {"lora/pytorch_lora_weights.safetensors", "lora/lora_comfyui.safetensors"} <= names
    assert (result["plan"]["training_type"], result["dataset"]["trigger_word"], result["warnings"]) == (
        "lora",
        "sks",
        [],
    )
    assert s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"] not in output
    # The access key ID is an identifier that SigV4 presigned URLs must carry; it appears nowhere else.
    without_presigned_credentials = re.sub(r"X-Amz-Credential=[^&'\"\s]+", "", output)
    assert s3_bucket_env["BUCKET_ACCESS_KEY_ID"] not in without_presigned_credentials


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the API server exited early"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listened on port {port} within {timeout} s")


def test_local_api_server_runsync_lands_the_weights_in_the_bucket(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    port = free_tcp_port()
    log = (tmp_path / "api.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "handler.py", "--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", str(port)],
        cwd=REPO_ROOT,
        env={**worker_env, **s3_bucket_env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_port(port, server)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/runsync",
            data=json.dumps({"input": demo_input()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=HANDLER_TIMEOUT_SECONDS) as response:
            reply = json.loads(response.read())
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        log.close()
    assert reply["status"] == "COMPLETED", reply
    assert_artifacts_landed_byte_identical(reply["output"], s3_client, s3_bucket_env["BUCKET_NAME"])
