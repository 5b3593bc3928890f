"""`python -m fluxbooth ...` (**contract**): `plan`, `doctor` and `train`.

plan    — which memory strategy a job gets on this machine or on hypothetical hardware described whole
          (`--gpus 1 --gpu-memory 24GiB --host-memory 62GiB --cpus 16 --disk 200GiB --gpu-name 4090`), with the
          request's bounds on every job flag and the worker's deadline; exits 1 when the worker would refuse the job.
doctor  — is this machine ready to train; exits 1 when a check fails (`--allow-cpu` on CPU-only hosts).
train   — run one request (a JSON file holding the `input` object, or `{"input": {...}}`) outside RunPod;
          prints the result JSON; exits 1 when the job failed. Progress goes to stderr (a bar on a
          terminal, plain lines otherwise); `--verbose` adds the full log.
submit  — send photos and a request to an endpoint (RunPod or a local API server), follow the job and download
          its files (fluxbooth.client; its own exit codes, listed in `submit --help`).

Exit codes: 0 success, 1 does not fit / a check failed, 2 invalid arguments or input, 141 the reader closed
the output early (`plan | head`), quietly.
This module never imports torch: doctor runs its torch checks in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.hardware import Hardware, format_bytes, hypothetical_hardware, parse_size, probe_hardware
from fluxbooth.jsonfiles import MAX_REQUEST_BYTES, JSONBoundError, read_json_file
from fluxbooth.settings import WorkerSettings

if TYPE_CHECKING:
    from fluxbooth.request import TrainingRequest
    from fluxbooth.spec import JobSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CLOSED_PIPE = 128 + 13  # 128 + SIGPIPE, as the shell reports a process that signal ended


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _whole_number(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def _integer(text: str) -> int:
    """A whole number; its bounds are the request's (checked by TrainingRequest, as the worker does)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _zero_stage(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _auto_or_boolean(text: str) -> bool | str:
    """A flag for a request field that is "auto", true or false (as JSON spells them)."""
    return {"true": True, "false": False}.get(text, text)


def _request_choices(name: str) -> tuple[str, ...]:
    """The values a request field takes (its Literal in TrainingRequest, the one owner), for a flag's choices."""
    from typing import get_args

    from fluxbooth.request import TrainingRequest

    return tuple(str(value) for value in get_args(TrainingRequest.model_fields[name].annotation))


# =================================================================================================
# plan
# =================================================================================================

# The plan flags that are request fields, as (flag, field): the request validates them, as the worker does.
REQUEST_FLAGS = (
    ("--base-model", "base_model"),
    ("--training-type", "training_type"),
    ("--base-precision", "base_precision"),
    ("--resolution", "resolution"),
    ("--batch-size", "batch_size"),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps"),
    ("--steps", "steps"),
    ("--lora-rank", "lora_rank"),
    ("--mixed-precision", "mixed_precision"),
    ("--zero-stage", "zero_stage"),
    ("--offload", "offload"),
    ("--fused-backward-pass", "fused_backward_pass"),
    ("--gradient-checkpointing", "gradient_checkpointing"),
    ("--deadline", "timeout_seconds"),
)
# Hypothetical hardware is described whole, or not at all: nothing of this machine is mixed in.
HARDWARE_FLAGS = (("--gpus", "gpus"), ("--gpu-memory", "gpu_memory"), ("--host-memory", "host_memory"),
                  ("--cpus", "cpus"), ("--disk", "disk"))
# What a request needs that sizing does not: stand-ins when plan is given flags instead of a request file.
SIZING_STAND_INS = {"model_name": "plan", "dataset_url": "https://example.com/dataset.zip", "instance_prompt": "a photo of sks person"}
CLASS_PROMPT_STAND_IN = "a photo of a person"
# The instance_images_source of a count given by flag (the others: remote_count's zip, url and cap).
INSTANCE_IMAGES_FLAG = "--instance-images"
IMAGES_SOURCE_WORDS = {"zip": "counted in the request's dataset zip", "url": "counted in the directory of the zip at dataset_url",
                       "cap": "the worker's cap, FLUXBOOTH_MAX_IMAGES", INSTANCE_IMAGES_FLAG: INSTANCE_IMAGES_FLAG}


