"""GPU evidence: the worker's real path on a full-size synthetic FLUX.1-dev and FLUX.2 [klein] 4B, cut into
independent calls of at most 9 minutes (a lent GPU machine starts cold, for 15 minutes in all).

Each run writes a request JSON, records `python -m fluxbooth plan --json` for it, then runs
`python -m fluxbooth train` on it while a thread samples NVML's used memory and the summed PSS of the
worker's process tree; the trainer's events give the phases and the seconds per step, its result the
PyTorch allocator peaks. Smaller cards are emulated on the big one: FLUXBOOTH_GPU_MEMORY_BYTES makes
the planner see the small card, FLUXBOOTH_CUDA_MEMORY_FRACTION caps PyTorch's allocator inside the
trainer (it caps only PyTorch, so NVML's reading is recorded beside it).

The runs (`--list`): a rank-16 LoRA at 1024² planned for 80, 48, 24 and 16 GiB cards, for every base
precision the request accepts; LoRA with ZeRO-3 parameter offload on an 8 GiB card at 512²; a full fine-tune
(ZeRO-2, optimizer offloaded) on a reduced-depth model sized to the host RAM; the end-of-job phases
(validation render, export) under 24 and 16 GiB; the fixed-noise learning check off and on; a full-size
synthetic FLUX.2 [klein] 4B, LoRA on 24 and 16 GiB and its end of job. `calls()` packs them in that order
into calls whose setup (the models, built on a cold machine; CPU Adam, which the trainer builds: `SETUP_SECONDS`)
and runs fit `CALL_BUDGET_SECONDS`; every call is independent of the others. A run that would not finish within
what is left of its call is skipped and named under the table.

The bench builds no DeepSpeed op itself: no plan loads a GPU op (the trainer steps torch's fused AdamW, never
FusedAdam, which needs nvcc to match torch's CUDA), and a run whose plan offloads the optimizer (the full
fine-tune, ZeRO-3 offload, any card where the planner chooses it) has its trainer build DeepSpeedCPUAdam into the
worker's keyed ops folder as a job would, once per machine, in that run's loading phase.

Each call writes four files under `--out` ($OUT on the device machine): `table.md` (its rows),
`gpu-runs.jsonl` (every field of every run, its request and plan included), `setup.log` and `runs.log` (the
worker's log of each run). Its rows are merged into bench/RESULTS.md by run and GPU (bench/gpu_results.py):
`--results` on the device machine, `--merge $OUT/table.md` back here. `--dry-run` runs the same code on the CPU
with the `tiny` preset, a few steps at 64², and two runs (the end-of-job LoRA on the reduced-depth model, and
on tiny FLUX.2 [klein]). Not `scaled`: its 71 M bf16 parameters step in 15 s on a 2-core CPU, and the dry run
checks the sequence, not the speed (2.2 min with `tiny` against about 4.5 with `scaled`, ops built).

Usage: python bench/gpu.py --call N [--out DIR] [--work DIR] [--results FILE] [--only NAME,...]
       python bench/gpu.py --list | --merge TABLE.md [--results FILE]
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

from gpu_results import merge_into, table_rows  # noqa: E402
from gpu_runner import Nvml, RunRecord, RunSpec, dataset_zip, predict, read_result, train  # noqa: E402

from fluxbooth.contract.environment import CUDA_MEMORY_FRACTION_ENV  # noqa: E402
from fluxbooth.host.hardware import GIB  # noqa: E402
from fluxbooth.messages import format_bytes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CARDS_GIB = (80, 48, 24, 16)
FALLBACK_PRECISIONS = ("bf16", "fp8", "nf4")
CALL_BUDGET_SECONDS = 510.0
SAFETY_SECONDS = 15.0
# The files a call writes under --out (the device tool brings back at most 8).
TABLE, RECORDS, SETUP_LOG, RUNS_LOG = "table.md", "gpu-runs.jsonl", "setup.log", "runs.log"
# How much of each run's worker log runs.log keeps (the end, where failures are).
RUN_LOG_TAIL_CHARACTERS = 200_000
# A cold machine's setup, per thing a call's runs need (estimates until a GPU call times them: setup.log); "ops":
# CPU Adam built by the trainer of the call's first run whose plan offloads the optimizer (the planner's choice
# on some cards, so every call keeps room for it).
SETUP_SECONDS = {"ops": 120.0, "full": 120.0, "reduced": 60.0, "klein": 90.0}
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


GPU_MODE = Mode(
    "flux1-dev",
    "cuda",
    1024,
    small_resolution=512,
    steps=6,
    dry_run=False,
    sample_seconds=0.1,
    klein_preset="flux2-klein-4b",
)
DRY_MODE = Mode(
    "tiny", "cpu", 64, small_resolution=64, steps=2, dry_run=True, sample_seconds=0.5, klein_preset="tiny-flux2-klein"
)
KLEIN = "klein"  # RunSpec.model of the runs on mode.klein_preset


def request_precisions() -> tuple[list[str], bool]:
    """The base precisions the request schema accepts ("auto" aside), and whether it has the field at all."""
    from fluxbooth.request.model import TrainingRequest

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


def flux1_other_runs(mode: Mode) -> list[RunSpec]:
    end_of_job = {
        **LORA,
        "resolution": mode.resolution,
        "validation_prompts": ["a photo of sks dog"],
        "output_formats": ["diffusers", "comfyui"],
    }
    return [
        RunSpec(
            "lora-zero3-offload-8GiB-512",
            0,
            f"LoRA r16 {mode.small_resolution}², ZeRO-3 parameter offload, 8 GiB",
            {**LORA, "resolution": mode.small_resolution, "zero_stage": 3, "offload": "cpu"},
            card_gib=8,
            estimate_seconds=150,
        ),
        RunSpec(
            "full-zero2-offload-reduced",
            0,
            "full fine-tune, ZeRO-2, optimizer offloaded, reduced depth",
            {"training_type": "full", "resolution": mode.small_resolution, "zero_stage": 2, "offload": "cpu"},
            model="reduced",
            estimate_seconds=150,
        ),
        RunSpec(
            "end-of-job-24GiB", 0, "validation render + export, 24 GiB", end_of_job, card_gib=24, estimate_seconds=120
        ),
        RunSpec(
            "end-of-job-16GiB", 0, "validation render + export, 16 GiB", end_of_job, card_gib=16, estimate_seconds=200
        ),
        RunSpec(
            "learning-check-off",
            0,
            f"LoRA r16 {mode.resolution}², 80 GiB",
            {**LORA, "resolution": mode.resolution},
            card_gib=80,
        ),
        RunSpec(
            "learning-check-on",
            0,
            f"LoRA r16 {mode.resolution}², 80 GiB, the fixed-noise learning check on (learning_check)",
            {**LORA, "resolution": mode.resolution, "learning_check": True},
            card_gib=80,
            estimate_seconds=150,
        ),
    ]


def klein_runs(mode: Mode) -> list[RunSpec]:
    """FLUX.2 [klein] 4B: LoRA on 24 and 16 GiB cards (the planner picks the base precision), then its end of job."""
    end_of_job = {
        **LORA,
        "resolution": mode.resolution,
        "validation_prompts": ["a photo of sks dog"],
        "output_formats": ["diffusers", "comfyui"],
    }
    return [
        RunSpec(
            f"klein4b-lora-r16-{mode.resolution}-{card}GiB",
            0,
            f"FLUX.2 [klein] 4B, LoRA r16 {mode.resolution}², plan for {card} GiB",
            {**LORA, "resolution": mode.resolution},
            card_gib=card,
            model=KLEIN,
            estimate_seconds=120,
        )
        for card in (24, 16)
    ] + [
        RunSpec(
            "klein4b-end-of-job-24GiB",
            0,
            "FLUX.2 [klein] 4B, validation render + export, 24 GiB",
            end_of_job,
            card_gib=24,
            model=KLEIN,
            estimate_seconds=150,
        ),
    ]


def sequence(mode: Mode) -> list[RunSpec]:
    """Every run, in order, each with the call that runs it (`pack`); the dry run's two runs as call 0."""
    precisions, has_field = request_precisions()
    runs = lora_runs(0, CARDS_GIB, precisions, has_field, mode)
    runs += flux1_other_runs(mode)
    runs += klein_runs(mode)
    if mode.dry_run:
        # The same code path in runs that fit a CPU test: the end-of-job LoRA (training, validation render,
        # export) on the reduced-depth model (so its build is exercised too), and on tiny FLUX.2 [klein].
        ends = ("end-of-job-24GiB", "klein4b-end-of-job-24GiB")
        return [
            replace(run, call=0, model="reduced" if run.model == "full" else run.model)
            for run in runs
            if run.name in ends
        ]
    return pack(runs)


