"""The image, read from its Dockerfile (no Docker daemon runs here, so no image is built in tests): a
runtime CUDA base with no second copy of torch's CUDA libraries, dependencies before the source, torch's
CUDA build pinned and asserted, DeepSpeed's ops prebuilt for every GPU generation RunPod rents with
portable CPU flags and checked by ds_report, the environment the worker needs; plus the RunPod hub files
and the CI workflow that builds and pushes the image."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from fluxbooth.model_source import DEFAULT_BAKED_MODELS_DIR, DEFAULT_RUNPOD_MODEL_CACHE
from tests.conftest import REPO_ROOT


def _load_builder_module(name: str) -> ModuleType:
    """builder/ holds build scripts, not a package: load one by its path."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "builder" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verify_ds_ops = _load_builder_module("verify_ds_ops")
REQUIRED_OPS: tuple[str, ...] = verify_ds_ops.REQUIRED_OPS
installed_ops = verify_ds_ops.installed_ops
ops_not_prebuilt = verify_ds_ops.ops_not_prebuilt

RUNPOD_GPU_ARCHITECTURES = "8.0;8.6;8.9;9.0;10.0;12.0"  # Ampere (A100, A40/3090), Ada, Hopper, Blackwell
TORCH_CUDA = "12.8"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def parse_dockerfile(text: str) -> list[list[Instruction]]:
    """The Dockerfile as stages of instructions: comments dropped, continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[list[Instruction]] = [[]]
    for line in logical:
        keyword, _, arguments = line.strip().partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(arguments.split()))
        if instruction.keyword == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


@pytest.fixture(scope="module")
def stages() -> list[list[Instruction]]:
    return parse_dockerfile((REPO_ROOT / "Dockerfile").read_text())


def global_args(stages: list[list[Instruction]]) -> dict[str, str]:
    return dict(item.arguments.split("=", 1) for item in stages[0] if item.keyword == "ARG")


def base_image(stage: list[Instruction], args: dict[str, str]) -> str:
    image = stage[0].arguments.split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda match: args[match[1]], image)


def index_of(stage: list[Instruction], keyword: str, fragment: str) -> int:
    matches = [number for number, item in enumerate(stage) if item.keyword == keyword and fragment in item.arguments]
    assert len(matches) == 1, f"expected one {keyword} containing {fragment!r}, found {len(matches)}"
    return matches[0]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in stage:
        if item.keyword == "ENV":
            values.update(dict(pair.split("=", 1) for pair in shlex.split(item.arguments)))
    return values


# --- bases -------------------------------------------------------------------------------------------


def test_two_stages_a_cuda_devel_build_and_a_cuda_base_runtime(stages: list[list[Instruction]]) -> None:
    args = global_args(stages)
    build, final = stages[1], stages[2]
    assert len(stages) == 3
    assert base_image(build, args) == "nvidia/cuda:12.8.1-devel-ubuntu22.04"
    assert build[0].arguments.endswith(" AS build")
    # CUDA's `base` flavour holds only the driver shim and cudart: `runtime` would add cuBLAS, cuDNN and NCCL,
    # which torch's nvidia-* wheels already ship.
    assert base_image(final, args) == "nvidia/cuda:12.8.1-base-ubuntu22.04"


def test_the_final_image_copies_the_built_virtualenv_and_no_cuda_toolkit(stages: list[list[Instruction]]) -> None:
    final = stages[2]
    index_of(final, "COPY", "--from=build /opt/venv /opt/venv")
    installs = " ".join(item.arguments for item in final if item.keyword == "RUN")
    assert not re.search(r"\b(cuda-toolkit|cuda-libraries|libcudnn|libnccl|libcublas)", installs)


# --- torch's CUDA build --------------------------------------------------------------------------------


def requirement_lines(name: str) -> list[str]:
    return [line.strip() for line in (REPO_ROOT / name).read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_the_image_pins_torchs_cuda_build_to_requirements_release() -> None:
    cuda_lines = requirement_lines("requirements-cuda.txt")
    assert cuda_lines == ["--index-url https://download.pytorch.org/whl/cu128", "torch==2.13.0+cu128"]
    assert "torch==2.13.0" in requirement_lines("requirements.txt")


def test_requirements_txt_keeps_the_cpu_torch() -> None:
    lines = requirement_lines("requirements.txt")
    assert not [line for line in lines if "+cu" in line or line.startswith("--index-url") or "download.pytorch.org" in line]


def test_torch_is_installed_first_and_its_cuda_version_asserted(stages: list[list[Instruction]]) -> None:
    build = stages[1]
    copy_cuda = index_of(build, "COPY", "requirements-cuda.txt")
    install_cuda = index_of(build, "RUN", "pip install -r requirements-cuda.txt")
    copy_rest = index_of(build, "COPY", "requirements.txt ./")
    assert copy_cuda < install_cuda < copy_rest
    assert f"assert torch.version.cuda == '{TORCH_CUDA}'" in build[install_cuda].arguments
    install_rest = index_of(build, "RUN", "pip install -r requirements-without-deepspeed.txt")
    assert f"assert torch.version.cuda == '{TORCH_CUDA}'" in build[install_rest].arguments


# --- layer order ---------------------------------------------------------------------------------------


def test_dependencies_come_before_the_source(stages: list[list[Instruction]]) -> None:
    build, final = stages[1], stages[2]
    copied_in_build = " ".join(item.arguments for item in build if item.keyword == "COPY")
    assert "src" not in copied_in_build.split() and "handler.py" not in copied_in_build
    copy_source = index_of(final, "COPY", "src ./src")
    copy_handler = index_of(final, "COPY", "handler.py")
    copy_venv = index_of(final, "COPY", "--from=build")
    bake_model = index_of(final, "RUN", "builder/fetch_model.py")
    assert copy_venv < bake_model < copy_handler < copy_source
    assert [item.keyword for item in final[copy_source + 1 :]] == ["RUN", "CMD"], "only a smoke check after the source"


def test_the_dockerignore_keeps_the_venv_and_git_out_of_the_context() -> None:
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


# --- DeepSpeed's ops ------------------------------------------------------------------------------------


def deepspeed_install(stages: list[list[Instruction]]) -> Instruction:
    build = stages[1]
    return build[index_of(build, "RUN", "pip install --no-build-isolation")]


def build_variable_of(op_name: str) -> str:
    """The DS_BUILD_* variable DeepSpeed's own builder for `op_name` reads."""
    for module in ("fused_adam", "fused_lion", "async_io", "cpu.cpu_adam", "cpu.cpu_adagrad", "cpu.cpu_lion"):
        loaded = importlib.import_module(f"deepspeed.ops.op_builder.{module}")
        for value in vars(loaded).values():
            if isinstance(value, type) and getattr(value, "NAME", None) == op_name and hasattr(value, "BUILD_VAR"):
                return value.BUILD_VAR
    raise AssertionError(f"DeepSpeed has no builder named {op_name}")


