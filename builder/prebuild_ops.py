"""Build DeepSpeed's CPU Adam op at image-build time, so no job pays the ~2 minute JIT build.

Run with TORCH_EXTENSIONS_DIR set to where the worker will look (the Dockerfile sets it).
"""

from __future__ import annotations

import os
import sys


def build_cpu_adam() -> str:
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    return os.environ.get("TORCH_EXTENSIONS_DIR", "<torch default>")


if __name__ == "__main__":
    print(f"DeepSpeed CPUAdam built into {build_cpu_adam()}", file=sys.stderr)
