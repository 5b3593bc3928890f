"""`python handler.py` as RunPod runs it: the runpod SDK's worker loop against a stand-in for RunPod's job queue
over real HTTP (tests/support/runpod_queue.py), and the SDK's local test mode (`--test_input`).

- Worker start: the doctor's checks run once, as the SDK's fitness check, and a worker that cannot train stays
  up and answers each job at once with `worker_unfit`, naming what failed, without `refresh_worker` (a fresh worker
  would come up just as unfit), instead of exiting and leaving the jobs queued.
- Logs: at RUNPOD_LOG_LEVEL=INFO (the image's setting) they hold no dataset bytes and no presigned URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.support.factories import make_dataset_zip, to_base64
from tests.support.fake_trainer_jobs import FAKE_TRAINER_MODULE
from tests.support.runpod_queue import RunPodQueue

START_TIMEOUT_SECONDS = 300
JOB_TIMEOUT_SECONDS = 600
UNFIT_FIX = "; fix the endpoint (its image, GPU type or environment variables) and send the job again"


def canary_job(job_id: str, **overrides: Any) -> dict[str, Any]:
    """A job whose dataset is recognisable in any log: its base64 is long and unique to this zip."""
    return {
        "id": job_id,
        "input": {
            "model_name": "sks-canary",
            "base_model": "fluxbooth/tiny-flux",
            "dataset": to_base64(make_dataset_zip(3, size=(80, 80))),
            "instance_prompt": "a photo of sks dog",
            "steps": 2,
            "resolution": 64,
            **overrides,
        },
    }


def dataset_fragment(job: dict[str, Any]) -> str:
    """200 characters from the middle of the dataset's base64: what a leak of the dataset would show."""
    dataset = job["input"]["dataset"]
    middle = len(dataset) // 2
    return dataset[middle : middle + 200]


@pytest.fixture
def worker_process_env(worker_env: dict[str, str], runpod_queue: RunPodQueue) -> dict[str, str]:  # noqa: F811
    """A serverless worker's environment, with this checkout's source first on the path."""
    return {
        **worker_env,
        **runpod_queue.worker_environment(),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
        "RUNPOD_LOG_LEVEL": "INFO",
        # The SDK's own system checks include a TCP connect to 8.8.8.8, which this machine cannot make.
        "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
    }


class Worker:
    def __init__(self, env: dict[str, str], log_path: Path, *arguments: str) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "handler.py", *arguments],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def start_worker(workers: list[Worker], env: dict[str, str], tmp_path: Path, *arguments: str) -> Worker:
    worker = Worker(env, tmp_path / f"worker-{len(workers)}.log", *arguments)
    workers.append(worker)
    return worker


# --- worker start ---------------------------------------------------------------------------------------


def test_a_worker_with_a_broken_setting_answers_its_job_worker_unfit_naming_the_setting(
    worker_process_env: dict[str, str],
    runpod_queue: RunPodQueue,
    workers: list[Worker],
    tmp_path: Path,  # noqa: F811
) -> None:
    runpod_queue.jobs.append(canary_job("answered-unfit"))
    env = {**worker_process_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "soon"}
    worker = start_worker(workers, env, tmp_path)

    result = runpod_queue.wait_for_result("answered-unfit", START_TIMEOUT_SECONDS)

    assert json.loads(result["error"]) == {
        "code": "worker_unfit",
        "message": "this worker cannot train: worker settings: environment variable FLUXBOOTH_JOB_DEADLINE_SECONDS='soon' "
        "is not a number; fix the endpoint's environment variables" + UNFIT_FIX,
        "refresh_worker": False,
    }
    assert "answers every job with worker_unfit" in worker.log


def test_a_runpod_worker_without_a_bucket_answers_its_job_worker_unfit(
    worker_process_env: dict[str, str],
    runpod_queue: RunPodQueue,
    workers: list[Worker],
    tmp_path: Path,  # noqa: F811
) -> None:
    runpod_queue.jobs.append(canary_job("answered-unfit"))
    start_worker(workers, worker_process_env, tmp_path)

    # Only the bucket fails: every other check runs first, the runtime probe (torch, DeepSpeed) included.
    result = runpod_queue.wait_for_result("answered-unfit", JOB_TIMEOUT_SECONDS)

    error = json.loads(result["error"])
    assert (error["code"], error["refresh_worker"]) == ("worker_unfit", False)
    assert "object storage: no bucket is configured, and this worker runs on RunPod" in error["message"]


