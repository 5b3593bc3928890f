"""Build DeepSpeed's CPU Adam op (and async_io, for NVMe offload, where libaio is installed) at image-build
time, so no job pays the minutes of JIT build.

Run with TORCH_EXTENSIONS_DIR set to where the worker will look (the Dockerfile sets it).
"""

from __future__ import annotations

import os
import sys


def build_ops() -> list[str]:
    """Build the ops the worker's plans use; returns the names built."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    CPUAdamBuilder().load()
    built = ["cpu_adam"]
    if AsyncIOBuilder().is_compatible(verbose=True):
        AsyncIOBuilder().load()
        built.append("async_io")
    else:
        print("async_io not built: libaio-dev is missing, so NVMe offload is unavailable in this image", file=sys.stderr)
    return built


if __name__ == "__main__":
    built = build_ops()
    print(f"DeepSpeed ops {built} built into {os.environ.get('TORCH_EXTENSIONS_DIR', '<torch default>')}", file=sys.stderr)
