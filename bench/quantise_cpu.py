"""What quantising a frozen FLUX base on the CPU costs, per weight and per thread.

A block-swapped LoRA's base is built in host RAM and quantised there, layer by layer, by the trainer's own
layers (fluxbooth.train.quantize: Float8Linear, Nf4Linear), before training starts; the planner charges that
time to the loading phase from the numbers measured here (plan/timing.py CPU_QUANTISE_NS_PER_WEIGHT_THREAD).

Each precision quantises bf16 matrices of FLUX.1's MLP shapes (12288x3072 and 3072x12288), first on one thread
and then on every usable core; the cost is the median seconds times the threads, over the weights: nanoseconds
of one thread per weight. On a machine shared with other work the all-cores row is the noisier one; the planner
reads the 1-thread row.

`python bench/quantise_cpu.py` prints the table and rewrites its section of bench/RESULTS.md (under 60 s on
2 cores).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

import torch  # noqa: E402

from bench.overhead import write_section  # noqa: E402
from fluxbooth.train.quantize import quantised_linear  # noqa: E402

SECTION = "quantise_cpu"
SHAPES = ((12288, 3072), (3072, 12288))
PRECISIONS = ("fp8", "nf4")
REPEATS = 3


def cpu_model() -> str:
    """lscpu's model name (platform.processor() is empty on most Linux machines), else the machine type."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        listing = ""
    for line in listing.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def seconds_to_quantise(precision: str, weights: list[torch.Tensor]) -> float:
    """Median seconds to quantise every matrix in `weights` once, as the trainer's loader does."""
    quantised_linear(precision, weights[0][:64, :64].contiguous(), None)  # warm-up: kernels and tables
    timings = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for weight in weights:
            quantised_linear(precision, weight, None)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def ns_per_weight_thread(precision: str, weights: list[torch.Tensor], threads: int) -> float:
    torch.set_num_threads(threads)
    elements = sum(weight.numel() for weight in weights)
    return seconds_to_quantise(precision, weights) * threads / elements * 1e9


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, cores})
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) for shape in SHAPES]
    with torch.no_grad():
        costs = {(p, t): ns_per_weight_thread(p, weights, t) for p in PRECISIONS for t in counts}
    elements = sum(weight.numel() for weight in weights)
    lines = [
        "## Quantising a frozen base on the CPU (`bench/quantise_cpu.py`)",
        "",
        f"Machine: {cpu_model()}, {cores} usable cores, torch {torch.__version__}; the trainer's own layers"
        f" (fluxbooth.train.quantize) over {len(SHAPES)} bf16 matrices of FLUX.1's block shapes"
        f" ({elements / 1e6:.1f} M weights), median of {REPEATS}.",
        "",
        "| precision | threads | ns per weight per thread |",
        "|---|---:|---:|",
    ]
    lines += [f"| {p} | {t} | {costs[p, t]:.1f} |" for p in PRECISIONS for t in counts]
    table = "\n".join(lines)
    print(table)
    write_section(table, SECTION)


if __name__ == "__main__":
    main()