def test_the_ops_are_built_for_ampere_ada_hopper_and_blackwell(stages: list[list[Instruction]]) -> None:
    assert env_of(stages[1])["TORCH_CUDA_ARCH_LIST"] == RUNPOD_GPU_ARCHITECTURES


@pytest.mark.parametrize("op_name", REQUIRED_OPS)
def test_every_required_op_is_prebuilt_when_deepspeed_installs(stages: list[list[Instruction]], op_name: str) -> None:
    arguments = deepspeed_install(stages).arguments.split()
    assert f"{build_variable_of(op_name)}=1" in arguments
    assert "DS_BUILD_OPS=0" in arguments and "DS_ACCELERATOR=cuda" in arguments


def test_the_op_list_has_fused_adam_and_the_offload_optimizers() -> None:
    assert {"fused_adam", "cpu_adam", "async_io"} <= set(REQUIRED_OPS)


def test_ds_report_checks_the_ops_in_the_same_layer(stages: list[list[Instruction]]) -> None:
    arguments = deepspeed_install(stages).arguments
    assert "ds_report > /tmp/ds_report.txt" in arguments
    assert "python builder/verify_ds_ops.py /tmp/ds_report.txt" in arguments


def test_no_build_step_asks_for_the_build_hosts_cpu(stages: list[list[Instruction]]) -> None:
    assert not [item for stage in stages for item in stage if "-march=native" in item.arguments]


def test_deepspeeds_cpu_ops_compile_through_the_portable_compiler(stages: list[list[Instruction]]) -> None:
    assert "CXX=/build/builder/portable-cxx" in deepspeed_install(stages).arguments.split()


# --- the portable compiler wrapper, run for real ---------------------------------------------------------


def run_portable_cxx(*arguments: str, **env: str) -> list[str]:
    completed = subprocess.run(
        [str(REPO_ROOT / "builder" / "portable-cxx"), *arguments],
        env={**os.environ, "FLUXBOOTH_REAL_CXX": "echo", **env}, capture_output=True, text=True, check=True,
    )
    return completed.stdout.split()


def test_portable_cxx_replaces_the_native_march_and_avx512() -> None:
    assert run_portable_cxx("-O3", "-march=native", "-fopenmp", "-D__AVX512__", "cpu_adam.cpp") == [
        "-O3", "-march=x86-64-v3", "-fopenmp", "-D__AVX256__", "cpu_adam.cpp"
    ]


