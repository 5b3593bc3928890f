"""The tiny pipeline as a FLUX repo on a local hub that speaks the real protocol (tests/support/hub_server.py), the
worker environment that finds models only where the test puts them, and the calls the base-model tests make:
resolve a name, catch its refusal, download it, run a whole job on it.

The fixtures are registered in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.errors import FluxboothError
from fluxbooth.job.run import run_job
from fluxbooth.models.source import ResolvedModel, download_base_model, ensure_tiny_model, resolve_base_model
from fluxbooth.settings import WorkerSettings
from tests.support.factories import make_dataset_zip, to_base64
from tests.support.hub_server import HubFile, HubRepo, HubServer, folder_files, running_hub

REPO_ID = "acme/tiny-flux"
SINGLE_FILE_CHECKPOINT = "flux1-dev.safetensors"


@pytest.fixture(scope="session")
def tiny_pipeline(model_cache_dir: Path) -> Path:
    return ensure_tiny_model(model_cache_dir)


@pytest.fixture
def hub() -> Iterator[HubServer]:
    yield from running_hub()


def pipeline_repo(tiny_pipeline: Path, repo_id: str = REPO_ID, **options: Any) -> HubRepo:
    """The tiny pipeline as a FLUX repo on the hub, with the single-file checkpoint beside it at the root
    (as black-forest-labs/FLUX.1-dev carries one) and a README."""
    repo = HubRepo(repo_id, **options)
    repo.add_commit(
        folder_files(tiny_pipeline)
        + [
            HubFile(SINGLE_FILE_CHECKPOINT, b"\0" * 4096),
            HubFile("README.md", b"# tiny\n"),
        ]
    )
    return repo


@pytest.fixture
def model_env(worker_env: dict[str, str], tmp_path: Path, hub: HubServer) -> dict[str, str]:
    """Offline (worker_env sets HF_HUB_OFFLINE=1), every model place under tmp_path, the local hub as endpoint."""
    return {
        **worker_env,
        "HF_HUB_CACHE": str(tmp_path / "hf-cache" / "hub"),
        "FLUXBOOTH_RUNPOD_MODEL_CACHE": str(tmp_path / "runpod-volume" / "huggingface-cache" / "hub"),
        "FLUXBOOTH_BAKED_MODELS_DIR": str(tmp_path / "baked"),
        "HF_ENDPOINT": hub.endpoint,
    }


def online(env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**{name: value for name, value in env.items() if name != "HF_HUB_OFFLINE"}, **extra}


def resolve(env: dict[str, str], name: str | None = REPO_ID, revision: str | None = None) -> ResolvedModel:
    return resolve_base_model(name, WorkerSettings.from_environ(env), revision)


def refusal(env: dict[str, str], name: str | None = REPO_ID, revision: str | None = None) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        resolve(env, name, revision)
    return caught.value


def download(model: ResolvedModel, env: dict[str, str], deadline_seconds: float = 120.0) -> list[dict[str, Any]]:
    updates: list[dict[str, Any]] = []

    async def go() -> None:
        await download_base_model(model, env, updates.append, 0.0, time.monotonic() + deadline_seconds)

    asyncio.run(go())
    return updates


def job_input(**overrides: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-dog",
        "base_model": REPO_ID,
        "dataset": to_base64(make_dataset_zip(3)),
        "instance_prompt": "a photo of sks dog",
        "steps": 2,
        "resolution": 64,
        **overrides,
    }


def run(env: dict[str, str], raw_input: dict[str, Any], progress: list[dict[str, Any]]) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(env)
    return asyncio.run(run_job(raw_input, job_id="model-source", settings=settings, progress=progress.append))