# --- logs on RunPod: the SDK's worker loop -----------------------------------------------------------------


@pytest.mark.slow
def test_at_info_a_trained_jobs_logs_hold_no_presigned_url_and_no_dataset(
    worker_process_env: dict[str, str],
    runpod_queue: RunPodQueue,
    workers: list[Worker],  # noqa: F811
    s3_bucket_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,  # noqa: F811
) -> None:
    job = canary_job("trained-at-info")
    runpod_queue.jobs.append(job)
    env = {**worker_process_env, **s3_bucket_env, "FLUXBOOTH_TRAINER_MODULE": FAKE_TRAINER_MODULE}
    worker = start_worker(workers, env, tmp_path)

    result = runpod_queue.wait_for_result(job["id"], JOB_TIMEOUT_SECONDS)

    urls = [artifact["url"] for artifact in result["output"]["artifacts"]]
    assert urls and all("X-Amz-Signature=" in url for url in urls), result
    log = worker.log
    assert "All fitness checks passed." in log
    assert "X-Amz-Signature" not in log and not [url for url in urls if url.split("?")[0] in log]
    assert dataset_fragment(job) not in log
    assert "Handler output:" not in log


def test_at_debug_the_sdk_logs_no_handler_output(
    worker_process_env: dict[str, str],
    runpod_queue: RunPodQueue,
    workers: list[Worker],  # noqa: F811
    s3_bucket_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """At the SDK's default level, DEBUG, its worker loop would print each handler output (a trained job's
    presigned URLs among them); the worker withholds it (fluxbooth.runpod_log)."""
    job = canary_job("refused-at-debug", steps="many")
    runpod_queue.jobs.append(job)
    worker = start_worker(workers, {**worker_process_env, **s3_bucket_env, "RUNPOD_LOG_LEVEL": "DEBUG"}, tmp_path)

    result = runpod_queue.wait_for_result(job["id"], JOB_TIMEOUT_SECONDS)

    assert json.loads(result["error"])["code"] == "invalid_input"
    assert "Handler output: (job input, output and progress are not logged)" in worker.log
    assert "run_job return: (job input, output and progress are not logged)" in worker.log
    assert "input.steps" not in worker.log.split("Handler output:")[1].splitlines()[0]


# --- logs in the SDK's local test mode -----------------------------------------------------------------------


PRESIGNED_LOOKING_URL = (
    "https://bucket.s3.amazonaws.com/photo.png?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=canary0123456789abcdef"
)


@pytest.mark.parametrize("level", ["INFO", "DEBUG", None])
def test_local_test_mode_never_logs_the_dataset_or_a_presigned_url(
    worker_env: dict[str, str], workers: list[Worker], tmp_path: Path, level: str | None
) -> None:
    """`python handler.py --test_input ...` at any RUNPOD_LOG_LEVEL (unset: the SDK's DEBUG): the job's base64
    photos and any presigned URL in it stay out of stdout and stderr."""
    job = canary_job("local-canary", steps="many", validation_images=[PRESIGNED_LOOKING_URL])
    env = {**worker_env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    env = {**env, "RUNPOD_LOG_LEVEL": level} if level else {k: v for k, v in env.items() if k != "RUNPOD_LOG_LEVEL"}
    worker = start_worker(workers, env, tmp_path, "--test_input", json.dumps(job))
    assert worker.wait(START_TIMEOUT_SECONDS) == 1  # the job is refused: the SDK's local mode exits 1
    assert "invalid request: input.steps: Input should be a valid integer" in worker.log
    assert dataset_fragment(job) not in worker.log
    assert "X-Amz-Signature" not in worker.log and "canary0123456789abcdef" not in worker.log


def test_local_test_mode_with_a_number_id_and_a_list_input_prints_the_error_not_a_traceback(
    worker_env: dict[str, str], workers: list[Worker], tmp_path: Path
) -> None:
    env = {
        **worker_env,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
        "RUNPOD_LOG_LEVEL": "INFO",
    }
    worker = start_worker(workers, env, tmp_path, "--test_input", json.dumps({"id": 7, "input": [1, 2]}))
    assert worker.wait(START_TIMEOUT_SECONDS) == 1
    assert (
        'Job 7 failed with error: {"code": "invalid_input", "message": "input: expected a JSON object with the '
        'training fields, got list", "refresh_worker": false}'
    ) in worker.log
    assert "Traceback" not in worker.log
