"""The runpod SDK's shared logger, once wrapped, prints no job input, output or progress, and no URL's
query string (a presigned URL's signature); its other lines pass unchanged."""

from __future__ import annotations

from fluxbooth.runpod_log import WITHHELD, withholding, without_url_queries

PRESIGNED = "https://bucket.example/out/lora.safetensors?X-Amz-Credential=AK&X-Amz-Signature=deadbeef"


def printed_by_wrapped_logger(message: str) -> list[tuple[str, str, str | None]]:
    lines: list[tuple[str, str, str | None]] = []
    log = withholding(lambda text, level="INFO", job_id=None: lines.append((text, level, job_id)))
    log(message, "DEBUG", "job-1")
    return lines


def test_the_local_job_is_withheld() -> None:
    assert printed_by_wrapped_logger("Retrieved local job: {'input': {'dataset': 'UEsDBBQ...'}}") == [
        (f"Retrieved local job: {WITHHELD}", "DEBUG", "job-1")
    ]


def test_a_handler_output_with_a_presigned_url_is_withheld() -> None:
    assert printed_by_wrapped_logger(f"Handler output: {{'artifacts': [{{'url': '{PRESIGNED}'}}]}}") == [
        (f"Handler output: {WITHHELD}", "DEBUG", "job-1")
    ]


def test_the_result_run_job_returns_is_withheld() -> None:
    assert printed_by_wrapped_logger(f"run_job return: {{'output': {{'url': '{PRESIGNED}'}}}}") == [
        (f"run_job return: {WITHHELD}", "DEBUG", "job-1")
    ]


def test_a_job_queue_reply_the_sdk_cannot_parse_is_withheld() -> None:
    assert printed_by_wrapped_logger('rp_job | Response content is not valid JSON. b\'{"input": {"dataset"') == [
        (f"rp_job | Response content is not valid JSON. {WITHHELD}", "DEBUG", "job-1")
    ]


def test_a_progress_update_is_withheld_after_its_job_id() -> None:
    assert printed_by_wrapped_logger("job-1 | Sending Progress Update: {'stage': 'train'}") == [
        (f"job-1 | Sending Progress Update: {WITHHELD}", "DEBUG", "job-1")
    ]


def test_other_sdk_lines_pass_unchanged() -> None:
    assert printed_by_wrapped_logger("Jobs in queue: 1") == [("Jobs in queue: 1", "DEBUG", "job-1")]


def test_a_url_keeps_its_path_and_loses_its_query() -> None:
    assert without_url_queries(f'{{"url": "{PRESIGNED}", "bucket": "b"}}') == (
        '{"url": "https://bucket.example/out/lora.safetensors?[query not logged]", "bucket": "b"}'
    )
