"""The worker image, built and run: the Dockerfile's CPU variant (TORCH_VARIANT=cpu) on a Debian bookworm base
made from Debian's packages, built with buildah (builder/cpu_image.py), and the worker run inside it: the
demo job to a result with its artifacts, the worker's start checks, NVMe offload's async_io, and a handler
process that never imports torch.

Needs root and Debian's buildah, podman and mmdebstrap; without them the tests are skipped (and say so),
except where FLUXBOOTH_REQUIRE_IMAGE=1 (CI, which installs them) makes them fail. A cold build takes many
minutes (torch, every pinned package, DeepSpeed's CPU ops compiled); buildah's layer cache and pip's download
cache make a later one on the same machine rebuild only what changed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def _load_cpu_image() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_image", REPO_ROOT / "builder" / "cpu_image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cpu_image = _load_cpu_image()
RESULT_MARK = "fluxbooth.result: result "
TORCH_PROBE = "import atexit, sys; atexit.register(lambda: print('TORCH_IMPORTED', 'torch' in sys.modules, flush=True)); "


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    problem = None
    if os.geteuid() != 0:
        problem = "building the image needs root (buildah --isolation chroot)"
    elif missing := cpu_image.missing_tools():
        problem = f"{', '.join(missing)} not installed (apt-get install buildah podman mmdebstrap)"
    if problem is not None:
        if os.environ.get("FLUXBOOTH_REQUIRE_IMAGE") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return cpu_image.build(log=tmp_path_factory.mktemp("image") / "build.log")


@pytest.fixture()
def container(image: str) -> Iterator[str]:
    with cpu_image.working_container(image) as name:
        yield name


def run_in(container: str, command: list[str], timeout: float, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cpu_image.run_command(container, command, environ), capture_output=True, text=True, timeout=timeout
    )


def logged_result(output: str) -> dict[str, object]:
    lines = [line for line in output.splitlines() if RESULT_MARK in line]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0].split(RESULT_MARK, 1)[1])


def test_the_demo_job_trains_in_the_image_to_a_result_with_its_artifacts(container: str) -> None:
    # As the image docs run it, in the image's working directory (the demo: a LoRA with a trigger word). -X importtime lists every module the handler
    # process imports (the trainer's processes are started without it).
    demo = 'python -X importtime handler.py --test_input "$(cat test_input.json)"'
    completed = run_in(container, ["sh", "-c", demo], timeout=1800)

    assert completed.returncode == 0, completed.stderr[-4000:]
    result = logged_result(completed.stdout + completed.stderr)
    assert "error" not in result
    assert result["plan"]["zero_stage"] == 2 and result["plan"]["optimizer"] == "DeepSpeedCPUAdam"
    names = [artifact["name"] for artifact in result["artifacts"]]
    assert {"lora/pytorch_lora_weights.safetensors", "lora/lora_comfyui.safetensors"} <= set(names)
    assert result["warnings"] == []
    assert all(artifact["uri"].startswith("file:///app/outputs/sks-toy-demo/") for artifact in result["artifacts"])
    assert all(len(artifact["sha256"]) == 64 and artifact["bytes"] > 0 for artifact in result["artifacts"])
    # The handler process ran the whole job and never imported torch (the trainer is a subprocess).
    imported = {line.rpartition("|")[2].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")}
    assert "runpod" in imported and "fluxbooth.job" in imported
    assert not {name for name in imported if name.split(".")[0] in {"torch", "deepspeed", "diffusers", "transformers"}}


def test_the_worker_start_checks_pass_in_the_image(container: str) -> None:
    checks = "from handler import check_worker_at_start, configure_logging, settings_for_logging; " \
        "configure_logging(settings_for_logging()); check_worker_at_start(); print('START CHECKS PASSED')"
    completed = run_in(container, ["python", "-c", checks], timeout=600)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "START CHECKS PASSED" in completed.stdout
    assert "FAIL" not in completed.stderr


def test_nvme_offload_works_in_the_image(container: str) -> None:
    # DeepSpeed decides NVMe offload by linking a probe against the unversioned libaio.so (libaio-dev).
    probe = "from deepspeed.accelerator import get_accelerator; " \
        "print('AIO', get_accelerator().create_op_builder('AsyncIOBuilder').is_compatible(verbose=False))"
    completed = run_in(container, ["python", "-c", probe], timeout=300)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "AIO True" in completed.stdout


def test_the_worker_start_runs_only_fluxboths_own_checks_and_never_imports_torch(container: str) -> None:
    # What runpod's worker loop does first (serverless/worker.py run_worker): run the registered fitness checks.
    # RUNPOD_SKIP_AUTO_SYSTEM_CHECKS in the image keeps the SDK's own checks (which import torch and open a
    # CUDA context on a GPU worker) out; the worker's start checks run the doctor in a subprocess.
    start = TORCH_PROBE + (
        "import asyncio, handler, runpod; from runpod.serverless.modules import rp_fitness; "
        "start_check = handler.StartCheck(); runpod.serverless.register_fitness_check(start_check.run); "
        "asyncio.run(rp_fitness.run_fitness_checks()); "
        "print('CHECKS', [check.__qualname__ for check in rp_fitness._fitness_checks], 'FAILED', start_check.failures)"
    )
    completed = run_in(container, ["python", "-c", start], timeout=600)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "CHECKS ['StartCheck.run'] FAILED ()" in completed.stdout
    assert "TORCH_IMPORTED False" in completed.stdout


def test_the_image_reads_heic_without_shipping_a_gpl_encoder(container: str) -> None:
    # pi-heif decodes with libheif and libde265 (LGPL); pillow-heif's wheels would also ship x265 (GPL).
    probe = (
        "import importlib.util, pathlib, site; from PIL import Image; "
        "from fluxbooth.dataset.images import register_heif_decoder; register_heif_decoder(); "
        "print('HEIF', 'HEIF' in Image.OPEN); print('PILLOW_HEIF', importlib.util.find_spec('pillow_heif') is not None); "
        "print('X265', sorted(path.name for folder in site.getsitepackages() for path in pathlib.Path(folder).rglob('libx265*')))"
    )
    completed = run_in(container, ["python", "-c", probe], timeout=300)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.split("\n")[:3] == ["HEIF True", "PILLOW_HEIF False", "X265 []"]
