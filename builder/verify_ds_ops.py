"""Fail the image build unless DeepSpeed's ops are prebuilt: `python builder/verify_ds_ops.py REPORT`.

REPORT is what `ds_report` printed in the build. Each op it lists as installed ([YES]) was compiled into
DeepSpeed's package at `pip install` time (DS_BUILD_*=1), so no job compiles it (nvcc, minutes) at a cold
start; an op listed [NO] would be JIT-compiled by the first job that needs it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# What the trainer may load on a GPU worker: the fused GPU optimizers, the offloaded CPU ones, and
# async_io for NVMe offload. The Dockerfile sets DS_BUILD_<op>=1 for each (tests/test_dockerfile.py checks).
REQUIRED_OPS = ("fused_adam", "fused_lion", "cpu_adam", "cpu_adagrad", "cpu_lion", "async_io")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_OP_LINE = re.compile(r"^(?P<op>[a-z0-9_]+) \.+ \[(?P<installed>YES|NO)\]")


def installed_ops(report: str) -> dict[str, bool]:
    """Each op line of a ds_report (`fused_adam ..... [YES] ...... [OKAY]`), as installed or not."""
    found: dict[str, bool] = {}
    for line in _ANSI_ESCAPE.sub("", report).splitlines():
        if match := _OP_LINE.match(line.strip()):
            found[match["op"]] = match["installed"] == "YES"
    return found


def ops_not_prebuilt(report: str, required: tuple[str, ...] = REQUIRED_OPS) -> list[str]:
    listed = installed_ops(report)
    return [op for op in required if not listed.get(op)]


def main(arguments: list[str]) -> int:
    if len(arguments) != 1:
        print("usage: verify_ds_ops.py DS_REPORT_OUTPUT", file=sys.stderr)
        return 2
    report = Path(arguments[0]).read_text(errors="replace")
    print(report)
    missing = ops_not_prebuilt(report)
    if missing:
        print(f"DeepSpeed ops not prebuilt: {', '.join(missing)}; check the DS_BUILD_* build log above", file=sys.stderr)
        return 1
    print(f"DeepSpeed ops prebuilt: {', '.join(REQUIRED_OPS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
