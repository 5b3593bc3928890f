"""DeepSpeed's prebuilt ops in the image, and the build's check of them.

    python builder/verify_ds_ops.py build-env        the DS_* variables for `pip install deepspeed`
    python builder/verify_ds_ops.py accelerator-env  DS_ACCELERATOR for ds_report
    python builder/verify_ds_ops.py check REPORT     fail unless REPORT lists every op as installed, no fused
                                                     GPU op is, and the ops are recorded for CUDA

REPORT is what `ds_report` printed in the build. Each op it lists as installed ([YES]) was compiled into
DeepSpeed's package at `pip install` time (DS_BUILD_*=1), so no job compiles it at a cold start; an op listed
[NO] would be JIT-compiled by the first job that needs it.

Why these are the ops a GPU worker loads (DeepSpeed 0.19.8's source): DeepSpeed records the ops it built and
the accelerator it built them for (deepspeed/git_version_info_installed.py: installed_ops, accelerator_name);
an op builder loads the prebuilt module only when accelerator_name is the accelerator running
(op_builder/builder.py, OpBuilder.load), else it JIT-builds. So the ops are built with DS_ACCELERATOR=cuda, the
accelerator a GPU worker selects. For cuda, CPU Adam, Adagrad and Lion come from op_builder/cpu
(accelerator/cuda_accelerator.py, _lazy_init_class_dict), CPUOpBuilder, a torch CppExtension; async_io and
pin_memory are CUDAOpBuilders, which build a CppExtension when no CUDA toolkit is found
(CUDAOpBuilder.builder: MissingCUDAException sets build_for_cpu). The image has no CUDA toolkit, so all are
host C++ and no nvcc is needed. DeepSpeed's fused GPU optimizers are not built: the trainer uses torch's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The accelerator DeepSpeed builds for. It is named, never detected: the build machine has no GPU.
ACCELERATOR = "cuda"

# What the trainer may load, with the DS_BUILD_* variable DeepSpeed's own builder reads (tests/image/test_dockerfile.py
# checks each name against DeepSpeed): the offloaded CPU optimizers and async_io for NVMe offload (DeepSpeed
# adds pin_memory, which async_io loads).
REQUIRED_OPS = {
    "cpu_adam": "DS_BUILD_CPU_ADAM",
    "cpu_adagrad": "DS_BUILD_CPU_ADAGRAD",
    "cpu_lion": "DS_BUILD_CPU_LION",
    "async_io": "DS_BUILD_AIO",
}
# DeepSpeed's GPU optimizers, which need nvcc: never in the image.
FORBIDDEN_OPS = ("fused_adam", "fused_lion")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_OP_LINE = re.compile(r"^(?P<op>[a-z0-9_]+) \.+ \[(?P<installed>YES|NO)\]")


def accelerator_env() -> list[str]:
    return [f"DS_ACCELERATOR={ACCELERATOR}"]


def build_env() -> list[str]:
    """`DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_<op>=1 …`: only the listed ops."""
    return [*accelerator_env(), "DS_BUILD_OPS=0", *(f"{name}=1" for name in REQUIRED_OPS.values())]


def installed_ops(report: str) -> dict[str, bool]:
    """Each op line of a ds_report (`cpu_adam ..... [YES] ...... [OKAY]`), as installed or not."""
    found: dict[str, bool] = {}
    for line in _ANSI_ESCAPE.sub("", report).splitlines():
        if match := _OP_LINE.match(line.strip()):
            found[match["op"]] = match["installed"] == "YES"
    return found


def report_problems(report: str, accelerator: str) -> list[str]:
    """What is wrong with a build's ops: one not prebuilt, a fused GPU op built, or another accelerator."""
    listed = installed_ops(report)
    problems = []
    if missing := [op for op in REQUIRED_OPS if not listed.get(op)]:
        problems.append(f"DeepSpeed ops not prebuilt: {', '.join(missing)}; check the DS_BUILD_* build log above")
    if built := [op for op in FORBIDDEN_OPS if listed.get(op)]:
        problems.append(f"DeepSpeed GPU ops built (they need nvcc): {', '.join(built)}")
    if accelerator != ACCELERATOR:
        problems.append(f"DeepSpeed's ops are recorded for {accelerator!r}, a GPU worker runs {ACCELERATOR!r}")
    return problems


def check(report: str) -> int:
    from deepspeed import git_version_info

    print(report)
    problems = report_problems(report, git_version_info.accelerator_name)
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    print(f"DeepSpeed ops prebuilt for {ACCELERATOR}: {', '.join(REQUIRED_OPS)}")
    return 0


def main(arguments: list[str]) -> int:
    usage = "usage: verify_ds_ops.py build-env | accelerator-env | check DS_REPORT_OUTPUT"
    command = arguments[0] if arguments else ""
    if command == "check" and len(arguments) == 2:
        return check(Path(arguments[1]).read_text(errors="replace"))
    if command in ("build-env", "accelerator-env") and len(arguments) == 1:
        print(" ".join(build_env() if command == "build-env" else accelerator_env()))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
