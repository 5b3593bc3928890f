"""Build the DeepSpeed ops the trainer loads, ahead of time, so no job (or test) pays their JIT build:
CPU Adam (and Adagrad and Lion, the other offloaded optimizers), async_io for NVMe offload (where libaio
is installed) and, on DeepSpeed's CPU accelerator, its shared-memory collectives.

The ops are JIT-built for the accelerator DeepSpeed selects (DS_ACCELERATOR) into the folder the worker passes to
the trainer: TORCH_EXTENSIONS_DIR when set, else the worker's default for this environment (fluxbooth.host.op_cache:
keyed by venv, torch and compiler, where the demo and the tests look too). `--where` prints that folder. CI builds
the CPU ones in the background while the fast tests run.
The Docker image compiles the ops a GPU worker loads into DeepSpeed's package at install time (DS_BUILD_*=1,
checked by builder/verify_ds_ops.py) and uses this only for the ops the demo job loads on DeepSpeed's CPU
accelerator (`prebuild_ops.py CPUAdamBuilder ShareMemCommBuilder`): naming builders builds those alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

OPTIMIZER_OPS = ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder")


def build_named_ops(names: list[str]) -> list[str]:
    """Build the named op builders for the accelerator DeepSpeed selects; returns the names built."""
    from deepspeed.accelerator import get_accelerator

    for name in names:
        get_accelerator().create_op_builder(name).load()
    return names


def build_ops() -> list[str]:
    """Build every op the trainer may load here; returns the names built. CPU Adam and the shared-memory
    collectives first: nearly every trainer test loads them, and CI runs the tests while this builds, so a
    trainer that needs an op still building waits for it. NVMe's async_io and the other optimizers' ops,
    which a few tests load, last."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    first = [OPTIMIZER_OPS[0]] + (["ShareMemCommBuilder"] if accelerator.device_name() == "cpu" else [])
    built = []
    for name in first:
        accelerator.create_op_builder(name).load()
        built.append(name)
    async_io = accelerator.create_op_builder("AsyncIOBuilder")
    if async_io is not None and async_io.is_compatible(verbose=False):
        async_io.load()
        built.append("AsyncIOBuilder")
    else:
        print("async_io not built: libaio-dev is missing, so NVMe offload is unavailable here", file=sys.stderr)
    for name in OPTIMIZER_OPS[1:]:
        accelerator.create_op_builder(name).load()
        built.append(name)
    return built


def worker_extensions_dir() -> Path:
    """The folder the worker would hand its trainer here (TORCH_EXTENSIONS_DIR, else its keyed default)."""
    # Deferred, and from the checkout's src/: the image runs this before the package is copied in, always with
    # TORCH_EXTENSIONS_DIR set, so only a run without it (CI, a developer) needs fluxbooth.
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    sys.path.insert(0, str(REPO_ROOT / "src"))
    from fluxbooth.host.op_cache import op_cache_dir
    from fluxbooth.settings import WorkerSettings

    return op_cache_dir(os.environ, WorkerSettings.from_environ(os.environ).cache_dir)


if __name__ == "__main__":
    extensions = worker_extensions_dir()
    if sys.argv[1:] == ["--where"]:
        print(extensions)
        sys.exit(0)
    extensions.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    built = build_named_ops(sys.argv[1:]) if sys.argv[1:] else build_ops()
    print(f"DeepSpeed ops {built} built into {extensions}", file=sys.stderr)
