"""Stage "load" (session): the accelerator, the DeepSpeed config completed and checked, precision and
optimizer decided: everything that can fail in seconds fails here, before any model is loaded."""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, set_seed
from deepspeed.accelerator import get_accelerator

from fluxbooth.contract.buckets import BUCKET_MULTIPLE
from fluxbooth.contract.environment import CUDA_MEMORY_FRACTION_ENV
from fluxbooth.contract.names import (
    FULL_EXPORT_FORMATS,
    LORA_EXPORT_FORMATS,
    SUPPORTED_TIMESTEP_SAMPLING,
    SUPPORTED_WEIGHTING_SCHEMES,
)
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.train.base_model import resolve_base_model
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.fused_adafactor import check_fused_backward_pass
from fluxbooth.train.optim import validated_optimizer_name
from fluxbooth.train.runtime import EventReporter, StageClock
from fluxbooth.train.state import Precision, Session

# Ranks wait at barriers while the main process generates class images, gathers ZeRO-3 weights for
# export or renders validation images; on a real model any of these can outlast the 30-minute default.
PROCESS_GROUP_TIMEOUT_SECONDS = 4 * 3600


def open_session(config: TrainerConfig, reporter: EventReporter) -> Session:
    validate_config(config)
    clock = StageClock(reporter)
    with clock.stage("load"):
        cuda_memory_fraction = limit_cuda_memory(os.environ)
        accelerator = _make_accelerator(config)
        _check_process_group(accelerator)
        reporter.enabled = accelerator.is_main_process
        # The base model is resolved here, once: every later stage reads it from the session.
        base = resolve_base_model(config.base_model)
        deepspeed_config = _completed_deepspeed_config(accelerator, config, base.transformer_config)
        zero_stage = int((deepspeed_config or {}).get("zero_optimization", {}).get("stage", 0))
        _check_batch_sizes(config, deepspeed_config)
        nvme_paths = _prepared_nvme_paths(config, deepspeed_config, zero_stage, accelerator)
        precision = _precision(config, deepspeed_config, accelerator)
        # Checked before the slow stages, so a bad name fails in seconds.
        optimizer_name = validated_optimizer_name(config, deepspeed_config)
        check_fused_backward_pass(config, deepspeed_config, accelerator.num_processes)
        set_seed(config.optimisation.seed)
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        Path(config.cache_dir).mkdir(parents=True, exist_ok=True)
    return Session(
        config=config,
        reporter=reporter,
        clock=clock,
        accelerator=accelerator,
        deepspeed_config=deepspeed_config,
        zero_stage=zero_stage,
        precision=precision,
        optimizer_name=optimizer_name,
        nvme_paths=nvme_paths,
        base=base,
        cuda_memory_fraction=cuda_memory_fraction,
    )


def limit_cuda_memory(environ: Any) -> float | None:
    """Apply FLUXBOOTH_CUDA_MEMORY_FRACTION (0 < value <= 1) before anything is loaded; the fraction applied."""
    raw = environ.get(CUDA_MEMORY_FRACTION_ENV)
    if not raw:
        return None
    try:
        fraction = float(raw)
    except ValueError as error:
        raise TrainerFailure(
            "invalid_config", f"{CUDA_MEMORY_FRACTION_ENV}={raw!r} is not a number between 0 and 1"
        ) from error
    if not 0 < fraction <= 1:
        raise TrainerFailure("invalid_config", f"{CUDA_MEMORY_FRACTION_ENV}={raw!r} must be above 0 and at most 1")
    if not torch.cuda.is_available():
        return None
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def validate_config(config: TrainerConfig) -> None:
    if config.training_type not in ("full", "lora"):
        raise TrainerFailure("invalid_config", f"training_type {config.training_type!r} must be 'full' or 'lora'")
    if config.optimisation.timestep_sampling not in SUPPORTED_TIMESTEP_SAMPLING:
        raise TrainerFailure(
            "invalid_config",
            f"timestep_sampling {config.optimisation.timestep_sampling!r} must be one of {list(SUPPORTED_TIMESTEP_SAMPLING)}",
        )
    if config.optimisation.weighting_scheme not in SUPPORTED_WEIGHTING_SCHEMES:
        raise TrainerFailure(
            "invalid_config",
            f"weighting_scheme {config.optimisation.weighting_scheme!r} must be one of {list(SUPPORTED_WEIGHTING_SCHEMES)} (it weighs "
            "the loss; a sigma density such as logit_normal or mode is timestep_sampling)",
        )
    allowed = FULL_EXPORT_FORMATS if config.training_type == "full" else LORA_EXPORT_FORMATS
    wrong = [name for name in config.export.formats if name not in allowed]
    if wrong or not config.export.formats:
        raise TrainerFailure(
            "invalid_config",
            f"export_formats {list(config.export.formats)} for {config.training_type} training must be from {list(allowed)}",
        )
    width, height = config.resolution.render_shape
    if width % BUCKET_MULTIPLE or height % BUCKET_MULTIPLE:
        raise TrainerFailure(
            "invalid_config", f"resolution {width}x{height}: both sides must be multiples of {BUCKET_MULTIPLE}"
        )
    if any(size <= 0 or size % BUCKET_MULTIPLE for size in config.resolution.sizes):
        raise TrainerFailure(
            "invalid_config",
            f"resolution {config.resolution.describe()}: each size must be a multiple of {BUCKET_MULTIPLE}",
        )
    if config.prompts.with_prior_preservation and not config.prompts.class_prompt:
        raise TrainerFailure("invalid_config", "with_prior_preservation needs a class_prompt")
    if config.optimisation.steps < 1:
        raise TrainerFailure("invalid_config", "steps must be at least 1")
    if not 0 <= config.prompts.caption_dropout <= 1:
        raise TrainerFailure(
            "invalid_config", f"caption_dropout {config.prompts.caption_dropout} must be between 0 and 1"
        )


