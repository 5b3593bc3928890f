"""A dry run plans for the dataset actually sent: an inline zip's images are counted from its central directory,
a `dataset_url`'s from the directory fetched by at most two HTTP range requests (never the whole zip), by the
dataset stage's own rules; when the zip cannot be counted the worker's cap is used and the answer says why. The
answer names the count and its source (`instance_images`, `instance_images_source`), and a dry run and the real
job agree on whether the job fits."""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli import main as cli_main
from fluxbooth.clock import JobClock
from fluxbooth.dataset.remote_count import COUNT_STAGE, TAIL_BYTES, count_dataset, count_remote_zip
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.run import run_job
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, DatasetLimits, WorkerSettings
from tests.support.factories import dataset_members, make_dataset_zip, make_zip, to_base64
from tests.support.header_trickler import LIMITS, HeaderTrickler
from tests.support.http_fixtures import LocalHTTPServer

# A trainer module that cannot even be imported: a real job that got past every check ends at the launch.
NO_TRAINER = "tests.no_such_trainer_module"
# Random bytes (skipped by the dataset stage as not an image; deflate cannot shrink them) make the zip far larger
# than the part a dry run may read.
PADDING = ("notes.bin", random.Random(0).randbytes(2 * 1024 * 1024))


@pytest.fixture
def env(worker_env: dict[str, str], tiny_model: Path) -> dict[str, str]:  # noqa: F811
    return {**worker_env, "FLUXBOOTH_TRAINER_MODULE": NO_TRAINER, "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1"}


def job_input(**dataset: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "instance_prompt": "a photo of sks dog",
        "steps": 4,
        "resolution": 64,
        "dry_run": True,
        **dataset,
    }


