"""One deadline rule on both deploy routes (issue 27, item 1): the image's and the Hub's defaults give the worker a
deadline a minute under RunPod's default execution timeout, and on every card hub.json rents, the default request is
planned within that deadline or refused, with the numbers, before anything is downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.plan import choose_plan
from fluxbooth.request.model import TrainingRequest, parse_request
from fluxbooth.request.spec import resolve_job_spec
from fluxbooth.settings import (
    DEADLINE_BELOW_EXECUTION_TIMEOUT_SECONDS,
    RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS,
    TINY_MODEL_NAME,
    WorkerSettings,
)
from fluxbooth.sizing import model_size

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())
DEMO = json.loads((REPO_ROOT / "test_input.json").read_text())["input"]
# RunPod's GPU pools (docs.runpod.io, references/gpu-types, "GPU pools"): the cards behind each pool id hub.json may
# name, with their memory, and host RAM as the CLI's tier tests give those classes (tests/cli/test_cli.py RUNPOD_TIERS;
# 141 GB H200: 250 GiB). Which outcome a card gets does not matter here, only that it comes before any download.
RUNPOD_POOLS: dict[str, list[tuple[str, int, int]]] = {
    "AMPERE_16": [
        ("NVIDIA RTX A4000", 16, 62),
        ("NVIDIA RTX A4500", 20, 62),
        ("NVIDIA RTX 4000 Ada Generation", 20, 62),
    ],
    "AMPERE_24": [("NVIDIA RTX A5000", 24, 62), ("NVIDIA L4", 24, 62), ("NVIDIA GeForce RTX 3090", 24, 62)],
    "ADA_24": [("NVIDIA GeForce RTX 4090", 24, 62)],
    "AMPERE_48": [("NVIDIA RTX A6000", 48, 94), ("NVIDIA A40", 48, 94)],
    "ADA_48_PRO": [("NVIDIA L40", 48, 94), ("NVIDIA L40S", 48, 94), ("NVIDIA RTX 6000 Ada Generation", 48, 94)],
    "AMPERE_80": [("NVIDIA A100 80GB PCIe", 80, 188), ("NVIDIA A100-SXM4-80GB", 80, 188)],
    "ADA_80_PRO": [("NVIDIA H100 PCIe", 80, 188), ("NVIDIA H100 80GB HBM3", 80, 188)],
    "HOPPER_141": [("NVIDIA H200", 141, 250)],
}


def hub_env_default(key: str) -> Any:
    return next(item["input"]["default"] for item in HUB["config"]["env"] if item["key"] == key)


def image_environment() -> dict[str, str]:
    """What the Dockerfile sets with ENV that the worker's settings read (FLUXBOOTH_*), at its build defaults."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    found = re.findall(r"\b(FLUXBOOTH_[A-Z_]+)=(\S+)", text)
    return {name: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value) for name, value in found}


ROUTES = {
    "image": WorkerSettings.from_environ(image_environment()).job_deadline_seconds,
    "hub": int(hub_env_default("FLUXBOOTH_JOB_DEADLINE_SECONDS")),
}


def hub_cards() -> list[tuple[str, int, int]]:
    pools = [pool.strip() for pool in HUB["config"]["gpuIds"].split(",") if pool.strip() and not pool.startswith("-")]
    return [card for pool in pools for card in RUNPOD_POOLS[pool]]


def default_request() -> TrainingRequest:
    """The request a new user sends: only the fields the request model requires (the demo's), the rest its defaults."""
    return parse_request({name: DEMO[name] for name in ("model_name", "dataset", "instance_prompt")})


def planned_or_refused(request: TrainingRequest, base_model: str, card: tuple[str, int, int], deadline: int) -> None:
    """The plan the worker makes before anything is downloaded (job.py's first plan, a cold worker: the whole
    pipeline still to download) fits the deadline, or the refusal carries the numbers."""
    name, gpu_gib, host_gib = card
    size = model_size(base_model)
    hardware = hypothetical_hardware(
        gpus=1,
        gpu_memory_bytes=gpu_gib * GIB,
        host_memory_bytes=host_gib * GIB,
        disk_bytes=int(HUB["config"]["containerDiskInGb"]) * 10**9,
        gpu_name=name,
    )
    # The pipeline's bf16 weights stand in for the resolved model's file list (no network in tests).
    cold = (size.transformer_params + size.encoder_params) * 2
    settings = WorkerSettings.from_environ({})
    try:
        plan = choose_plan(
            resolve_job_spec(request, size, settings),
            hardware,
            size,
            deadline_seconds=deadline,
            instance_images=settings.dataset_limits.min_images,
            download_bytes=cold,
            transfer_rates=settings.transfer_rates,
        )
    except FluxboothError as error:
        assert error.code is ErrorCode.DOES_NOT_FIT
        if "deadline" in error.message:
            assert error.details["estimated_seconds"] > deadline == error.details["deadline_seconds"]
            assert error.details["phase_seconds"]["download"] > 0
            assert (
                f"about {error.details['steps_that_fit']} steps" in error.message or error.details["steps_that_fit"] < 1
            )
        else:
            assert error.details["gpu_memory_bytes"] == gpu_gib * GIB
        return
    assert plan.predicted_total_seconds is not None and plan.predicted_total_seconds <= deadline


# ---- one rule --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
def test_each_routes_deadline_is_a_minute_under_runpods_default_execution_timeout(route: str) -> None:
    assert ROUTES[route] == RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS - DEADLINE_BELOW_EXECUTION_TIMEOUT_SECONDS == 540


def test_the_image_leaves_the_deadline_to_the_workers_default() -> None:
    assert "FLUXBOOTH_JOB_DEADLINE_SECONDS" not in image_environment()


def test_every_hub_preset_names_the_execution_timeout_its_deadline_needs() -> None:
    presets = HUB["config"]["presets"]
    assert len(presets) >= 2
    for preset in presets:
        deadline = preset["defaults"]["FLUXBOOTH_JOB_DEADLINE_SECONDS"]
        assert f"{deadline + DEADLINE_BELOW_EXECUTION_TIMEOUT_SECONDS} s" in preset["name"], preset


def test_the_hubs_default_preset_is_the_default_deadline() -> None:
    defaults = [preset["defaults"]["FLUXBOOTH_JOB_DEADLINE_SECONDS"] for preset in HUB["config"]["presets"]]
    assert defaults[0] == ROUTES["hub"]


# ---- the default request on every card -----------------------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("card", hub_cards(), ids=lambda card: card[0])
def test_the_default_request_is_planned_within_the_deadline_or_refused_with_the_numbers(
    route: str, card: tuple[str, int, int]
) -> None:
    request = default_request()
    planned_or_refused(
        request,
        request.base_model or WorkerSettings.from_environ(image_environment()).default_base_model,
        card,
        ROUTES[route],
    )


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("card", hub_cards(), ids=lambda card: card[0])
def test_the_demo_request_is_planned_within_the_deadline_or_refused_with_the_numbers(
    route: str, card: tuple[str, int, int], tiny_base: Path
) -> None:
    # test_input.json and .runpod/tests.json as they are: their base model named in the request, or the route's.
    request = parse_request(DEMO)
    base = request.base_model or WorkerSettings.from_environ(image_environment()).default_base_model
    planned_or_refused(request, str(tiny_base) if base == TINY_MODEL_NAME else base, card, ROUTES[route])
