"""`python -m fluxbooth ...` (**contract**): `plan`, `doctor` and `train`.

plan    — which memory strategy a job gets on this machine or on hypothetical hardware
          (`--gpu-memory 8GiB --host-memory 64GiB --gpus 1 --disk 200GiB`); exits 1 when nothing fits.
doctor  — is this machine ready to train; exits 1 when a check fails (`--allow-cpu` on CPU-only hosts).
train   — run one request (a JSON file holding the `input` object, or `{"input": {...}}`) outside RunPod;
          prints the result JSON; exits 1 when the job failed. Progress goes to stderr (a bar on a
          terminal, plain lines otherwise); `--verbose` adds the full log.

Exit codes: 0 success, 1 does not fit / a check failed, 2 invalid arguments or input.
This module never imports torch: doctor runs its torch checks in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.hardware import Hardware, format_bytes, hypothetical_hardware, parse_bytes, probe_hardware, with_overrides

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _resolution(text: str) -> tuple[int, int]:
    from fluxbooth.request import parse_resolution

    try:
        return parse_resolution(text if "x" in text.lower() else int(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--resolution {text!r}: {error}") from error


def _zero_stage(text: str) -> int | str:
    if text == "auto":
        return text
    if text in ("1", "2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError("expected auto, 1, 2 or 3")


# =================================================================================================
# plan
# =================================================================================================


def add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a memory strategy (ZeRO stage, offload) for a job, or say why nothing fits",
        description="Predict GPU, host-RAM and disk needs of every strategy and choose the fastest that fits. "
        "Without hardware flags the machine is probed; with them, the flags replace what was probed.",
    )
    hardware = parser.add_argument_group("hardware (hypothetical; defaults: this machine)")
    hardware.add_argument("--gpu-memory", type=_size, help="memory per GPU, e.g. 8GiB, 80GB")
    hardware.add_argument("--host-memory", type=_size, help="host RAM the container may use, e.g. 64GiB")
    hardware.add_argument("--gpus", type=int, help="number of GPUs (0: CPU only)")
    hardware.add_argument("--disk", type=_size, help="free disk at the work directory, e.g. 200GiB")
    hardware.add_argument("--gpu-name", default=None, help="GPU model for the time estimate, e.g. 'H100'")
    hardware.add_argument("--nvme-path", default=None, help="a fast-disk directory DeepSpeed may offload to")
    job = parser.add_argument_group("job")
    job.add_argument("--request", type=Path, help="a request JSON (job input); flags below override its fields")
    job.add_argument("--base-model", help="a preset name (black-forest-labs/FLUX.1-dev, ...-schnell) or a local diffusers folder")
    job.add_argument("--training-type", choices=("full", "lora"), help="(default: lora)")
    job.add_argument(
        "--base-precision", choices=("auto", "bf16", "fp8", "nf4"), help="how a LoRA's frozen base is stored (default: auto)"
    )
    job.add_argument("--resolution", type=_resolution, help="1024 or 768x1024 (width x height)")
    job.add_argument("--batch-size", type=int)
    job.add_argument("--gradient-accumulation-steps", type=int)
    job.add_argument("--steps", type=int)
    job.add_argument(
        "--instance-images", type=int, help="photos in the dataset (default: the dataset cap, as the worker plans before download)"
    )
    job.add_argument("--lora-rank", type=int)
    job.add_argument("--mixed-precision", choices=("bf16", "fp16", "no"))
    job.add_argument("--zero-stage", type=_zero_stage, help="auto, 1, 2 or 3")
    job.add_argument("--offload", choices=("auto", "none", "cpu", "nvme"))
    job.add_argument("--no-deepspeed", action="store_true", help="plain accelerate, no ZeRO")
    job.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None, help="(default: on)"
    )
    job.add_argument("--prior-preservation", action="store_true", help="with_prior_preservation (doubles the batch)")
    job.add_argument("--deadline", type=float, help="refuse or warn when the estimated run time exceeds this many seconds")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run_plan_command)


def _job_from_arguments(arguments: argparse.Namespace) -> tuple[Any, list[str]]:
    """The job to plan, and the request's own warnings (e.g. a learning rate that does not suit its type)."""
    from fluxbooth.plan import JobShape

    job = JobShape()
    notes: list[str] = []
    if arguments.request is not None:
        from fluxbooth.request import parse_request

        try:
            raw = json.loads(arguments.request.read_text())
        except (OSError, ValueError) as error:
            raise FluxboothError(
                ErrorCode.INVALID_INPUT, f"--request {arguments.request}: not a readable JSON file ({type(error).__name__})"
            ) from error
        from fluxbooth.plan import as_job

        request = parse_request(raw.get("input", raw) if isinstance(raw, dict) else raw)
        job = as_job(request)
        notes = request.warnings()
    overrides = {
        "training_type": arguments.training_type,
        "base_precision": arguments.base_precision,
        "resolution": arguments.resolution,
        "batch_size": arguments.batch_size,
        "gradient_accumulation_steps": arguments.gradient_accumulation_steps,
        "steps": arguments.steps,
        "num_instance_images": arguments.instance_images,
        "lora_rank": arguments.lora_rank,
        "mixed_precision": arguments.mixed_precision,
        "zero_stage": arguments.zero_stage,
        "offload": arguments.offload,
        "gradient_checkpointing": arguments.gradient_checkpointing,
    }
    if arguments.no_deepspeed:
        overrides["use_deepspeed"] = False
    if arguments.prior_preservation:
        overrides["with_prior_preservation"] = True
    from dataclasses import replace

    return replace(job, **{name: value for name, value in overrides.items() if value is not None}), notes


