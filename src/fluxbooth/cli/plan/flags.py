"""The plan subcommand's parser: its flags, grouped as hypothetical hardware and the job, each job flag
bounded as the request bounds its field (the request, validated as the worker validates it, says why)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from fluxbooth.host.hardware import parse_size
from fluxbooth.request.model import TrainingRequest


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
    return tuple(str(value) for value in get_args(TrainingRequest.model_fields[name].annotation))


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a memory strategy (ZeRO stage, offload) for a job, or say why the worker would refuse it",
        description="Predict GPU, host-RAM and disk needs and the time of every strategy and choose the fastest "
        "that fits, as the worker does (its deadline included). Without hardware flags this machine is probed; "
        "hypothetical hardware needs all of --gpus, --gpu-memory, --host-memory, --cpus and --disk.",
    )
    hardware = parser.add_argument_group("hypothetical hardware (all or none; none: this machine)")
    hardware.add_argument(
        "--runpod-gpu",
        metavar="TYPE",
        help="a RunPod serverless GPU type ('RTX 4090', 'H100 SXM'; 'list' prints them all; 'all' plans the job on "
        "every one, on a first job and with the model cached): fills in --gpus 1, --gpu-memory, --host-memory, --cpus, "
        "--disk and --gpu-name as a worker on it gets them, and prices the quote at its per-second rate; flags given "
        "beside it win",
    )
    hardware.add_argument("--gpus", type=_whole_number(0), help="number of GPUs (0: CPU only, no --gpu-memory)")
    hardware.add_argument("--gpu-memory", type=_size, help="memory per GPU with its unit, e.g. 24GiB, 80GiB")
    hardware.add_argument("--host-memory", type=_size, help="host RAM the container may use, e.g. 62GiB")
    hardware.add_argument("--cpus", type=_whole_number(1), help="CPU cores the container may use, e.g. 16")
    hardware.add_argument("--disk", type=_size, help="free disk at the work directory, e.g. 200GiB")
    hardware.add_argument(
        "--gpu-name", default=None, help="the card, for the time estimate: '4090', 'RTX A6000', 'H100 NVL'"
    )
    hardware.add_argument("--nvme-path", default=None, help="a fast-disk directory DeepSpeed may offload to")
    job = parser.add_argument_group("job (bounded as the request bounds its fields)")
    job.add_argument("--request", type=Path, help="a request JSON (job input); flags below override its fields")
    job.add_argument(
        "--base-model", help="a preset name (black-forest-labs/FLUX.1-dev, ...-schnell) or a local diffusers folder"
    )
    job.add_argument("--training-type", choices=_request_choices("training_type"), help="(default: lora)")
    job.add_argument(
        "--base-precision",
        choices=_request_choices("base_precision"),
        help="how a LoRA's frozen base is stored (default: auto)",
    )
    job.add_argument(
        "--resolution", help="sizes for aspect buckets (1024 or 512,768,1024), or one fixed shape (768x1024)"
    )
    job.add_argument("--batch-size", type=_integer)
    job.add_argument("--gradient-accumulation-steps", type=_integer)
    job.add_argument("--steps", type=_integer)
    job.add_argument(
        "--instance-images",
        type=_integer,
        help="photos in the dataset (default: counted from the --request's dataset zip or the directory of the zip at "
        "its dataset_url, as a dry run does; the worker's cap without a request file or when the zip cannot be counted)",
    )
    job.add_argument("--lora-rank", type=_integer)
    job.add_argument("--mixed-precision", choices=_request_choices("mixed_precision"))
    job.add_argument("--zero-stage", type=_zero_stage, help=" or ".join(_request_choices("zero_stage")))
    job.add_argument("--offload", choices=_request_choices("offload"))
    job.add_argument("--no-deepspeed", action="store_true", help="plain accelerate, no ZeRO")
    job.add_argument(
        "--fused-backward-pass",
        type=_auto_or_boolean,
        choices=("auto", True, False),
        metavar="{auto,true,false}",
        help="a full fine-tune as Adafactor fused into the backward pass: the planner's choice (auto), only it, or never",
    )
    job.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, help="every block (default: by memory)"
    )
    job.add_argument("--prior-preservation", action="store_true", help="with_prior_preservation (doubles the batch)")
    job.add_argument(
        "--deadline",
        type=_integer,
        help="the job's deadline in seconds, as the request's timeout_seconds (default: the worker's, "
        "FLUXBOOTH_JOB_DEADLINE_SECONDS)",
    )
    job.add_argument(
        "--cached",
        action="store_true",
        help="the base model is already in the worker's cache or on its volume: its download is not counted "
        "(default: counted, at FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND; a local folder never is)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output (also with --runpod-gpu list)")