def add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a memory strategy (ZeRO stage, offload) for a job, or say why the worker would refuse it",
        description="Predict GPU, host-RAM and disk needs and the time of every strategy and choose the fastest "
        "that fits, as the worker does (its deadline included). Without hardware flags this machine is probed; "
        "hypothetical hardware needs all of --gpus, --gpu-memory, --host-memory, --cpus and --disk.",
    )
    hardware = parser.add_argument_group("hypothetical hardware (all or none; none: this machine)")
    hardware.add_argument(
        "--runpod-gpu", metavar="TYPE",
        help="a RunPod serverless GPU type ('RTX 4090', 'H100 SXM'; 'list' prints them all): fills in --gpus 1, "
        "--gpu-memory, --host-memory, --cpus, --disk and --gpu-name as a worker on it gets them, and prices the quote "
        "at its per-second rate; flags given beside it win",
    )
    hardware.add_argument("--gpus", type=_whole_number(0), help="number of GPUs (0: CPU only, no --gpu-memory)")
    hardware.add_argument("--gpu-memory", type=_size, help="memory per GPU with its unit, e.g. 24GiB, 80GiB")
    hardware.add_argument("--host-memory", type=_size, help="host RAM the container may use, e.g. 62GiB")
    hardware.add_argument("--cpus", type=_whole_number(1), help="CPU cores the container may use, e.g. 16")
    hardware.add_argument("--disk", type=_size, help="free disk at the work directory, e.g. 200GiB")
    hardware.add_argument("--gpu-name", default=None, help="the card, for the time estimate: '4090', 'RTX A6000', 'H100 NVL'")
    hardware.add_argument("--nvme-path", default=None, help="a fast-disk directory DeepSpeed may offload to")
    job = parser.add_argument_group("job (bounded as the request bounds its fields)")
    job.add_argument("--request", type=Path, help="a request JSON (job input); flags below override its fields")
    job.add_argument("--base-model", help="a preset name (black-forest-labs/FLUX.1-dev, ...-schnell) or a local diffusers folder")
    job.add_argument("--training-type", choices=_request_choices("training_type"), help="(default: lora)")
    job.add_argument(
        "--base-precision", choices=_request_choices("base_precision"), help="how a LoRA's frozen base is stored (default: auto)"
    )
    job.add_argument("--resolution", help="sizes for aspect buckets (1024 or 512,768,1024), or one fixed shape (768x1024)")
    job.add_argument("--batch-size", type=_integer)
    job.add_argument("--gradient-accumulation-steps", type=_integer)
    job.add_argument("--steps", type=_integer)
    job.add_argument(
        "--instance-images", type=_integer,
        help="photos in the dataset (default: counted from the --request's dataset zip or the directory of the zip at "
        "its dataset_url, as a dry run does; the worker's cap without a request file or when the zip cannot be counted)",
    )
    job.add_argument("--lora-rank", type=_integer)
    job.add_argument("--mixed-precision", choices=_request_choices("mixed_precision"))
    job.add_argument("--zero-stage", type=_zero_stage, help=" or ".join(_request_choices("zero_stage")))
    job.add_argument("--offload", choices=_request_choices("offload"))
    job.add_argument("--no-deepspeed", action="store_true", help="plain accelerate, no ZeRO")
    job.add_argument(
        "--fused-backward-pass", type=_auto_or_boolean, choices=("auto", True, False), metavar="{auto,true,false}",
        help="a full fine-tune as Adafactor fused into the backward pass: the planner's choice (auto), only it, or never",
    )
    job.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None, help="(default: on)"
    )
    job.add_argument("--prior-preservation", action="store_true", help="with_prior_preservation (doubles the batch)")
    job.add_argument(
        "--deadline", type=_integer,
        help="the job's deadline in seconds, as the request's timeout_seconds (default: the worker's, "
        "FLUXBOOTH_JOB_DEADLINE_SECONDS)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run_plan_command)


def _read_request_file(path: Path) -> dict[str, Any]:
    try:
        raw = read_json_file(path, max_bytes=MAX_REQUEST_BYTES)
    except JSONBoundError as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"--request {path}: {error}") from None
    except (OSError, ValueError) as error:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT, f"--request {path}: not a readable JSON file ({type(error).__name__})"
        ) from None
    fields = raw.get("input", raw) if isinstance(raw, dict) else raw
    if not isinstance(fields, dict):
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"--request {path}: expected a JSON object with the request's fields")
    return dict(fields)


