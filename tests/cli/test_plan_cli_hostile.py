"""`python -m fluxbooth plan` answers what it is asked: N cards priced as N, the RunPod GPU list as JSON, a long
name cut in its message, the learning check's forward passes and the base model's download in the time plan, a
request file without a dataset planned, and no negative figure anywhere in a report."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.__main__ import main
from fluxbooth.errors import FluxboothError
from fluxbooth.messages import ELLIPSIS, MAX_NAME_CHARS
from fluxbooth.plan.runpod_gpus import RUNPOD_GPUS, runpod_gpu

H100 = ["--runpod-gpu", "H100 SXM"]
SHORT_JOB = ["--steps", "100", "--deadline", "7200"]


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
    }


def plan_json(arguments: list[str], environ: dict[str, str]) -> tuple[int, Any]:
    out = io.StringIO()
    code = main(["plan", *arguments, "--json"], environ, out)
    return code, json.loads(out.getvalue())


def training_seconds(report: dict[str, Any]) -> float:
    return report["plan"]["phases"]["training"]["seconds"]


def write_request(tmp_path: Path, **fields: Any) -> str:
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"model_name": "m", "instance_prompt": "a photo of sks dog", **fields}))
    return str(path)


def test_gpus_with_a_runpod_gpu_prices_that_many_cards(cli_env: dict[str, str]) -> None:
    price_per_second = runpod_gpu("H100 SXM").price_per_second  # type: ignore[union-attr]

    code, report = plan_json([*H100, "--gpus", "2", "--cached", *SHORT_JOB], cli_env)

    assert code == 0, report["error"]
    assert len(report["hardware"]["gpus"]) == 2
    assert report["cost"]["price_per_hour"] == pytest.approx(2 * price_per_second * 3600)
    assert report["cost"]["price_source"] == f"RunPod's flex price for 2 x H100 SXM, {2 * price_per_second:g} USD/s"


def test_the_runpod_gpu_list_is_printed_as_json_with_json(cli_env: dict[str, str]) -> None:
    code, listed = plan_json(["--runpod-gpu", "list"], cli_env)

    assert code == 0
    assert [gpu["name"] for gpu in listed] == [gpu.name for gpu in RUNPOD_GPUS]
    assert listed[0] == {
        "name": "RTX A4000",
        "gpu_id": "NVIDIA RTX A4000",
        "pool": "AMPERE_16",
        "price_per_second": 0.00016,
        "assumed_host_memory_gib": 62,
        "assumed_vcpus": 8,
        "memory_gib": 16,
        "aliases": ["A4000"],
    }


@pytest.mark.parametrize("flag", ["--runpod-gpu", "--gpu-name"])
def test_an_over_long_gpu_name_is_cut_in_the_message(
    cli_env: dict[str, str], capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    hardware = (
        []
        if flag == "--runpod-gpu"
        else ["--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "62GiB", "--cpus", "8", "--disk", "100GiB"]
    )
    try:
        code = main(["plan", *hardware, flag, "x" * 100_000], cli_env, io.StringIO())
    except FluxboothError as error:
        message = error.message
    else:
        assert code != 0
        message = capsys.readouterr().err
    shown = message.split("'")[1]
    assert len(shown) == MAX_NAME_CHARS and ELLIPSIS in shown
    assert len(message) < 2000


def test_the_learning_checks_forward_passes_are_in_the_time_plan(cli_env: dict[str, str], tmp_path: Path) -> None:
    _, without = plan_json(["--request", write_request(tmp_path, steps=100), *H100, "--cached"], cli_env)
    _, checked = plan_json(
        ["--request", write_request(tmp_path, steps=100, learning_check=True), *H100, "--cached"], cli_env
    )

    seconds_per_step = without["plan"]["predicted_seconds_per_step"]
    # 24 forward passes of one sample, each about a third of a one-sample step.
    assert training_seconds(checked) - training_seconds(without) == pytest.approx(8 * seconds_per_step, rel=0.05)


def test_a_request_file_without_a_dataset_is_planned_for_the_cap(cli_env: dict[str, str], tmp_path: Path) -> None:
    code, report = plan_json(["--request", write_request(tmp_path, steps=100), *H100, "--cached"], cli_env)

    assert code == 0, report["error"]
    assert (report["instance_images"], report["instance_images_source"]) == (1000, "cap")
    assert report["instance_images_note"].startswith(
        "the request has no dataset or dataset_url; planned for the worker's cap"
    )


def test_a_request_file_without_a_dataset_is_planned_for_instance_images(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    code, report = plan_json(
        ["--request", write_request(tmp_path, steps=100), "--instance-images", "12", *H100, "--cached"], cli_env
    )

    assert code == 0, report["error"]
    assert report["instance_images"] == 12


def test_the_base_models_download_is_counted_unless_cached(cli_env: dict[str, str]) -> None:
    _, downloaded = plan_json([*H100, *SHORT_JOB], cli_env)
    _, cached = plan_json([*H100, *SHORT_JOB, "--cached"], cli_env)

    # FLUX.1 [dev]: the 11.9 B transformer and the encoders, in bf16.
    assert downloaded["base_model_download_bytes"] > 30 * 10**9
    assert downloaded["plan"]["phases"]["download"]["seconds"] == pytest.approx(
        downloaded["base_model_download_bytes"] / 100e6, rel=0.01
    )
    assert cached["base_model_download_bytes"] == 0 and cached["plan"]["phases"]["download"]["seconds"] == 0


def negative_numbers(value: Any, where: str = "") -> list[str]:
    if isinstance(value, dict):
        return [found for key, item in value.items() for found in negative_numbers(item, f"{where}.{key}")]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in negative_numbers(item, f"{where}[{index}]")]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return [f"{where} = {value}"]
    return []


@pytest.mark.parametrize(
    "arguments",
    [
        [*H100, *SHORT_JOB],
        ["--runpod-gpu", "RTX 4090", *SHORT_JOB],
        ["--runpod-gpu", "RTX 4090", "--prior-preservation", *SHORT_JOB],
        [*H100, "--training-type", "full", *SHORT_JOB],
        ["--runpod-gpu", "RTX A6000", "--training-type", "full", "--steps", "100000"],
        ["--gpus", "0", "--host-memory", "64GiB", "--cpus", "8", "--disk", "200GiB", *SHORT_JOB],
    ],
    ids=["h100-lora", "4090-lora", "4090-prior", "h100-full", "a6000-refused", "cpu"],
)
def test_no_figure_in_a_plan_or_any_candidates_breakdown_is_negative(
    cli_env: dict[str, str], arguments: list[str]
) -> None:
    _, report = plan_json(arguments, cli_env)

    assert report["candidates"], report
    assert negative_numbers(report) == []