def launched_world_size() -> int:
    """How many processes the launcher started (torchrun's WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _make_accelerator(config: TrainerConfig) -> Any:
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    arguments: dict[str, Any] = {"kwargs_handlers": [_process_group_settings(uses_deepspeed)]}
    if not uses_deepspeed:
        arguments["gradient_accumulation_steps"] = config.optimisation.gradient_accumulation_steps
        # Several plain processes on a machine without GPUs (torchrun started them: accelerate's own
        # MULTI_CPU launch needs mpirun): without `cpu`, accelerate would not make them data parallel.
        arguments["cpu"] = launched_world_size() > 1 and not torch.cuda.is_available()
    return Accelerator(**arguments)


def _process_group_settings(uses_deepspeed: bool) -> Any:
    """accelerate picks no process-group backend for DeepSpeed without a GPU and then reports a single
    process even when several run (each believing it is rank 0); name DeepSpeed's CPU backend for it."""
    arguments: dict[str, Any] = {"timeout": timedelta(seconds=PROCESS_GROUP_TIMEOUT_SECONDS)}
    if uses_deepspeed and not torch.cuda.is_available():
        arguments["backend"] = get_accelerator().communication_backend_name()
    return InitProcessGroupKwargs(**arguments)


def _check_process_group(accelerator: Any) -> None:
    """Every process must know the others: otherwise each believes it is rank 0 and trains alone on the
    same data, and all of them write the same files."""
    world = launched_world_size()
    if world > 1 and (accelerator.num_processes != world or accelerator.distributed_type == DistributedType.NO):
        raise TrainerFailure(
            "invalid_config",
            f"the launcher started {world} processes but accelerate formed {accelerator.distributed_type.value} "
            f"with {accelerator.num_processes}; check the accelerate config's distributed_type and use_cpu",
        )


