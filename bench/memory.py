"""Predicted vs measured host-RAM peak on the CPU, for every strategy that runs on DeepSpeed's CPU
accelerator, through the real path: the worker's config files, `accelerate launch`, the trainer.

Two models, both FLUX.1 architecture with random weights, built here (no download):
- `tiny`: fluxbooth.synthetic.tiny's pipeline (135 k transformer parameters) — the process baseline dominates;
- `scaled`: the same encoders and VAE with a wider, deeper transformer (about 70 M parameters),
  so the model states the planner predicts (weights, fp32 master, Adam, gradients) are a large
  part of the peak.

The measured peak is the largest sum of proportional set sizes (PSS: resident memory with pages
shared between processes, such as torch's libraries, counted once) over the launched process tree
(`accelerate launch` and the trainer it starts), sampled every 20 ms. The predicted number is
`Plan.predicted_host_bytes`, which covers the same two processes.

Usage: python bench/memory.py [--models tiny,scaled] [--steps 3] [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import psutil

from fluxbooth.contract.events import EVENT_MARKER
from fluxbooth.host.hardware import probe_hardware
from fluxbooth.job.launch import trainer_command
from fluxbooth.job.launch_files import child_environment, trainer_config_for, write_launch_files
from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.messages import format_bytes
from fluxbooth.plan import Strategy, plan_for_strategy
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec, resolve_job_spec
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import model_size

SECTION_BEGIN = "<!-- memory:begin -->"
SECTION_END = "<!-- memory:end -->"
SAMPLE_SECONDS = 0.02
# Instance images per benchmark job (the planner is told the count, as the worker is after the dataset cap).
BENCH_IMAGES = 4
# glibc raises its mmap threshold after large frees, so freed activation buffers stay in the heap
# and in RSS; a fixed threshold returns them to the system. Both are measured.
ALLOCATOR_VARIANTS = {"glibc default": {}, "MALLOC_MMAP_THRESHOLD_=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"}}

RUN_TIMEOUT_SECONDS = 900

# The scaled transformer: FLUX.1's head dim and block types, 4 heads, 4 + 8 blocks.
SCALED_TRANSFORMER = {
    "num_layers": 4,
    "num_single_layers": 8,
    "attention_head_dim": 128,
    "num_attention_heads": 4,
    "axes_dims_rope": [16, 56, 56],
}

RESOLUTIONS = {"tiny": 64, "scaled": 256}

STRATEGIES = (
    Strategy("full", False, 0, "none", "none"),
    Strategy("full", True, 2, "none", "none"),
    Strategy("full", True, 2, "cpu", "none"),
    Strategy("full", True, 3, "none", "none"),
    Strategy("full", True, 3, "cpu", "none"),
    Strategy("full", True, 3, "cpu", "cpu"),
    Strategy("lora", True, 2, "cpu", "none"),
    Strategy("lora", True, 3, "cpu", "cpu"),
)


@dataclass(frozen=True)
class Measurement:
    model: str
    strategy: Strategy
    allocator: str
    resolution: int
    predicted_bytes: int
    measured_bytes: int
    largest_process_bytes: int
    peak_stage: str
    peak_by_stage: dict[str, int]
    predicted_seconds_per_step: float
    measured_seconds_per_step: float | None
    seconds: float
    returncode: int
    log_tail: str

    @property
    def error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def build_models(root: Path) -> dict[str, Path]:
    import torch
    from diffusers import FluxTransformer2DModel

    from fluxbooth.synthetic.tiny import TRANSFORMER_CONFIG, build_tiny_pipeline

    tiny = build_tiny_pipeline(root / "tiny")
    scaled = root / "scaled"
    if not (scaled / "transformer" / "config.json").is_file():
        staging = root / "scaled.building"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(tiny, staging)
        shutil.rmtree(staging / "transformer")
        torch.manual_seed(0)
        # Stored in bf16, as FLUX.1's own checkpoints are: the planner assumes weights load in the
        # compute dtype without a conversion copy.
        transformer = FluxTransformer2DModel(**{**TRANSFORMER_CONFIG, **SCALED_TRANSFORMER}).to(torch.bfloat16)
        transformer.save_pretrained(staging / "transformer")
        staging.rename(scaled)
    return {"tiny": tiny, "scaled": scaled}


def make_images(folder: Path, count: int, side: int) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for index in range(count):
        pixels = generator.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"image_{index}.png")


class TreeSampler:
    """Samples the summed PSS of a process and all its descendants until stopped, and notes the
    trainer stage (from its progress events) in which the peak happened."""

    def __init__(self, pid: int) -> None:
        self._root = psutil.Process(pid)
        self.peak = 0
        self.largest = 0
        self.stage = "launch"
        self.peak_stage = "launch"
        self.peak_by_stage: dict[str, int] = {}
        self.step_seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                processes = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            sizes = []
            for process in processes:
                try:
                    # PSS: shared library pages (torch is mapped by both processes) count once in the sum.
                    sizes.append(process.memory_full_info().pss)
                except psutil.Error:
                    continue
            if sizes:
                total = sum(sizes)
                self.peak_by_stage[self.stage] = max(self.peak_by_stage.get(self.stage, 0), total)
                if total > self.peak:
                    self.peak = total
                    self.peak_stage = self.stage
                self.largest = max(self.largest, max(sizes))
            time.sleep(SAMPLE_SECONDS)


def predicted_host_bytes(
    plan_bytes: int, strategy: Strategy, spec: JobSpec, hardware: Any, size: Any, allocator: str
) -> int:
    """The plan's prediction; with glibc's mmap threshold fixed, less the allocator-retention term
    (which models glibc's default behaviour and is what the worker ships with)."""
    if allocator == "glibc default":
        return plan_bytes
    from fluxbooth.plan import JobShape, estimate_memory

    job = JobShape.from_spec(spec, instance_images=BENCH_IMAGES)
    estimate = estimate_memory(strategy, size, job, hardware, job.mixed_precision)
    return plan_bytes - estimate.breakdown.get("host.allocator_retention", 0)


def bench_spec(strategy: Strategy, resolution: int, size: Any, **fields: Any) -> JobSpec:
    """The job spec a benchmark job of `strategy` runs (a LoRA at rank 4), as the worker resolves it."""
    request = parse_request(
        {
            "model_name": "bench",
            "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
            "instance_prompt": "a photo of sks dog",
            "resolution": resolution,
            "training_type": strategy.training_type,
            "use_deepspeed": strategy.use_deepspeed,
            **({"lora_rank": 4} if strategy.training_type == "lora" else {}),
            **fields,
        }
    )
    return resolve_job_spec(request, size, WorkerSettings.from_environ({}))


def run_one(
    model_name: str, model_dir: Path, strategy: Strategy, resolution: int, steps: int, work: Path, allocator: str
) -> Measurement:
    job_dir = (
        work
        / f"{model_name}-{strategy.training_type}-z{strategy.zero_stage}-{strategy.offload_optimizer}-{strategy.offload_param}"
    )
    shutil.rmtree(job_dir, ignore_errors=True)
    instance_dir = job_dir / "data" / "instance"
    make_images(instance_dir, BENCH_IMAGES, resolution)
    hardware = probe_hardware(job_dir, {"PATH": os.environ.get("PATH", "")})
    size = model_size(str(model_dir))
    spec = bench_spec(strategy, resolution, size, steps=steps)
    plan = plan_for_strategy(strategy, spec, hardware, size, instance_images=BENCH_IMAGES)
    trainer = trainer_config_for(
        spec, plan, base_model=str(model_dir), instance_dir=instance_dir, class_dir=None, job_dir=job_dir
    )
    files = write_launch_files(job_dir, plan, trainer)
    extensions = extensions_dir(WorkerSettings.from_environ(os.environ))
    env = child_environment(plan, os.environ, cpu_count=hardware.cpu_count, torch_extensions_dir=extensions)
    env.update(ALLOCATOR_VARIANTS[allocator])
    command = trainer_command(files, plan, hardware.cpu_count)
    started = time.monotonic()
    with (job_dir / "trainer.log").open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=job_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        with TreeSampler(process.pid) as sampler:
            deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                if line.startswith(EVENT_MARKER):
                    try:
                        event = json.loads(line[len(EVENT_MARKER) :])
                    except ValueError:
                        event = {}
                    if event.get("event") == "stage":
                        sampler.stage = str(event.get("stage"))
                    elif event.get("event") == "step" and event.get("seconds_per_step") is not None:
                        sampler.step_seconds.append(float(event["seconds_per_step"]))
                if time.monotonic() > deadline:
                    os.killpg(process.pid, 9)
            returncode = process.wait()
    lines = (job_dir / "trainer.log").read_text(errors="replace").splitlines()
    return Measurement(
        model=model_name,
        strategy=strategy,
        allocator=allocator,
        resolution=resolution,
        predicted_bytes=predicted_host_bytes(plan.predicted_host_bytes, strategy, spec, hardware, size, allocator),
        measured_bytes=sampler.peak,
        largest_process_bytes=sampler.largest,
        peak_stage=sampler.peak_stage,
        peak_by_stage=dict(sampler.peak_by_stage),
        predicted_seconds_per_step=plan.predicted_seconds_per_step or 0.0,
        # The first step pays one-off costs (allocations, op warm-up): the median of the rest.
        measured_seconds_per_step=statistics.median(sampler.step_seconds[1:] or sampler.step_seconds)
        if sampler.step_seconds
        else None,
        seconds=time.monotonic() - started,
        returncode=returncode,
        log_tail="\n".join(lines[-5:]),
    )


def describe(strategy: Strategy) -> str:
    if not strategy.use_deepspeed:
        return f"{strategy.training_type}, no DeepSpeed"
    return f"{strategy.training_type}, ZeRO-{strategy.zero_stage}, offload {strategy.offload_optimizer}/{strategy.offload_param}"


def machine_description() -> str:
    """This machine as the RESULTS sections name it (the CPU benches run without a GPU)."""
    import torch

    return (
        f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"{format_bytes(psutil.virtual_memory().total)} RAM, torch {torch.__version__}, no GPU"
    )


def section(measurements: list[Measurement], sizes: dict[str, Any]) -> str:
    machine = machine_description()
    lines = [
        SECTION_BEGIN,
        "### Host RAM on the CPU: predicted vs measured (bench/memory.py)",
        "",
        f"Machine: {machine}. Real `accelerate launch` of the trainer (DeepSpeed CPU accelerator, bf16, "
        "gradient checkpointing), measured = peak summed PSS of the launcher and trainer processes "
        "(20 ms sampling), predicted = `Plan.predicted_host_bytes`. The worker runs with glibc's default "
        "allocator settings; the rows with `MALLOC_MMAP_THRESHOLD_` fixed are an experiment that isolates "
        "the memory glibc keeps after frees (predicted there without the `allocator_retention` term, see "
        "docs/memory.md). s/step: the trainer's own timing, median of steps 2-5, on a machine shared with "
        "other work (noisy).",
        "",
        "Not independent of these runs: the process baselines (0.39 + 0.05 + 0.19 GiB) were read off the "
        "tiny rows, and the allocator-retention factors (1× and 2× the 16-bit weights) off the difference "
        "between the two allocator settings of the scaled rows; the export phase was added after the "
        "scaled runs showed the peak there. Everything else is docs/memory.md's formulas.",
        "",
        "| model | transformer params | strategy | resolution | allocator | predicted | measured | error | peak during | s/step predicted | s/step measured | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item in measurements:
        lines.append(
            f"| {item.model} | {sizes[item.model]:,} | {describe(item.strategy)} | {item.resolution}² | {item.allocator} | "
            f"{format_bytes(item.predicted_bytes)} | {format_bytes(item.measured_bytes)} | "
            f"{item.error * 100:+.1f} % | {item.peak_stage} | {item.predicted_seconds_per_step:.2f} | "
            f"{item.measured_seconds_per_step if item.measured_seconds_per_step is None else round(item.measured_seconds_per_step, 2)} | "
            f"{item.returncode} |"
        )
    for allocator in ALLOCATOR_VARIANTS:
        ok = [item for item in measurements if item.returncode == 0 and item.allocator == allocator]
        if ok:
            worst = max(ok, key=lambda item: abs(item.error))
            lines += [
                "",
                f"Largest error with {allocator}: {worst.error * 100:+.1f} % "
                f"({worst.model}, {describe(worst.strategy)}; {len(ok)} runs).",
            ]
    lines += [
        "",
        "GPU rows (full-size FLUX.1 with random weights at 512² and 1024², emulated 8/16/24 GiB cards, "
        "the cost of CUDA_LAUNCH_BLOCKING / PYTORCH_NO_CUDA_MEMORY_CACHING): not measured — no GPU was "
        "available to this work. The GPU column of `python -m fluxbooth plan` is a prediction only.",
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


def rerender(log: Path, models: dict[str, Path], jobs: Path) -> tuple[list[Measurement], dict[str, int]]:
    """Measurements from an earlier run's JSON lines, predictions recomputed by the current planner."""
    measurements = []
    sizes = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "strategy_fields" in row:
            strategy = Strategy(*row["strategy_fields"])
        else:
            strategy = next(candidate for candidate in STRATEGIES if describe(candidate) == row["strategy"])
        row.setdefault("resolution", RESOLUTIONS[row["model"]])
        model_dir = models[row["model"]]
        size = model_size(str(model_dir))
        sizes[row["model"]] = size.transformer_params
        spec = bench_spec(strategy, row["resolution"], size)
        hardware = probe_hardware(jobs, {"PATH": os.environ.get("PATH", "")})
        plan = plan_for_strategy(strategy, spec, hardware, size, instance_images=BENCH_IMAGES)
        measurements.append(
            Measurement(
                model=row["model"],
                strategy=strategy,
                allocator=row["allocator"],
                resolution=row["resolution"],
                predicted_bytes=predicted_host_bytes(
                    plan.predicted_host_bytes, strategy, spec, hardware, size, row["allocator"]
                ),
                measured_bytes=row["measured"],
                largest_process_bytes=row["largest_process"],
                peak_stage=row["peak_stage"],
                peak_by_stage=row["peak_by_stage"],
                predicted_seconds_per_step=plan.predicted_seconds_per_step or 0.0,
                measured_seconds_per_step=row["seconds_per_step"][1],
                seconds=row["seconds"],
                returncode=row["exit"],
                log_tail="",
            )
        )
    return measurements, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,scaled")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "fluxbooth-bench-memory")
    parser.add_argument("--only", default=None, help="comma-separated indices into the strategy list")
    parser.add_argument(
        "--allocators", default="glibc default", help=f"comma-separated, from {list(ALLOCATOR_VARIANTS)}"
    )
    parser.add_argument("--write", type=Path, help="replace the memory section of this markdown file")
    parser.add_argument(
        "--render",
        type=Path,
        help="do not run anything: re-render the section from this earlier run's output (its JSON lines), "
        "with predictions from the current planner",
    )
    arguments = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    arguments.work_dir.mkdir(parents=True, exist_ok=True)
    models = build_models(arguments.work_dir / "models")
    if arguments.render:
        measurements, sizes = rerender(arguments.render, models, arguments.work_dir / "jobs")
        text = section(measurements, sizes)
        print(text)
        if arguments.write:
            sys.path.insert(0, str(Path(__file__).parent))
            from activations import replace_section

            replace_section(arguments.write, SECTION_BEGIN, SECTION_END, text)
        return
    resolutions = RESOLUTIONS
    strategies = STRATEGIES
    if arguments.only:
        strategies = tuple(STRATEGIES[int(index)] for index in arguments.only.split(","))
    measurements = []
    sizes = {}
    for name in arguments.models.split(","):
        sizes[name] = model_size(str(models[name])).transformer_params
        for strategy, allocator in [(st, al) for st in strategies for al in arguments.allocators.split(",")]:
            item = run_one(
                name, models[name], strategy, resolutions[name], arguments.steps, arguments.work_dir / "jobs", allocator
            )
            measurements.append(item)
            print(
                json.dumps(
                    {
                        "model": name,
                        "strategy": describe(strategy),
                        "strategy_fields": list(astuple(strategy)),
                        "resolution": item.resolution,
                        "allocator": allocator,
                        "predicted": item.predicted_bytes,
                        "measured": item.measured_bytes,
                        "largest_process": item.largest_process_bytes,
                        "peak_stage": item.peak_stage,
                        "peak_by_stage": item.peak_by_stage,
                        "error_percent": round(item.error * 100, 1),
                        "seconds": round(item.seconds, 1),
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
        sys.path.insert(0, str(Path(__file__).parent))
        from activations import replace_section

        replace_section(arguments.write, SECTION_BEGIN, SECTION_END, text)


if __name__ == "__main__":
    main()
