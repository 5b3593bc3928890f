"""Build the DeepSpeed ops the trainer loads, ahead of time, so no job (or test) pays their JIT build:
CPU Adam (and Adagrad and Lion, the other offloaded optimizers), async_io for NVMe offload (where libaio
is installed) and, on DeepSpeed's CPU accelerator, its shared-memory collectives.

The ops are JIT-built for the accelerator DeepSpeed selects (DS_ACCELERATOR) into TORCH_EXTENSIONS_DIR, the
folder the worker passes to the trainer: CI builds the CPU ones in the background while the fast tests run.
The Docker image compiles the ops a GPU worker loads into DeepSpeed's package at install time (DS_BUILD_*=1,
checked by builder/verify_ds_ops.py) and uses this only for the ops the demo job loads on DeepSpeed's CPU
accelerator (`prebuild_ops.py CPUAdamBuilder ShareMemCommBuilder`): naming builders builds those alone.
"""

from __future__ import annotations

import os
import sys

OPTIMIZER_OPS = ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder")


def build_named_ops(names: list[str]) -> list[str]:
    """Build the named op builders for the accelerator DeepSpeed selects; returns the names built."""
    from deepspeed.accelerator import get_accelerator

    for name in names:
        get_accelerator().create_op_builder(name).load()
    return names


def build_ops() -> list[str]:
    """Build every op the trainer may load here; returns the names built."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    wanted = list(OPTIMIZER_OPS)
    if accelerator.device_name() == "cpu":
        wanted.append("ShareMemCommBuilder")
    built = []
    for name in wanted:
        accelerator.create_op_builder(name).load()
        built.append(name)
    async_io = accelerator.create_op_builder("AsyncIOBuilder")
    if async_io is not None and async_io.is_compatible(verbose=False):
        async_io.load()
        built.append("AsyncIOBuilder")
    else:
        print("async_io not built: libaio-dev is missing, so NVMe offload is unavailable here", file=sys.stderr)
    return built


if __name__ == "__main__":
    built = build_named_ops(sys.argv[1:]) if sys.argv[1:] else build_ops()
    print(f"DeepSpeed ops {built} built into {os.environ.get('TORCH_EXTENSIONS_DIR', '<torch default>')}", file=sys.stderr)
