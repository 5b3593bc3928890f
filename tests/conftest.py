"""Shared test setup: the S3 server fixtures, and one DeepSpeed op-build cache for every trainer run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from fluxbooth.host.op_cache import unbuilt_ops
from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.settings import WorkerSettings

# s3server: the S3 fixtures; readme_citations: a run that skips a test the README or docs/ cite fails; the others: the
# fixtures that tests in more than one module share (a test module importing a fixture by name would shadow it).
pytest_plugins = [
    "tests.support.s3server",
    "tests.support.readme_citations",
    "tests.support.fake_trainer_jobs",
    "tests.support.handler_api_server",
    "tests.support.header_trickler",
    "tests.support.http_fixtures",
    "tests.support.model_hub",
    "tests.support.runpod_api",
    "tests.support.runpod_queue",
    "tests.support.submit_client",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_builder_module(name: str) -> ModuleType:
    """builder/ holds build scripts, not a package: load one by its path, once, registered in sys.modules (as
    `builder_<name>`), where dataclasses look their module up."""
    module_name = f"builder_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / "builder" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def default_torch_extensions_dir() -> Path:
    # Outside any temporary directory on purpose: building DeepSpeed's CPU ops takes minutes, and CI reuses this
    # cache between runs on the same machine. The worker's default folder for this environment (keyed by venv,
    # torch and compiler), where the demo and CI's prebuild (builder/prebuild_ops.py) build them too.
    return extensions_dir(WorkerSettings.from_environ(os.environ))


# The ops the tests' CPU jobs load (CPU Adam on DeepSpeed's CPU accelerator), as builder/prebuild_ops.py names them.
TEST_JOB_OPS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}


@pytest.fixture(scope="session")
def torch_extensions_dir() -> Path:
    """The ops folder, with the ops the tests' jobs load built: the worker counts an op still to build in its plan
    (minutes), so without this a test's plan would depend on whether an earlier test had built them. CI's prebuild
    builds them in the background; here a build already under way is waited for (torch's lock), not repeated."""
    path = default_torch_extensions_dir()
    path.mkdir(parents=True, exist_ok=True)
    missing = unbuilt_ops(path, TEST_JOB_OPS)
    if missing:
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "builder" / "prebuild_ops.py"), *(TEST_JOB_OPS[op] for op in missing)],
            env={**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(path)},
            check=True,
        )
    return path


@pytest.fixture(scope="session")
def libaio() -> None:
    """NVMe offload needs DeepSpeed's async_io op, which links libaio: a system package, not a pip one.
    Without it the NVMe tests are skipped (and say so), except where FLUXBOOTH_REQUIRE_LIBAIO=1 (CI, which
    installs libaio-dev) makes them fail, so a CI run can never skip them quietly."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        return
    message = "libaio is not installed (apt-get install libaio-dev): DeepSpeed cannot build its async_io op"
    if os.environ.get("FLUXBOOTH_REQUIRE_LIBAIO") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def mounted_tmpfs(target: Path, size_bytes: int = 16 * 1024**2) -> Iterator[Path]:
    """A real tmpfs mounted at `target` (root only), unmounted afterwards. Where it cannot be mounted the test
    is skipped, except where FLUXBOOTH_REQUIRE_TMPFS=1 (CI, which runs as root) makes it fail."""
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "fluxbooth-test", str(target)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        message = f"cannot mount a tmpfs at {target}: {mounted.stderr.strip() or mounted.returncode}"
        if os.environ.get("FLUXBOOTH_REQUIRE_TMPFS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache (the tiny model) for the whole session, so it is built once."""
    return tmp_path_factory.mktemp("fluxbooth-cache")


def worker_environment(root: Path, model_cache_dir: Path, torch_extensions_dir: Path) -> dict[str, str]:
    """A clean environment for a worker (in-process or subprocess) that writes only under `root`, sharing the
    session's model and DeepSpeed op caches. Module-scoped fixtures that run one job for many tests call it."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(root)),
        "FLUXBOOTH_WORK_DIR": str(root / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(root / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(model_cache_dir),
        "FLUXBOOTH_VOLUME_DIR": str(root / "no-volume"),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def worker_env(tmp_path: Path, model_cache_dir: Path, torch_extensions_dir: Path) -> Iterator[dict[str, str]]:
    """A clean environment for a worker that writes only under tmp_path."""
    yield worker_environment(tmp_path, model_cache_dir, torch_extensions_dir)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX pipeline (seed 0) that the trainer tests train on, built once per session."""
    from fluxbooth.synthetic.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("base") / "tiny-flux", seed=0)


# Test files that run longest, started first, so that neither of the two workers ends the run alone with one of them.
LONGEST_FIRST = ("test_image.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


WORKER_CORES = pytest.StashKey[tuple[set[int], set[int]]]()


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker's share of the cores (where there is at least one per worker), for its trainer tests."""
    worker_input = getattr(config, "workerinput", None)
    if worker_input is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(worker_input["workercount"])
    if len(cores) >= workers:
        index = int(str(worker_input["workerid"]).removeprefix("gw"))
        share = set(cores[index * len(cores) // workers : (index + 1) * len(cores) // workers])
        config.stash[WORKER_CORES] = (share, set(cores))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A trainer test (marked slow) runs on its worker's share of the cores, before its fixtures launch anything:
    the trainers inherit the affinity and size their threads by it, as the worker does on a machine
    (host.limits.allowed_cpus). Unpinned, two workers' trainers each ran two OpenMP threads on CI's two cores:
    two copies of tests/trainer/test_trainer_lora.py at once took 120 s, pinned 91 s. Other tests keep every core:
    pinned, the fast tests took longer, an idle worker's core unusable by the other's subprocesses."""
    cores = item.config.stash.get(WORKER_CORES, None)
    if cores is not None:
        share, every_core = cores
        os.sched_setaffinity(0, share if item.get_closest_marker("slow") else every_core)
