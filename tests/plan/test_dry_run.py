"""A plan-only job: `"dry_run": true` answers with the plan report the CLI's `plan --json` prints (every phase's
predicted time and memory, the deadline check) and, with FLUXBOOTH_PRICE_PER_HOUR, the predicted cost, reading
no more of the dataset than its zip's directory (tests/plan/test_dry_run_count.py) and without starting the trainer."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli import main as cli_main
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.run import run_job
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from handler import handler
from tests.support.factories import make_dataset_zip
from tests.support.http_fixtures import LocalHTTPServer

PRICE = "0.69"
# A trainer module that cannot even be imported: a job that launched it would fail.
NO_TRAINER = "tests.no_such_trainer_module"


@pytest.fixture
def dataset_server(http_server: LocalHTTPServer) -> LocalHTTPServer:  # noqa: F811 - the imported fixture
    http_server.add("/dataset.zip", body=make_dataset_zip(3), ranges=True)
    return http_server


@pytest.fixture
def quote_env(worker_env: dict[str, str], tiny_model: Path) -> dict[str, str]:  # noqa: F811
    return {
        **worker_env,
        "FLUXBOOTH_TRAINER_MODULE": NO_TRAINER,
        "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1",
        "FLUXBOOTH_MAX_IMAGES": "10",
    }


def dry_run_input(server: LocalHTTPServer, **overrides: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "dataset_url": server.url("/dataset.zip"),
        "instance_prompt": "a photo of sks dog",
        "steps": 4,
        "resolution": 64,
        "dry_run": True,
        **overrides,
    }


def run(env: dict[str, str], job_input: dict[str, Any], progress: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(env)
    sink = progress.append if progress is not None else None
    return asyncio.run(run_job(job_input, job_id="quote-1", settings=settings, progress=sink))


def test_a_dry_run_answers_with_the_plan_after_one_range_request_to_the_dataset_url(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer, tmp_path: Path
) -> None:
    progress: list[dict[str, Any]] = []
    result = run(quote_env, dry_run_input(dataset_server), progress)

    assert (result["model_name"], result["dry_run"]) == ("sks-dog", True)
    assert len(dataset_server.requests) == 1 and dataset_server.range_headers[0].startswith("bytes=-")
    assert progress == []
    assert sorted(tmp_path.joinpath("work").rglob("*")) == []


def test_a_dry_run_starts_no_trainer(quote_env: dict[str, str], dataset_server: LocalHTTPServer) -> None:
    # The worker's trainer module does not exist: a launch would end the job in trainer_failed.
    result = run(quote_env, dry_run_input(dataset_server))

    assert "error" not in result and "artifacts" not in result


def test_a_dry_run_predicts_every_phases_time_and_memory(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer
) -> None:
    result = run(quote_env, dry_run_input(dataset_server))

    phases = result["plan"]["phases"]
    assert {"loading", "caching", "training", "export"} <= set(phases)
    assert all({"seconds", "gpu_bytes", "host_bytes"} <= set(phase) for phase in phases.values())
    assert phases["training"]["seconds"] > 0 and phases["training"]["host_bytes"] > 0
    assert result["plan"]["predicted_total_seconds"] >= phases["training"]["seconds"]


def test_a_dry_run_quotes_the_default_renders_and_their_scoring(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer
) -> None:
    result = run(quote_env, dry_run_input(dataset_server))

    job, phases = result["job"], result["plan"]["phases"]
    # The three default prompts, rendered by the base model before the first step and at the end, then scored.
    assert (job["validation_prompts"], job["validation_rounds"], job["likeness"]) == (3, 2, True)
    assert phases["validation"]["seconds"] > 0 and phases["scoring"]["seconds"] > 0


def test_a_dry_run_without_validation_prompts_quotes_neither_renders_nor_scoring(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer
) -> None:
    phases = run(quote_env, dry_run_input(dataset_server, validation_prompts=[]))["plan"]["phases"]

    assert (phases["validation"]["seconds"], phases["scoring"]["seconds"]) == (0, 0)


def test_a_dry_run_checks_the_jobs_deadline(quote_env: dict[str, str], dataset_server: LocalHTTPServer) -> None:
    result = run(quote_env, dry_run_input(dataset_server, timeout_seconds=900))

    assert (result["deadline_seconds"], result["deadline_source"]) == (900, "timeout_seconds")
    assert result["plan"]["predicted_total_seconds"] < 900


def test_a_dry_run_the_deadline_refuses_is_does_not_fit_with_the_report_in_its_details(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer
) -> None:
    result = run(quote_env, dry_run_input(dataset_server, steps=100_000, timeout_seconds=60))

    assert (result["error"]["code"], result["refresh_worker"]) == ("does_not_fit", False)
    assert "beyond the job deadline" in result["error"]["message"]
    report = result["error"]["details"]["plan_report"]
    assert report["plan"] is None and report["candidates"]
    assert len(dataset_server.requests) == 1


def test_with_a_price_per_hour_a_dry_run_quotes_the_whole_jobs_cost(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer
) -> None:
    result = run({**quote_env, "FLUXBOOTH_PRICE_PER_HOUR": PRICE}, dry_run_input(dataset_server))

    seconds = result["plan"]["predicted_total_seconds"]
    assert result["cost"] == {
        "price_per_hour": 0.69,
        "predicted_seconds": round(seconds, 1),
        "predicted_cost": round(seconds / 3600 * 0.69, 4),
    }


def test_without_a_price_a_dry_run_quotes_no_cost(quote_env: dict[str, str], dataset_server: LocalHTTPServer) -> None:
    assert "cost" not in run(quote_env, dry_run_input(dataset_server))


def test_a_dry_run_holds_the_fields_of_plan_json(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer, tmp_path: Path
) -> None:
    env = {**quote_env, "FLUXBOOTH_PRICE_PER_HOUR": PRICE}
    job_input = dry_run_input(dataset_server)
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({"input": job_input}))
    out = io.StringIO()

    assert cli_main(["plan", "--json", "--request", str(request_file)], environ=env, out=out) == 0
    printed = json.loads(out.getvalue())
    answered = run(env, job_input)

    assert set(answered) - {"model_name", "dry_run"} == set(printed) - {"error"}
    assert (answered["job"], answered["model"], answered["candidates"]) == (
        printed["job"],
        printed["model"],
        printed["candidates"],
    )


def test_a_dry_run_through_the_handler_answers_the_same(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**quote_env, "FLUXBOOTH_PRICE_PER_HOUR": PRICE}.items():
        monkeypatch.setenv(name, value)

    result = asyncio.run(handler({"id": "quote-2", "input": dry_run_input(dataset_server)}))

    assert result["dry_run"] is True and result["cost"]["price_per_hour"] == 0.69
    assert result["instance_images"] == 3


# --- the fields ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_dry_run_must_be_a_json_boolean(value: object) -> None:
    raw = {
        "model_name": "sks-dog",
        "dataset_url": "https://example.com/d.zip",
        "instance_prompt": "a photo",
        "dry_run": value,
    }
    with pytest.raises(FluxboothError) as caught:
        parse_request(raw)

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == "invalid request: input.dry_run: Input should be a valid boolean"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("cheap", "is not a number"),
        ("0", "must be a price above 0, like 0.69"),
        ("-1", "must be a price above 0, like 0.69"),
        ("nan", "is not a finite number"),
        ("inf", "is not a finite number"),
    ],
)
def test_the_price_per_hour_must_be_a_price_above_zero(value: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_PRICE_PER_HOUR": value})

    assert str(caught.value) == f"environment variable FLUXBOOTH_PRICE_PER_HOUR={value!r} {reason}"


def test_a_worker_with_a_malformed_price_answers_worker_unfit_naming_the_variable(
    quote_env: dict[str, str], dataset_server: LocalHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**quote_env, "FLUXBOOTH_PRICE_PER_HOUR": "cheap"}.items():
        monkeypatch.setenv(name, value)

    result = asyncio.run(handler({"id": "quote-3", "input": dry_run_input(dataset_server)}))

    assert json.loads(result["error"])["message"] == (
        "worker settings: environment variable FLUXBOOTH_PRICE_PER_HOUR='cheap' is not a number; "
        "fix the endpoint's environment variables"
    )


def test_the_cli_plan_prints_the_cost_when_the_endpoint_sets_a_price(quote_env: dict[str, str]) -> None:
    out = io.StringIO()
    arguments = [
        "plan",
        "--base-model",
        TINY_MODEL_NAME,
        "--resolution",
        "64",
        "--steps",
        "4",
        "--instance-images",
        "3",
    ]

    assert cli_main(arguments, environ={**quote_env, "FLUXBOOTH_PRICE_PER_HOUR": PRICE}, out=out) == 0
    assert " at 0.69 per hour (FLUXBOOTH_PRICE_PER_HOUR)" in out.getvalue()
