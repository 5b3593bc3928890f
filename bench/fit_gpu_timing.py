"""Fit the planner's GPU time model to published FLUX.1 LoRA step times (bench/published_timings.json).

The planner's seconds per step (fluxbooth.plan.timing.step_terms) is a fixed overhead, the matmuls and
attention at GPU_EFFICIENCY of the datasheet bf16 peak, the optimizer, and (quantised base) rebuilding the
weights at DEQUANTISE_BANDWIDTH_EFFICIENCY of the datasheet memory bandwidth. This script evaluates those
terms for every published run the planner can describe (the rows with "fit": true), finds the two
efficiencies that minimise the squared log error over them (a grid search: two parameters, a handful of rows),
and prints, for every row with a stated resolution, the published time beside the planner's before the fit
(the constants up to issue 21) and with the constants in timing.py now, and the spread.

Usage: .venv/bin/python bench/fit_gpu_timing.py [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from activations import replace_section  # noqa: E402 (bench/activations.py)

from fluxbooth.host.hardware import GIB, hypothetical_hardware  # noqa: E402
from fluxbooth.plan import timing  # noqa: E402
from fluxbooth.plan.memory import compute_dtype_bytes, trainable_params  # noqa: E402
from fluxbooth.plan.types import JobShape, Strategy  # noqa: E402
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size  # noqa: E402

RUNS = Path(__file__).resolve().parent / "published_timings.json"
SECTION_BEGIN = "<!-- published-timings:begin -->"
SECTION_END = "<!-- published-timings:end -->"
# The constants before issue 21 fitted them: 40 % of the bf16 peak; fp8 and nf4 dequantisation counted as
# 5 and 9 bytes per weight at the full datasheet bandwidth.
PREVIOUS_GPU_EFFICIENCY = 0.40
PREVIOUS_DEQUANTISE_BYTES = {"fp8": 5.0, "nf4": 9.0}
# Cards without bf16 (compute capability below 8.0) train in fp16.
COMPUTE_CAPABILITY = {"Tesla T4": (7, 5)}
GRID = [step / 1000 for step in range(20, 4001, 5)]


@dataclass(frozen=True)
class Row:
    run: dict[str, Any]
    terms: dict[str, float]


def job_for(run: dict[str, Any]) -> tuple[Strategy, JobShape, Any]:
    targets = run["lora_targets"]
    capability = COMPUTE_CAPABILITY.get(run["gpu"], (8, 9))
    job = JobShape(
        training_type="lora",
        lora_rank=run["lora_rank"],
        lora_targets=tuple(targets) if isinstance(targets, list) else (),
        base_precision=run["base_precision"],
        use_deepspeed=False,
        mixed_precision="bf16" if capability >= (8, 0) else "fp16",
        gradient_checkpointing=bool(run["gradient_checkpointing"]),  # not stated (null): none
        resolution=tuple(run["resolution"]),
        batch_size=run["batch_size"] or 1,
        gradient_accumulation_steps=run["gradient_accumulation_steps"],
        max_sequence_length=run["text_tokens"],
        num_instance_images=4,
    )
    hardware = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=24 * GIB, host_memory_bytes=64 * GIB, disk_bytes=500 * GIB,
        gpu_name=run["gpu"], compute_capability=capability,
    )  # fmt: skip
    every = run.get("checkpoint_every", 1) if run["gradient_checkpointing"] else 0
    return Strategy("lora", False, 0, "none", "none", run["base_precision"], checkpoint_every=every), job, hardware


def terms_of(run: dict[str, Any], model: ModelSize) -> dict[str, float]:
    strategy, job, hardware = job_for(run)
    trainable = trainable_params(model, "lora", job.lora_rank, job.lora_targets or model.default_lora_targets)
    terms = timing.step_terms(strategy, model, job, hardware, trainable, compute_dtype_bytes(job.mixed_precision))
    # As if at GPU_EFFICIENCY, the basis `predicted` rescales from (timing.py uses its card's class's).
    terms["compute"] *= class_efficiency(run) / timing.GPU_EFFICIENCY
    return terms


def class_efficiency(run: dict[str, Any]) -> float:
    """timing.py's efficiency for the run's GPU class."""
    spec = timing.gpu_spec_for(job_for(run)[2])[0]
    return timing.gpu_efficiency(spec)


def predicted(terms: dict[str, float], efficiency: float, dequantise: float, traffic: float = 1.0) -> float:
    """Seconds per step with other efficiencies than timing.py's (the terms scale inversely with them) and
    `traffic` times the dequantisation bytes timing.py counts."""
    compute = terms["compute"] * timing.GPU_EFFICIENCY / efficiency
    rebuild = terms["dequantise"] * timing.DEQUANTISE_BANDWIDTH_EFFICIENCY / dequantise * traffic
    return terms["overhead"] + terms["optimizer"] + terms["streaming"] + compute + rebuild


def implementation_traffic(run: dict[str, Any]) -> float:
    """The dequantisation bytes of the implementation that ran, over those of fluxbooth's (timing.py)."""
    if run["base_precision"] not in timing.DEQUANTISE_TRAFFIC_BYTES:
        return 1.0
    return float(run["dequantise_bytes_per_weight"]) / timing.DEQUANTISE_TRAFFIC_BYTES[run["base_precision"]]


