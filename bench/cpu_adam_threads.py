"""What `OMP_NUM_THREADS=1` (the reference guide's setting) costs DeepSpeedCPUAdam.

Each thread count runs in a fresh process, because OpenMP reads the variable once at start-up.
`python bench/cpu_adam_threads.py` prints a table and rewrites its section of bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import write_section  # noqa: E402

PARAMETERS = 50_000_000
STEPS = 5
SECTION = "cpu_adam_threads"

STEP_TIMER = r"""
import json, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
parameter = torch.nn.Parameter(torch.randn(int(sys.argv[1])))
optimizer = DeepSpeedCPUAdam([parameter], lr=1e-4)
parameter.grad = torch.randn_like(parameter)
optimizer.step()  # warm-up: first step allocates the moments
timings = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter(); optimizer.step(); timings.append(time.perf_counter() - started)
print(json.dumps(sorted(timings)[len(timings) // 2]))
"""


def seconds_per_step(threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    completed = subprocess.run(
        [sys.executable, "-c", STEP_TIMER, str(PARAMETERS), str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(completed.stdout.strip().splitlines()[-1]))


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, cores})
    timings = {threads: seconds_per_step(threads) for threads in counts}
    lines = [
        "## DeepSpeedCPUAdam vs OMP_NUM_THREADS (`bench/cpu_adam_threads.py`)",
        "",
        f"Machine: {platform.machine()}, {cores} usable cores; one optimizer step over {PARAMETERS / 1e6:.0f} M fp32 parameters, median of {STEPS}.",
        "",
        "| OMP_NUM_THREADS | seconds per step | slowdown vs all cores |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {threads} | {timings[threads]:.3f} | {timings[threads] / timings[cores]:.2f}× |" for threads in counts
    ]
    table = "\n".join(lines)
    print(table)
    write_section(table, SECTION)


if __name__ == "__main__":
    main()
