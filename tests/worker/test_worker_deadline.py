"""A job whose deadline arrives in the middle of training, through the worker (run_job, what handler.py runs), over
moto's S3 server (issue 27, item 3): the trainer stops at a step boundary before the deadline, the worker stores the
adapter trained so far and a checkpoint, and answers `timeout` with them, the step reached and how to continue; the
same request resubmitted with `resume_from: "latest"` ends on the weights of a run that was never interrupted.

The run falls behind its plan because tests/support/slow_trainer_module.py counts every step of the real trainer 20 s slower."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from botocore.client import BaseClient
from safetensors.torch import load

from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from fluxbooth.storage.checkpoints import COMPLETE_MARKER
from tests.conftest import worker_environment
from tests.support.resume_tolerance import close_after_resume
from tests.support.s3server import TEST_PREFIX, TEST_REGION, client_for_env, empty_and_delete_bucket

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
# Plenty for the planner (≈17 s predicted on this 2-core machine, under half of it: no checkpoints of its own) and
# for the trainer's start (up to minutes on a busy 2-core machine), too little for the slowed trainer: its stop time
# comes about 8 minutes after the job starts, and each of its steps counts 20 s.
SHORT_DEADLINE_SECONDS = 600
LONG_DEADLINE_SECONDS = 1800
MODEL_NAME = "sks-deadline"


def request(**overrides: Any) -> dict[str, Any]:
    """The demo request as a LoRA of STEPS steps."""
    demo = json.loads((REPO_ROOT / "test_input.json").read_text())["input"]
    return {**demo, "model_name": MODEL_NAME, "training_type": "lora", "steps": STEPS, **overrides}


@pytest.fixture(scope="module")
def bucket_env(moto_server_url: str) -> Iterator[dict[str, str]]:
    token = uuid.uuid4().hex
    env = {
        "BUCKET_ENDPOINT_URL": moto_server_url,
        "BUCKET_ACCESS_KEY_ID": f"FBTESTKEY{token[:11].upper()}",
        "BUCKET_SECRET_ACCESS_KEY": f"fbtest-secret-{token}",
        "BUCKET_NAME": f"fluxbooth-test-{token[:16]}",
        "BUCKET_REGION": TEST_REGION,
        "BUCKET_PREFIX": TEST_PREFIX,
    }
    client = client_for_env(env)
    client.create_bucket(Bucket=env["BUCKET_NAME"])
    yield env
    empty_and_delete_bucket(client, env["BUCKET_NAME"])


@pytest.fixture(scope="module")
def environment(
    tmp_path_factory: pytest.TempPathFactory,
    model_cache_dir: Path,
    torch_extensions_dir: Path,
    bucket_env: dict[str, str],
) -> dict[str, str]:
    return {
        **worker_environment(tmp_path_factory.mktemp("worker-deadline"), model_cache_dir, torch_extensions_dir),
        **bucket_env,
    }


@pytest.fixture(scope="module")
def interrupted(environment: dict[str, str]) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(
        {
            **environment,
            "PYTHONPATH": str(REPO_ROOT),
            "FLUXBOOTH_TRAINER_MODULE": "tests.support.slow_trainer_module",
            "FLUXBOOTH_JOB_DEADLINE_SECONDS": str(SHORT_DEADLINE_SECONDS),
        }
    )
    return asyncio.run(run_job(request(), job_id="interrupted", settings=settings))


@pytest.fixture(scope="module")
def resumed(environment: dict[str, str], interrupted: dict[str, Any]) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(
        {**environment, "FLUXBOOTH_JOB_DEADLINE_SECONDS": str(LONG_DEADLINE_SECONDS)}
    )
    result = asyncio.run(run_job(request(resume_from="latest"), job_id="resumed", settings=settings))
    assert "error" not in result, result
    return result


@pytest.fixture(scope="module")
def uninterrupted(environment: dict[str, str]) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(
        {**environment, "FLUXBOOTH_JOB_DEADLINE_SECONDS": str(LONG_DEADLINE_SECONDS)}
    )
    # Another model name: its own checkpoints and exports, beside the interrupted job's.
    result = asyncio.run(run_job(request(model_name=f"{MODEL_NAME}-whole"), job_id="uninterrupted", settings=settings))
    assert "error" not in result, result
    return result


def error_of(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" in result, result
    return result["error"]


def keys_in(client: BaseClient, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def adapter_of(artifacts: list[dict[str, Any]], client: BaseClient) -> dict[str, torch.Tensor]:
    (adapter,) = [artifact for artifact in artifacts if artifact["name"].endswith("pytorch_lora_weights.safetensors")]
    where = urlparse(adapter["uri"])
    return load(client.get_object(Bucket=where.netloc, Key=where.path.lstrip("/"))["Body"].read())


def test_a_job_whose_deadline_arrives_mid_training_answers_timeout_at_the_step_reached(
    interrupted: dict[str, Any],
) -> None:
    error = error_of(interrupted)
    reached = error["details"]["step"]

    assert error["code"] == "timeout"
    assert 0 < reached < STEPS
    assert f"came at step {reached}/{STEPS}" in error["message"]
    assert '"resume_from": "latest"' in error["message"] and f"remaining {STEPS - reached} steps" in error["message"]
    assert error["details"]["resume_from"] == "latest"
    # The trainer stopped on its own, cleanly: the worker needs no refresh.
    assert interrupted["refresh_worker"] is False


def test_the_timeout_keeps_the_adapter_trained_so_far_in_storage(
    interrupted: dict[str, Any], bucket_env: dict[str, str]
) -> None:
    client = client_for_env(bucket_env)
    adapter = adapter_of(error_of(interrupted)["details"]["artifacts"], client)

    assert any(".lora_A." in name for name in adapter) and any(".lora_B." in name for name in adapter)


def test_the_timeout_keeps_a_checkpoint_at_the_step_reached_in_storage(
    interrupted: dict[str, Any], bucket_env: dict[str, str]
) -> None:
    details = error_of(interrupted)["details"]
    prefix = f"{TEST_PREFIX}/{MODEL_NAME}/checkpoints/checkpoint-{details['step']}"

    assert details["checkpoints"] == [f"s3://{bucket_env['BUCKET_NAME']}/{prefix}"]
    assert details["latest_checkpoint"] == details["checkpoints"][-1]
    assert f"{prefix}/{COMPLETE_MARKER}" in keys_in(client_for_env(bucket_env), bucket_env["BUCKET_NAME"], prefix)


def test_resuming_latest_finishes_the_job_from_the_step_reached(
    interrupted: dict[str, Any], resumed: dict[str, Any]
) -> None:
    assert resumed["metrics"]["resumed_from_step"] == error_of(interrupted)["details"]["step"]
    assert resumed["metrics"]["steps"] == STEPS


def test_the_resumed_job_ends_on_the_uninterrupted_jobs_weights(
    resumed: dict[str, Any], uninterrupted: dict[str, Any], bucket_env: dict[str, str]
) -> None:
    client = client_for_env(bucket_env)
    expected, actual = adapter_of(uninterrupted["artifacts"], client), adapter_of(resumed["artifacts"], client)
    learning_rate = request()["learning_rate"]

    assert expected.keys() == actual.keys()
    assert all(close_after_resume(expected[name], actual[name], learning_rate) for name in expected)
