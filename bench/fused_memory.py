"""Host-RAM peak of the fused Adafactor full fine-tune (bf16 weights, Adafactor stepped per parameter inside
the backward pass, no DeepSpeed) on the CPU, against the planner's prediction, through the real path: the
worker's config files from the plan, `accelerate launch`, the trainer.

bench/memory.py's method and models, reused rather than copied: the tiny model and the `scaled` FLUX-architecture
transformer (71 M parameters, random weights, stored in bf16), 4 instance images, the summed PSS of the launcher
and trainer processes sampled every 20 ms, predicted = the plan's host peak over the phases they run for
Strategy.fused_backward_pass. glibc's default allocator settings, as the worker runs.

Usage: python bench/fused_memory.py [--models tiny,scaled] [--steps 4] [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from activations import replace_section  # noqa: E402
from memory import (  # noqa: E402
    BENCH_IMAGES,
    RESOLUTIONS,
    Measurement,
    bench_spec,
    build_models,
    machine_description,
    run_one,
)

from fluxbooth.host.hardware import probe_hardware  # noqa: E402
from fluxbooth.messages import format_bytes  # noqa: E402
from fluxbooth.plan import plan_for_strategy  # noqa: E402
from fluxbooth.plan.candidates import FUSED_STRATEGY  # noqa: E402
from fluxbooth.sizing import model_size  # noqa: E402

SECTION_BEGIN = "<!-- fused_memory:begin -->"
SECTION_END = "<!-- fused_memory:end -->"
AGREEMENT = 0.15
# The phase the plan counts after the trainer has exited (the worker drawing the report): not these processes.
WORKER_ONLY_PHASES = ("report",)


def trainer_phases_prediction(model_dir: Path, resolution: int, steps: int, work: Path) -> int:
    """The plan's host peak over the phases the trainer runs (loading to export): what the bench measures."""
    size = model_size(str(model_dir))
    plan = plan_for_strategy(
        FUSED_STRATEGY,
        bench_spec(FUSED_STRATEGY, resolution, size, steps=steps),
        probe_hardware(work, {"PATH": os.environ.get("PATH", "")}),
        size,
        instance_images=BENCH_IMAGES,
    )
    return max(phase.host_bytes for name, phase in plan.phases if name not in WORKER_ONLY_PHASES)


def section(measurements: list[Measurement], sizes: dict[str, int]) -> str:
    machine = machine_description()
    lines = [
        SECTION_BEGIN,
        "### Fused Adafactor full fine-tune: host RAM on the CPU, predicted vs measured (bench/fused_memory.py)",
        "",
        f"Machine: {machine}, shared with other engineers' work while it ran (times are noisy; memory is not "
        "affected). `accelerate launch` of the trainer without DeepSpeed, bf16 weights, Adafactor fused into the "
        "backward pass (train/fused_adafactor.py), gradient checkpointing, glibc's default allocator; measured = "
        "peak summed PSS of the launcher and trainer processes (20 ms sampling), predicted = the plan's host "
        "peak over the phases these processes run, loading to export (`Plan.phases`; the report phase after them "
        "is the worker's) (on the CPU every device term is host memory: the bf16 weights, Adafactor's "
        "factored state, the largest layer's gradient and fp32 step copies, the activations, plus glibc's "
        "retention of 1x the bf16 weights). s/step: the trainer's own timing, median of the steps after the first.",
        "",
        "| model | transformer params | resolution | predicted | measured | error | peak during | s/step predicted | s/step measured | exit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item in measurements:
        measured_step = "-" if item.measured_seconds_per_step is None else f"{item.measured_seconds_per_step:.2f}"
        lines.append(
            f"| {item.model} | {sizes[item.model]:,} | {item.resolution}² | {format_bytes(item.predicted_bytes)} | "
            f"{format_bytes(item.measured_bytes)} | {item.error * 100:+.1f} % | {item.peak_stage} | "
            f"{item.predicted_seconds_per_step:.2f} | {measured_step} | {item.returncode} |"
        )
    ok = [item for item in measurements if item.returncode == 0]
    if ok:
        worst = max(ok, key=lambda item: abs(item.error))
        verdict = "within" if abs(worst.error) <= AGREEMENT else "outside"
        lines += ["", f"Largest error: {worst.error * 100:+.1f} % ({worst.model}), {verdict} ±{AGREEMENT * 100:.0f} %."]
    lines += [
        "",
        "GPU memory and time of this strategy (FLUX.1-dev on 24/48/80 GiB cards): predictions only — no GPU was "
        "available to this work.",
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,scaled")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "fluxbooth-bench-fused-memory")
    parser.add_argument("--write", type=Path, help="replace (or add) the fused_memory section of this markdown file")
    arguments = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    arguments.work_dir.mkdir(parents=True, exist_ok=True)
    models = build_models(arguments.work_dir / "models")
    measurements, sizes = [], {}
    for name in arguments.models.split(","):
        sizes[name] = model_size(str(models[name])).transformer_params
        item = run_one(
            name,
            models[name],
            FUSED_STRATEGY,
            RESOLUTIONS[name],
            arguments.steps,
            arguments.work_dir / "jobs",
            "glibc default",
        )
        predicted = trainer_phases_prediction(
            models[name], RESOLUTIONS[name], arguments.steps, arguments.work_dir / "jobs"
        )
        item = replace(item, predicted_bytes=predicted)
        measurements.append(item)
        print(
            json.dumps(
                {
                    "model": name,
                    "predicted": item.predicted_bytes,
                    "measured": item.measured_bytes,
                    "error_percent": round(item.error * 100, 1),
                    "peak_stage": item.peak_stage,
                    "peak_by_stage": item.peak_by_stage,
                    "seconds_per_step": [item.predicted_seconds_per_step, item.measured_seconds_per_step],
                    "exit": item.returncode,
                }
            ),
            flush=True,
        )
        if item.returncode != 0:
            print(item.log_tail, file=sys.stderr, flush=True)
    text = section(measurements, sizes)
    print(text)
    if arguments.write:
        replace_section(arguments.write, SECTION_BEGIN, SECTION_END, text)


if __name__ == "__main__":
    main()