def setup_needs(run: RunSpec) -> set[str]:
    """What a cold machine builds for `run`: CPU Adam if its plan offloads the optimizer (its trainer builds it) and
    its model (the reduced-depth model shares the full model's encoders, so it needs that one built too)."""
    return {"ops", run.model, *(("full",) if run.model == "reduced" else ())}


def call_seconds(runs: list[RunSpec]) -> float:
    """A call's setup on a cold machine plus its runs' estimates."""
    needs = set().union(*(setup_needs(run) for run in runs)) if runs else set()
    return sum(SETUP_SECONDS[need] for need in needs) + sum(run.estimate_seconds for run in runs)


def pack(runs: list[RunSpec]) -> list[RunSpec]:
    """Number the calls: in order, each run joins the current call while the call's setup and runs still fit
    CALL_BUDGET_SECONDS less SAFETY_SECONDS, else it opens the next call."""
    packed: list[RunSpec] = []
    current: list[RunSpec] = []
    call = 1
    for run in runs:
        if current and call_seconds([*current, run]) > CALL_BUDGET_SECONDS - SAFETY_SECONDS:
            call, current = call + 1, []
        current.append(run)
        packed.append(replace(run, call=call))
    return packed


def call_count(mode: Mode) -> int:
    return max(run.call for run in sequence(mode))