def _base_model_from(arguments: argparse.Namespace, environ: Mapping[str, str]) -> str:
    from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings

    name = arguments.base_model
    if name is None and arguments.request is not None:
        try:
            raw = json.loads(arguments.request.read_text())
            name = (raw.get("input", raw) if isinstance(raw, dict) else {}).get("base_model")
        except (OSError, ValueError, AttributeError):
            name = None
    settings = WorkerSettings.from_environ(environ)
    name = name or settings.default_base_model
    if name == TINY_MODEL_NAME:
        # The tiny model is built from code on first use; it must exist to be sized.
        from fluxbooth.job import ensure_tiny_model

        return str(ensure_tiny_model(settings.cache_dir))
    return name


def _hardware_from(arguments: argparse.Namespace, environ: Mapping[str, str]) -> Hardware:
    from fluxbooth.settings import WorkerSettings

    flags = (arguments.gpu_memory, arguments.host_memory, arguments.gpus, arguments.disk)
    settings = WorkerSettings.from_environ(environ)
    probe_env = dict(environ)
    if arguments.nvme_path:
        probe_env["FLUXBOOTH_NVME_PATH"] = arguments.nvme_path
    if all(flag is not None for flag in flags):
        return hypothetical_hardware(
            gpus=arguments.gpus,
            gpu_memory_bytes=arguments.gpu_memory,
            host_memory_bytes=arguments.host_memory,
            disk_bytes=arguments.disk,
            gpu_name=arguments.gpu_name or "hypothetical GPU",
            nvme_path=arguments.nvme_path,
        )
    hardware = probe_hardware(settings.work_root, probe_env)
    if any(flag is not None for flag in flags):
        gpus = arguments.gpus
        if gpus is None and arguments.gpu_memory is not None and not hardware.gpus:
            gpus = 1
        hardware = with_overrides(
            hardware,
            gpus=gpus,
            gpu_memory_bytes=arguments.gpu_memory,
            host_memory_bytes=arguments.host_memory,
            disk_bytes=arguments.disk,
        )
    if arguments.gpu_name and hardware.gpus:
        from dataclasses import replace

        hardware = replace(hardware, gpus=tuple(replace(gpu, name=arguments.gpu_name) for gpu in hardware.gpus))
    return hardware


def _describe_hardware(hardware: Hardware) -> str:
    if hardware.gpus:
        gpu = f"{hardware.gpu_count}x {hardware.gpus[0].name} ({format_bytes(hardware.gpu_memory_bytes)})"
    else:
        gpu = "no GPU"
    return (
        f"{gpu}, {format_bytes(hardware.host_available_bytes)} host RAM, {hardware.cpu_count} CPUs, "
        f"{format_bytes(hardware.disk_free_bytes)} disk [{hardware.source}]"
    )


def _count(value: int) -> str:
    for divisor, suffix in ((1e9, " B"), (1e6, " M")):
        if value >= divisor:
            return f"{value / divisor:.2f}{suffix}"
    return f"{value:,}"


