"""handler.py: the async RunPod entry point. Cancellation stops the whole trainer tree and re-raises, every
other ending is the error contract's dict, the SDK runs one job at a time, and logs are redacted."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runpod.serverless.modules.rp_scale import JobScaler

from fluxbooth.settings import WorkerSettings
from handler import StartCheck, configure_logging, handler, one_job_at_a_time, settings_for_logging, worker_config
from tests.support.fake_trainer_jobs import files_left_under, job_input, process_is_running, trainer_lines
from tests.support.fake_trainer_module import reported_pids

CANCEL_WAIT_SECONDS = 120


@pytest.fixture
def handler_env(
    fake_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, isolated_aws_environment: None
) -> dict[str, str]:
    """`handler` reads its settings from the process environment, as on RunPod."""
    for name, value in fake_env.items():
        monkeypatch.setenv(name, value)
    return fake_env


# --- results, never exceptions ---------------------------------------------------------------------


def wire_error(result: dict[str, Any]) -> dict[str, Any]:
    """RunPod carries `error` as a string: the contract's error object, JSON-encoded."""
    return json.loads(result["error"])


def test_a_bad_request_comes_back_as_the_error_string(handler_env: dict[str, str]) -> None:
    result = asyncio.run(handler({"id": "bad-1", "input": {"colour": "blue"}}))
    assert wire_error(result)["code"] == "invalid_input"
    assert "input.colour: unknown field" in wire_error(result)["message"]
    assert result["refresh_worker"] is False


def test_a_job_without_input_is_invalid_input(handler_env: dict[str, str]) -> None:
    result = asyncio.run(handler({"id": "bad-2"}))
    assert wire_error(result)["code"] == "invalid_input"
    assert "input: expected a JSON object" in wire_error(result)["message"]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("soon", "is not a number"),
        ("1e400", "is not a finite number"),
        ("0", "must be 1 second or more"),
    ],
)
def test_a_malformed_worker_setting_is_worker_unfit_naming_it_without_a_restart(
    handler_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, raw: str, why: str
) -> None:
    monkeypatch.setenv("FLUXBOOTH_JOB_DEADLINE_SECONDS", raw)
    result = asyncio.run(handler({"id": "bad-3", "input": job_input()}))
    assert wire_error(result) == {
        "code": "worker_unfit",
        "message": f"worker settings: environment variable FLUXBOOTH_JOB_DEADLINE_SECONDS={raw!r} {why}; fix the "
        "endpoint's environment variables",
        "refresh_worker": False,
    }
    assert result["refresh_worker"] is False


