"""The image, read from its Dockerfile (tests/image/test_image.py builds it and runs it): build arguments for both
bases, a plain Debian base and PyPI alone (no CUDA toolkit, no nvcc, no PyTorch index), dependencies before
the source, torch pinned to PyPI's CUDA build and checked, DeepSpeed's host ops prebuilt for the CUDA
accelerator with portable CPU flags and checked by ds_report, the environment the worker needs; plus the
RunPod hub files and the CI workflow that builds and pushes the versioned image."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from fluxbooth.models.source import DEFAULT_BAKED_MODELS_DIR, DEFAULT_RUNPOD_MODEL_CACHE
from tests.conftest import REPO_ROOT, load_builder_module

verify_ds_ops = load_builder_module("verify_ds_ops")
image_checks = load_builder_module("image_checks")
face_models = load_builder_module("face_models")
fetch_model = load_builder_module("fetch_model")
REQUIRED_OPS: dict[str, str] = verify_ds_ops.REQUIRED_OPS
installed_ops = verify_ds_ops.installed_ops
report_problems = verify_ds_ops.report_problems

# The CUDA versions RunPod's API accepts in allowedCudaVersions: the enum of Endpoint, EndpointCreateInput and
# PodCreateInput .allowedCudaVersions in RunPod's published OpenAPI schema (github.com/runpod/docs,
# api-reference/openapi.json at a900806, 2026-08-20; served at https://rest.runpod.io/v1/openapi.json).
RUNPOD_API_CUDA_VERSIONS = (
    "13.0",
    "12.9",
    "12.8",
    "12.7",
    "12.6",
    "12.5",
    "12.4",
    "12.3",
    "12.2",
    "12.1",
    "12.0",
    "11.8",
)
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


def test_the_bases_are_build_arguments_defaulting_to_plain_debian_bookworm(stages: list[list[Instruction]]) -> None:
    # Debian 12's own Python is 3.11, the project's; no nvidia/cuda base: torch's nvidia-* wheels are the
    # image's only CUDA libraries, and nothing in the image compiles CUDA code.
    assert global_args(stages) == {"BUILD_BASE": "debian:bookworm-slim", "RUNTIME_BASE": "debian:bookworm-slim"}
    assert len(stages) == 3
    assert stages[1][0].arguments == "${BUILD_BASE} AS build"
    assert stages[2][0].arguments == "${RUNTIME_BASE}"


def test_the_dockerfile_has_no_build_variant(stages: list[list[Instruction]]) -> None:
    # One image: the one RunPod pulls, which CI also runs (a CUDA torch runs on a CPU).
    assert "TORCH_VARIANT" not in (REPO_ROOT / "Dockerfile").read_text()
    assert not (REPO_ROOT / "requirements-torch-cpu.txt").exists()


def test_nothing_in_the_build_asks_for_nvcc_or_a_cuda_toolkit(stages: list[list[Instruction]]) -> None:
    steps = " ".join(item.arguments for stage in stages for item in stage)
    assert not re.search(r"nvcc|cuda-toolkit|TORCH_CUDA_ARCH_LIST|CUDA_HOME|nvidia/cuda", steps)
    for name in ("requirements.txt", "requirements-deepspeed.txt", "requirements-torch-cuda.txt"):
        assert "nvcc" not in (REPO_ROOT / name).read_text()


def test_every_package_comes_from_pypi_not_pytorchs_index() -> None:
    for name in ("Dockerfile", "requirements.txt", "requirements-deepspeed.txt", "requirements-torch-cuda.txt"):
        text = (REPO_ROOT / name).read_text()
        assert "download.pytorch.org" not in text and "index-url" not in text, name


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


# --- torch, pinned to PyPI's CUDA build ----------------------------------------------------------------------


def requirement_lines(name: str) -> list[str]:
    return [
        line.strip()
        for line in (REPO_ROOT / name).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_the_image_pins_pypis_torch_and_what_deepspeed_adds_on_cuda() -> None:
    # DeepSpeed's setup.py requires nvidia-ml-py when it builds for CUDA; unpinned, pip would take the newest.
    assert requirement_lines("requirements-torch-cuda.txt") == [
        "torch==2.13.0,!=2.13.0+cpu",
        "nvidia-ml-py==13.580.126",
    ]
    assert "torch==2.13.0" in requirement_lines("requirements.txt")


def test_the_torch_pin_takes_pypis_cuda_build_and_never_a_local_cpu_wheel() -> None:
    # PEP 440: 2.13.0+cpu matches ==2.13.0 and sorts above 2.13.0, so a pip configuration offering a local CPU
    # wheel would win without the exclusion.
    from packaging.requirements import Requirement
    from packaging.version import Version

    pin = Requirement(requirement_lines("requirements-torch-cuda.txt")[0])
    assert Version("2.13.0+cpu") > Version("2.13.0") and Version("2.13.0+cpu") in Requirement("torch==2.13.0").specifier
    assert [str(version) for version in pin.specifier.filter(["2.13.0+cpu", "2.13.0", "2.13.1"])] == ["2.13.0"]


def test_torch_is_installed_first_and_checked(stages: list[list[Instruction]]) -> None:
    build = stages[1]
    copy_torch = index_of(build, "COPY", "requirements-torch-cuda.txt ./")
    install_torch = index_of(build, "RUN", "pip install -r requirements-torch-cuda.txt")
    copy_deepspeed = index_of(build, "COPY", "requirements-deepspeed.txt ./")
    assert copy_torch < install_torch < copy_deepspeed
    assert "python builder/image_checks.py torch" in build[install_torch].arguments
    install_rest = index_of(build, "RUN", "pip install -r requirements-image.txt")
    assert "python builder/image_checks.py torch" in build[install_rest].arguments


def test_the_scoring_models_baked_are_the_revisions_the_worker_pins() -> None:
    from fluxbooth.likeness.weights import DINO, SIGLIP

    assert fetch_model.SCORING_MODELS == tuple(
        (model.repo_id, model.revision, model.patterns) for model in (DINO, SIGLIP)
    )


def test_the_captioner_baked_is_the_revision_the_worker_pins() -> None:
    from fluxbooth.contract.captioning import DEFAULT_CAPTION_MODEL, DEFAULT_CAPTION_REVISION

    assert fetch_model.CAPTION_MODEL[:2] == (DEFAULT_CAPTION_MODEL, DEFAULT_CAPTION_REVISION)


def test_the_captioner_is_baked_on_request_into_the_cache_the_worker_reads(stages: list[list[Instruction]]) -> None:
    final = stages[2]
    assert stage_args(final)["CAPTION_MODEL"] == "0"
    bake = index_of(final, "RUN", "fetch_model.py --caption-model")
    assert f'--caption-model="$CAPTION_MODEL" {DEFAULT_BAKED_MODELS_DIR}' in final[bake].arguments
    assert bake < index_of(final, "COPY", "src ./src")


def test_the_face_models_the_build_keeps_are_the_files_scoring_loads() -> None:
    from fluxbooth.likeness.faces import FILE_SHA256

    assert sorted(face_models.FACE_MODELS_USED) == sorted(FILE_SHA256)


def test_the_scoring_models_are_baked_on_request_into_the_cache_the_worker_reads(
    stages: list[list[Instruction]],
) -> None:
    final = stages[2]
    assert stage_args(final)["SCORING_MODELS"] == "0"
    bake = index_of(final, "RUN", "fetch_model.py --scoring-models")
    assert f'--scoring-models="$SCORING_MODELS" {DEFAULT_BAKED_MODELS_DIR}' in final[bake].arguments
    assert bake < index_of(final, "COPY", "src ./src")


def test_the_published_image_bakes_the_scoring_models() -> None:
    workflow = (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert re.search(r"build-args: \|\n\s+SCORING_MODELS=1\n", workflow)


def test_the_unused_face_models_are_removed_in_the_layer_that_installs_them(stages: list[list[Instruction]]) -> None:
    build = stages[1]
    install_rest = index_of(build, "RUN", "pip install -r requirements-image.txt")
    assert "python face_models.py" in build[install_rest].arguments
    assert (
        "builder/face_models.py" in build[index_of(build, "COPY", "requirements.txt builder/face_models.py")].arguments
    )


def test_the_face_model_check_removes_the_68_point_and_cnn_models_and_keeps_the_two_scoring_loads(
    tmp_path: Path,
) -> None:
    for name in (*face_models.FACE_MODELS_USED, *face_models.FACE_MODELS_DROPPED):
        (tmp_path / name).write_bytes(b"weights")

    assert face_models.prune_face_models(tmp_path) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(face_models.FACE_MODELS_USED)


def test_the_face_model_check_fails_when_a_model_scoring_loads_is_missing(tmp_path: Path) -> None:
    (tmp_path / "shape_predictor_5_face_landmarks.dat").write_bytes(b"weights")

    assert face_models.prune_face_models(tmp_path) == [
        f"dlib_face_recognition_resnet_model_v1.dat is missing from {tmp_path}"
    ]


def test_the_image_ships_a_notice_naming_each_scoring_models_licence(stages: list[list[Instruction]]) -> None:
    notice = (REPO_ROOT / "NOTICE").read_text()
    assert index_of(stages[2], "COPY", "NOTICE")
    for model, licence in [
        ("dlib_face_recognition_resnet_model_v1", "public domain"),
        ("dinov2", "Apache License 2.0"),
        ("siglip", "Apache License 2.0"),
        ("Qwen3-VL-2B-Instruct", "Apache License 2.0"),
    ]:
        assert re.search(rf"{model}.*?{licence}", notice, re.DOTALL | re.IGNORECASE), model


def test_the_torch_check_accepts_pypis_cuda_13_build() -> None:
    architectures = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]
    assert image_checks.torch_problems("2.13.0+cu130", "13.0", architectures) == []


def test_the_torch_check_refuses_a_cpu_build() -> None:
    assert image_checks.torch_problems("2.13.0+cpu", None, []) == [
        "torch 2.13.0+cpu is installed, expected 2.13.0 built for CUDA 13.x",
        "torch's CUDA is None, expected 13.x",
        "torch has no kernels for sm_80, sm_86, sm_89, sm_90, sm_100, sm_120 (has none)",
    ]


def test_the_torch_check_refuses_another_cuda_or_missing_kernels() -> None:
    assert image_checks.torch_problems("2.13.0+cu126", "12.6", ["sm_80"]) == [
        "torch's CUDA is 12.6, expected 13.x",
        "torch has no kernels for sm_90, sm_100, sm_120 (has sm_80)",
    ]


def test_torch_kernels_of_an_older_minor_serve_a_newer_gpu_of_the_same_major() -> None:
    # PyPI's torch 2.13.0+cu130 ships sm_75, sm_80, sm_86, sm_90, sm_100 and sm_120: Ada (sm_89) runs the sm_86
    # kernels; nothing serves a newer major.
    assert image_checks.runs_on("sm_89", ["sm_80", "sm_86"]) and image_checks.runs_on("sm_90", ["sm_90a"])
    assert not image_checks.runs_on("sm_120", ["sm_100"]) and not image_checks.runs_on("sm_86", ["sm_89"])


def test_the_torch_check_takes_no_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert image_checks.main(["torch", "cpu"]) == 2
    assert "usage: image_checks.py torch" in capsys.readouterr().err


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
    copy_rest = index_of(build, "COPY", "requirements.txt builder/face_models.py ./")
    assert copy_deepspeed < install_deepspeed < copy_rest
    assert "-r requirements-deepspeed.txt" in requirement_lines("requirements.txt")
    assert not [line for line in requirement_lines("requirements.txt") if line.startswith("deepspeed==")]


# --- layer order ---------------------------------------------------------------------------------------


def test_dependencies_come_before_the_source(stages: list[list[Instruction]]) -> None:
    build, final = stages[1], stages[2]
    copied_in_build = " ".join(item.arguments for item in build if item.keyword == "COPY")
    assert "src" not in copied_in_build.split() and "handler.py" not in copied_in_build
    copy_source = index_of(final, "COPY", "src ./src")
    copy_handler = index_of(final, "COPY", "handler.py")
    copy_venv = index_of(final, "COPY", "--from=build /opt/venv")
    bake_model = index_of(final, "RUN", 'builder/fetch_model.py --model="$BASE_MODEL"')
    assert copy_venv < bake_model < copy_handler < copy_source
    assert [item.keyword for item in final[copy_source + 1 :]] == ["RUN", "CMD"], "only a smoke check after the source"


def test_a_baked_model_is_fetched_with_the_files_the_worker_downloads() -> None:
    from fluxbooth.models.source import PIPELINE_FILE_PATTERNS

    assert sorted(load_builder_module("fetch_model").COMPONENT_PATTERNS) == sorted(PIPELINE_FILE_PATTERNS)


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


@pytest.mark.parametrize("op_name", list(REQUIRED_OPS))
def test_each_required_op_is_named_by_deepspeeds_own_build_variable(op_name: str) -> None:
    assert REQUIRED_OPS[op_name] == build_variable_of(op_name)


def test_the_image_builds_only_the_host_ops_for_the_cuda_accelerator() -> None:
    assert verify_ds_ops.build_env() == [
        "DS_ACCELERATOR=cuda",
        "DS_BUILD_OPS=0",
        "DS_BUILD_CPU_ADAM=1",
        "DS_BUILD_CPU_ADAGRAD=1",
        "DS_BUILD_CPU_LION=1",
        "DS_BUILD_AIO=1",
    ]


def test_deepspeed_installs_with_the_build_variables(stages: list[list[Instruction]]) -> None:
    assert (
        "env $(python builder/verify_ds_ops.py build-env) CXX=/build/builder/portable-cxx MAX_JOBS=2 "
        "pip install --no-build-isolation --no-deps"
    ) in deepspeed_install(stages).arguments


def test_ds_report_checks_the_ops_in_the_same_layer(stages: list[list[Instruction]]) -> None:
    arguments = deepspeed_install(stages).arguments
    assert "env $(python builder/verify_ds_ops.py accelerator-env) ds_report > /tmp/ds_report.txt" in arguments
    assert "python builder/verify_ds_ops.py check /tmp/ds_report.txt" in arguments


def test_the_demos_cpu_accelerator_ops_are_prebuilt_where_and_how_the_worker_loads_them(
    stages: list[list[Instruction]],
) -> None:
    # torch's JIT load reruns ninja in every new process: the build command (CXX, flags) and the folder must be
    # the runtime's, or the first job rebuilds the op.
    build, final = stages[1], stages[2]
    step = build[index_of(build, "RUN", "builder/prebuild_ops.py")].arguments
    runtime = env_of(final)
    assert f"TORCH_EXTENSIONS_DIR={runtime['TORCH_EXTENSIONS_DIR']} CXX={runtime['CXX']}" in step
    assert "DS_ACCELERATOR=cpu" in step and "prebuild_ops.py CPUAdamBuilder ShareMemCommBuilder" in step
    assert step.endswith("find /opt/torch_extensions -name lock -delete")
    index_of(final, "COPY", f"--from=build {runtime['TORCH_EXTENSIONS_DIR']} {runtime['TORCH_EXTENSIONS_DIR']}")


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
        env={**os.environ, "FLUXBOOTH_REAL_CXX": "echo", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return completed.stdout.split()


def test_portable_cxx_replaces_the_native_march_and_avx512() -> None:
    assert run_portable_cxx("-O3", "-march=native", "-fopenmp", "-D__AVX512__", "cpu_adam.cpp") == [
        "-O3",
        "-march=x86-64-v3",
        "-fopenmp",
        "-D__AVX256__",
        "cpu_adam.cpp",
    ]


def test_portable_cxx_drops_debug_information() -> None:
    assert run_portable_cxx("-O3", "-g", "-Wno-reorder", "cpu_adam.cpp") == ["-O3", "-Wno-reorder", "cpu_adam.cpp"]


def test_portable_cxx_passes_every_other_flag_through() -> None:
    flags = ["-O3", "-std=c++20", "-D__AVX256__", "-I/x y", "-o", "out.o"]
    assert run_portable_cxx(*flags) == ["-O3", "-std=c++20", "-D__AVX256__", "-I/x", "y", "-o", "out.o"]


def test_portable_cxx_compiles_with_gcc_for_the_portable_target(tmp_path: Path) -> None:
    source = tmp_path / "simd.cpp"
    source.write_text("#include <immintrin.h>\nint main() { __m256 x = _mm256_set1_ps(1.0f); return (int)x[0] - 1; }\n")
    subprocess.run(
        [
            str(REPO_ROOT / "builder" / "portable-cxx"),
            "-march=native",
            "-D__AVX512__",
            str(source),
            "-o",
            str(tmp_path / "a.out"),
        ],
        env={**os.environ, "FLUXBOOTH_REAL_CXX": "g++"},
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "a.out").is_file()


# --- the ds_report check, against DeepSpeed's real report ------------------------------------------------


@pytest.fixture(scope="module")
def real_ds_report() -> str:
    """ds_report of this machine's DeepSpeed, which was installed without prebuilt ops."""
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "ds_report")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    return completed.stdout