def _plan_table(report: dict[str, Any], out: TextIO) -> None:
    job = report["job"]
    model = report["model"]
    width, height = job["resolution"]
    out.write(
        f"model    {model['name']} ({_count(model['transformer_params'])} transformer parameters)\n"
        f"job      {job['training_type']}"
        + (f" rank {job['lora_rank']}, base {job['base_precision']}" if job["training_type"] == "lora" else "")
        + f", {width}x{height}, batch {job['batch_size']}, {job['mixed_precision']}, "
        f"checkpointing {'on' if job['gradient_checkpointing'] else 'off'}\n"
        f"machine  {report['hardware_summary']}\n\n"
    )
    header = ("", "type", "base", "ZeRO", "offload opt/param", "fits", "GPU (each)", "host RAM", "disk", "speed", "reason")
    rows = [header]
    chosen = report["chosen"]
    for candidate in report["candidates"]:
        kind = candidate["training_type"] + (f" r{candidate['lora_rank']}" if candidate["lora_rank"] else "")
        is_chosen = chosen is not None and all(
            chosen[key] == candidate[key]
            for key in ("training_type", "base_precision", "zero_stage", "offload_optimizer", "offload_param", "lora_rank")
        )
        rows.append(
            (
                "*" if is_chosen else ("" if candidate["honours_request"] else "~"),
                kind,
                candidate["base_precision"],
                str(candidate["zero_stage"]) if candidate["use_deepspeed"] else "-",
                f"{candidate['offload_optimizer']}/{candidate['offload_param']}",
                "yes" if candidate["fits"] else "no",
                "-" if report["accelerator"] == "cpu" else format_bytes(candidate["gpu_bytes"]),
                format_bytes(candidate["host_bytes"]),
                format_bytes(candidate["disk_bytes"]),
                f"{candidate['relative_speed']:.2f}x",
                candidate["reason"],
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(len(header) - 1)]
    for row in rows:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1] + "\n")
    out.write("\n* chosen   ~ an alternative (another training type or base precision), shown for comparison\n")
    if chosen is not None:
        _chosen_summary(report, out)
    else:
        out.write(f"\nnothing fits: {report['error']['message']}\n")
    for warning in report["warnings"]:
        out.write(f"warning: {warning}\n")