def _request_fields(arguments: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The request to plan (the file's fields, or stand-ins for what sizing does not read, with the flags
    over them), and the flag that set each field."""
    fields = _read_request_file(arguments.request) if arguments.request is not None else dict(SIZING_STAND_INS)
    from_flags: dict[str, str] = {}
    for flag, name in REQUEST_FLAGS:
        value = getattr(arguments, flag[2:].replace("-", "_"))
        if value is not None:
            fields[name], from_flags[name] = value, flag
    if arguments.no_deepspeed:
        fields["use_deepspeed"], from_flags["use_deepspeed"] = False, "--no-deepspeed"
    if arguments.prior_preservation:
        fields["with_prior_preservation"], from_flags["with_prior_preservation"] = True, "--prior-preservation"
        if arguments.request is None:
            fields["class_prompt"] = CLASS_PROMPT_STAND_IN
    base_model = fields.get("base_model")
    if isinstance(base_model, str) and Path(base_model).is_dir():
        # A local folder given relative to here; the request takes absolute paths only.
        fields["base_model"] = str(Path(base_model).resolve())
    return fields, from_flags


def _validated_request(arguments: argparse.Namespace) -> TrainingRequest:
    """The request as the worker validates it: every bound and rule of TrainingRequest, each refusal naming
    the flag that set the field."""
    from fluxbooth.request import parse_request

    fields, from_flags = _request_fields(arguments)
    try:
        return parse_request(fields)
    except FluxboothError as error:
        def flag_for(match: re.Match[str]) -> str:
            return from_flags.get(match.group(1), match.group(0))

        raise FluxboothError(error.code, re.sub(r"input\.(\w+)", flag_for, error.message)) from None


def _instance_images(arguments: argparse.Namespace, request: TrainingRequest, settings: WorkerSettings) -> Any:
    """The dataset's image count (a remote_count.DatasetCount): `--instance-images` when given, bounded by the
    worker's dataset limits; else the --request's dataset counted as a dry run counts it; else the worker's cap."""
    from fluxbooth.dataset.remote_count import SOURCE_CAP, DatasetCount, count_dataset

    limits = settings.dataset_limits
    count = arguments.instance_images
    if count is None:
        if arguments.request is None:
            return DatasetCount(limits.max_images, SOURCE_CAP)
        try:
            return count_dataset(request, limits)
        except FluxboothError as error:
            # A request file often carries a placeholder dataset: plan still answers, for the cap.
            return DatasetCount(
                limits.max_images, SOURCE_CAP,
                f"the request's dataset was not counted ({error.message}); planned for the worker's cap of "
                f"{limits.max_images} (FLUXBOOTH_MAX_IMAGES)",
            )
    if not limits.min_images <= count <= limits.max_images:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"--instance-images {count}: the worker accepts {limits.min_images} to {limits.max_images} instance images "
            "(FLUXBOOTH_MIN_IMAGES, FLUXBOOTH_MAX_IMAGES)",
        )
    return DatasetCount(count, INSTANCE_IMAGES_FLAG)


def _base_model_from(request: TrainingRequest, settings: WorkerSettings) -> str:
    from fluxbooth.settings import TINY_MODEL_NAME

    name = request.base_model or settings.default_base_model
    if name == TINY_MODEL_NAME:
        # The tiny model is built from code on first use; it must exist to be sized.
        from fluxbooth.job import ensure_tiny_model

        return str(ensure_tiny_model(settings.cache_dir))
    return name


def matched_gpu_name(typed: str) -> str:
    """The planner's name for a card as people type it ("4090", "rtx4090", "RTX 4090"); invalid_input
    listing the known cards when it matches none."""
    from fluxbooth.plan.gpus import GPU_TABLE, gpu_spec

    spec = gpu_spec(typed)
    if spec is None:
        known = ", ".join(row.name for _, row in GPU_TABLE)
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"--gpu-name {typed!r} matches no card the planner knows ({known}); leave --gpu-name out to time "
            "the job as an unknown card",
        )
    return spec.name