def report_line(op: str, installed: str) -> str:
    return f"{op} {'.' * (23 - len(op))} \x1b[92m[{installed}]\x1b[0m ....... \x1b[92m[OKAY]\x1b[0m"


def test_a_deepspeed_without_prebuilt_ops_fails_the_check(real_ds_report: str) -> None:
    assert installed_ops(real_ds_report)["cpu_adam"] is False
    assert report_problems(real_ds_report, "cuda") == [
        "DeepSpeed ops not prebuilt: cpu_adam, cpu_adagrad, cpu_lion, async_io; check the DS_BUILD_* build log above"
    ]


def test_a_report_listing_every_op_installed_for_cuda_passes(real_ds_report: str) -> None:
    lines = [report_line(op, "YES") for op in REQUIRED_OPS]
    assert report_problems(real_ds_report + "\n" + "\n".join(lines), "cuda") == []


def test_ops_recorded_for_another_accelerator_fail_the_check(real_ds_report: str) -> None:
    # DeepSpeed loads a prebuilt op only when it was built for the accelerator running; else it JIT-builds.
    lines = [report_line(op, "YES") for op in REQUIRED_OPS]
    assert report_problems(real_ds_report + "\n" + "\n".join(lines), "cpu") == [
        "DeepSpeed's ops are recorded for 'cpu', a GPU worker runs 'cuda'"
    ]