def _chosen_summary(report: dict[str, Any], out: TextIO) -> None:
    """The chosen strategy, then each phase's peak memory and time."""
    plan = report["plan"]
    on_cpu = report["accelerator"] == "cpu"
    out.write(
        f"\nchosen: {plan['training_type']}"
        + (f" over {'a' if plan['base_precision'] == 'bf16' else 'an'} {plan['base_precision']} base" if plan["training_type"] == "lora" else "")
        + " with "
        + (f"ZeRO-{plan['zero_stage']}" if plan["use_deepspeed"] else "no DeepSpeed")
        + f", offload optimizer {plan['offload_optimizer']}, parameters {plan['offload_param']}, "
        f"optimizer {plan['optimizer']}\n"
        f"time:   ≈{plan['predicted_seconds_per_step']:.2f} s/step, ≈{report['estimated_run_seconds'] / 60:.0f} min "
        f"for {report['job']['steps']} steps, ≈{(plan['predicted_total_seconds'] or 0) / 60:.0f} min for the whole job "
        "(a rough estimate, see docs/memory.md)\n\n"
    )
    rows = [("phase", "GPU peak", "host peak", "time")]
    for name, phase in plan["phases"].items():
        rows.append(
            (
                name,
                "-" if on_cpu or not phase["gpu_bytes"] else format_bytes(phase["gpu_bytes"]),
                format_bytes(phase["host_bytes"]) if phase["host_bytes"] else "-",
                f"{phase['seconds'] / 60:.1f} min" if phase["seconds"] >= 60 else f"{phase['seconds']:.0f} s",
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


def run_plan_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    from fluxbooth.plan import check_job, choose_plan, evaluate_candidates, model_size, pick

    job, request_warnings = _job_from_arguments(arguments)
    hardware = _hardware_from(arguments, environ)
    model = model_size(_base_model_from(arguments, environ))
    # Sizing an endpoint is about memory: the deadline is checked only when one is asked for.
    deadline = arguments.deadline if arguments.deadline is not None else job.timeout_seconds
    check_job(job, model)
    candidates = evaluate_candidates(job, hardware, model)
    report: dict[str, Any] = {
        "chosen": None,
        "plan": None,
        "error": None,
        "accelerator": hardware.accelerator,
        "hardware": hardware.to_dict(),
        "hardware_summary": _describe_hardware(hardware),
        "model": model.to_dict(),
        "job": {
            "training_type": job.training_type,
            "lora_rank": job.lora_rank,
            "base_precision": job.base_precision,
            "resolution": list(job.resolution),
            "batch_size": job.batch_size,
            "gradient_accumulation_steps": job.gradient_accumulation_steps,
            "steps": job.steps,
            "instance_images": job.num_instance_images,
            "mixed_precision": job.mixed_precision,
            "gradient_checkpointing": job.gradient_checkpointing,
            "zero_stage": job.zero_stage,
            "offload": job.offload,
            "use_deepspeed": job.use_deepspeed,
        },
        "deadline_seconds": deadline,
        "candidates": [candidate.to_dict() for candidate in candidates],
        "warnings": list(request_warnings),
    }
    try:
        plan = choose_plan(job, hardware, model, deadline_seconds=deadline)
    except FluxboothError as error:
        if error.code is not ErrorCode.DOES_NOT_FIT:
            raise
        report["error"] = {"code": error.code.value, "message": error.message}
    else:
        report["plan"] = plan.to_dict()
        report["warnings"] += list(plan.warnings)
        report["estimated_run_seconds"] = round((plan.predicted_seconds_per_step or 0) * job.steps)
        chosen = pick(candidates)
        report["chosen"] = chosen.to_dict() if chosen is not None else None
    if arguments.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        _plan_table(report, out)
    return EXIT_OK if report["plan"] is not None else EXIT_FAILED


# =================================================================================================
# doctor
# =================================================================================================


def add_doctor_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check that this machine can train: DeepSpeed ops, accelerate, CUDA/bf16, configs, RAM, disk, model, bucket",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="a machine without a GPU is not a failure")
    parser.add_argument("--build-ops", action="store_true", help="JIT-build DeepSpeed ops that are not built yet (minutes)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run_doctor_command)


def run_doctor_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    from fluxbooth.doctor import DoctorOptions, doctor_passed, run_doctor

    results = run_doctor(environ, DoctorOptions(allow_cpu=arguments.allow_cpu, build_ops=arguments.build_ops))
    passed = doctor_passed(results)
    if arguments.json:
        out.write(json.dumps({"ok": passed, "checks": [result.to_dict() for result in results]}, indent=2) + "\n")
    else:
        width = max(len(result.name) for result in results)
        for result in results:
            out.write(f"{result.status.upper():4}  {result.name.ljust(width)}  {result.detail}\n")
        out.write("\n" + ("all checks passed\n" if passed else "some checks FAILED\n"))
    return EXIT_OK if passed else EXIT_FAILED


# train
# =================================================================================================


def add_train_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="run one training request (JSON file) outside RunPod")
    parser.add_argument("request", type=Path, help="JSON file: the request's input object, or {\"input\": {...}}")
    parser.add_argument("--job-id", default=None, help="job id used in storage keys (default: random)")
    parser.add_argument(
        "--verbose", action="store_true", help="log everything (the trainer's own output included) on stderr"
    )
    parser.set_defaults(handler=run_train_command)


def run_train_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    import asyncio
    import logging

    from fluxbooth.job import run_job
    from fluxbooth.progress import ProgressBar
    from fluxbooth.settings import WorkerSettings

    try:
        document = json.loads(arguments.request.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"request file {arguments.request}: {error}") from error
    job_input = document["input"] if isinstance(document, dict) and set(document) <= {"input", "id"} and "input" in document else document
    # The progress lines are what a person watches; the full log would bury them, so it is opt-in.
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    progress = ProgressBar.for_stream(sys.stderr)
    try:
        result = asyncio.run(
            run_job(job_input, job_id=arguments.job_id, settings=WorkerSettings.from_environ(environ), progress=progress)
        )
    finally:
        progress.close()
    out.write(json.dumps(result, indent=2) + "\n")
    return EXIT_FAILED if "error" in result else EXIT_OK


# =================================================================================================
# Entry point
# =================================================================================================


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth", description="fluxbooth: FLUX.1 DreamBooth under DeepSpeed")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{plan,doctor,train}")
    add_plan_parser(subparsers)
    add_doctor_parser(subparsers)
    add_train_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    stream = out or sys.stdout
    try:
        return int(arguments.handler(arguments, dict(os.environ if environ is None else environ), stream))
    except FluxboothError as error:
        if getattr(arguments, "json", False):
            stream.write(json.dumps(error.to_result(), indent=2) + "\n")
        else:
            sys.stderr.write(f"error ({error.code.value}): {error.message}\n")
        return EXIT_USAGE if error.code is ErrorCode.INVALID_INPUT else EXIT_FAILED
