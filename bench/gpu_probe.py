"""The GPU probe: one device call of at most 5 minutes that checks the lent machine can run the trainer and
measures FLUX.1-dev's default LoRA job against the planner (docs/development/gpu-probe.md).

Four sections, each in its own process (bench/gpu_probe_train.py) under its own time budget
(`SECTION_SECONDS`), so a slow one cannot eat the time a rerun needs:
1. `imports`: torch, DeepSpeed, diffusers and the project; `ulimit -l` and /dev/shm; the GPU, driver and CUDA;
2. `resident`: full-depth FLUX.1-dev (19 double + 38 single blocks at hidden 3072) built on the device with
   random bf16 weights, rank-16 LoRA steps at 1024² on the whole card;
3. `swapped`: the same, block-swapped (train/blockswap.py) under a 24 GiB cap;
4. `render`: one validation image through the trainer's render loop (train/validation.render_prompts).
Each against the planner's step (or render) time and its phase's GPU charge. Every section runs with the
trainer's one allocator setting (contract.environment.CUDA_ALLOCATOR_SETTING).

It writes 3 files into --out (`probe.json`, `table.md`, `sections.log`: every section's output) and prints its
table last. `--device cpu` is its dry run: the same code at a CPU size (`--size tiny`: the test's).

Usage: python bench/gpu_probe.py --device cuda|cpu --out DIR [--size h100|cpu|tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from gpu_probe_sizes import SIZES  # noqa: E402
from gpu_probe_table import render_table  # noqa: E402
from gpu_probe_train import SECTIONS  # noqa: E402

from fluxbooth.contract.environment import CUDA_ALLOCATOR_SETTING  # noqa: E402

# Each section's budget, seconds (its process's start and imports included). On the GPU they sum to 265 s: with
# the wheels' install before them, the call stays inside 5 minutes, and a rerun fits in what a lent machine's 15
# minutes leave after its cold start (docs/development/gpu-probe.md). On the CPU: generous, for a loaded CI machine.
SECTION_SECONDS = {
    "cuda": {"imports": 30, "resident": 65, "swapped": 110, "render": 60},
    "cpu": {"imports": 120, "resident": 120, "swapped": 120, "render": 120},
}
PROBE_FILES = ("probe.json", "table.md", "sections.log")


def section_environment(device_type: str) -> dict[str, str]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOCATOR_SETTING, "PYTHONUNBUFFERED": "1"}
    if device_type == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for CUDA
    return env


def run_section(section: str, size_name: str, device_type: str, log: Any, work: Path) -> dict[str, Any]:
    """bench/gpu_probe_train.py for `section` under its budget: its record, its exit status and its seconds."""
    record = work / f"{section}.json"
    budget = SECTION_SECONDS[device_type][section]
    command = [
        sys.executable,
        str(BENCH / "gpu_probe_train.py"),
        "--section",
        section,
        "--device",
        device_type,
        "--size",
        size_name,
        "--record",
        str(record),
    ]
    log.write(f"==== section {section} (budget {budget} s)\n")
    log.flush()
    started = time.monotonic()
    try:
        completed = subprocess.run(
            command, env=section_environment(device_type), stdout=log, stderr=subprocess.STDOUT, timeout=budget
        )
        exit_status: int | str = completed.returncode
    except subprocess.TimeoutExpired:
        exit_status = "timeout"
    loaded = json.loads(record.read_text()) if record.is_file() else {"section": section}
    return {**loaded, "exit": exit_status, "budget": budget, "wall_seconds": round(time.monotonic() - started, 1)}


def measure(size_name: str, device_type: str, out: Path) -> dict[str, Any]:
    """Every section in order; after a failed import check the others are skipped (they would fail alike)."""
    report: dict[str, Any] = {"size": size_name, "device": device_type, "allocator": CUDA_ALLOCATOR_SETTING}
    with (out / "sections.log").open("w") as log, tempfile.TemporaryDirectory(prefix="gpu-probe-") as work:
        for section in SECTIONS:
            if section != "imports" and not report["imports"].get("ok"):
                report[section] = {"section": section, "exit": "skipped: the import check failed"}
                continue
            report[section] = run_section(section, size_name, device_type, log, Path(work))
            print(f"probe: {section} exit {report[section]['exit']} in {report[section]['wall_seconds']} s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True, help=f"writes {', '.join(PROBE_FILES)} here")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: h100 on cuda, cpu on the CPU")
    arguments = parser.parse_args(argv)
    size_name = arguments.size or ("h100" if arguments.device == "cuda" else "cpu")
    out = arguments.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = measure(size_name, arguments.device, out)
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "probe.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = render_table(report)
    (out / "table.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
