"""GPU evidence: the worker's real path on a full-size synthetic FLUX.1-dev (calls 1-3) and FLUX.2 [klein] 4B
(call 4), in calls of at most 9 minutes.

Each run writes a request JSON, records `python -m fluxbooth plan --json` for it, then runs
`python -m fluxbooth train` on it while a thread samples NVML's used memory and the summed PSS of the
worker's process tree; the trainer's events give the phases and the seconds per step, its result the
PyTorch allocator peaks. Smaller cards are emulated on the big one: FLUXBOOTH_GPU_MEMORY_BYTES makes
the planner see the small card, FLUXBOOTH_CUDA_MEMORY_FRACTION caps PyTorch's allocator inside the
trainer (it caps only PyTorch, so NVML's reading is recorded beside it).

  call 1: setup (DeepSpeed's CUDA ops built and timed, flux1-dev built on the GPU), then a rank-16
          LoRA at 1024² planned for 80 and 48 GiB cards, for every base precision the request accepts;
  call 2: the same for 24 and 16 GiB cards;
  call 3: LoRA with ZeRO-3 parameter offload on an 8 GiB card at 512²; a full fine-tune (ZeRO-2,
          optimizer offloaded) on a reduced-depth model sized to the host RAM; the end-of-job phases
          (validation render, export) under 24 and 16 GiB; the guide's debug variables off and on.
  call 4: the other families: a full-size synthetic FLUX.2 [klein] 4B (Qwen3-4B text encoder) built on the
          GPU, a rank-16 LoRA at 1024² planned for 24 and 16 GiB cards, and its end of job (validation with
          the family's sampling, both LoRA formats) on 24 GiB. FLUX.2 [dev] (32 B transformer, 24 B text
          encoder: 112 GB of bf16 weights) does not fit the lent machine's 64 GiB disk and is planned only
          (bench/family_tiers.py).

A run that would not finish within the call's budget is skipped and noted in the work folder; the
next call on the same (still warm) machine runs it first. Each call appends its table to bench/RESULTS.md (`--results`) and writes every log under `--out`
($OUT on the device machine). `--dry-run` runs the same code on the CPU with the `scaled` preset, a
few steps at 64², and two runs (the end-of-job LoRA on the reduced-depth model, and on tiny FLUX.2 [klein]).

Usage: python bench/gpu.py --call 1|2|3 [--out DIR] [--work DIR] [--results FILE] [--only NAME,...]
       python bench/gpu.py --dry-run --out DIR --results FILE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fluxbooth.hardware import GIB, format_bytes  # noqa: E402
from gpu_runner import Nvml, RunRecord, RunSpec, dataset_zip, predict, read_result, train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CARDS_GIB = (80, 48, 24, 16)
FALLBACK_PRECISIONS = ("bf16", "fp8", "nf4")
CALL_BUDGET_SECONDS = 510.0
SAFETY_SECONDS = 15.0
SECTION_TITLE = "### GPU: the worker on a full-size synthetic FLUX.1-dev (bench/gpu.py)"
LORA = {"training_type": "lora", "lora_rank": 16}


@dataclass(frozen=True)
class Mode:
    """What differs between a GPU call and the CPU dry run: the model, the sizes, the step counts."""

    preset: str
    device: str
    resolution: int
    small_resolution: int
    steps: int
    dry_run: bool
    # Sampling a process tree's PSS costs CPU: slower on a small shared machine.
    sample_seconds: float
    klein_preset: str  # the FLUX.2 [klein] model call 4 trains


GPU_MODE = Mode("flux1-dev", "cuda", 1024, small_resolution=512, steps=6, dry_run=False, sample_seconds=0.1, klein_preset="flux2-klein-4b")
DRY_MODE = Mode("scaled", "cpu", 64, small_resolution=64, steps=2, dry_run=True, sample_seconds=0.5, klein_preset="tiny-flux2-klein")
KLEIN = "klein"  # RunSpec.model of the runs on mode.klein_preset


def request_precisions() -> tuple[list[str], bool]:
    """The base precisions the request schema accepts ("auto" aside), and whether it has the field at all."""
    from fluxbooth.request import TrainingRequest

    declared = TrainingRequest.model_fields.get("base_precision")
    if declared is None:
        return list(FALLBACK_PRECISIONS), False
    values: list[str] = []
    pending = [declared.annotation]
    while pending:
        annotation = pending.pop()
        for argument in typing.get_args(annotation):
            if isinstance(argument, str) and argument != "auto":
                values.append(argument)
            elif argument is not None and not isinstance(argument, str):
                pending.append(argument)
    return sorted(set(values), key=lambda value: (value != "bf16", value)), True


def precision_fields(precision: str, schema_has_field: bool) -> dict[str, Any]:
    # Before the field exists every run is bf16 (leave it out); fp8/nf4 then go in as-is and are refused.
    if precision == "bf16" and not schema_has_field:
        return {}
    return {"base_precision": precision}


def lora_runs(call: int, cards: tuple[int, ...], precisions: list[str], has_field: bool, mode: Mode) -> list[RunSpec]:
    return [
        RunSpec(
            name=f"lora-r16-{mode.resolution}-{card}GiB-{precision}",
            call=call,
            purpose=f"LoRA r16 {mode.resolution}², plan for {card} GiB",
            fields={**LORA, "resolution": mode.resolution, **precision_fields(precision, has_field)},
            card_gib=card,
            # Quantising the base on load (fp8, nf4) and offloading (small cards) cost time of their own.
            estimate_seconds=(100 if card >= 48 else 150) + (0 if precision == "bf16" else 60),
        )
        for card in cards
        for precision in precisions
    ]


def call_three(mode: Mode) -> list[RunSpec]:
    end_of_job = {
        **LORA, "resolution": mode.resolution, "validation_prompts": ["a photo of sks dog"],
        "output_formats": ["diffusers", "comfyui"],
    }
    return [
        RunSpec(
            "lora-zero3-offload-8GiB-512", 3, f"LoRA r16 {mode.small_resolution}², ZeRO-3 parameter offload, 8 GiB",
            {**LORA, "resolution": mode.small_resolution, "zero_stage": 3, "offload": "cpu"}, card_gib=8,
            estimate_seconds=150,
        ),
        RunSpec(
            "full-zero2-offload-reduced", 3, "full fine-tune, ZeRO-2, optimizer offloaded, reduced depth",
            {"training_type": "full", "resolution": mode.small_resolution, "zero_stage": 2, "offload": "cpu"},
            model="reduced", estimate_seconds=150,
        ),
        RunSpec("end-of-job-24GiB", 3, "validation render + export, 24 GiB", end_of_job, card_gib=24, estimate_seconds=120),
        RunSpec("end-of-job-16GiB", 3, "validation render + export, 16 GiB", end_of_job, card_gib=16, estimate_seconds=200),
        RunSpec("debug-off", 3, f"LoRA r16 {mode.resolution}², 80 GiB, debug off", {**LORA, "resolution": mode.resolution}, card_gib=80),
        RunSpec(
            "debug-on", 3, f"LoRA r16 {mode.resolution}², 80 GiB, debug on (CUDA_LAUNCH_BLOCKING, no allocator cache)",
            {**LORA, "resolution": mode.resolution, "debug": True}, card_gib=80, estimate_seconds=200,
        ),
    ]


def call_four(mode: Mode) -> list[RunSpec]:
    """FLUX.2 [klein] 4B: LoRA on 24 and 16 GiB cards (the planner picks the base precision), then its end of job."""
    end_of_job = {
        **LORA, "resolution": mode.resolution, "validation_prompts": ["a photo of sks dog"], "output_formats": ["diffusers", "comfyui"],
    }
    return [
        RunSpec(f"klein4b-lora-r16-{mode.resolution}-{card}GiB", 4, f"FLUX.2 [klein] 4B, LoRA r16 {mode.resolution}², plan for {card} GiB",
                {**LORA, "resolution": mode.resolution}, card_gib=card, model=KLEIN, estimate_seconds=120)
        for card in (24, 16)
    ] + [
        RunSpec("klein4b-end-of-job-24GiB", 4, "FLUX.2 [klein] 4B, validation render + export, 24 GiB", end_of_job, card_gib=24,
                model=KLEIN, estimate_seconds=150),
    ]


def sequence(mode: Mode) -> list[RunSpec]:
    """Every run of the four calls, in order."""
    precisions, has_field = request_precisions()
    runs = lora_runs(1, CARDS_GIB[:2], precisions, has_field, mode)
    runs += lora_runs(2, CARDS_GIB[2:], precisions, has_field, mode)
    runs += call_three(mode)
    runs += call_four(mode)
    if mode.dry_run:
        # The same code path in runs that fit a CPU test: the end-of-job LoRA (training, validation render,
        # export) on the reduced-depth model (so its build is exercised too), and on tiny FLUX.2 [klein].
        ends = ("end-of-job-24GiB", "klein4b-end-of-job-24GiB")
        runs = [replace(run, call=0, model="reduced" if run.model == "full" else run.model) for run in runs if run.name in ends]
    return runs


# ----------------------------------------------------------------------------------------------
# Setup: the wheels' packages checked, DeepSpeed's ops and the synthetic models built, all timed
# ----------------------------------------------------------------------------------------------


def timed(label: str, command: list[str], env: dict[str, str], log_dir: Path, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = round(time.monotonic() - started, 1)
    (log_dir / f"setup-{label}.log").write_text(completed.stdout + "\n--- stderr ---\n" + completed.stderr)
    print(f"setup {label}: exit {completed.returncode} in {seconds} s", flush=True)
    return {"step": label, "exit": completed.returncode, "seconds": seconds, "tail": completed.stderr.strip()[-300:]}


BUILD_OPS = """
import deepspeed
from deepspeed.accelerator import get_accelerator
for name in ("FusedAdamBuilder", "CPUAdamBuilder"):
    get_accelerator().create_op_builder(name).load()
    print(name, "loaded", flush=True)
