"""NVMe offload through the worker: the job trains under ZeRO-3 with the optimizer and parameters offloaded
to FLUXBOOTH_NVME_PATH, in a swap folder of its own that is gone afterwards, and swap folders that killed
jobs left behind are cleared first. (That DeepSpeed really swaps is shown in tests/test_trainer.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nvme_job(
    libaio: None, tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nvme-worker")
    nvme_root = root / "nvme"
    (nvme_root / "fluxbooth-swap-killed-job" / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (nvme_root / "someone-elses-folder").mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(Path.home()),
        "FLUXBOOTH_WORK_DIR": str(root / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(root / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(model_cache_dir),
        "FLUXBOOTH_VOLUME_DIR": str(root / "no-volume"),
        "FLUXBOOTH_NVME_PATH": str(nvme_root),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
        "HF_HUB_OFFLINE": "1",
    }
    job_input = dict(
        json.loads((REPO_ROOT / "test_input.json").read_text())["input"],
        training_type="full",
        steps=2,
        zero_stage=3,
        offload="nvme",
    )
    result = asyncio.run(run_job(job_input, job_id="nvme-1", settings=WorkerSettings.from_environ(env)))
    assert "error" not in result, result
    return {"result": result, "nvme_root": nvme_root}


def test_the_job_offloads_the_optimizer_to_nvme_under_zero3(nvme_job: dict[str, Any]) -> None:
    plan, metrics = nvme_job["result"]["plan"], nvme_job["result"]["metrics"]
    assert (plan["zero_stage"], plan["offload_optimizer"]) == (3, "nvme")
    assert (metrics["zero_stage"], metrics["offload_optimizer"]) == (3, "nvme")


def test_the_job_swaps_in_a_folder_of_its_own(nvme_job: dict[str, Any]) -> None:
    swap = Path(nvme_job["result"]["plan"]["nvme_path"])
    # Named after the run's own work folder (job-<id>-<attempt>), so two runs of one job id never share it.
    assert swap.parent == nvme_job["nvme_root"]
    assert re.fullmatch(r"fluxbooth-swap-job-nvme-1-[0-9a-f]{12}", swap.name)


def test_the_jobs_swap_folder_is_removed_afterwards(nvme_job: dict[str, Any]) -> None:
    assert not Path(nvme_job["result"]["plan"]["nvme_path"]).exists()


def test_a_swap_folder_left_by_a_killed_job_is_removed_and_other_folders_are_kept(nvme_job: dict[str, Any]) -> None:
    assert sorted(path.name for path in nvme_job["nvme_root"].iterdir()) == ["someone-elses-folder"]