def fit(rows: list[Row]) -> tuple[float, float]:
    def loss(efficiency: float, dequantise: float) -> float:
        return sum(
            math.log(
                predicted(row.terms, efficiency, dequantise, implementation_traffic(row.run))
                / row.run["seconds_per_step"]
            )
            ** 2
            for row in rows
        )

    return min(((efficiency, dequantise) for efficiency in GRID for dequantise in GRID), key=lambda pair: loss(*pair))


def previous(row: Row) -> float:
    """The planner's time before issue 21: its own dequantisation bytes at the full datasheet bandwidth."""
    traffic = PREVIOUS_DEQUANTISE_BYTES.get(row.run["base_precision"], 0.0) / timing.DEQUANTISE_TRAFFIC_BYTES.get(
        row.run["base_precision"], 1.0
    )
    return predicted(row.terms, PREVIOUS_GPU_EFFICIENCY, 1.0, traffic)


def now(row: Row) -> float:
    """The planner's time with timing.py's constants, for the implementation that ran (its dequantisation
    bytes)."""
    return predicted(
        row.terms, class_efficiency(row.run), timing.DEQUANTISE_BANDWIDTH_EFFICIENCY, implementation_traffic(row.run)
    )


def spread(ratios: list[float]) -> str:
    errors = [abs(ratio - 1) for ratio in ratios]
    return (
        f"median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%} "
        f"(predicted/published {min(ratios):.2f}-{max(ratios):.2f})"
    )


def section(rows: list[Row], fitted: tuple[float, float]) -> str:
    current = [now(row) for row in rows]
    lines = [
        SECTION_BEGIN,
        "## The planner's step times beside published ones (`bench/fit_gpu_timing.py`)",
        "",
        "Published seconds per optimizer step of FLUX.1-dev LoRA runs on named GPUs (sources and settings in "
        "docs/published_timings.md and bench/published_timings.json; none measured here). 'Planner' is "
        "fluxbooth.plan.timing for the same GPU, resolution, T5 length, rank, batch, accumulation, checkpointing "
        "and base precision, without DeepSpeed, as the published trainers ran. 'Before' is the time model up "
        f"to issue 21 ({PREVIOUS_GPU_EFFICIENCY:.0%} of the bf16 peak, dequantisation 5 / 9 bytes per weight); "
        f"'now' uses timing.py's GPU_EFFICIENCY = {timing.GPU_EFFICIENCY} (H100, H200, B200: "
        f"DATACENTER_GPU_EFFICIENCY = {timing.DATACENTER_GPU_EFFICIENCY}, an estimate for this trainer without "
        "torch.compile and FlashAttention 3, not fitted) and DEQUANTISE_BANDWIDTH_EFFICIENCY = "
        f"{timing.DEQUANTISE_BANDWIDTH_EFFICIENCY} (the fit over the rows marked 'fit' gives {fitted[0]:.3f} and "
        f"{fitted[1]:.3f}).",
        "",
        "| run | GPU | base | size | rank | batch x accum. | published s/step | planner before | planner now | now / published | fit |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for row, seconds in zip(rows, current, strict=True):
        run = row.run
        width, height = run["resolution"]
        lines.append(
            f"| [{run['id']}]({run['source']}) | {run['gpu']} | {run['base_precision']} ({run['base_implementation']}) | "
            f"{width}x{height}, {run['text_tokens']} text tokens | {run['lora_rank']} | "
            f"{run['batch_size']} x {run['gradient_accumulation_steps']} | {run['seconds_per_step']:.2f} | "
            f"{previous(row):.2f} | {seconds:.2f} | {seconds / run['seconds_per_step']:.2f} | "
            f"{'yes' if run['fit'] else 'no: ' + run['not_fitted']} |"
        )
    fitted_rows = [index for index, row in enumerate(rows) if row.run["fit"]]
    lines += [
        "",
        "Spread over the fitted rows: before, "
        + spread([previous(rows[index]) / rows[index].run["seconds_per_step"] for index in fitted_rows])
        + "; now, "
        + spread([current[index] / rows[index].run["seconds_per_step"] for index in fitted_rows])
        + ".",
        "",
        SECTION_END,
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace this script's section in a RESULTS.md")
    arguments = parser.parse_args(argv)
    model = model_size(FLUX_DEV_NAME)
    runs = json.loads(RUNS.read_text())["runs"]
    rows = [Row(run, terms_of(run, model)) for run in runs if run["resolution"] is not None]
    fitted = fit([row for row in rows if row.run["fit"]])
    print(f"fitted GPU_EFFICIENCY {fitted[0]:.3f}, DEQUANTISE_BANDWIDTH_EFFICIENCY {fitted[1]:.3f}")
    text = section(rows, fitted)
    print(text)
    if arguments.write:
        replace_section(arguments.write, SECTION_BEGIN, SECTION_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
