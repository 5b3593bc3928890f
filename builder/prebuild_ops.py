"""Build the DeepSpeed ops the trainer loads, ahead of time, so no job (or test) pays their JIT build:
CPU Adam (and Adagrad and Lion, the other offloaded optimizers), async_io for NVMe offload (where libaio
is installed) and, on DeepSpeed's CPU accelerator, its shared-memory collectives.

The ops are JIT-built for the accelerator DeepSpeed selects (DS_ACCELERATOR) into TORCH_EXTENSIONS_DIR, the
folder the worker passes to the trainer: CI builds the CPU ones in the background while the fast tests run.
The Docker image does not use this: it compiles the ops into DeepSpeed's package at install time
(DS_BUILD_*=1), which needs no GPU, and checks them with builder/verify_ds_ops.py.
"""

from __future__ import annotations

import os
import sys

OPTIMIZER_OPS = ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder")


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
    built = build_ops()
    print(f"DeepSpeed ops {built} built into {os.environ.get('TORCH_EXTENSIONS_DIR', '<torch default>')}", file=sys.stderr)