def test_a_fused_gpu_op_in_the_image_fails_the_check(real_ds_report: str) -> None:
    lines = [report_line(op, "YES") for op in (*REQUIRED_OPS, "fused_adam")]
    assert report_problems(real_ds_report + "\n" + "\n".join(lines), "cuda") == [
        "DeepSpeed GPU ops built (they need nvcc): fused_adam"
    ]


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
    assert (
        f'python builder/fetch_model.py --model="$BASE_MODEL" --revision="$BASE_MODEL_REVISION" {DEFAULT_BAKED_MODELS_DIR}'
        in final[index_of(final, "RUN", 'builder/fetch_model.py --model="$BASE_MODEL"')].arguments
    )
    assert (
        "--mount=type=secret,id=hf_token"
        in final[index_of(final, "RUN", 'builder/fetch_model.py --model="$BASE_MODEL"')].arguments
    )


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
def test_the_hub_allows_the_cuda_versions_runpods_api_lists_that_run_the_images_cuda(listing: str) -> None:
    # CUDA's minor-version compatibility: the image's 13.0 runtime runs on a driver of any 13.x (R580 and later),
    # not on a 12.x one; RunPod's API accepts only the versions its schema enumerates.
    allowed = json.loads((REPO_ROOT / ".runpod" / listing).read_text())["config"]["allowedCudaVersions"]
    runs_cu130 = [cuda for cuda in RUNPOD_API_CUDA_VERSIONS if version(cuda)[0] == 13 and version(cuda) >= (13, 0)]

    assert allowed == runs_cu130 == ["13.0"]


