"""Where DeepSpeed's JIT-built ops live (TORCH_EXTENSIONS_DIR), and which of them a job must still build.

torch JIT-builds an op into TORCH_EXTENSIONS_DIR/<op>/ with ninja, against the headers of the torch it runs
under, the DeepSpeed sources of its venv and the compiler CXX names. One folder shared by every checkout and
venv is rebuilt each time another one used it (194 s for CPU Adam on the demo's 2 cores, issue 43), and an op
built elsewhere could be loaded. So the default folder is keyed by what the op is built with: the Python prefix
(the venv), Python's, torch's and DeepSpeed's versions and the compiler; the checkout is not part of it, so a
second clone on the same venv finds the ops built. An explicit TORCH_EXTENSIONS_DIR is used as it is (the image
sets one and builds its ops into it, for its one environment).

The worker, the demo (`python handler.py`, the worker in local test mode), the tests (tests/conftest.py) and CI's
prebuild (builder/prebuild_ops.py; `--where` prints the folder) all take the folder from `op_cache_dir`.
Torch-free: versions are read from the installed packages' metadata, never by importing them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

OP_CACHE_FOLDER = "torch_extensions"  # under the worker's cache folder (settings.cache_dir)
DEFAULT_COMPILER = "c++"  # torch's cpp_extension compiles with CXX, else this
COMPILER_PROBE_SECONDS = 10
# One op's JIT build: CPU Adam took 194 s on the demo's shared 2-core machine (issue 43); the other ops compile
# sources of the same size against the same torch headers, and are counted alike.
OP_BUILD_SECONDS = 200.0
# The op each offloaded DeepSpeed optimizer steps with (plan.optimizer names the class).
OPTIMIZER_OPS = {"DeepSpeedCPUAdam": "cpu_adam", "DeepSpeedCPUAdagrad": "cpu_adagrad", "DeepSpeedCPULion": "cpu_lion"}
SHARED_MEMORY_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU accelerator's collectives
ASYNC_IO_OP = "async_io"  # NVMe offload


@dataclass(frozen=True)
class OpBuildKey:
    """What a JIT-built op depends on; two environments that agree on all of it can share its build."""

    python_prefix: str
    python_version: str
    torch_version: str
    deepspeed_version: str
    compiler: str

    @property
    def folder_name(self) -> str:
        """Readable where it can be, unique where it must: `py3.11-torch2.9.1-<12 hex digits>`."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"py{self.python_version}-torch{self.torch_version}-{digest}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def compiler_identity(environ: Mapping[str, str]) -> str:
    """The compiler torch would build with: its resolved path and the first line of its `--version`."""
    named = environ.get("CXX") or DEFAULT_COMPILER
    found = shutil.which(named, path=environ.get("PATH"))
    if found is None:
        return f"{named} (not found)"
    path = os.path.realpath(found)
    try:
        probe = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=COMPILER_PROBE_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{path} ({type(error).__name__})"
    lines = probe.stdout.splitlines()
    return f"{path} {lines[0] if lines else ''}".strip()


def op_build_key(environ: Mapping[str, str], *, prefix: str | None = None) -> OpBuildKey:
    """This interpreter's key (the trainer runs under the worker's own interpreter: job/launch.py)."""
    return OpBuildKey(
        python_prefix=os.path.realpath(prefix or sys.prefix),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
        torch_version=_version("torch"),
        deepspeed_version=_version("deepspeed"),
        compiler=compiler_identity(environ),
    )


def op_cache_dir(environ: Mapping[str, str], cache_dir: Path, key: OpBuildKey | None = None) -> Path:
    """TORCH_EXTENSIONS_DIR when set; else the folder for this environment's key under `cache_dir`."""
    explicit = environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    return cache_dir / OP_CACHE_FOLDER / (key or op_build_key(environ)).folder_name


def ops_loaded(*, accelerator: str, use_deepspeed: bool, optimizer: str, nvme: bool) -> tuple[str, ...]:
    """The JIT ops a trainer with this plan loads: the offloaded optimizer's, the CPU accelerator's collectives,
    async_io for NVMe."""
    if not use_deepspeed:
        return ()
    ops = [OPTIMIZER_OPS[optimizer]] if optimizer in OPTIMIZER_OPS else []
    if accelerator == "cpu":
        ops.append(SHARED_MEMORY_OP)
    if nvme:
        ops.append(ASYNC_IO_OP)
    return tuple(ops)


def _prebuilt_in_package(op: str) -> bool:
    """Compiled into DeepSpeed's package at install time (DS_BUILD_*=1, as the image does for its GPU ops)."""
    spec = importlib.util.find_spec("deepspeed")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any((Path(root) / "ops").rglob(f"{op}_op*.so")) for root in spec.submodule_search_locations)


def unbuilt_ops(extensions_dir: Path, ops: Iterable[str]) -> tuple[str, ...]:
    """Those of `ops` the trainer would JIT-build: neither in DeepSpeed's package nor built in `extensions_dir`
    (torch leaves <op>/<op>.so there)."""
    return tuple(op for op in ops if not (extensions_dir / op / f"{op}.so").is_file() and not _prebuilt_in_package(op))
