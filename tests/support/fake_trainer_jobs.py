"""Whole jobs whose `accelerate launch` runs the fault-injecting stand-in trainer, `tests.support.fake_trainer_module`
(chosen by the job's `instance_prompt`, "... fault:crash"): the tiny model, the worker environment that launches the
stand-in, a job's input, and what a test reads back (files left behind, processes, the trainer's log lines).

The fixtures are registered in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.settings import TINY_MODEL_NAME
from tests.conftest import REPO_ROOT
from tests.support.factories import make_dataset_zip, to_base64

FAKE_TRAINER_MODULE = "tests.support.fake_trainer_module"
SEED = 1234


@pytest.fixture(scope="session")
def tiny_model(model_cache_dir: Path) -> Path:
    """Built once, before any job's clock starts: a short deadline must not pay for the build."""
    return ensure_tiny_model(model_cache_dir)


@pytest.fixture
def fake_env(worker_env: dict[str, str], tiny_model: Path) -> dict[str, str]:
    """A worker environment whose `accelerate launch` runs the fault-injecting trainer."""
    # A worker that accepts at most 10 images: the plan (made before the dataset) is sized, and its caching
    # time counted, for the most images the worker accepts, and these deadline tests allow seconds.
    return {
        **worker_env,
        "PYTHONPATH": str(REPO_ROOT),
        "FLUXBOOTH_TRAINER_MODULE": FAKE_TRAINER_MODULE,
        "FLUXBOOTH_MAX_IMAGES": "10",
    }


def job_input(prompt: str = "a photo of sks dog", **overrides: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "dataset": to_base64(make_dataset_zip(3)),
        "instance_prompt": prompt,
        "steps": 4,
        "resolution": 64,
        "seed": SEED,
        **overrides,
    }


def files_left_under(root: Path) -> list[Path]:
    return sorted(root.rglob("*")) if root.exists() else []


def process_is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def trainer_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "fluxbooth.job.supervisor"]