def _hypothetical_hardware(arguments: argparse.Namespace) -> Hardware | None:
    """The machine the flags describe, or None without hardware flags; invalid_input when it is described
    only in part."""
    given = {flag: getattr(arguments, name) for flag, name in HARDWARE_FLAGS}
    if all(value is None for value in given.values()) and arguments.gpu_name is None:
        return None
    cpu_only = arguments.gpus == 0
    missing = [flag for flag, value in given.items() if value is None and not (cpu_only and flag == "--gpu-memory")]
    if missing:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"hypothetical hardware needs {', '.join(missing)} as well: give all of --gpus, --gpu-memory, "
            "--host-memory, --cpus and --disk (--gpus 0: no --gpu-memory), or none to plan for this machine; "
            "its own values are never mixed in",
        )
    if cpu_only and (arguments.gpu_memory is not None or arguments.gpu_name is not None):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT, "--gpus 0 describes a machine without a GPU: drop --gpu-memory and --gpu-name"
        )
    return hypothetical_hardware(
        gpus=arguments.gpus,
        gpu_memory_bytes=arguments.gpu_memory or 0,
        host_memory_bytes=arguments.host_memory,
        disk_bytes=arguments.disk,
        cpu_count=arguments.cpus,
        gpu_name=matched_gpu_name(arguments.gpu_name) if arguments.gpu_name else "hypothetical GPU",
        nvme_path=arguments.nvme_path,
    )


