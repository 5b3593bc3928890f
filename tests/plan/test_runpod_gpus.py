"""`python -m fluxbooth plan --runpod-gpu TYPE` (**contract**): every GPU type RunPod offers for serverless is a
preset that fills in the machine a worker on it gets (GPU memory, the assumed host RAM and vCPUs, the Hub's
container disk, the card's datasheet row for the time) and prices the quote at RunPod's per-second rate."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from fluxbooth.cli import main
from fluxbooth.cli.exits import EXIT_OK, EXIT_USAGE
from fluxbooth.host.hardware import GIB
from fluxbooth.plan.gpus import gpu_spec
from fluxbooth.plan.runpod_gpus import RUNPOD_CONTAINER_DISK_GB, RUNPOD_GPUS, known_names, runpod_gpu
from fluxbooth.request.limits import MAX_TIMEOUT_SECONDS
from tests.conftest import REPO_ROOT

# FLUX.1-dev's rank-16 LoRA at 512 px, with the longest deadline a request may ask for: fits every card's memory,
# so each preset shows a whole quote.
JOB = ["--base-model", "black-forest-labs/FLUX.1-dev", "--resolution", "512", "--deadline", str(MAX_TIMEOUT_SECONDS)]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
        "HF_HUB_OFFLINE": "1",
    }


def plan(env: dict[str, str], *arguments: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(["plan", *arguments], env, out), out.getvalue()


@pytest.mark.parametrize("gpu", RUNPOD_GPUS, ids=[gpu.name for gpu in RUNPOD_GPUS])
def test_each_runpod_gpu_type_plans_on_the_machine_a_worker_on_it_gets(env: dict[str, str], gpu) -> None:  # type: ignore[no-untyped-def]
    code, printed = plan(env, "--json", "--runpod-gpu", gpu.name, *JOB)
    report = json.loads(printed)

    assert code == EXIT_OK, report["error"]
    hardware = report["hardware"]
    assert [(card["name"], card["total_bytes"]) for card in hardware["gpus"]] == [
        (gpu_spec(gpu.gpu_id).name, gpu.memory_gib * GIB)  # type: ignore[union-attr]
    ]
    assert (hardware["host_available_bytes"], hardware["cpu_count"]) == (gpu.host_memory_gib * GIB, gpu.vcpus)
    assert hardware["disk_free_bytes"] == RUNPOD_CONTAINER_DISK_GB * 10**9
    assert report["runpod_gpu"]["pool"] == gpu.pool
    if gpu.price_per_second is None:
        assert "cost" not in report
    else:
        assert report["cost"]["price_per_hour"] == pytest.approx(gpu.price_per_second * 3600)
        assert report["cost"]["price_source"] == f"RunPod's flex price for {gpu.name}, {gpu.price_per_second:g} USD/s"


def test_every_preset_has_a_datasheet_row_for_its_time(env: dict[str, str]) -> None:
    assert [gpu.name for gpu in RUNPOD_GPUS if gpu_spec(gpu.gpu_id) is None] == []


@pytest.mark.parametrize("typed", ["RTX 4090", "rtx4090", "4090", "NVIDIA GeForce RTX 4090", "rtx-4090"])
def test_a_gpu_type_is_found_as_runpod_names_it_by_its_gpu_id_or_a_short_name(typed: str) -> None:
    assert runpod_gpu(typed) is not None and runpod_gpu(typed).name == "RTX 4090"  # type: ignore[union-attr]


def test_an_unknown_gpu_type_is_a_usage_error_listing_the_known_ones(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = plan(env, "--runpod-gpu", "RTX 9090", *JOB)

    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"error (invalid_input): --runpod-gpu 'RTX 9090' is no RunPod serverless GPU type the planner knows; known: "
        f"{known_names()} (--runpod-gpu list shows their numbers)\n"
    )


def test_list_prints_every_preset_with_its_numbers(env: dict[str, str]) -> None:
    code, printed = plan(env, "--runpod-gpu", "list")

    assert code == EXIT_OK
    lines = printed.splitlines()
    assert lines[0].split() == [
        "GPU",
        "type",
        "GPU",
        "ID",
        "memory",
        "host",
        "RAM*",
        "vCPUs*",
        "pool",
        "USD/s",
        "(flex)",
    ]
    assert lines[8].split()[:2] == ["RTX", "4090"] and lines[8].split()[-2:] == ["ADA_24", "0.00031"]
    assert [line[: len(gpu.name) + 1] for line, gpu in zip(lines[1:], RUNPOD_GPUS, strict=False)] == [
        gpu.name + " " for gpu in RUNPOD_GPUS
    ]
    assert lines[9].split()[-2:] == ["not", "published"]  # RTX 5090


def test_flags_given_beside_the_preset_win(env: dict[str, str]) -> None:
    _, printed = plan(env, "--json", "--runpod-gpu", "RTX 4090", "--host-memory", "120GiB", "--cpus", "24", *JOB)
    hardware = json.loads(printed)["hardware"]

    assert (hardware["host_available_bytes"], hardware["cpu_count"]) == (120 * GIB, 24)


def test_the_table_shows_the_price_it_used(env: dict[str, str]) -> None:
    _, printed = plan(env, "--runpod-gpu", "H100 SXM", *JOB)

    assert "per hour (RunPod's flex price for H100 SXM, 0.00116 USD/s)" in printed


def test_a_gpu_type_without_a_published_price_is_priced_by_the_endpoints_setting(env: dict[str, str]) -> None:
    _, printed = plan({**env, "FLUXBOOTH_PRICE_PER_HOUR": "0.9"}, "--json", "--runpod-gpu", "RTX 5090", *JOB)

    assert json.loads(printed)["cost"]["price_source"] == "FLUXBOOTH_PRICE_PER_HOUR"


def test_the_presets_container_disk_is_the_hub_deploys() -> None:
    hub = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())

    assert hub["config"]["containerDiskInGb"] == RUNPOD_CONTAINER_DISK_GB


def test_the_hub_listing_offers_only_pools_that_have_presets() -> None:
    hub = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())

    assert set(hub["config"]["gpuIds"].split(",")) <= {gpu.pool for gpu in RUNPOD_GPUS}