# ----------------------------------------------------------------------------------------------
# Setup: the wheels' packages checked, DeepSpeed's ops and the synthetic models built, all timed
# ----------------------------------------------------------------------------------------------


def timed(label: str, command: list[str], env: dict[str, str], log_dir: Path, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = round(time.monotonic() - started, 1)
    with (log_dir / SETUP_LOG).open("a") as log:
        log.write(f"=== {label}: {' '.join(command[:4])} ...\n{completed.stdout}\n--- stderr ---\n{completed.stderr}\n")
    print(f"setup {label}: exit {completed.returncode} in {seconds} s", flush=True)
    return {"step": label, "exit": completed.returncode, "seconds": seconds, "tail": completed.stderr.strip()[-300:]}


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
    """Build (or reuse) the models the runs need (no DeepSpeed op: see the module docstring). The models and the
    timings."""
    import psutil

    steps: list[dict[str, Any]] = []
    full = work / "models" / mode.preset
    double, single = reduced_layers(psutil.virtual_memory().total, mode)
    reduced = work / "models" / f"{mode.preset}-{double}x{single}"
    klein = work / "models" / mode.klein_preset
    models = {"full": full, "reduced": reduced, KLEIN: klein}
    for preset, folder, needed in ((mode.preset, full, ("full", "reduced")), (mode.klein_preset, klein, (KLEIN,))):
        if any(run.model in needed for run in runs):
            steps.append(
                timed(
                    f"build-{preset}",
                    [
                        sys.executable,
                        "-m",
                        "fluxbooth.synthetic",
                        "--preset",
                        preset,
                        "--device",
                        mode.device,
                        str(folder),
                    ],
                    env,
                    log_dir,
                    500,
                )
            )
    if not any(run.model == "reduced" for run in runs):
        return models, steps
    steps.append(
        timed(
            f"build-reduced-{double}x{single}",
            [
                sys.executable,
                "-m",
                "fluxbooth.synthetic",
                "--preset",
                mode.preset,
                "--device",
                mode.device,
                "--layers",
                f"{double},{single}",
                "--share-encoders-with",
                str(full),
                str(reduced),
            ],
            env,
            log_dir,
            300,
        )
    )
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
            env[CUDA_MEMORY_FRACTION_ENV] = f"{card / real_gpu_bytes:.6f}"
    return env


def run_one(
    spec: RunSpec, mode: Mode, models: dict[str, Path], work: Path, log_dir: Path, nvml: Nvml, timeout: float
) -> RunRecord:
    import base64

    from fluxbooth.sizing import model_size

    folder = work / "runs" / spec.name
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
    keep_run_log(folder, log_dir, spec.name)
    if spec.model == "reduced" and record.transformer_params:
        parameters = record.transformer_params
        record.notes.append(
            f"per transformer parameter: host {record.host_peak / parameters:.1f} B"
            + (f", GPU (NVML) {record.nvml_used_peak / parameters:.1f} B" if record.nvml_used_peak else "")
        )
    return record


def keep_run_log(folder: Path, log_dir: Path, name: str) -> None:
    """The run's request, plan and the end of its worker log, appended to --out's runs.log."""
    parts = []
    for file in ("request.json", "env.json", "plan.json", "plan.log", "worker.log", "result.json"):
        path = folder / file
        if path.is_file():
            text = path.read_text(errors="replace")
            if file == "request.json":
                text = json.dumps({key: value for key, value in json.loads(text).items() if key != "dataset"}, indent=1)
            parts.append(f"--- {file} ---\n{text[-RUN_LOG_TAIL_CHARACTERS:]}")
    with (log_dir / RUNS_LOG).open("a") as log:
        log.write(f"=== run {name}\n" + "\n".join(parts) + "\n")


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


def machine(nvml: Nvml) -> tuple[str, str]:
    """(the GPU, or "CPU", and the versions: driver, CUDA, torch, DeepSpeed), named in every row."""
    import deepspeed
    import torch

    described = nvml.describe()
    if not described:
        return (
            "CPU",
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, DeepSpeed {deepspeed.__version__}",
        )
    return described["gpu"], (
        f"driver {described['driver']}, CUDA {torch.version.cuda}, torch {torch.__version__}, DeepSpeed {deepspeed.__version__}"
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


def row(record: RunRecord, gpu: str, versions: str, recorded: str) -> str:
    """One row of bench/RESULTS.md's gpu table (bench/gpu_results.COLUMNS)."""
    plan = record.plan
    phases = ", ".join(f"{name} {seconds:.0f}" for name, seconds in record.phase_seconds.items())
    predicted_step = plan.get("predicted_seconds_per_step")
    cells = [
        record.name,
        gpu,
        versions,
        recorded,
        record.card,
        record.base_precision,
        plan_cell(plan),
        gib(plan.get("predicted_gpu_bytes")),
        gib(record.gpu_allocated_peak),
        gib(record.gpu_reserved_peak),
        gib(record.nvml_used_peak),
        gib(plan.get("predicted_host_bytes")),
        gib(record.host_peak),
        "-" if predicted_step is None else f"{predicted_step:.2f}",
        "-" if record.seconds_per_step is None else f"{record.seconds_per_step:.2f}",
        phases or "-",
        f"{record.exit_status} {record.outcome[:120]}",
        "; ".join(record.notes) or "-",
    ]
    return "| " + " | ".join(str(cell).replace("\n", " ").replace("|", "/") for cell in cells) + " |"


def call_table(call: str, rows: list[str], setup_steps: list[dict[str, Any]], skipped: list[str]) -> str:
    """table.md: what one call measured (its rows are what --merge takes)."""
    from gpu_results import HEADER

    lines = [f"Call {call} of bench/gpu.py.", ""]
    if setup_steps:
        lines += [
            "Setup: "
            + "; ".join(f"{step['step']} exit {step['exit']} in {step['seconds']} s" for step in setup_steps)
            + ".",
            "",
        ]
    lines += [HEADER, *rows]
    if skipped:
        lines += ["", "Not run (the call's time budget was spent; run the call again): " + ", ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def merge_results(results: Path, table: str, skipped: list[str]) -> None:
    """Merge a call's rows into `results` (bench/RESULTS.md) by run and GPU."""
    existing = results.read_text() if results.is_file() else ""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(merge_into(existing, table_rows(table), skipped))


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--call", type=int, help="which GPU call to run (see --list)")
    which.add_argument("--dry-run", action="store_true", help="the same code on the CPU: tiny preset, 64², two runs")
    which.add_argument("--list", action="store_true", help="print the runs of every call and exit")
    which.add_argument(
        "--merge", type=Path, help="merge a call's table.md (brought back from $OUT) into --results and exit"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="where the logs go (default: $OUT)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / ".fluxbooth" / "gpu-bench",
        help="models, jobs and caches (reused while the machine stays warm)",
    )
    parser.add_argument(
        "--results", type=Path, default=REPO / "bench" / "RESULTS.md", help="the markdown file the rows are merged into"
    )
    parser.add_argument("--only", default=None, help="comma-separated run names (see --list)")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=CALL_BUDGET_SECONDS,
        help="runs that would not finish within this many seconds of the start are skipped",
    )
    arguments = parser.parse_args(argv)
    if arguments.call is not None and not 1 <= arguments.call <= call_count(GPU_MODE):
        parser.error(f"--call: choose 1 to {call_count(GPU_MODE)} (see --list)")
    if arguments.out is None and (arguments.call is not None or arguments.dry_run):
        parser.error("--out is required when $OUT is not set")
    return arguments


def selected_runs(arguments: argparse.Namespace, mode: Mode) -> list[RunSpec]:
    """--only's runs; else the call's (every run, in the dry run)."""
    runs = sequence(mode)
    if arguments.only:
        wanted = set(arguments.only.split(","))
        unknown = wanted - {run.name for run in runs}
        if unknown:
            raise SystemExit(f"--only: unknown run(s) {sorted(unknown)}; see --list")
        return [run for run in runs if run.name in wanted]
    return runs if mode.dry_run else [run for run in runs if run.call == arguments.call]


def measure_runs(
    runs: list[RunSpec], mode: Mode, arguments: argparse.Namespace, started: float, machine_names: tuple[str, str]
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """Set up, then every run that still fits the call's budget: (rows, skipped run names, setup steps)."""
    work, log_dir = arguments.work.absolute(), arguments.out.absolute()
    nvml = Nvml()
    models, setup_steps = setup(mode, work, log_dir, os.environ.copy(), runs)
    recorded = time.strftime("%Y-%m-%d", time.gmtime())
    rows: list[str] = []
    skipped: list[str] = []
    for spec in runs:
        remaining = arguments.budget_seconds - (time.monotonic() - started) - SAFETY_SECONDS
        if remaining < spec.estimate_seconds:
            skipped.append(spec.name)
            continue
        record = run_one(spec, mode, models, work, log_dir, nvml, remaining)
        with (log_dir / RECORDS).open("a") as lines:
            lines.write(json.dumps({"gpu": machine_names[0], "versions": machine_names[1], **record.to_dict()}) + "\n")
        rows.append(row(record, *machine_names, recorded))
        print(rows[-1], flush=True)
    return rows, skipped, setup_steps


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    arguments = parse_arguments(argv)
    mode = DRY_MODE if arguments.dry_run else GPU_MODE
    if arguments.list:
        for run in sequence(mode):
            print(f"call {run.call}: {run.name} — {run.purpose} (about {run.estimate_seconds:.0f} s)")
        return 0
    if arguments.merge:
        merge_results(arguments.results, arguments.merge.read_text(), [])
        return 0
    arguments.work.absolute().mkdir(parents=True, exist_ok=True)
    arguments.out.absolute().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(arguments.work.absolute() / "torch_extensions"))
    runs = selected_runs(arguments, mode)
    machine_names = machine(Nvml())
    print(f"{machine_names[0]} ({machine_names[1]}): {len(runs)} run(s)", flush=True)
    rows, skipped, setup_steps = measure_runs(runs, mode, arguments, started, machine_names)
    table = call_table("dry run" if mode.dry_run else str(arguments.call), rows, setup_steps, skipped)
    (arguments.out.absolute() / TABLE).write_text(table)
    merge_results(arguments.results, table, skipped)
    print(table, flush=True)
    return 0 if rows and all(step["exit"] == 0 for step in setup_steps) else 1


if __name__ == "__main__":
    sys.exit(main())