def _hardware_from(arguments: argparse.Namespace, settings: WorkerSettings, environ: Mapping[str, str]) -> Hardware:
    hypothetical = _hypothetical_hardware(arguments)
    if hypothetical is not None:
        return hypothetical
    probe_env = dict(environ)
    if arguments.nvme_path:
        probe_env["FLUXBOOTH_NVME_PATH"] = arguments.nvme_path
    return probe_hardware(settings.work_root, probe_env)


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
        f"machine  {report['hardware_summary']}\n"
        f"images   {report['instance_images']} ({IMAGES_SOURCE_WORDS.get(report['instance_images_source'], report['instance_images_source'])})\n"
        + (f"         {report['instance_images_note']}\n" if report.get("instance_images_note") else "")
        + (f"gpu      {report['gpu_name']['given']!r} read as {report['gpu_name']['matched']}\n" if report["gpu_name"] else "")
        + f"deadline {report['deadline_seconds'] / 60:.0f} min ({report['deadline_source']})\n\n"
    )
    header = ("", "type", "base", "ZeRO", "offload opt/param", "fits", "GPU (each)", "host RAM", "disk", "speed", "reason")
    rows = [header]
    chosen = report["chosen"]
    for candidate in report["candidates"]:
        kind = candidate["training_type"] + (f" r{candidate['lora_rank']}" if candidate["lora_rank"] else "")
        # Adafactor stepped inside the backward pass on bf16 weights, without DeepSpeed.
        kind += " fused" if candidate["fused_backward_pass"] else ""
        is_chosen = chosen is not None and chosen["fused_backward_pass"] == candidate["fused_backward_pass"] and all(
            chosen[key] == candidate[key]
            for key in ("training_type", "base_precision", "zero_stage", "offload_optimizer", "offload_param", "block_swap", "lora_rank")
        )
        rows.append(
            (
                "*" if is_chosen else ("" if candidate["honours_request"] else "~"),
                kind,
                candidate["base_precision"],
                str(candidate["zero_stage"]) if candidate["use_deepspeed"] else "-",
                # The frozen base streamed block by block from host RAM (block swapping) shows as "blocks".
                f"{candidate['offload_optimizer']}/{'blocks' if candidate['block_swap'] else candidate['offload_param']}",
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
        # The worker's answer: refused before any download, for memory, disk or the deadline.
        out.write(f"\nrefused ({report['error']['code']}): {report['error']['message']}\n")
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
        + ("Adafactor fused into the backward pass (bf16 weights), " if plan["fused_backward_pass"] else "")
        + (f"ZeRO-{plan['zero_stage']}" if plan["use_deepspeed"] else "no DeepSpeed")
        + f", offload optimizer {plan['offload_optimizer']}, parameters {plan['offload_param']}, "
        + (f"{'trained' if plan['training_type'] == 'full' else 'frozen'} blocks swapped in from host RAM, " if plan["block_swap"] else "")
        + f"optimizer {plan['optimizer']}\n"
        f"time:   ≈{plan['predicted_seconds_per_step']:.2f} s/step, ≈{report['estimated_run_seconds'] / 60:.0f} min "
        f"for {report['job']['steps']} steps, ≈{(plan['predicted_total_seconds'] or 0) / 60:.0f} min for the whole job "
        "(a rough estimate, see docs/memory.md)\n"
        + (
            f"cost:   ≈{report['cost']['predicted_cost']:.2f} at {report['cost']['price_per_hour']:g} per hour "
            f"({report['cost'].get('price_source', 'FLUXBOOTH_PRICE_PER_HOUR')})\n" if "cost" in report else ""
        )
        + "\n"
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


def _deadline_source(spec: JobSpec) -> str:
    """Where the deadline the worker would give this job (the spec's) came from."""
    if spec.deadline_from_request:
        return "--deadline / timeout_seconds"
    return "the worker's FLUXBOOTH_JOB_DEADLINE_SECONDS"


def _apply_runpod_preset(arguments: argparse.Namespace) -> Any:
    """The RunPod GPU type --runpod-gpu names (plan.runpod_gpus), its machine filled into the hardware flags not
    given; None without the flag."""
    from fluxbooth.plan.runpod_gpus import preset_for, worker_flags

    if arguments.runpod_gpu is None:
        return None
    gpu = preset_for(arguments.runpod_gpu, gpus_flag=arguments.gpus)
    for name, value in worker_flags(gpu).items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    return gpu


def run_plan_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    from fluxbooth.plan import model_size
    from fluxbooth.plan.runpod_gpus import preset_table, quote_price
    from fluxbooth.quote import plan_report
    from fluxbooth.spec import resolve_job_spec

    if arguments.runpod_gpu is not None and arguments.runpod_gpu.strip().lower() == "list":
        out.write(preset_table())
        return EXIT_OK
    gpu = _apply_runpod_preset(arguments)
    settings = WorkerSettings.from_environ(environ)
    price_per_hour, price_source = quote_price(gpu, settings.price_per_hour)
    request = _validated_request(arguments)
    dataset = _instance_images(arguments, request, settings)
    hardware = _hardware_from(arguments, settings, environ)
    model = model_size(_base_model_from(request, settings))
    spec = resolve_job_spec(request, model, settings)
    report = plan_report(
        spec,
        hardware=hardware,
        model=model,
        instance_images=dataset.instance_images,
        instance_images_source=dataset.source,
        deadline_seconds=spec.deadline_seconds,
        deadline_source=_deadline_source(spec),
        price_per_hour=price_per_hour,
        gpu_name_given=arguments.gpu_name,
    )
    if gpu is not None:
        report["runpod_gpu"] = gpu.to_dict()
    if "cost" in report:
        report["cost"]["price_source"] = price_source
    report["instance_images_note"] = dataset.note
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

    try:
        document = read_json_file(arguments.request, max_bytes=MAX_REQUEST_BYTES)
    except (OSError, ValueError) as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"request file {arguments.request}: {error}") from None
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
    from fluxbooth.client.command import add_submit_parser

    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{plan,doctor,train,submit}")
    add_plan_parser(subparsers)
    add_doctor_parser(subparsers)
    add_train_parser(subparsers)
    add_submit_parser(subparsers)
    return parser


def _run(arguments: argparse.Namespace, environ: Mapping[str, str], stream: TextIO) -> int:
    try:
        return int(arguments.handler(arguments, environ, stream))
    except FluxboothError as error:
        if getattr(arguments, "json", False):
            stream.write(json.dumps(error.to_result(), indent=2) + "\n")
        else:
            sys.stderr.write(f"error ({error.code.value}): {error.message}\n")
        return EXIT_USAGE if error.code is ErrorCode.INVALID_INPUT else EXIT_FAILED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    stream = out or sys.stdout
    try:
        code = _run(arguments, dict(os.environ if environ is None else environ), stream)
        stream.flush()
    except BrokenPipeError:
        # The reader has gone (`plan | head`): what it read is all it wanted. Point stdout at /dev/null so
        # the interpreter's last flush does not fail again, and end as a process killed by SIGPIPE would.
        if stream is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
    return code