def _completed_deepspeed_config(
    accelerator: Any, config: TrainerConfig, transformer_config: dict[str, Any]
) -> dict[str, Any] | None:
    """Hand-written DeepSpeed JSONs (DiffSynth-Studio's, accelerate's templates) say "auto" for sizes that
    accelerate fills from a dataloader and `model.config.hidden_size`, neither of which exists here, and
    zero.Init reads them before accelerate would. Fill them from train.json and the transformer's width."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    width = int(transformer_config["num_attention_heads"]) * int(transformer_config["attention_head_dim"])
    batch = config.optimisation.batch_size * config.optimisation.gradient_accumulation_steps * accelerator.num_processes
    plugin.deepspeed_config_process(
        must_match=False,
        train_micro_batch_size_per_gpu=config.optimisation.batch_size,
        gradient_accumulation_steps=config.optimisation.gradient_accumulation_steps,
        train_batch_size=batch,
        gradient_clipping=config.optimisation.max_grad_norm,
        **{
            "zero_optimization.reduce_bucket_size": width * width,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * width * width),
            "zero_optimization.stage3_param_persistence_threshold": 10 * width,
            "optimizer.params.lr": config.optimisation.learning_rate,
            "scheduler.params.warmup_max_lr": config.optimisation.learning_rate,
            "scheduler.params.warmup_min_lr": 0.0,
            "scheduler.params.warmup_num_steps": max(1, config.optimisation.lr_warmup_steps),
            "scheduler.params.total_num_steps": config.optimisation.steps,
        },
    )
    # accelerate read the accumulation steps before they were filled.
    accelerator.gradient_accumulation_steps = config.optimisation.gradient_accumulation_steps
    return dict(plugin.deepspeed_config)


def _check_batch_sizes(config: TrainerConfig, deepspeed_config: dict[str, Any] | None) -> None:
    """The DeepSpeed JSON and train.json must agree; a silent mismatch changes what is trained."""
    if deepspeed_config is None:
        return
    for name, expected in (
        ("train_micro_batch_size_per_gpu", config.optimisation.batch_size),
        ("gradient_accumulation_steps", config.optimisation.gradient_accumulation_steps),
    ):
        declared = deepspeed_config.get(name)
        if declared not in (None, "auto") and int(declared) != expected:
            raise TrainerFailure(
                "invalid_config",
                f"DeepSpeed JSON has {name}={declared} but train.json asks for {expected}; make them agree",
            )


def _nvme_paths(deepspeed_config: dict[str, Any] | None) -> list[Path]:
    zero = (deepspeed_config or {}).get("zero_optimization", {})
    paths = []
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) or {}
        if offload.get("device") == "nvme":
            if not offload.get("nvme_path"):
                raise TrainerFailure(
                    "invalid_config", f"zero_optimization.{section} offloads to nvme but names no nvme_path"
                )
            paths.append(Path(offload["nvme_path"]))
    return paths


def _prepared_nvme_paths(
    config: TrainerConfig, deepspeed_config: dict[str, Any] | None, zero_stage: int, accelerator: Any
) -> list[Path]:
    """NVMe offload needs ZeRO-3 (ZeRO-1/2 silently keep the optimizer in RAM instead) and DeepSpeed's
    async_io op, which needs libaio. The swap folder starts empty: stale swap files from an earlier
    run are a known cause of crashes on resume."""
    paths = _nvme_paths(deepspeed_config)
    if not paths:
        return []
    if zero_stage != 3:
        raise TrainerFailure(
            "invalid_config",
            f"NVMe offload needs ZeRO stage 3; at stage {zero_stage} DeepSpeed silently keeps the optimizer "
            "in CPU RAM instead. Use zero_stage 3, or offload 'cpu'",
        )
    param_offload = (deepspeed_config or {}).get("zero_optimization", {}).get("offload_param") or {}
    if (
        config.training_type == "lora"
        and config.memory.gradient_checkpointing
        and param_offload.get("device") == "nvme"
    ):
        raise TrainerFailure(
            "invalid_config",
            "LoRA with the frozen base offloaded to NVMe fails under gradient checkpointing in DeepSpeed 0.19: the "
            "recomputed forward re-gathers frozen parameters whose swap buffers are never returned ('Not enough "
            "buffers 0 for swapping 1', DeepSpeed issue #3062). Use offload_param 'cpu', or turn "
            "gradient_checkpointing off",
        )
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise TrainerFailure(
            "missing_libaio",
            "NVMe offload needs DeepSpeed's async_io op, which cannot be built here: it needs libaio's headers "
            "and library and a C compiler. Install them in the image (apt-get install libaio-dev build-essential) "
            "or use offload 'cpu'",
        )
    if accelerator.is_local_main_process:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    return paths


def _precision(config: TrainerConfig, deepspeed_config: dict[str, Any] | None, accelerator: Any) -> Precision:
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}
    if deepspeed_config is not None:
        if str(deepspeed_config.get("bf16", {}).get("enabled", False)).lower() == "true":
            name = "bf16"
        elif str(deepspeed_config.get("fp16", {}).get("enabled", False)).lower() == "true":
            name = "fp16"
        else:
            name = "no"
        deepspeed_accelerator = get_accelerator()
        supported = {"bf16": deepspeed_accelerator.is_bf16_supported, "fp16": deepspeed_accelerator.is_fp16_supported}
        if name in supported and not supported[name]():
            raise TrainerFailure(
                "invalid_config",
                f"mixed_precision {name} is not supported by DeepSpeed's {deepspeed_accelerator.device_name()} accelerator; "
                f"use {'bf16' if name == 'fp16' else 'no'}",
            )
        return Precision(load_dtype=dtypes[name], input_dtype=dtypes[name], text_dtype=dtypes[name], name=name)
    name = accelerator.mixed_precision if accelerator.mixed_precision in dtypes else "no"
    # Without DeepSpeed: trainable weights stay fp32 under autocast; a frozen LoRA base can live in half precision,
    # and so does every weight of the fused pass (bf16, no fp32 master copy).
    frozen_base = dtypes[name] if config.training_type == "lora" or config.memory.fused_backward_pass else torch.float32
    return Precision(load_dtype=frozen_base, input_dtype=frozen_base, text_dtype=dtypes[name], name=name)