def test_an_unfit_worker_answers_each_job_at_once_without_asking_for_a_restart(
    handler_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLUXBOOTH_MAX_IMAGES", "inf")
    start_check = StartCheck()
    start_check.run()
    answer = worker_config(start_check)["handler"]

    results = [asyncio.run(answer({"id": f"unfit-{n}", "input": job_input()})) for n in range(2)]

    for result in results:
        assert wire_error(result) == {
            "code": "worker_unfit",
            "message": "this worker cannot train: worker settings: environment variable FLUXBOOTH_MAX_IMAGES='inf' is "
            "not a finite number; fix the endpoint's environment variables; fix the endpoint (its image, GPU type or "
            "environment variables) and send the job again",
            "refresh_worker": False,
        }
        assert result["refresh_worker"] is False


@pytest.mark.parametrize("raw", ["inf", "1e400", "nan", "-3"])
def test_logging_settings_never_raise_on_a_setting_that_does_not_parse(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("FLUXBOOTH_JOB_DEADLINE_SECONDS", raw)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    assert settings_for_logging().secret_values == ["hf_secret_value"]


def test_a_runpod_worker_without_a_bucket_refuses_the_job_before_any_work(
    handler_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "ep-42")
    result = asyncio.run(handler({"id": "no-bucket", "input": job_input()}))
    error = wire_error(result)
    assert (error["code"], error["refresh_worker"]) == ("internal", False)
    assert error["message"].startswith("worker configuration: no bucket is configured, and this worker runs on RunPod")
    assert result["refresh_worker"] is False


@pytest.mark.slow
def test_weights_kept_on_a_runpod_workers_disk_on_purpose_come_with_a_warning(
    handler_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "ep-42")
    monkeypatch.setenv("FLUXBOOTH_ALLOW_LOCAL_OUTPUT", "1")
    result = asyncio.run(handler({"id": "kept-locally", "input": job_input()}))
    assert "error" not in result, result
    output_dir = Path(handler_env["FLUXBOOTH_OUTPUT_DIR"]).resolve()
    assert all(artifact["uri"].startswith(output_dir.as_uri()) for artifact in result["artifacts"])
    assert (
        f"the weights were written to {output_dir} on this worker's own disk, which RunPod deletes with the worker: "
        "fetch them before it scales down, or configure a bucket (BUCKET_ENDPOINT_URL) or a FLUXBOOTH_OUTPUT_DIR on "
        "the network volume" in result["warnings"]
    )


# --- cancellation ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cancelling_the_handler_kills_the_trainer_tree_removes_the_job_dir_and_reraises(
    handler_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    work_root = Path(handler_env["FLUXBOOTH_WORK_DIR"])

    async def cancel_once_the_trainer_hangs() -> dict[str, int]:
        task = asyncio.create_task(handler({"id": "cancel-me", "input": job_input("x fault:hang")}))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + CANCEL_WAIT_SECONDS
        while not (pids := reported_pids(trainer_lines(caplog))):
            assert not task.done(), f"the job ended before it hung: {task.result()}"
            assert loop.time() < give_up, "the fake trainer never reported its pids"
            await asyncio.sleep(0.1)
        assert [folder.name[:-13] for folder in work_root.iterdir()] == ["job-cancel-me"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pids

    pids = asyncio.run(cancel_once_the_trainer_hangs())
    assert set(pids) == {"launcher", "trainer", "grandchild"}
    assert [name for name, pid in pids.items() if process_is_running(pid)] == []
    assert files_left_under(work_root) == []


# --- concurrency -----------------------------------------------------------------------------------


@pytest.mark.parametrize("current", [0, 1, 2, 8, 64])
def test_the_concurrency_modifier_always_answers_one(current: int) -> None:
    assert one_job_at_a_time(current) == 1


def test_the_sdk_runs_one_job_at_a_time_with_this_worker_config(handler_env: dict[str, str]) -> None:
    jobs_to_offer = 3
    offered: list[int] = []
    results: list[dict[str, Any]] = []
    in_flight = [0]
    peak = [0]

    async def offer_jobs(session: object, jobs_needed: int) -> list[dict[str, Any]]:
        offered.append(jobs_needed)
        start = sum(offered) - jobs_needed
        return [
            {"id": f"sdk-{index}", "input": {"colour": "blue"}}
            for index in range(start, min(start + jobs_needed, jobs_to_offer))
        ]

    async def no_stop_signals(session: object) -> list[str]:
        await asyncio.sleep(0.05)  # the pace of RunPod's long poll (not a synchronisation)
        return []

    async def scenario() -> None:
        config = worker_config()
        scaler: JobScaler
        # The SDK's fetch loop asks the concurrency modifier at the start of every turn, then fetches if it has
        # room: counting those calls tells when the loop has had its chance to take a second job.
        loop_turns = [0]
        turned = asyncio.Event()

        def counted_modifier(current: int) -> int:
            loop_turns[0] += 1
            turned.set()
            return config["concurrency_modifier"](current)

        async def while_the_sdk_loop_turns(turns: int) -> None:
            target = loop_turns[0] + turns
            while loop_turns[0] < target:
                turned.clear()
                await turned.wait()

        async def run_through_the_handler(session: object, config: dict[str, Any], job: dict[str, Any]) -> None:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            # Two turns: the one under way when the job started has then decided, with this job in flight,
            # whether to fetch another.
            await asyncio.wait_for(while_the_sdk_loop_turns(2), timeout=30)
            results.append(await config["handler"](job))
            in_flight[0] -= 1
            if len(results) == jobs_to_offer:
                scaler.kill_worker()

        scaler = JobScaler(
            {
                **config,
                "concurrency_modifier": counted_modifier,
                "jobs_fetcher": offer_jobs,
                "jobs_handler": run_through_the_handler,
                "stop_signals_fetcher": no_stop_signals,
            }
        )
        await asyncio.wait_for(scaler.run(), timeout=60)

    asyncio.run(scenario())
    assert peak[0] == 1
    assert max(offered) == 1, "the SDK asked for more than one job at a time"
    assert [wire_error(result)["code"] for result in results] == ["invalid_input"] * jobs_to_offer


# --- logging ---------------------------------------------------------------------------------------


@pytest.fixture
def restored_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_worker_logging_masks_secrets_in_every_library_and_traceback(restored_root_logger: None) -> None:
    canary = "canary-bucket-key-7f3a9c"
    output = io.StringIO()
    env = {"BUCKET_ENDPOINT_URL": "https://loras.s3.us-east-1.amazonaws.com", "BUCKET_ACCESS_KEY_ID": canary}
    configure_logging(WorkerSettings.from_environ(env), output, level=logging.DEBUG)
    # botocore's DEBUG log prints the SigV4 Authorization header, which names the access key ID.
    logging.getLogger("botocore.endpoint").debug(
        "headers={'Authorization': b'AWS4-HMAC-SHA256 Credential=%s/...'}", canary
    )
    try:
        raise RuntimeError(f"failed with {canary}")
    except RuntimeError:
        logging.getLogger("fluxbooth.job.run").exception("job crashed")
    written = output.getvalue()
    assert canary not in written
    assert "Credential=[REDACTED]/" in written
    assert "RuntimeError: failed with [REDACTED]" in written