"""


def reduced_layers(host_bytes: int, mode: Mode) -> tuple[int, int]:
    """Double and single blocks (FLUX's 1:2 ratio) for a full fine-tune whose host state fits `host_bytes`:
    about 20 bytes per parameter on the host (fp32 master weights, Adam's two moments, fp32 gradients)
    kept under 40 % of the RAM. One double block is ~340 M parameters, one single block ~142 M."""
    if mode.dry_run:
        return 1, 2
    parameters = 0.4 * host_bytes / 20
    blocks = max(1, int((parameters - 0.1e9) // (340e6 + 2 * 142e6)))
    return min(blocks, 19), min(2 * blocks, 38)


def setup(
    mode: Mode, work: Path, log_dir: Path, env: dict[str, str], runs: list[RunSpec]
) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Build (or reuse) the models the runs need; on a GPU also DeepSpeed's CUDA ops. The models and the timings."""
    import psutil

    steps = []
    if not mode.dry_run:
        steps.append(timed("deepspeed-ops", [sys.executable, "-c", BUILD_OPS], env, log_dir, 400))
    full = work / "models" / mode.preset
    double, single = reduced_layers(psutil.virtual_memory().total, mode)
    reduced = work / "models" / f"{mode.preset}-{double}x{single}"
    klein = work / "models" / mode.klein_preset
    models = {"full": full, "reduced": reduced, KLEIN: klein}
    for preset, folder, needed in ((mode.preset, full, ("full", "reduced")), (mode.klein_preset, klein, (KLEIN,))):
        if any(run.model in needed for run in runs):
            steps.append(timed(
                f"build-{preset}", [sys.executable, "-m", "fluxbooth.synthetic", "--preset", preset, "--device", mode.device, str(folder)],
                env, log_dir, 500,
            ))
    if not any(run.model == "reduced" for run in runs):
        return models, steps
    steps.append(timed(
        f"build-reduced-{double}x{single}",
        [sys.executable, "-m", "fluxbooth.synthetic", "--preset", mode.preset, "--device", mode.device,
         "--layers", f"{double},{single}", "--share-encoders-with", str(full), str(reduced)],
        env, log_dir, 300,
    ))
    return models, steps


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------


def run_environment(base: dict[str, str], work: Path, spec: RunSpec, real_gpu_bytes: int | None) -> dict[str, str]:
    env = {
        **base,
        "FLUXBOOTH_WORK_DIR": str(work / "jobs"),
        "FLUXBOOTH_OUTPUT_DIR": str(work / "outputs" / spec.name),
        "FLUXBOOTH_CACHE_DIR": str(work / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(work / "no-volume"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if spec.card_gib is not None and real_gpu_bytes:
        card = int(spec.card_gib * GIB)
        env["FLUXBOOTH_GPU_MEMORY_BYTES"] = str(card)
        if card < real_gpu_bytes:
            env["FLUXBOOTH_CUDA_MEMORY_FRACTION"] = f"{card / real_gpu_bytes:.6f}"
    return env


def run_one(spec: RunSpec, mode: Mode, models: dict[str, Path], work: Path, log_dir: Path, nvml: Nvml, timeout: float) -> RunRecord:
    import base64

    from fluxbooth.modelsize import model_size

    folder = log_dir / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = models[spec.model]
    request = {
        "model_name": spec.name,
        "dataset": base64.b64encode(dataset_zip(4, mode.resolution)).decode("ascii"),
        "instance_prompt": "a photo of sks dog",
        "base_model": str(model_dir),
        "steps": mode.steps,
        "timeout_seconds": max(60, int(timeout)),
        **spec.fields,
    }
    request_path = folder / "request.json"
    request_path.write_text(json.dumps(request, indent=2) + "\n")
    card = f"{spec.card_gib:g} GiB" if spec.card_gib is not None else "whole GPU"
    record = RunRecord(spec.name, spec.call, spec.purpose, card, str(spec.fields.get("base_precision", "bf16")))
    record.transformer_params = model_size(str(model_dir)).transformer_params
    env = run_environment(os.environ.copy(), work, spec, nvml.total_bytes())
    (folder / "env.json").write_text(json.dumps({k: v for k, v in env.items() if k.startswith("FLUXBOOTH_")}, indent=2))
    record.plan = predict(request_path, env, folder)
    result = train(request_path, env, folder, record, nvml, timeout, mode.sample_seconds)
    read_result(result, record)
    exported = sum(int(artifact.get("bytes", 0)) for artifact in result.get("artifacts", []))
    if exported:
        record.notes.append(f"exported {format_bytes(exported)}")
    # The weights are not the measurement; a full fine-tune's would fill the disk over a call.
    shutil.rmtree(work / "outputs" / spec.name, ignore_errors=True)
    if spec.model == "reduced" and record.transformer_params:
        parameters = record.transformer_params
        record.notes.append(
            f"per transformer parameter: host {record.host_peak / parameters:.1f} B"
            + (f", GPU (NVML) {record.nvml_used_peak / parameters:.1f} B" if record.nvml_used_peak else "")
        )
    return record


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


def machine(nvml: Nvml) -> str:
    """GPU, driver, CUDA, torch and DeepSpeed, named in every row."""
    import deepspeed
    import torch

    described = nvml.describe()
    if not described:
        return f"CPU only ({platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, DeepSpeed {deepspeed.__version__}"
    return (
        f"{described['gpu']}, driver {described['driver']}, CUDA {torch.version.cuda}, torch {torch.__version__}, "
        f"DeepSpeed {deepspeed.__version__}"
    )


def gib(value: int | float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def plan_cell(plan: dict[str, Any]) -> str:
    if "error" in plan:
        return f"refused ({plan['error'][:80]})"
    if not plan:
        return "-"
    strategy = f"ZeRO-{plan.get('zero_stage')}" if plan.get("use_deepspeed") else "no DeepSpeed"
    base = f", base {plan['base_precision']}" if plan.get("base_precision") else ""
    return f"{plan.get('training_type')} {strategy} offload {plan.get('offload_optimizer')}/{plan.get('offload_param')}{base}"


def row(record: RunRecord, where: str) -> str:
    plan = record.plan
    phases = ", ".join(f"{name} {seconds:.0f}" for name, seconds in record.phase_seconds.items())
    predicted_step = plan.get("predicted_seconds_per_step")
    cells = [
        record.name, where, record.card, record.base_precision, plan_cell(plan),
        gib(plan.get("predicted_gpu_bytes")), gib(record.gpu_allocated_peak), gib(record.gpu_reserved_peak),
        gib(record.nvml_used_peak), gib(plan.get("predicted_host_bytes")), gib(record.host_peak),
        "-" if predicted_step is None else f"{predicted_step:.2f}",
        "-" if record.seconds_per_step is None else f"{record.seconds_per_step:.2f}",
        phases or "-", f"{record.exit_status} {record.outcome[:120]}".replace("|", "/"), "; ".join(record.notes) or "-",
    ]
    return "| " + " | ".join(str(cell).replace("\n", " ") for cell in cells) + " |"


HEADER = (
    "| run | machine | card | base | plan | GPU pred GiB | alloc peak | reserved peak | NVML used peak | "
    "host pred GiB | host peak (PSS) | s/step pred | s/step | phases (s) | exit | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def section(call: str, where: str, records: list[RunRecord], setup_steps: list[dict[str, Any]], skipped: list[str]) -> str:
    lines = [
        "", f"{SECTION_TITLE}, call {call}", "",
        f"Machine: {where}. Recorded {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. GPU pred/host pred: "
        "`python -m fluxbooth plan --json`; alloc/reserved: the trainer's torch peaks; NVML: the device's used "
        "memory sampled every 0.1 s (it includes the CUDA context, and is not capped by the emulated card); "
        "host: summed PSS of the worker's process tree; s/step: median after the first step.", "",
    ]
    if setup_steps:
        lines.append("Setup: " + "; ".join(f"{step['step']} exit {step['exit']} in {step['seconds']} s" for step in setup_steps) + ".")
        lines.append("")
    lines.append(HEADER)
    lines += [row(record, where) for record in records]
    if skipped:
        lines += ["", "Not run in this call (its time budget was spent; the next call runs them first): " + ", ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--call", type=int, choices=(1, 2, 3, 4), help="which of the four GPU calls to run")
    which.add_argument("--dry-run", action="store_true", help="the same code on the CPU: scaled preset, 64², one run")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="where the logs go (default: $OUT)")
    parser.add_argument("--work", type=Path, default=REPO / ".fluxbooth" / "gpu-bench",
                        help="models, jobs and caches (kept between calls while the machine stays warm)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "RESULTS.md", help="the markdown file the table is appended to")
    parser.add_argument("--only", default=None, help="comma-separated run names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the runs of every call and exit")
    parser.add_argument("--budget-seconds", type=float, default=CALL_BUDGET_SECONDS,
                        help="runs that would not finish within this many seconds of the start are skipped")
    arguments = parser.parse_args(argv)
    if arguments.out is None and not arguments.list:
        parser.error("--out is required when $OUT is not set")
    return arguments


PENDING_FILE = "pending.json"


def selected_runs(arguments: argparse.Namespace, mode: Mode, work: Path) -> list[RunSpec]:
    """--only's runs; else the runs an earlier call on this machine skipped, then this call's."""
    runs = sequence(mode)
    if arguments.only:
        wanted = set(arguments.only.split(","))
        unknown = wanted - {run.name for run in runs}
        if unknown:
            raise SystemExit(f"--only: unknown run(s) {sorted(unknown)}; see --list")
        return [run for run in runs if run.name in wanted]
    if mode.dry_run:
        return runs
    try:
        pending = set(json.loads((work / PENDING_FILE).read_text()))
    except (OSError, ValueError):
        pending = set()
    carried = [run for run in runs if run.name in pending and run.call != arguments.call]
    return carried + [run for run in runs if run.call == arguments.call]


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    arguments = parse_arguments(argv)
    mode = DRY_MODE if arguments.dry_run else GPU_MODE
    if arguments.list:
        for run in sequence(mode):
            print(f"call {run.call}: {run.name} — {run.purpose}")
        return 0
    work, log_dir = arguments.work.absolute(), arguments.out.absolute()
    work.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))
    runs = selected_runs(arguments, mode, work)
    nvml = Nvml()
    where = machine(nvml)
    print(f"{where}: {len(runs)} run(s)", flush=True)
    models, setup_steps = setup(mode, work, log_dir, os.environ.copy(), runs)
    records: list[RunRecord] = []
    skipped: list[str] = []
    for spec in runs:
        remaining = arguments.budget_seconds - (time.monotonic() - started) - SAFETY_SECONDS
        if remaining < spec.estimate_seconds:
            skipped.append(spec.name)
            continue
        record = run_one(spec, mode, models, work, log_dir, nvml, remaining)
        records.append(record)
        with (log_dir / "gpu-runs.jsonl").open("a") as lines:
            lines.write(json.dumps({"machine": where, **record.to_dict()}) + "\n")
        print(row(record, where), flush=True)
    (work / PENDING_FILE).write_text(json.dumps(skipped) + "\n")
    text = section("dry run" if mode.dry_run else str(arguments.call), where, records, setup_steps, skipped)
    arguments.results.parent.mkdir(parents=True, exist_ok=True)
    with arguments.results.open("a") as results:
        results.write(text)
    (log_dir / "table.md").write_text(text)
    print(text, flush=True)
    return 0 if records and all(step["exit"] == 0 for step in setup_steps) else 1


if __name__ == "__main__":
    sys.exit(main())
