"""One clock per job (issue 29, item 1): every network read of the dataset and of the validation images,
connecting, the status line and headers included, ends at the job's deadline, which they share; a job whose
deadline passes while fetching ends as `timeout` naming the stage, seconds after the deadline."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.clock import JobClock
from fluxbooth.dataset.controls import fetch_validation_images
from fluxbooth.dataset.fetch import download_dataset
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.run import run_job
from fluxbooth.messages import describe_seconds
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from tests.support.factories import make_dataset_zip, make_image, to_base64
from tests.support.header_trickler import LIMITS, HeaderTrickler
from tests.support.http_fixtures import LocalHTTPServer


def timed_refusal(function: Any, *args: Any, **kwargs: Any) -> tuple[FluxboothError, float]:
    started = time.monotonic()
    with pytest.raises(FluxboothError) as caught:
        function(*args, **kwargs)
    return caught.value, time.monotonic() - started


def test_a_server_trickling_its_headers_is_the_jobs_timeout_at_the_deadline(
    trickler: HeaderTrickler, tmp_path: Path
) -> None:
    clock = JobClock(time.monotonic(), 3.0)
    error, seconds = timed_refusal(download_dataset, trickler.url, tmp_path / "d.zip", LIMITS, clock=clock)
    assert (error.code, error.refresh_worker, error.details) == (
        ErrorCode.TIMEOUT,
        False,
        {"stage": "downloading dataset_url"},
    )
    assert error.message == (
        "the job deadline of 3 s passed while downloading dataset_url; raise timeout_seconds "
        "(or FLUXBOOTH_JOB_DEADLINE_SECONDS on the endpoint), or serve the files faster"
    )
    assert 2.9 <= seconds < 5.0


def test_a_server_trickling_its_headers_past_the_downloads_own_budget_is_invalid_dataset(
    trickler: HeaderTrickler, tmp_path: Path
) -> None:
    error, seconds = timed_refusal(download_dataset, trickler.url, tmp_path / "d.zip", LIMITS, total_timeout_seconds=2)
    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        f"dataset_url: downloading {trickler.url} took too long; the server is too slow, host the file elsewhere"
    )
    assert seconds < 4.0


def test_a_job_clock_already_used_up_refuses_before_connecting(trickler: HeaderTrickler, tmp_path: Path) -> None:
    clock = JobClock(time.monotonic() - 10, 5.0)
    error, seconds = timed_refusal(download_dataset, trickler.url, tmp_path / "d.zip", LIMITS, clock=clock)
    assert error.code is ErrorCode.TIMEOUT and seconds < 1.0


def test_the_dataset_and_the_validation_images_share_one_deadline(
    http_server: LocalHTTPServer,
    tmp_path: Path,  # noqa: F811
) -> None:
    # Each image alone is well inside its own budget; together they outlast the job's deadline.
    image = make_image("PNG", size=(64, 64))
    urls = [http_server.add(f"/v{index}.png", body=image, delay_seconds=1.5) for index in range(3)]
    request = parse_request(
        {
            "model_name": "kontext",
            "dataset": to_base64(make_dataset_zip(3)),
            "instance_prompt": "edit",
            "resolution": 64,
            "validation_prompts": ["a", "b", "c"],
            "validation_images": urls,
        }
    )
    clock = JobClock(time.monotonic(), 4.0)
    error, seconds = timed_refusal(fetch_validation_images, dataset_spec(request), tmp_path, LIMITS, clock)
    assert (error.code, error.details) == (ErrorCode.TIMEOUT, {"stage": "downloading input.validation_images[2]"})
    assert 3.9 <= seconds < 5.5


@pytest.mark.parametrize(
    ("seconds", "shown"), [(45, "45 s"), (60, "1 min"), (90, "1.5 min"), (3300, "55 min"), (5400, "1.5 h")]
)
def test_a_deadline_is_shown_in_the_unit_it_reads_best_in(seconds: float, shown: str) -> None:
    assert describe_seconds(seconds) == shown


@pytest.mark.slow
def test_a_header_trickling_dataset_url_ends_a_60_second_job_as_timeout_within_70_seconds(
    trickler: HeaderTrickler, worker_env: dict[str, str], model_cache_dir: Path
) -> None:
    ensure_tiny_model(model_cache_dir)  # built before the job's clock starts
    settings = WorkerSettings.from_environ({**worker_env, "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1"})
    job = {
        "model_name": "slow",
        "base_model": TINY_MODEL_NAME,
        "dataset_url": trickler.url,
        "instance_prompt": "sks",
        "steps": 2,
        "resolution": 64,
        "timeout_seconds": 60,
    }
    started = time.monotonic()
    result = asyncio.run(run_job(job, job_id="slow-server", settings=settings))
    seconds = time.monotonic() - started
    assert result["error"]["code"] == "timeout", result
    assert result["error"]["message"].startswith(
        "the job deadline of 1 min passed while downloading dataset_url; raise timeout_seconds"
    )
    assert result["refresh_worker"] is False
    assert 59.0 <= seconds < 70.0
