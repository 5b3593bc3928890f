"""The image, read from its Dockerfile (tests/test_image.py builds its CPU variant and runs it): build
arguments for both bases and the torch variant, a runtime base with no second copy of torch's CUDA
libraries, dependencies before the source, torch pinned per variant to builds that exist, DeepSpeed's ops
prebuilt with portable CPU flags and checked by ds_report, the environment the worker needs; plus the RunPod
hub files and the CI workflow that builds and pushes the image."""

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
image_checks = _load_builder_module("image_checks")
REQUIRED_OPS: dict[str, dict[str, str]] = verify_ds_ops.REQUIRED_OPS
installed_ops = verify_ds_ops.installed_ops
ops_not_prebuilt = verify_ds_ops.ops_not_prebuilt
CUDA_PINS = json.loads((REPO_ROOT / "builder" / "cuda_pins.json").read_text())

RUNPOD_GPU_ARCHITECTURES = "8.0;8.6;8.9;9.0;10.0;12.0"  # Ampere (A100, A40/3090), Ada, Hopper, Blackwell
# RunPod's execution timeout when an endpoint does not set one, which is what a RunPod Hub deploy gets (the
# Hub's hub.json has no timeout field): "The default is 600 seconds (10 minutes)", docs.runpod.io,
# serverless/endpoints/endpoint-configurations, "Execution timeout".
RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS = 600


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


# --- build arguments and bases -----------------------------------------------------------------------------


def stage_args(stage: list[Instruction]) -> dict[str, str]:
    return dict(item.arguments.split("=", 1) for item in stage if item.keyword == "ARG" and "=" in item.arguments)


def test_the_bases_are_build_arguments_defaulting_to_cuda_13s_devel_and_base_images(
    stages: list[list[Instruction]],
) -> None:
    args = global_args(stages)
    assert args == {
        "BUILD_BASE": "nvidia/cuda:13.0.2-devel-ubuntu24.04",
        "RUNTIME_BASE": "nvidia/cuda:13.0.2-base-ubuntu24.04",
    }
    assert len(stages) == 3
    assert stages[1][0].arguments == "${BUILD_BASE} AS build"
    # CUDA's `base` flavour holds only the driver shim and cudart: `runtime` would add cuBLAS, cuDNN and NCCL,
    # which torch's nvidia-* wheels already ship.
    assert stages[2][0].arguments == "${RUNTIME_BASE}"


def test_the_torch_variant_is_a_build_argument_defaulting_to_cuda(stages: list[list[Instruction]]) -> None:
    assert stage_args(stages[1])["TORCH_VARIANT"] == "cuda"
    assert image_checks.VARIANTS == ("cuda", "cpu")


def test_the_default_bases_and_torch_are_listed_as_published(stages: list[list[Instruction]]) -> None:
    published = {f"nvidia/cuda:{tag}" for tag in CUDA_PINS["images"]["nvidia/cuda"]}
    assert set(global_args(stages).values()) <= published


def test_nvcc_and_torch_are_the_same_cuda_release(stages: list[list[Instruction]]) -> None:
    build_base = global_args(stages)["BUILD_BASE"]
    torch_pin = image_checks.pinned_torch((REPO_ROOT / "requirements-torch-cuda.txt").read_text())
    cuda = image_checks.cuda_version_of_label(torch_pin.partition("+")[2])
    assert build_base.split(":")[1].startswith(f"{cuda}.")


def test_python_comes_from_the_bases_own_distribution(stages: list[list[Instruction]]) -> None:
    # No third-party archive (deadsnakes needs Launchpad and software-properties-common): any Debian or
    # Ubuntu base with apt works, Debian 12 giving Python 3.11 and Ubuntu 24.04 Python 3.12.
    for stage in stages[1:]:
        install = stage[index_of(stage, "RUN", "apt-get install")].arguments
        assert " python3 " in f"{install} " and "add-apt-repository" not in install