def test_portable_cxx_passes_every_other_flag_through() -> None:
    flags = ["-O3", "-std=c++20", "-D__AVX256__", "-I/x y", "-o", "out.o"]
    assert run_portable_cxx(*flags) == ["-O3", "-std=c++20", "-D__AVX256__", "-I/x", "y", "-o", "out.o"]


def test_portable_cxx_compiles_with_gcc_for_the_portable_target(tmp_path: Path) -> None:
    source = tmp_path / "simd.cpp"
    source.write_text("#include <immintrin.h>\nint main() { __m256 x = _mm256_set1_ps(1.0f); return (int)x[0] - 1; }\n")
    subprocess.run(
        [str(REPO_ROOT / "builder" / "portable-cxx"), "-march=native", "-D__AVX512__", str(source), "-o", str(tmp_path / "a.out")],
        env={**os.environ, "FLUXBOOTH_REAL_CXX": "g++"}, check=True, capture_output=True,
    )
    assert (tmp_path / "a.out").is_file()


# --- the ds_report check, against DeepSpeed's real report ------------------------------------------------


@pytest.fixture(scope="module")
def real_ds_report() -> str:
    """ds_report of this machine's DeepSpeed, which was installed without prebuilt ops."""
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "ds_report")], capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    return completed.stdout


def test_a_deepspeed_without_prebuilt_ops_fails_the_check(real_ds_report: str) -> None:
    assert installed_ops(real_ds_report)["cpu_adam"] is False
    assert ops_not_prebuilt(real_ds_report) == list(REQUIRED_OPS)


def test_a_report_listing_every_op_installed_passes(real_ds_report: str) -> None:
    lines = [f"{op} {'.' * (23 - len(op))} \x1b[92m[YES]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m" for op in REQUIRED_OPS]
    assert ops_not_prebuilt(real_ds_report + "\n" + "\n".join(lines)) == []


# --- environment -------------------------------------------------------------------------------------------


def test_the_worker_environment(stages: list[list[Instruction]]) -> None:
    env = env_of(stages[2])
    assert env["RUNPOD_LOG_LEVEL"] == "INFO"
    assert env["HF_HUB_CACHE"] == DEFAULT_RUNPOD_MODEL_CACHE == f"{env['HF_HOME']}/hub"
    assert env["PYTHONPATH"] == "/app/src"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_a_baked_model_goes_where_the_worker_looks(stages: list[list[Instruction]]) -> None:
    final = stages[2]
    assert f"python builder/fetch_model.py \"$BASE_MODEL\" {DEFAULT_BAKED_MODELS_DIR};" in final[
        index_of(final, "RUN", "builder/fetch_model.py")
    ].arguments
    assert "--mount=type=secret,id=hf_token" in final[index_of(final, "RUN", "builder/fetch_model.py")].arguments


def test_the_image_starts_the_handler(stages: list[list[Instruction]]) -> None:
    assert stages[2][-1] == Instruction("CMD", '["python", "-u", "handler.py"]')


# --- RunPod hub and CI -------------------------------------------------------------------------------------


def test_the_hub_listing_is_a_gpu_serverless_worker_with_the_bucket_variables() -> None:
    hub = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())
    assert (hub["type"], hub["config"]["runsOn"], hub["config"]["gpuCount"]) == ("serverless", "GPU", 1)
    keys = [item["key"] for item in hub["config"]["env"]]
    assert keys[:3] == ["BUCKET_ENDPOINT_URL", "BUCKET_ACCESS_KEY_ID", "BUCKET_SECRET_ACCESS_KEY"]
    assert {"HF_TOKEN", "FLUXBOOTH_ALLOW_LOCAL_OUTPUT", "RUNPOD_LOG_LEVEL"} <= set(keys)


def test_the_hub_test_is_the_tiny_demo_job() -> None:
    tests = json.loads((REPO_ROOT / ".runpod" / "tests.json").read_text())
    demo = json.loads((REPO_ROOT / "test_input.json").read_text())["input"]
    assert [test["input"] for test in tests["tests"]] == [demo]
    # The hub's test endpoint has no bucket: it keeps the demo's weights on its disk on purpose.
    assert {"key": "FLUXBOOTH_ALLOW_LOCAL_OUTPUT", "value": "1"} in tests["config"]["env"]


def test_the_workflow_builds_the_dockerfile_and_pushes_to_ghcr() -> None:
    workflow = (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "uses: docker/build-push-action@v6" in workflow
    assert "images: ghcr.io/${{ github.repository }}" in workflow
    assert "push: ${{ github.event_name != 'pull_request' }}" in workflow