def run(env: dict[str, str], job: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(run_job(job, job_id="count-1", settings=WorkerSettings.from_environ(env)))


def padded_zip(images: int = 4, extra_members: int = 0) -> bytes:
    skipped = [(f"scans/page{index}.pdf", b"%PDF") for index in range(extra_members)]
    return make_zip([*dataset_members(images), *skipped, PADDING])


# --- an inline zip --------------------------------------------------------------------------------


def test_a_dry_run_of_a_four_image_inline_zip_quotes_four_images(env: dict[str, str]) -> None:
    result = run(env, job_input(dataset=to_base64(make_dataset_zip(4))))

    assert (result["instance_images"], result["instance_images_source"]) == (4, "zip")
    assert result["job"]["instance_images"] == 4


def test_a_dry_run_counts_only_what_the_dataset_stage_takes_as_instance_images(env: dict[str, str]) -> None:
    members = [
        *dataset_members(4, captions=True, class_images=2),
        ("__MACOSX/._photo0.png", b"\x00\x05\x16\x07"),
        (".DS_Store", b"\x00"),
        ("readme.pdf", b"%PDF"),
    ]
    result = run(env, job_input(dataset=to_base64(make_zip(members))))

    assert (result["instance_images"], result["instance_images_source"]) == (4, "zip")


def test_a_dry_run_refuses_a_zip_with_too_few_images_as_the_job_would(env: dict[str, str]) -> None:
    result = run(env, job_input(dataset=to_base64(make_dataset_zip(1))))

    assert (result["error"]["code"], result["refresh_worker"]) == ("invalid_dataset", False)
    assert result["error"]["message"] == "dataset: found 1 instance image(s); at least 3 are needed. Add more photos"


def real_and_dry(env: dict[str, str], **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same job's answers as a real job and as a dry run."""
    real = asyncio.run(
        run_job({**job_input(**fields), "dry_run": False}, job_id="real-1", settings=WorkerSettings.from_environ(env))
    )
    return real, run(env, job_input(**fields))


def test_a_dry_run_of_an_inline_file_that_is_not_a_zip_is_refused_as_the_job_refuses_it(env: dict[str, str]) -> None:
    real, dry = real_and_dry(env, dataset=to_base64(b"GIF89a not a zip"))

    assert (
        dry["error"]
        == real["error"]
        == {
            "code": "invalid_dataset",
            "message": "dataset: the upload is not a zip archive; put the images in a .zip",
        }
    )


def test_a_dry_run_refuses_members_declaring_more_than_the_limits_as_the_job_does(env: dict[str, str]) -> None:
    real, dry = real_and_dry({**env, "FLUXBOOTH_MAX_EXPANDED_BYTES": "1000"}, dataset=to_base64(make_dataset_zip(4)))

    assert dry["error"] == real["error"]
    assert dry["error"]["code"] == "invalid_dataset"
    assert dry["error"]["message"].startswith("dataset: the archive declares ")
    assert "over the 1000 B cap (FLUXBOOTH_MAX_EXPANDED_BYTES)" in dry["error"]["message"]


def test_a_dry_run_refuses_a_resume_from_that_finds_nothing_as_the_job_does(env: dict[str, str]) -> None:
    missing = f"file://{Path(env['FLUXBOOTH_OUTPUT_DIR']).resolve()}/sks-dog/checkpoints/checkpoint-40"
    real, dry = real_and_dry(env, dataset=to_base64(make_dataset_zip(4)), resume_from=missing)

    assert dry["error"] == real["error"]
    assert dry["error"]["code"] == "invalid_input"
    assert dry["error"]["message"].startswith(f"input.resume_from: {missing} is not a complete checkpoint")


def test_a_dry_run_resuming_from_latest_with_nothing_stored_says_so_as_the_job_does(env: dict[str, str]) -> None:
    dry = run(env, job_input(dataset=to_base64(make_dataset_zip(4)), resume_from="latest"))

    assert any(warning.startswith("resume_from 'latest': no complete checkpoint under ") for warning in dry["warnings"])


# --- a dataset_url ------------------------------------------------------------------------------------


def test_a_dry_run_of_a_dataset_url_reads_only_the_zips_last_bytes_in_one_range_request(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    zip_bytes = padded_zip(4)
    http_server.add("/photos.zip", body=zip_bytes, ranges=True)

    result = run(env, job_input(dataset_url=http_server.url("/photos.zip")))

    assert (result["instance_images"], result["instance_images_source"]) == (4, "url")
    assert http_server.range_headers == [f"bytes=-{TAIL_BYTES}"]
    assert http_server.bytes_sent == TAIL_BYTES < len(zip_bytes)


def test_a_dry_run_fetches_a_directory_longer_than_the_tail_with_a_second_range_request(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    zip_bytes = padded_zip(4, extra_members=3000)
    http_server.add("/photos.zip", body=zip_bytes, ranges=True)

    result = run(env, job_input(dataset_url=http_server.url("/photos.zip")))

    assert (result["instance_images"], result["instance_images_source"]) == (4, "url")
    assert len(http_server.requests) == 2
    assert http_server.range_headers[0] == f"bytes=-{TAIL_BYTES}"
    assert http_server.range_headers[1].startswith("bytes=") and not http_server.range_headers[1].startswith("bytes=-")
    assert http_server.bytes_sent < len(zip_bytes) - len(PADDING[1])


def test_a_dry_run_follows_a_redirect_once_and_asks_the_final_url_for_the_rest(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    http_server.add("/photos.zip", body=padded_zip(4, extra_members=3000), ranges=True)
    http_server.add("/link", status=302, redirect_to=http_server.url("/photos.zip"))

    result = run(env, job_input(dataset_url=http_server.url("/link")))

    assert result["instance_images"] == 4
    assert http_server.requests == ["/link", "/photos.zip", "/photos.zip"]


def test_a_zip64_directory_is_found_through_its_zip64_end_record(http_server: LocalHTTPServer) -> None:  # noqa: F811
    # Over 65,535 members: the end record says 0xFFFF and the zip64 record before it holds the real numbers.
    zip_bytes = make_zip([*dataset_members(4), *((f"scans/{index}.pdf", b"") for index in range(65_536))])
    http_server.add("/photos.zip", body=zip_bytes, ranges=True)

    count = count_remote_zip(http_server.url("/photos.zip"), DatasetLimits(max_members=70_000, allow_private_urls=True))

    assert count == 4
    assert len(http_server.requests) == 2


def test_a_server_that_ignores_ranges_gets_the_cap_and_the_answer_says_so(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    http_server.add("/photos.zip", body=padded_zip(4))
    url = http_server.url("/photos.zip")

    result = run({**env, "FLUXBOOTH_MAX_IMAGES": "10"}, job_input(dataset_url=url))

    assert (result["instance_images"], result["instance_images_source"]) == (10, "cap")
    assert len(http_server.requests) == 1
    assert result["instance_images_note"] == (
        f"the dataset's images were not counted (http://127.0.0.1:{http_server.port}/photos.zip ignores range "
        "requests); planned for the worker's cap of 10 (FLUXBOOTH_MAX_IMAGES)"
    )


def test_a_dataset_url_that_answers_404_is_refused_as_the_download_would_refuse_it(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    result = run(env, job_input(dataset_url=http_server.url("/gone.zip")))

    assert result["error"]["code"] == "invalid_dataset"
    assert result["error"]["message"] == (
        f"dataset_url: the server answered 404 Not Found for http://127.0.0.1:{http_server.port}/gone.zip: nothing at that "
        "address; check the URL (presigned URLs expire)"
    )


def test_a_zip_over_the_download_cap_is_refused_as_the_download_would_refuse_it(
    env: dict[str, str],
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    http_server.add("/photos.zip", body=padded_zip(4), ranges=True)

    result = run(
        {**env, "FLUXBOOTH_MAX_DOWNLOAD_BYTES": str(1024 * 1024)}, job_input(dataset_url=http_server.url("/photos.zip"))
    )

    assert result["error"]["code"] == "invalid_dataset"
    assert result["error"]["message"].startswith(
        f"dataset_url: http://127.0.0.1:{http_server.port}/photos.zip is 2.0 MiB"
    )
    assert result["error"]["message"].endswith("over the 1.0 MiB download cap; use a smaller dataset")


def test_a_private_dataset_url_is_refused_before_any_request_as_the_download_refuses_it(
    worker_env: dict[str, str],
    tiny_model: Path,
    http_server: LocalHTTPServer,  # noqa: F811
) -> None:
    http_server.add("/photos.zip", body=padded_zip(4), ranges=True)

    result = run(worker_env, job_input(dataset_url=http_server.url("/photos.zip")))

    assert result["error"]["code"] == "invalid_input"
    assert "resolves to 127.0.0.1, a loopback address" in result["error"]["message"]
    assert http_server.requests == []


# --- the dry run and the real job agree (issue 29, item 6) ------------------------------------------------


def test_a_four_photo_job_at_60_s_that_the_worker_accepts_is_not_refused_by_its_dry_run(env: dict[str, str]) -> None:
    # Planned for the default cap of 1,000 images, this job's caching alone overran 60 s on this CPU.
    job = job_input(dataset=to_base64(make_dataset_zip(4)), timeout_seconds=60)

    quote = run(env, job)
    real = run(env, {**job, "dry_run": False})

    assert "error" not in quote and quote["plan"]["predicted_total_seconds"] < 60
    # The real job passed every plan check and ended at the launch of the (missing) trainer.
    assert real["error"]["code"] == "trainer_failed"


# --- the CLI ------------------------------------------------------------------------------------------


def plan_json(
    env: dict[str, str], tmp_path: Path, *arguments: str, request: dict[str, Any] | None = None
) -> dict[str, Any]:
    if request is not None:
        (tmp_path / "request.json").write_text(json.dumps({"input": request}))
        arguments = (*arguments, "--request", str(tmp_path / "request.json"))
    out = io.StringIO()
    cli_main(["plan", "--json", *arguments], environ=env, out=out)
    return json.loads(out.getvalue())


def test_plan_counts_the_request_files_inline_zip(env: dict[str, str], tmp_path: Path) -> None:
    report = plan_json(env, tmp_path, request=job_input(dataset=to_base64(make_dataset_zip(5))))

    assert (report["instance_images"], report["instance_images_source"]) == (5, "zip")


def test_plan_plans_a_request_files_placeholder_dataset_for_the_cap_and_says_why(
    env: dict[str, str], tmp_path: Path
) -> None:
    report = plan_json(
        {**env, "FLUXBOOTH_MAX_IMAGES": "10"}, tmp_path, request=job_input(dataset="base64_encoded_dataset_zip")
    )

    assert (report["instance_images"], report["instance_images_source"]) == (10, "cap")
    assert report["instance_images_note"].startswith(
        "the request's dataset was not counted (input.dataset: is not valid base64"
    )
    assert report["instance_images_note"].endswith("planned for the worker's cap of 10 (FLUXBOOTH_MAX_IMAGES)")


def test_plan_without_a_request_file_plans_for_the_cap(env: dict[str, str], tmp_path: Path) -> None:
    report = plan_json(
        {**env, "FLUXBOOTH_MAX_IMAGES": "10"}, tmp_path, "--base-model", TINY_MODEL_NAME, "--resolution", "64"
    )

    assert (report["instance_images"], report["instance_images_source"]) == (10, "cap")


def test_plans_instance_images_flag_overrides_the_count(env: dict[str, str], tmp_path: Path) -> None:
    request = job_input(dataset=to_base64(make_dataset_zip(5)))
    report = plan_json(env, tmp_path, "--instance-images", "3", request=request)

    assert (report["instance_images"], report["instance_images_source"]) == (3, "--instance-images")


# --- the count's requests end by its budget and the job's clock (issue 37, item 8) --------------------------


def test_a_server_trickling_its_headers_to_a_dry_run_is_the_jobs_timeout_at_the_deadline(
    trickler: HeaderTrickler,
) -> None:
    started = time.monotonic()
    with pytest.raises(FluxboothError) as caught:
        count_remote_zip(trickler.url, LIMITS, JobClock(started, 3.0))

    assert time.monotonic() - started < 5.0
    assert (caught.value.code, caught.value.details) == (ErrorCode.TIMEOUT, {"stage": COUNT_STAGE})
    assert caught.value.message.startswith(f"the job deadline of 3 s passed while {COUNT_STAGE}; ")


def test_a_server_trickling_its_headers_past_the_counts_budget_gets_the_cap_naming_that_budget(
    trickler: HeaderTrickler,
) -> None:
    request = parse_request(job_input(dataset_url=trickler.url))
    # One byte a second: no read waits the 2 s idle timeout, and the headers never end.
    limits = DatasetLimits(allow_private_urls=True, download_timeout_seconds=2, max_images=10)
    started = time.monotonic()

    count = count_dataset(dataset_spec(request), limits, JobClock(started, 600.0))

    assert time.monotonic() - started < 6.0
    assert (count.instance_images, count.source) == (10, "cap")
    assert count.note == (
        f"the dataset's images were not counted ({trickler.url} did not send what a dry run asks for within its "
        "4 s (2 x FLUXBOOTH_DOWNLOAD_TIMEOUT_SECONDS)); planned for the worker's cap of 10 (FLUXBOOTH_MAX_IMAGES)"
    )
