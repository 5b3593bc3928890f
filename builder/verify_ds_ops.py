"""DeepSpeed's prebuilt ops in the image: which ones each torch variant builds, and the build's check.

    python builder/verify_ds_ops.py build-env VARIANT        the DS_* variables for `pip install deepspeed`
    python builder/verify_ds_ops.py accelerator-env VARIANT  DS_ACCELERATOR for ds_report
    python builder/verify_ds_ops.py check VARIANT REPORT     fail unless REPORT lists every op as installed

REPORT is what `ds_report` printed in the build. Each op it lists as installed ([YES]) was compiled into
DeepSpeed's package at `pip install` time (DS_BUILD_*=1), so no job compiles it (minutes, nvcc for the GPU
ones) at a cold start; an op listed [NO] would be JIT-compiled by the first job that needs it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The accelerator DeepSpeed builds for. It is named, never detected: the build machine has no GPU.
ACCELERATORS = {"cuda": "cuda", "cpu": "cpu"}

# What the trainer may load, per variant, with the DS_BUILD_* variable DeepSpeed's own builder reads
# (tests/test_dockerfile.py checks each name against DeepSpeed). cuda: the fused GPU optimizers, the
# offloaded CPU ones and async_io for NVMe offload. cpu: the CPU optimizers, async_io, and the shared-memory
# collectives DeepSpeed's CPU accelerator initialises its process group with.
REQUIRED_OPS: dict[str, dict[str, str]] = {
    "cuda": {
        "fused_adam": "DS_BUILD_FUSED_ADAM",
        "fused_lion": "DS_BUILD_FUSED_LION",
        "cpu_adam": "DS_BUILD_CPU_ADAM",
        "cpu_adagrad": "DS_BUILD_CPU_ADAGRAD",
        "cpu_lion": "DS_BUILD_CPU_LION",
        "async_io": "DS_BUILD_AIO",
    },
    "cpu": {
        "cpu_adam": "DS_BUILD_CPU_ADAM",
        "cpu_adagrad": "DS_BUILD_CPU_ADAGRAD",
        "cpu_lion": "DS_BUILD_CPU_LION",
        "async_io": "DS_BUILD_AIO",
        "deepspeed_shm_comm": "DS_BUILD_SHM_COMM",
    },
}

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_OP_LINE = re.compile(r"^(?P<op>[a-z0-9_]+) \.+ \[(?P<installed>YES|NO)\]")


def accelerator_env(variant: str) -> list[str]:
    return [f"DS_ACCELERATOR={ACCELERATORS[variant]}"]


def build_env(variant: str) -> list[str]:
    """`DS_ACCELERATOR=… DS_BUILD_OPS=0 DS_BUILD_<op>=1 …`: only the listed ops, for the named accelerator."""
    return [*accelerator_env(variant), "DS_BUILD_OPS=0", *(f"{name}=1" for name in REQUIRED_OPS[variant].values())]


def installed_ops(report: str) -> dict[str, bool]:
    """Each op line of a ds_report (`fused_adam ..... [YES] ...... [OKAY]`), as installed or not."""
    found: dict[str, bool] = {}
    for line in _ANSI_ESCAPE.sub("", report).splitlines():
        if match := _OP_LINE.match(line.strip()):
            found[match["op"]] = match["installed"] == "YES"
    return found


def ops_not_prebuilt(report: str, required: tuple[str, ...]) -> list[str]:
    listed = installed_ops(report)
    return [op for op in required if not listed.get(op)]


def check(variant: str, report: str) -> int:
    print(report)
    required = tuple(REQUIRED_OPS[variant])
    missing = ops_not_prebuilt(report, required)
    if missing:
        print(f"DeepSpeed ops not prebuilt: {', '.join(missing)}; check the DS_BUILD_* build log above", file=sys.stderr)
        return 1
    print(f"DeepSpeed ops prebuilt: {', '.join(required)}")
    return 0


def main(arguments: list[str]) -> int:
    usage = "usage: verify_ds_ops.py build-env|accelerator-env VARIANT | check VARIANT DS_REPORT_OUTPUT"
    command, variant = (arguments + ["", ""])[:2]
    if variant not in REQUIRED_OPS or command not in ("build-env", "accelerator-env", "check"):
        print(usage, file=sys.stderr)
        return 2
    if command == "check":
        if len(arguments) != 3:
            print(usage, file=sys.stderr)
            return 2
        return check(variant, Path(arguments[2]).read_text(errors="replace"))
    print(" ".join(build_env(variant) if command == "build-env" else accelerator_env(variant)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
