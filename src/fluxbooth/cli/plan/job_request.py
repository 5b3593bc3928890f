"""The request plan sizes: a --request file's fields with the job flags over them (or stand-ins for what
sizing does not read), validated as the worker validates it; its image count, base model, and where its
deadline came from."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from fluxbooth.dataset.remote_count import SOURCE_CAP, DatasetCount, count_dataset
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.jsonfiles import MAX_REQUEST_BYTES, JSONBoundError, read_json_file
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.plan.timing import stored_model_bytes
from fluxbooth.request.dataset_spec import DatasetSpec
from fluxbooth.request.model import TrainingRequest, parse_request
from fluxbooth.request.spec import JobSpec
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from fluxbooth.sizing import ModelSize

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
# What a request needs that sizing does not: stand-ins when plan is given flags instead of a request file.
SIZING_STAND_INS = {
    "model_name": "plan",
    "dataset_url": "https://example.com/dataset.zip",
    "instance_prompt": "a photo of sks person",
}
CLASS_PROMPT_STAND_IN = "a photo of a person"
# The instance_images_source of a count given by flag (the others: remote_count's zip, url and cap).
INSTANCE_IMAGES_FLAG = "--instance-images"


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
        raise FluxboothError(
            ErrorCode.INVALID_INPUT, f"--request {path}: expected a JSON object with the request's fields"
        )
    return dict(fields)


def _request_fields(arguments: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The request to plan (the file's fields, or stand-ins for what sizing does not read, with the flags
    over them), and the flag that set each field."""
    fields: dict[str, Any] = (
        _read_request_file(arguments.request) if arguments.request is not None else dict(SIZING_STAND_INS)
    )
    if not fields.get("dataset") and not fields.get("dataset_url"):
        # A request written before its photos are: planned for --instance-images or the cap (`instance_images`).
        fields.pop("dataset", None)
        fields["dataset_url"] = SIZING_STAND_INS["dataset_url"]
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


def validated_request(arguments: argparse.Namespace) -> TrainingRequest:
    """The request as the worker validates it: every bound and rule of TrainingRequest, each refusal naming
    the flag that set the field."""
    fields, from_flags = _request_fields(arguments)
    try:
        return parse_request(fields)
    except FluxboothError as error:

        def flag_for(match: re.Match[str]) -> str:
            return from_flags.get(match.group(1), match.group(0))

        raise FluxboothError(error.code, re.sub(r"input\.(\w+)", flag_for, error.message)) from None


def instance_images(arguments: argparse.Namespace, dataset: DatasetSpec, settings: WorkerSettings) -> DatasetCount:
    """The dataset's image count (a remote_count.DatasetCount): `--instance-images` when given, bounded by the
    worker's dataset limits; else the --request's `dataset` counted as a dry run counts it; else the worker's cap."""
    limits = settings.dataset_limits
    count = arguments.instance_images
    if count is None:
        if arguments.request is None:
            return DatasetCount(limits.max_images, SOURCE_CAP)
        if dataset.dataset is None and dataset.dataset_url == SIZING_STAND_INS["dataset_url"]:
            return DatasetCount(
                limits.max_images,
                SOURCE_CAP,
                f"the request has no dataset or dataset_url; planned for the worker's cap of {limits.max_images} "
                "(FLUXBOOTH_MAX_IMAGES): give --instance-images to plan for your photos",
            )
        try:
            return count_dataset(dataset, limits)
        except FluxboothError as error:
            # A request file often carries a placeholder dataset: plan still answers, for the cap.
            return DatasetCount(
                limits.max_images,
                SOURCE_CAP,
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


def download_bytes(arguments: argparse.Namespace, base_model: str, model: ModelSize) -> int:
    """The base model's bytes a worker downloads before training: none for a local folder or with --cached."""
    if arguments.cached or Path(base_model).is_dir():
        return 0
    return stored_model_bytes(model)


def base_model_from(request: TrainingRequest, settings: WorkerSettings) -> str:
    name = request.base_model or settings.default_base_model
    if name == TINY_MODEL_NAME:
        # The tiny model is built from code on first use; it must exist to be sized.
        return str(ensure_tiny_model(settings.cache_dir))
    return name


def deadline_source(spec: JobSpec) -> str:
    """Where the deadline the worker would give this job (the spec's) came from."""
    if spec.deadline_from_request:
        return "--deadline / timeout_seconds"
    return "the worker's FLUXBOOTH_JOB_DEADLINE_SECONDS"