def test_the_workflow_exports_only_the_final_images_layers_to_githubs_cache() -> None:
    # mode=max exports every stage, the CUDA devel build stage included (several GB), into a 10 GB cache,
    # and an export error fails the build unless ignored.
    workflow = (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "cache-to: type=gha,mode=min,ignore-error=true" in workflow
    assert "mode=max" not in workflow.replace("mode=max would", "")


def workflow_text() -> str:
    return (REPO_ROOT / ".github" / "workflows" / "image.yml").read_text()


def test_the_workflow_builds_the_dockerfile_and_pushes_to_ghcr_only_on_a_version_tag() -> None:
    workflow = workflow_text()
    assert "uses: docker/build-push-action@v6" in workflow
    assert "images: ghcr.io/${{ github.repository_owner }}/fluxbooth" in workflow
    assert "push: ${{ startsWith(github.ref, 'refs/tags/v') }}" in workflow
    assert 'tags: ["v*"]' in workflow and "branches: [main]" not in workflow


def test_the_workflow_tags_only_the_version_and_its_minor() -> None:
    # :X.Y.Z and :X.Y; no :main, :latest or sha tag a user might pin by mistake.
    workflow = workflow_text()
    tags = re.search(r"tags: \|\n((?:\s+type=.*\n)+)", workflow)
    assert tags is not None
    assert tags[1].split() == ["type=semver,pattern={{version}}", "type=semver,pattern={{major}}.{{minor}}"]
    assert "latest=false" in workflow


def project_version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("page", ["docs/image.md", "docs/deploy.md"])
def test_the_image_docs_name_the_versioned_image(page: str) -> None:
    assert f"ghcr.io/<owner>/fluxbooth:{project_version()}" in (REPO_ROOT / page).read_text()


@pytest.mark.parametrize("page", ["README.md", "docs/image.md", "docs/deploy.md"])
def test_no_doc_names_a_moving_image_tag(page: str) -> None:
    assert not re.search(r"fluxbooth:(main|latest)\b|:latest\b|:main\b", (REPO_ROOT / page).read_text())


@pytest.mark.parametrize("listing", ["hub.json", "tests.json"])
def test_the_hub_files_never_name_a_moving_tag(listing: str) -> None:
    assert not re.search(r":(main|latest)\b", (REPO_ROOT / ".runpod" / listing).read_text())