def test_the_final_image_copies_the_built_virtualenv_and_no_cuda_toolkit(stages: list[list[Instruction]]) -> None:
    final = stages[2]
    index_of(final, "COPY", "--from=build /opt/venv /opt/venv")
    installs = " ".join(item.arguments for item in final if item.keyword == "RUN")
    assert not re.search(r"\b(cuda-toolkit|cuda-libraries|libcudnn|libnccl|libcublas)", installs)


# --- torch, pinned per variant --------------------------------------------------------------------------------


def requirement_lines(name: str) -> list[str]:
    return [line.strip() for line in (REPO_ROOT / name).read_text().splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize(("variant", "index", "pin"), [
    ("cuda", "https://download.pytorch.org/whl/cu130", "torch==2.13.0+cu130"),
    ("cpu", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"),
])
def test_each_variant_pins_torchs_build_of_requirements_release(variant: str, index: str, pin: str) -> None:
    assert requirement_lines(f"requirements-torch-{variant}.txt")[:2] == [f"--extra-index-url {index}", pin]
    assert "torch==2.13.0" in requirement_lines("requirements.txt")


def test_the_cuda_variant_pins_what_deepspeed_adds_on_cuda() -> None:
    # DeepSpeed's setup.py requires nvidia-ml-py when it builds for CUDA; unpinned, pip would take the newest.
    assert requirement_lines("requirements-torch-cuda.txt")[2:] == ["nvidia-ml-py==13.580.126"]


def test_the_cuda_torch_pin_is_published_on_its_index_for_the_images_python() -> None:
    index, pin = requirement_lines("requirements-torch-cuda.txt")[:2]
    version = pin.removeprefix("torch==")
    wheels = CUDA_PINS["indexes"][index.removeprefix("--extra-index-url ")]["torch"][version]
    python = CUDA_PINS["python"]["ubuntu24.04"].replace(".", "")
    assert f"torch-{version}-cp{python}-cp{python}-manylinux_2_28_x86_64.whl" in wheels


def test_the_image_docs_name_the_cuda_pins_and_their_index() -> None:
    readme = (REPO_ROOT / "docs" / "image.md").read_text()
    index, pin = requirement_lines("requirements-torch-cuda.txt")[:2]
    assert index.removeprefix("--extra-index-url ") in readme and f"`{pin.removeprefix('torch==')}`" in readme
    for tag in CUDA_PINS["images"]["nvidia/cuda"]:
        assert f"nvidia/cuda:{tag}" in readme


def test_requirements_txt_keeps_the_cpu_torch() -> None:
    lines = requirement_lines("requirements.txt")
    assert not [line for line in lines if "+cu" in line or line.startswith("--index-url") or "download.pytorch.org" in line]


def test_torch_is_installed_first_and_checked_against_its_pin(stages: list[list[Instruction]]) -> None:
    build = stages[1]
    copy_torch = index_of(build, "COPY", "requirements-torch-cuda.txt requirements-torch-cpu.txt")
    install_torch = index_of(build, "RUN", 'pip install -r "requirements-torch-$TORCH_VARIANT.txt"')
    copy_deepspeed = index_of(build, "COPY", "requirements-deepspeed.txt ./")
    assert copy_torch < install_torch < copy_deepspeed
    assert 'python builder/image_checks.py torch "$TORCH_VARIANT"' in build[install_torch].arguments
    install_rest = index_of(build, "RUN", "pip install -r requirements-image.txt")
    assert 'python builder/image_checks.py torch "$TORCH_VARIANT"' in build[install_rest].arguments


def test_the_build_stage_installs_no_editable_project(stages: list[list[Instruction]], tmp_path: Path) -> None:
    # requirements.txt ends with `-e .` for the README's commands; the build stage has no project to install
    # (the source is copied last, into the final stage), so pip would stop there.
    build = stages[1]
    step = build[index_of(build, "RUN", "pip install -r requirements-image.txt")].arguments
    filtering = re.search(r"(grep .*? > requirements-image\.txt)", step)
    assert filtering is not None
    (tmp_path / "requirements.txt").write_text((REPO_ROOT / "requirements.txt").read_text())
    subprocess.run(["sh", "-c", filtering[1]], cwd=tmp_path, check=True)
    installed = (tmp_path / "requirements-image.txt").read_text().splitlines()
    assert "-e ." in requirement_lines("requirements.txt")
    assert not [line for line in installed if line.startswith("-e")]
    assert "accelerate==1.15.0" in installed and "-r requirements-deepspeed.txt" in installed


def test_deepspeed_and_its_pins_are_installed_before_the_other_dependencies(stages: list[list[Instruction]]) -> None:
    build = stages[1]
    copy_deepspeed = index_of(build, "COPY", "requirements-deepspeed.txt ./")
    install_deepspeed = index_of(build, "RUN", "pip install --no-build-isolation --no-deps")
    copy_rest = index_of(build, "COPY", "requirements.txt ./")
    assert copy_deepspeed < install_deepspeed < copy_rest
    assert "-r requirements-deepspeed.txt" in requirement_lines("requirements.txt")
    assert not [line for line in requirement_lines("requirements.txt") if line.startswith("deepspeed==")]


@pytest.mark.parametrize("arguments", [["variant", "rocm"], ["torch", "gpu"]])
def test_an_unknown_torch_variant_stops_the_build(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert image_checks.main(arguments, REPO_ROOT) == 1
    assert f"TORCH_VARIANT must be one of cuda, cpu, not {arguments[1]!r}" in capsys.readouterr().err


def test_the_torch_check_accepts_the_pinned_cuda_build() -> None:
    architectures = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]
    assert image_checks.torch_problems("2.13.0+cu130", "2.13.0+cu130", "13.0", architectures) == []


def test_the_torch_check_refuses_another_build() -> None:
    assert image_checks.torch_problems("2.13.0+cu130", "2.13.0+cu126", "12.6", ["sm_80"]) == [
        "torch 2.13.0+cu126 is installed, the pin is 2.13.0+cu130",
        "torch's CUDA is 12.6, expected 13.0",
        "torch has no kernels for sm_86, sm_89, sm_90, sm_100, sm_120 (has sm_80)",
    ]


def test_the_torch_check_accepts_the_cpu_build_only_without_cuda() -> None:
    assert image_checks.torch_problems("2.13.0+cpu", "2.13.0+cpu", None, []) == []
    assert image_checks.torch_problems("2.13.0+cpu", "2.13.0+cu130", "13.0", []) == [
        "torch 2.13.0+cu130 is installed, the pin is 2.13.0+cpu",
        "torch's CUDA is 13.0, expected None",
    ]


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


def test_a_baked_model_is_fetched_with_the_files_the_worker_downloads() -> None:
    from fluxbooth.model_source import PIPELINE_FILE_PATTERNS

    assert sorted(_load_builder_module("fetch_model").COMPONENT_PATTERNS) == sorted(PIPELINE_FILE_PATTERNS)


def test_pips_downloads_stay_in_a_build_cache_not_in_a_layer(stages: list[list[Instruction]]) -> None:
    installs = [item.arguments for item in stages[1] if item.keyword == "RUN" and "pip install" in item.arguments]
    assert len(installs) == 3
    assert all(step.startswith("--mount=type=cache,target=/root/.cache/pip ") for step in installs)


def test_the_dockerignore_keeps_the_venv_and_git_out_of_the_context() -> None:
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


# --- DeepSpeed's ops ------------------------------------------------------------------------------------


def deepspeed_install(stages: list[list[Instruction]]) -> Instruction:
    build = stages[1]
    return build[index_of(build, "RUN", "pip install --no-build-isolation")]


def build_variable_of(op_name: str) -> str:
    """The DS_BUILD_* variable DeepSpeed's own builder for `op_name` reads."""
    modules = ("fused_adam", "fused_lion", "async_io", "cpu.cpu_adam", "cpu.cpu_adagrad", "cpu.cpu_lion", "cpu.comm")
    for module in modules:
        loaded = importlib.import_module(f"deepspeed.ops.op_builder.{module}")
        for value in vars(loaded).values():
            if isinstance(value, type) and getattr(value, "NAME", None) == op_name and hasattr(value, "BUILD_VAR"):
                return value.BUILD_VAR
    raise AssertionError(f"DeepSpeed has no builder named {op_name}")


def test_the_ops_are_built_for_ampere_ada_hopper_and_blackwell(stages: list[list[Instruction]]) -> None:
    assert env_of(stages[1])["TORCH_CUDA_ARCH_LIST"] == RUNPOD_GPU_ARCHITECTURES
    # The same generations the build's torch check asks torch's own kernels for.
    assert [f"sm_{arch.replace('.', '')}" for arch in RUNPOD_GPU_ARCHITECTURES.split(";")] == list(
        image_checks.RUNPOD_GPU_ARCHITECTURES
    )


@pytest.mark.parametrize(("variant", "op_name"), [(v, op) for v, ops in REQUIRED_OPS.items() for op in ops])
def test_each_required_op_is_named_by_deepspeeds_own_build_variable(variant: str, op_name: str) -> None:
    assert REQUIRED_OPS[variant][op_name] == build_variable_of(op_name)


def test_the_cuda_variant_builds_the_fused_gpu_and_the_offload_optimizers() -> None:
    assert verify_ds_ops.build_env("cuda") == [
        "DS_ACCELERATOR=cuda", "DS_BUILD_OPS=0", "DS_BUILD_FUSED_ADAM=1", "DS_BUILD_FUSED_LION=1",
        "DS_BUILD_CPU_ADAM=1", "DS_BUILD_CPU_ADAGRAD=1", "DS_BUILD_CPU_LION=1", "DS_BUILD_AIO=1",
    ]


def test_the_cpu_variant_builds_no_cuda_op() -> None:
    assert verify_ds_ops.build_env("cpu") == [
        "DS_ACCELERATOR=cpu", "DS_BUILD_OPS=0", "DS_BUILD_CPU_ADAM=1", "DS_BUILD_CPU_ADAGRAD=1",
        "DS_BUILD_CPU_LION=1", "DS_BUILD_AIO=1", "DS_BUILD_SHM_COMM=1",
    ]


def test_deepspeed_installs_with_the_variants_build_variables(stages: list[list[Instruction]]) -> None:
    assert (
        'env $(python builder/verify_ds_ops.py build-env "$TORCH_VARIANT") CXX=/build/builder/portable-cxx MAX_JOBS=4 '
        "pip install --no-build-isolation --no-deps"
    ) in deepspeed_install(stages).arguments


def test_ds_report_checks_the_ops_in_the_same_layer(stages: list[list[Instruction]]) -> None:
    arguments = deepspeed_install(stages).arguments
    assert "ds_report > /tmp/ds_report.txt" in arguments
    assert 'python builder/verify_ds_ops.py check "$TORCH_VARIANT" /tmp/ds_report.txt' in arguments


def test_no_build_step_asks_for_the_build_hosts_cpu(stages: list[list[Instruction]]) -> None:
    assert not [item for stage in stages for item in stage if "-march=native" in item.arguments]


def test_deepspeeds_cpu_ops_compile_through_the_portable_compiler(stages: list[list[Instruction]]) -> None:
    assert "CXX=/build/builder/portable-cxx" in deepspeed_install(stages).arguments.split()


def test_the_runtime_has_what_nvme_offload_links_against(stages: list[list[Instruction]]) -> None:
    # AsyncIOBuilder.is_compatible() compiles and links a probe with -laio: the unversioned libaio.so of
    # libaio-dev (libaio1 alone has only libaio.so.1), and a compiler.
    final = stages[2]
    packages = final[index_of(final, "RUN", "apt-get install")].arguments.split()
    assert {"libaio-dev", "gcc", "libc6-dev"} <= set(packages)


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
    required = tuple(REQUIRED_OPS["cpu"])
    assert installed_ops(real_ds_report)["cpu_adam"] is False
    assert ops_not_prebuilt(real_ds_report, required) == list(required)


def test_a_report_listing_every_op_installed_passes(real_ds_report: str) -> None:
    required = tuple(REQUIRED_OPS["cpu"])
    lines = [f"{op} {'.' * (23 - len(op))} \x1b[92m[YES]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m" for op in required]
    assert ops_not_prebuilt(real_ds_report + "\n" + "\n".join(lines), required) == []


# --- environment -------------------------------------------------------------------------------------------


def test_the_worker_environment(stages: list[list[Instruction]]) -> None:
    env = env_of(stages[2])
    assert env["RUNPOD_LOG_LEVEL"] == "INFO"
    assert env["HF_HUB_CACHE"] == DEFAULT_RUNPOD_MODEL_CACHE == f"{env['HF_HOME']}/hub"
    assert env["PYTHONPATH"] == "/app/src"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_runpods_automatic_system_checks_are_off_so_the_handler_never_imports_torch(
    stages: list[list[Instruction]],
) -> None:
    # runpod 1.12's automatic checks (rp_system_fitness) import torch and open a CUDA context in the handler
    # process on a GPU worker, for the worker's whole life; the worker's own start checks run in a subprocess.
    assert env_of(stages[2])["RUNPOD_SKIP_AUTO_SYSTEM_CHECKS"] == "true"


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


def test_a_hub_deploys_deadline_ends_jobs_before_runpods_default_execution_timeout() -> None:
    # A Hub deploy cannot set the endpoint's execution timeout, so the platform's default applies: the worker
    # must stop, keep the checkpoint and answer before it, with a minute for the upload and the reply.
    hub = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())
    deadline = next(item for item in hub["config"]["env"] if item["key"] == "FLUXBOOTH_JOB_DEADLINE_SECONDS")
    assert deadline["input"]["default"] <= RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS - 60


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.parametrize("listing", ["hub.json", "tests.json"])
def test_the_hub_allows_every_host_cuda_whose_driver_runs_the_images_cuda_and_no_other(listing: str) -> None:
    # CUDA's minor-version compatibility: the image's 13.0 runtime runs on a driver of any 13.x (R580 and later),
    # not on a 12.x one. RunPod matches allowedCudaVersions exactly, so a 13.2 host is excluded unless listed.
    torch_pin = image_checks.pinned_torch((REPO_ROOT / "requirements-torch-cuda.txt").read_text())
    cuda = version(image_checks.cuda_version_of_label(torch_pin.partition("+")[2]))
    running = [host for host in CUDA_PINS["host_cuda_versions"]["versions"] if version(host)[0] == cuda[0] and version(host) >= cuda]

    allowed = json.loads((REPO_ROOT / ".runpod" / listing).read_text())["config"]["allowedCudaVersions"]

    assert allowed == running == ["13.0", "13.1", "13.2", "13.3", "13.4"]


def test_the_workflow_exports_only_the_final_images_layers_to_githubs_cache() -> None:
    # mode=max exports every stage, the CUDA devel build stage included (several GB), into a 10 GB cache,
    # and an export error fails the build unless ignored.
    workflow = (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "cache-to: type=gha,mode=min,ignore-error=true" in workflow
    assert "mode=max" not in workflow.replace("mode=max would", "")


def test_the_workflow_builds_the_dockerfile_and_pushes_to_ghcr() -> None:
    workflow = (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "uses: docker/build-push-action@v6" in workflow
    assert "images: ghcr.io/${{ github.repository }}" in workflow
    assert "push: ${{ github.event_name != 'pull_request' }}" in workflow
