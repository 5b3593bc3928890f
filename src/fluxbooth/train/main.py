"""`python -m fluxbooth.train --config train.json`, run by `accelerate launch`: FLUX DreamBooth.

Stages: load (accelerator, configs) → cache (class images if needed, text embeddings, latents; the
encoders and VAE are freed afterwards) → train (DeepSpeed engine built only now) → save → export
(+ validate). Progress goes to stdout as `fluxbooth.events` lines from the main process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.names import (
    EXIT_INVALID_CONFIG,
    FULL_EXPORT_FORMATS,
    LORA_EXPORT_FORMATS,
    SUPPORTED_WEIGHTING_SCHEMES,
)
from fluxbooth.trainer_config import TrainerConfig

CHECKPOINT_PREFIX = "checkpoint-"
FIXED_NOISE_IMAGES = 4
FIXED_NOISE_SIGMAS = (0.25, 0.5, 0.75)
CHECKPOINT_STATE_NAME = "fluxbooth_state.json"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth.train", description="FLUX DreamBooth trainer (run under accelerate launch)")
    parser.add_argument("--config", type=Path, required=True, help="train.json written by the worker (fluxbooth.trainer_config)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    try:
        config = TrainerConfig.read(arguments.config)
    except (OSError, ValueError, TypeError, KeyError) as error:
        print(f"cannot read trainer config {arguments.config}: {error}", file=sys.stderr, flush=True)
        from fluxbooth.events import format_event

        print(format_event("error", code="invalid_config", message=f"cannot read {arguments.config.name}: {error}"), flush=True)
        return EXIT_INVALID_CONFIG
    # Imported only now: everything below needs torch.
    from fluxbooth.train.runtime import EventReporter

    reporter = EventReporter(enabled=_is_main_process_from_environment())
    try:
        Trainer(config, reporter).run()
    except TrainerFailure as failure:
        reporter.error(failure.code, failure.message, **failure.details)
        print(f"fluxbooth trainer: {failure.code}: {failure.message}", file=sys.stderr, flush=True)
        return failure.exit_status
    except Exception as error:  # classify what we can; the traceback goes to the log
        import torch

        traceback.print_exc()
        sys.stderr.flush()
        if isinstance(error, torch.cuda.OutOfMemoryError):
            failure = TrainerFailure("cuda_oom", f"the GPU ran out of memory: {str(error).splitlines()[0][:300]}")
        else:
            failure = TrainerFailure("trainer_failed", f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}")
        reporter.error(failure.code, failure.message)
        return failure.exit_status
    return 0


def _is_main_process_from_environment() -> bool:
    # Before the Accelerator exists; accelerate launch sets RANK for every process.
    return os.environ.get("RANK", "0") == "0"


def _seed_for(*parts: object) -> int:
    """A 63-bit seed mixed from `parts`: the same parts always give the same stream, on any rank or resume."""
    digest = hashlib.sha256(json.dumps([str(part) for part in parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# Ranks wait at barriers while the main process generates class images, gathers ZeRO-3 weights for
# export or renders validation images; on a real model any of these can outlast the 30-minute default.
PROCESS_GROUP_TIMEOUT_SECONDS = 4 * 3600


def _process_group_settings(uses_deepspeed: bool) -> Any:
    """accelerate picks no process-group backend for DeepSpeed without a GPU and then reports a single
    process even when several run (each believing it is rank 0); name DeepSpeed's CPU backend for it."""
    from datetime import timedelta

    import torch
    from accelerate.utils import InitProcessGroupKwargs

    arguments: dict[str, Any] = {"timeout": timedelta(seconds=PROCESS_GROUP_TIMEOUT_SECONDS)}
    if uses_deepspeed and not torch.cuda.is_available():
        from deepspeed.accelerator import get_accelerator

        arguments["backend"] = get_accelerator().communication_backend_name()
    return InitProcessGroupKwargs(**arguments)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def launched_world_size() -> int:
    """How many processes the launcher started (torchrun's WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def _without_transformers_zero3_init() -> Any:
    """transformers partitions every model it loads while accelerate's HfDeepSpeedConfig says ZeRO-3, which
    would shard the text encoders we only run once. accelerate's `zero3_init_context_manager(enable=False)`
    re-registers a config that still says stage 3, so the registration itself is hidden for the duration."""
    import transformers.integrations.deepspeed as transformers_deepspeed

    saved = transformers_deepspeed._hf_deepspeed_config_weak_ref
    transformers_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        transformers_deepspeed._hf_deepspeed_config_weak_ref = saved


def _class_image_name(index: int) -> str:
    return f"class_{index:05d}.png"


@dataclass
class Precision:
    """How the transformer is held and fed. Under DeepSpeed the engine casts the module to bf16/fp16
    itself and keeps fp32 master weights in the optimizer; without it, accelerate autocasts."""

    load_dtype: Any
    input_dtype: Any
    text_dtype: Any
    name: str


class Trainer:
    def __init__(self, config: TrainerConfig, reporter: Any) -> None:
        self.config = config
        self.reporter = reporter
        # Rendered during training (validation_steps); the final validation adds its own and writes the index.
        self.validation_records: list[dict[str, Any]] = []
        self.validation_artifacts: list[Any] = []
        self.nvme_paths: list[Path] = []
        self.nvme_swap_peak_bytes: dict[str, int] = {}

    # ---------------------------------------------------------------- setup

    def run(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from fluxbooth.train.runtime import StageClock

        config = self.config
        self.clock = StageClock(self.reporter)
        self._validate_config()
        with self.clock.stage("load"):
            uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
            accelerator_arguments: dict[str, Any] = {"kwargs_handlers": [_process_group_settings(uses_deepspeed)]}
            if not uses_deepspeed:
                accelerator_arguments["gradient_accumulation_steps"] = config.gradient_accumulation_steps
                # Several plain processes on a machine without GPUs (torchrun started them: accelerate's own
                # MULTI_CPU launch needs mpirun): without `cpu`, accelerate would not make them data parallel.
                accelerator_arguments["cpu"] = launched_world_size() > 1 and not _cuda_available()
            accelerator = Accelerator(**accelerator_arguments)
            self.accelerator = accelerator
            self._check_process_group()
            self.reporter.enabled = accelerator.is_main_process
            self.deepspeed_config = self._deepspeed_config()
            self._fill_deepspeed_auto_values()
            self.zero_stage = int((self.deepspeed_config or {}).get("zero_optimization", {}).get("stage", 0))
            self._check_batch_sizes()
            self._check_nvme_offload()
            self.precision = self._precision()
            from fluxbooth.train.optim import validated_optimizer_name

            # Checked before the slow stages, so a bad name fails in seconds.
            self.optimizer_name = validated_optimizer_name(config, self.deepspeed_config)
            set_seed(config.seed)
            Path(config.output_dir).mkdir(parents=True, exist_ok=True)
            Path(config.cache_dir).mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        from fluxbooth.train.cache import ReleaseTracker

        self.release_tracker = ReleaseTracker()
        with self.clock.stage("cache"):
            instance_set, class_set = self._build_caches()
        self._free_memory()
        still_alive = self.release_tracker.alive()
        if still_alive:
            self.reporter.warning(f"{still_alive} still in memory after caching; the engine will share memory with them")
        with self.clock.stage("load", what="transformer"):
            transformer = self._load_transformer()
        final_loss, optimizer_name = self._train(transformer, instance_set, class_set)
        # The engine (self.engine) owns the model from here; dropping this name lets export free it.
        del transformer, instance_set, class_set
        artifacts = self._save_and_export()
        metrics = {
            "steps": config.steps,
            "final_loss": final_loss,
            "optimizer": optimizer_name,
            "zero_stage": self.zero_stage,
            "offload_optimizer": self._offload_device("offload_optimizer"),
            "offload_param": self._offload_device("offload_param"),
            "training_type": config.training_type,
            "export_formats": list(config.export_formats),
            "mixed_precision": self.precision.name,
            "num_processes": accelerator.num_processes,
            "seconds_per_stage": dict(self.clock.seconds),
            "seconds_total": round(time.perf_counter() - started, 3),
            "peak_host_rss_bytes": self._peak_host_rss(),
            "transformer_loading": self.loading_report,
            "fixed_noise_loss": self.fixed_noise_loss,
            # Loaded while caching (this process), and all released before the transformer was loaded.
            "released_before_training": [] if still_alive else self.release_tracker.tracked,
        }
        from fluxbooth.train.runtime import peak_gpu_bytes

        gpu_peak = peak_gpu_bytes()
        if gpu_peak is not None:
            metrics["peak_gpu_bytes"] = gpu_peak
        if self.start_step:
            metrics["resumed_from_step"] = self.start_step
        if self.nvme_swap_peak_bytes:
            metrics["nvme_swap_peak_bytes"] = self.nvme_swap_peak_bytes
        if accelerator.is_main_process:
            from fluxbooth.train.export import write_json

            payload = {"metrics": metrics, "artifacts": [artifact.to_dict() for artifact in artifacts]}
            write_json(Path(config.output_dir) / "metrics.json", payload)
            payload["artifacts"].append({"name": "metrics", "path": "metrics.json", "kind": "metrics"})
            self.reporter.emit("done", **payload)
        accelerator.wait_for_everyone()
        accelerator.end_training()

    def _validate_config(self) -> None:
        config = self.config
        if config.training_type not in ("full", "lora"):
            raise TrainerFailure("invalid_config", f"training_type {config.training_type!r} must be 'full' or 'lora'")
        if config.weighting_scheme not in SUPPORTED_WEIGHTING_SCHEMES:
            raise TrainerFailure(
                "invalid_config", f"weighting_scheme {config.weighting_scheme!r} must be one of {list(SUPPORTED_WEIGHTING_SCHEMES)}"
            )
        allowed = FULL_EXPORT_FORMATS if config.training_type == "full" else LORA_EXPORT_FORMATS
        wrong = [name for name in config.export_formats if name not in allowed]
        if wrong or not config.export_formats:
            raise TrainerFailure(
                "invalid_config", f"export_formats {list(config.export_formats)} for {config.training_type} training must be from {list(allowed)}"
            )
        width, height = config.resolution
        if width % 16 or height % 16:
            raise TrainerFailure("invalid_config", f"resolution {width}x{height}: both sides must be multiples of 16")
        if config.with_prior_preservation and not config.class_prompt:
            raise TrainerFailure("invalid_config", "with_prior_preservation needs a class_prompt")
        if config.steps < 1:
            raise TrainerFailure("invalid_config", "steps must be at least 1")

    def _offload_device(self, section: str) -> str:
        """Where DeepSpeed really keeps the optimizer state / parameters ("none" below ZeRO-3 for parameters,
        where DeepSpeed ignores offload_param)."""
        zero = (self.deepspeed_config or {}).get("zero_optimization", {})
        if section == "offload_param" and self.zero_stage != 3:
            return "none"
        return str((zero.get(section) or {}).get("device", "none"))

    def _deepspeed_config(self) -> dict[str, Any] | None:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return None if plugin is None else plugin.deepspeed_config

    def _fill_deepspeed_auto_values(self) -> None:
        """Hand-written DeepSpeed JSONs (DiffSynth-Studio's, accelerate's templates) say "auto" for sizes that
        accelerate fills from a dataloader and `model.config.hidden_size`, neither of which exists here, and
        zero.Init reads them before accelerate would. Fill them from train.json and the transformer's width."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            return
        from diffusers import FluxTransformer2DModel

        from fluxbooth.train.model import resolve_model_folder

        config = self.config
        transformer_config = FluxTransformer2DModel.load_config(str(resolve_model_folder(config.base_model)), subfolder="transformer")
        width = int(transformer_config["num_attention_heads"]) * int(transformer_config["attention_head_dim"])
        batch = config.batch_size * config.gradient_accumulation_steps * self.accelerator.num_processes
        plugin.deepspeed_config_process(
            must_match=False,
            train_micro_batch_size_per_gpu=config.batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            train_batch_size=batch,
            gradient_clipping=config.max_grad_norm,
            **{
                "zero_optimization.reduce_bucket_size": width * width,
                "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * width * width),
                "zero_optimization.stage3_param_persistence_threshold": 10 * width,
                "optimizer.params.lr": config.learning_rate,
                "scheduler.params.warmup_max_lr": config.learning_rate,
                "scheduler.params.warmup_min_lr": 0.0,
                "scheduler.params.warmup_num_steps": max(1, config.lr_warmup_steps),
                "scheduler.params.total_num_steps": config.steps,
            },
        )
        self.deepspeed_config = plugin.deepspeed_config
        # accelerate read the accumulation steps before they were filled.
        self.accelerator.gradient_accumulation_steps = config.gradient_accumulation_steps

    def _check_process_group(self) -> None:
        """Every process must know the others: otherwise each believes it is rank 0 and trains alone on the
        same data, and all of them write the same files."""
        from accelerate.utils import DistributedType

        world = launched_world_size()
        accelerator = self.accelerator
        if world > 1 and (accelerator.num_processes != world or accelerator.distributed_type == DistributedType.NO):
            raise TrainerFailure(
                "invalid_config",
                f"the launcher started {world} processes but accelerate formed {accelerator.distributed_type.value} "
                f"with {accelerator.num_processes}; check the accelerate config's distributed_type and use_cpu",
            )

    def _check_batch_sizes(self) -> None:
        """The DeepSpeed JSON and train.json must agree; a silent mismatch changes what is trained."""
        if self.deepspeed_config is None:
            return
        micro = self.deepspeed_config.get("train_micro_batch_size_per_gpu")
        accumulation = self.deepspeed_config.get("gradient_accumulation_steps")
        for name, declared, expected in (
            ("train_micro_batch_size_per_gpu", micro, self.config.batch_size),
            ("gradient_accumulation_steps", accumulation, self.config.gradient_accumulation_steps),
        ):
            if declared not in (None, "auto") and int(declared) != expected:
                raise TrainerFailure(
                    "invalid_config", f"DeepSpeed JSON has {name}={declared} but train.json asks for {expected}; make them agree"
                )

    def _nvme_paths(self) -> list[Path]:
        zero = (self.deepspeed_config or {}).get("zero_optimization", {})
        paths = []
        for section in ("offload_optimizer", "offload_param"):
            offload = zero.get(section) or {}
            if offload.get("device") == "nvme":
                if not offload.get("nvme_path"):
                    raise TrainerFailure("invalid_config", f"zero_optimization.{section} offloads to nvme but names no nvme_path")
                paths.append(Path(offload["nvme_path"]))
        return paths

    def _check_nvme_offload(self) -> None:
        """NVMe offload needs ZeRO-3 (ZeRO-1/2 silently keep the optimizer in RAM instead) and DeepSpeed's
        async_io op, which needs libaio. The swap folder starts empty: stale swap files from an earlier
        run are a known cause of crashes on resume."""
        paths = self._nvme_paths()
        if not paths:
            return
        if self.zero_stage != 3:
            raise TrainerFailure(
                "invalid_config",
                f"NVMe offload needs ZeRO stage 3; at stage {self.zero_stage} DeepSpeed silently keeps the optimizer "
                "in CPU RAM instead. Use zero_stage 3, or offload 'cpu'",
            )
        param_offload = (self.deepspeed_config or {}).get("zero_optimization", {}).get("offload_param") or {}
        if self.config.training_type == "lora" and self.config.gradient_checkpointing and param_offload.get("device") == "nvme":
            raise TrainerFailure(
                "invalid_config",
                "LoRA with the frozen base offloaded to NVMe fails under gradient checkpointing in DeepSpeed 0.19: the "
                "recomputed forward re-gathers frozen parameters whose swap buffers are never returned ('Not enough "
                "buffers 0 for swapping 1', DeepSpeed issue #3062). Use offload_param 'cpu', or turn "
                "gradient_checkpointing off",
            )
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        if builder is None or not builder.is_compatible(verbose=False):
            raise TrainerFailure(
                "missing_libaio",
                "NVMe offload needs DeepSpeed's async_io op, which cannot be built here: it needs libaio's headers "
                "and library and a C compiler. Install them in the image (apt-get install libaio-dev build-essential) "
                "or use offload 'cpu'",
            )
        if self.accelerator.is_local_main_process:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True, exist_ok=True)
        self.nvme_paths = paths
        self.accelerator.wait_for_everyone()

    def _measure_nvme_swap(self) -> None:
        """Record how many bytes DeepSpeed keeps in its swap files (this machine's ranks), per kind.

        The proof that NVMe offload really swaps: DeepSpeed deletes the files when the engine goes away, and
        keeps parameters below `stage3_param_persistence_threshold` elements in memory instead."""
        if not self.nvme_paths or not self.accelerator.is_local_main_process:
            return
        for kind, pattern in (("optimizer", "zero_stage_3/optimizer"), ("params", "zero_stage_3/*params")):
            swapped = sum(
                file.stat().st_size
                for path in self.nvme_paths
                for folder in path.glob(pattern)
                for file in folder.rglob("*.swp")
                if file.is_file()
            )
            self.nvme_swap_peak_bytes[kind] = max(self.nvme_swap_peak_bytes.get(kind, 0), swapped)

    def _precision(self) -> Precision:
        import torch

        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}
        if self.deepspeed_config is not None:
            if str(self.deepspeed_config.get("bf16", {}).get("enabled", False)).lower() == "true":
                name = "bf16"
            elif str(self.deepspeed_config.get("fp16", {}).get("enabled", False)).lower() == "true":
                name = "fp16"
            else:
                name = "no"
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
            supported = {"bf16": accelerator.is_bf16_supported, "fp16": accelerator.is_fp16_supported}
            if name in supported and not supported[name]():
                raise TrainerFailure(
                    "invalid_config",
                    f"mixed_precision {name} is not supported by DeepSpeed's {accelerator.device_name()} accelerator; "
                    f"use {'bf16' if name == 'fp16' else 'no'}",
                )
            return Precision(load_dtype=dtypes[name], input_dtype=dtypes[name], text_dtype=dtypes[name], name=name)
        name = self.accelerator.mixed_precision if self.accelerator.mixed_precision in dtypes else "no"
        # Without DeepSpeed: trainable weights stay fp32 under autocast; a frozen LoRA base can live in half precision.
        frozen_base = dtypes[name] if self.config.training_type == "lora" else torch.float32
        return Precision(load_dtype=frozen_base, input_dtype=frozen_base, text_dtype=dtypes[name], name=name)

    def _free_memory(self) -> None:
        from fluxbooth.train.cache import free_accelerator_memory

        free_accelerator_memory()

    def _peak_host_rss(self) -> int:
        from fluxbooth.train.runtime import peak_host_rss_bytes

        return peak_host_rss_bytes()

    def _plain_loading(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """A context in which transformers builds models whole, not under ZeRO-3's zero.Init."""
        return _without_transformers_zero3_init

    # ---------------------------------------------------------------- cache

    def _build_caches(self) -> tuple[Any, Any]:
        from fluxbooth.train.cache import (
            cache_fingerprint,
            cache_path,
            encode_image_set,
            load_encoded,
            load_encoded_prompts,
            load_vae,
            save_encoded,
        )
        from fluxbooth.train.data import discover_images

        config = self.config
        accelerator = self.accelerator
        instance_images = discover_images(Path(config.instance_dir), config.instance_prompt)
        if not instance_images:
            raise TrainerFailure(
                "invalid_dataset", f"no images in the instance folder {Path(config.instance_dir).name}/; add PNG or JPEG files"
            )
        class_images = []
        if config.with_prior_preservation:
            class_images = self._class_images()
        sets: list[tuple[str, list[Any]]] = [("instance", instance_images)]
        if class_images:
            sets.append(("class", class_images))
        text_dtype_name = str(self.precision.text_dtype).removeprefix("torch.")
        paths = {
            name: cache_path(
                Path(config.cache_dir),
                name,
                cache_fingerprint(config.base_model, images, config.resolution, config.max_sequence_length, text_dtype_name),
            )
            for name, images in sets
        }
        validation_path = self._validation_prompts_path() if self._validates_during_training() else None
        # One process per machine encodes (the cache folder is per machine); the others wait and read.
        if accelerator.is_local_main_process and validation_path is not None and not validation_path.is_file():
            self._encode_validation_prompts(validation_path)
        if accelerator.is_local_main_process and not all(path.is_file() for path in paths.values()):
            vae = load_vae(config.base_model, self._plain_loading())
            self.release_tracker.track("vae", vae)
            device = self._encoder_device()
            try:
                for name, images in sets:
                    if paths[name].is_file():
                        continue
                    encoded = encode_image_set(
                        config.base_model,
                        images,
                        vae=vae,
                        resolution=config.resolution,
                        device=device,
                        text_dtype=self.precision.text_dtype,
                        max_sequence_length=config.max_sequence_length,
                        loading_context=self._plain_loading(),
                        tracker=self.release_tracker,
                    )
                    save_encoded(encoded, paths[name])
            finally:
                del vae
        accelerator.wait_for_everyone()
        loaded = {name: load_encoded(path) for name, path in paths.items()}
        self.validation_embeddings = None if validation_path is None else load_encoded_prompts(validation_path)
        self.reporter.emit(
            "stage",
            stage="cache",
            instance_images=len(loaded["instance"]),
            class_images=len(loaded["class"]) if "class" in loaded else 0,
            status="ready",
        )
        return loaded["instance"], loaded.get("class")

    def _encoder_device(self) -> Any:
        """Where the text encoders and the VAE run: the CPU when the planner keeps them off the GPU."""
        import torch

        return torch.device("cpu") if self.config.encoders_on_cpu else self.accelerator.device

    def _validates_during_training(self) -> bool:
        config = self.config
        return bool(config.validation_prompts and config.validation_steps and config.validation_steps < config.steps)

    def _validation_prompts_path(self) -> Path:
        from fluxbooth.train.cache import cache_path, prompts_fingerprint

        text_dtype_name = str(self.precision.text_dtype).removeprefix("torch.")
        config = self.config
        fingerprint = prompts_fingerprint(config.base_model, config.validation_prompts, config.max_sequence_length, text_dtype_name)
        return cache_path(Path(config.cache_dir), "validation", fingerprint)

    def _encode_validation_prompts(self, path: Path) -> None:
        """The validation prompts' embeddings, so renders during training need no text encoders (they are
        released before the transformer loads and would cost gigabytes beside the engine)."""
        from fluxbooth.train.cache import EncodedPrompts, encode_prompts, save_encoded_prompts

        config = self.config
        prompts = list(config.validation_prompts)
        prompt_embeds, pooled_prompt_embeds = encode_prompts(
            config.base_model,
            prompts,
            device=self._encoder_device(),
            dtype=self.precision.text_dtype,
            max_sequence_length=config.max_sequence_length,
            loading_context=self._plain_loading(),
            tracker=self.release_tracker,
        )
        save_encoded_prompts(EncodedPrompts(prompts, prompt_embeds, pooled_prompt_embeds), path)

    def _class_images(self) -> list[Any]:
        """Supplied class images (class_dir), topped up with images generated by the base pipeline."""
        from fluxbooth.train.data import TrainingImage, list_image_files

        config = self.config
        supplied_dir = Path(config.class_dir) if config.class_dir else None
        supplied = list_image_files(supplied_dir) if supplied_dir else []
        supplied = supplied[: config.num_class_images]
        missing = config.num_class_images - len(supplied)
        generated: list[Path] = []
        if missing > 0:
            folder = self._class_image_folder()
            self._generate_class_images(folder, missing)
            generated = [folder / _class_image_name(index) for index in range(missing)]
        return [TrainingImage(path=path, prompt=config.class_prompt or "") for path in supplied + generated]

    def _class_image_folder(self) -> Path:
        """Where generated class images live: a folder per (model, prompt, size, sampler settings, seed) under
        class_image_cache_dir when the worker keeps one across jobs, else inside this job's cache."""
        config = self.config
        if not config.class_image_cache_dir:
            return Path(config.cache_dir) / "class_images"
        recipe = {
            "base_model": config.base_model,
            "class_prompt": config.class_prompt,
            "resolution": list(config.resolution),
            "steps": config.class_image_inference_steps,
            "guidance_scale": config.validation_guidance_scale,
            "max_sequence_length": config.max_sequence_length,
            "seed": config.seed,
            "dtype": self.precision.name,
        }
        fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
        return Path(config.class_image_cache_dir) / fingerprint

    def _generate_class_images(self, folder: Path, count: int) -> None:
        """Render the missing ones of `count` class images from class_prompt with the base pipeline, each seeded
        by its index, shared out among the processes of this machine. Finished images are kept (written under
        a temporary name and renamed), so an interrupted job resumes generation where it stopped."""
        import torch
        from diffusers import FluxPipeline

        config = self.config
        accelerator = self.accelerator
        folder.mkdir(parents=True, exist_ok=True)
        local_rank = accelerator.local_process_index
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mine = [index for index in range(count) if index % local_world == local_rank and not (folder / _class_image_name(index)).is_file()]
        if any(not (folder / _class_image_name(index)).is_file() for index in range(count)):
            self.reporter.emit("stage", stage="cache", status="generating_class_images", count=count)
        if mine:
            with _without_transformers_zero3_init():
                pipeline = FluxPipeline.from_pretrained(config.base_model, torch_dtype=self.precision.text_dtype)
            if accelerator.device.type == "cuda":
                pipeline.enable_model_cpu_offload(device=accelerator.device)
            pipeline.set_progress_bar_config(disable=True)
            width, height = config.resolution
            for index in mine:
                target = folder / _class_image_name(index)
                generator = torch.Generator("cpu").manual_seed(_seed_for(config.seed, "class_image", index))
                image = pipeline(
                    prompt=config.class_prompt,
                    width=width,
                    height=height,
                    num_inference_steps=config.class_image_inference_steps,
                    guidance_scale=config.validation_guidance_scale,
                    generator=generator,
                    max_sequence_length=config.max_sequence_length,
                ).images[0]
                staging = target.with_name(f".{target.name}.{os.getpid()}.tmp.png")
                image.save(staging)
                os.replace(staging, target)
            del pipeline
            self._free_memory()
        accelerator.wait_for_everyone()

    # ---------------------------------------------------------------- model

    def _load_transformer(self) -> Any:
        from fluxbooth.train.model import add_lora_adapter, load_transformer, load_transformer_zero3, partitioning_report

        config = self.config
        self.loading_report: dict[str, Any] = {"method": "from_pretrained"}
        if self.zero_stage == 3:
            transformer = load_transformer_zero3(
                config.base_model, self.precision.load_dtype, self.deepspeed_config, self.accelerator.is_main_process
            )
            self.loading_report = {"method": "zero3_init", **partitioning_report(transformer)}
            if self.loading_report["materialised_elements"] or self.loading_report["partitioned"] != self.loading_report["parameters"]:
                raise TrainerFailure("trainer_failed", f"ZeRO-3 loading left parameters whole: {self.loading_report}")
        else:
            transformer = load_transformer(config.base_model, self.precision.load_dtype)
        if config.training_type == "lora":
            add_lora_adapter(transformer, config.lora)
            if self.deepspeed_config is None:
                # The trained adapter stays fp32 under autocast, as diffusers' LoRA scripts keep it.
                import torch

                for parameter in transformer.parameters():
                    if parameter.requires_grad:
                        parameter.data = parameter.data.to(torch.float32)
        else:
            transformer.requires_grad_(True)
        if config.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        transformer.train()
        return transformer

    # ---------------------------------------------------------------- training

    def _train(self, transformer: Any, instance_set: Any, class_set: Any) -> tuple[float, str]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        from fluxbooth.train.cache import vae_normalisation
        from fluxbooth.train.flow import SigmaSampler
        from fluxbooth.train.model import trainable_parameters
        from fluxbooth.train.optim import (
            build_optimizer,
            build_scheduler,
            innermost_optimizer,
            optimizer_class_name,
            schedule_stepped_by_deepspeed,
        )

        config = self.config
        accelerator = self.accelerator
        parameters = trainable_parameters(transformer)
        optimizer = build_optimizer(self.optimizer_name, parameters, config, self.deepspeed_config)
        self.scheduler_stepped_by_engine = schedule_stepped_by_deepspeed(optimizer, self.deepspeed_config)
        if self.scheduler_stepped_by_engine:
            scheduler = build_scheduler(optimizer, config, self.deepspeed_config, accelerator.num_processes)
            transformer, optimizer, scheduler = accelerator.prepare(transformer, optimizer, scheduler)
        else:
            # Stepped by hand once per optimizer step: accelerate's wrapper would step it once per process. Built on
            # the optimizer that really steps (accelerate swaps an offloaded torch AdamW for DeepSpeedCPUAdam).
            transformer, optimizer = accelerator.prepare(transformer, optimizer)
            scheduler = build_scheduler(innermost_optimizer(optimizer), config, self.deepspeed_config, accelerator.num_processes)
        self.engine, self.optimizer, self.scheduler = transformer, optimizer, scheduler
        real_optimizer_name = optimizer_class_name(optimizer)
        self.start_step = self._maybe_resume()

        noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(config.base_model, subfolder="scheduler")
        self.sampler = SigmaSampler.from_scheduler(
            noise_scheduler, config.weighting_scheme, config.logit_mean, config.logit_std, config.mode_scale
        )
        normalisation = vae_normalisation(config.base_model)
        self.guidance_scale = config.guidance_scale if accelerator.unwrap_model(transformer).config.guidance_embeds else None
        accumulation = config.gradient_accumulation_steps
        world, rank = accelerator.num_processes, accelerator.process_index
        final_loss = float("nan")
        self.ema = self._make_ema(transformer)
        if self.ema is not None and self._resume_ema_state is not None and accelerator.is_main_process:
            self.ema.load_state_dict(torch.load(self._resume_ema_state, map_location="cpu", weights_only=True))
        self.fixed_noise_loss = {"start": self._fixed_noise_loss(transformer, instance_set, normalisation)}

        with self.clock.stage("train", steps=config.steps, start_step=self.start_step, optimizer=real_optimizer_name):
            for step in range(self.start_step, config.steps):
                step_started = time.perf_counter()
                # The rate this step trains with (schedulers advance inside the optimizer step).
                step_lr = float(optimizer.param_groups[0]["lr"])
                losses = []
                for micro in range(accumulation):
                    with accelerator.accumulate(transformer):
                        position = ((step * accumulation + micro) * world + rank) * config.batch_size
                        batch = self._micro_batch(instance_set, class_set, position, normalisation)
                        generator = torch.Generator("cpu").manual_seed(_seed_for(config.seed, "noise", step, micro, rank))
                        per_sample = self._per_sample_loss(transformer, batch, generator)
                        if class_set is not None:
                            instance_loss, class_loss = per_sample.chunk(2)
                            loss = instance_loss.mean() + config.prior_loss_weight * class_loss.mean()
                        else:
                            loss = per_sample.mean()
                        accelerator.backward(loss)
                        if accelerator.sync_gradients and self.deepspeed_config is None and config.max_grad_norm > 0:
                            accelerator.clip_grad_norm_(parameters, config.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        losses.append(loss.detach().float())
                if not self.scheduler_stepped_by_engine:
                    scheduler.step()
                step_loss = float(accelerator.reduce(torch.stack(losses).mean(), reduction="mean"))
                if not math.isfinite(step_loss):
                    raise TrainerFailure(
                        "nan_loss",
                        f"the loss became {step_loss} at step {step + 1}; lower learning_rate or use bf16 instead of fp16",
                        step=step + 1,
                    )
                if self.ema is not None:
                    self.ema.update(accelerator.unwrap_model(transformer))
                final_loss = step_loss
                self._measure_nvme_swap()
                self.reporter.step(
                    step=step + 1,
                    total=config.steps,
                    loss=step_loss,
                    lr=step_lr,
                    seconds_per_step=time.perf_counter() - step_started,
                )
                if config.checkpointing_steps and (step + 1) % config.checkpointing_steps == 0 and step + 1 < config.steps:
                    self._save_checkpoint(step + 1)
                # The last step is left to the final validation, which renders the same weights once exported.
                if self.validation_embeddings is not None and (step + 1) % config.validation_steps == 0 and step + 1 < config.steps:
                    self._render_validation_during_training(transformer, step + 1)
        self.fixed_noise_loss["end"] = self._fixed_noise_loss(transformer, instance_set, normalisation)
        return final_loss, real_optimizer_name

    def _per_sample_loss(self, transformer: Any, batch: dict[str, Any], generator: Any, sigmas: Any = None) -> Any:
        """The rectified-flow loss of each sample in `batch` [B], float32."""
        import torch

        from fluxbooth.train.flow import build_flow_inputs, per_sample_loss, unpack_prediction

        device, dtype = self.accelerator.device, self.precision.input_dtype
        inputs = build_flow_inputs(
            batch["latents"],
            sampler=self.sampler,
            generator=generator,
            guidance_scale=self.guidance_scale,
            device=device,
            dtype=dtype,
            sigmas=sigmas,
        )
        text_ids = torch.zeros(batch["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        prediction = transformer(
            hidden_states=inputs.hidden_states,
            timestep=inputs.timestep,
            guidance=inputs.guidance,
            pooled_projections=batch["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            encoder_hidden_states=batch["prompt_embeds"].to(device=device, dtype=dtype),
            txt_ids=text_ids,
            img_ids=inputs.img_ids,
            return_dict=False,
        )[0]
        return per_sample_loss(unpack_prediction(prediction, inputs.latent_shape), inputs)

    def _fixed_noise_loss(self, transformer: Any, instance_set: Any, normalisation: Any) -> float:
        """*Collective.* The unweighted loss on the instance images (posterior means) at fixed noise and
        sigmas 0.25/0.5/0.75: a repeatable measure of learning, free of the sampling noise of step losses."""
        import torch

        losses = []
        with torch.no_grad():
            for index in range(min(len(instance_set), FIXED_NOISE_IMAGES)):
                prompt = instance_set.prompt_index[index : index + 1]
                batch = {
                    "latents": normalisation.apply(instance_set.latent_mean[index : index + 1]),
                    "prompt_embeds": instance_set.prompt_embeds[prompt],
                    "pooled_prompt_embeds": instance_set.pooled_prompt_embeds[prompt],
                }
                for sigma in FIXED_NOISE_SIGMAS:
                    generator = torch.Generator("cpu").manual_seed(_seed_for(self.config.seed, "fixed_noise", index, sigma))
                    losses.append(float(self._per_sample_loss(transformer, batch, generator, torch.tensor([sigma])).mean()))
        # A forward without backward leaves ZeRO-3's prefetched parameters gathered ("in flight"), which the
        # next gather (the export) would trip over; hand them back to their partitions.
        if hasattr(transformer, "empty_partition_cache"):
            transformer.empty_partition_cache()
        return sum(losses) / len(losses)

    def _micro_batch(self, instance_set: Any, class_set: Any, position: int, normalisation: Any) -> dict[str, Any]:
        """Samples `batch_size` instance images (and as many class images) at a global sample position.

        Each pass over a set is a fresh permutation seeded by (seed, set, epoch), so the batch at any
        (step, micro-step, rank) is a pure function of the seed: a resumed run sees the same data.
        """
        import torch

        def pick(encoded: Any, stream: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            count = len(encoded)
            indices = []
            for offset in range(self.config.batch_size):
                epoch, within = divmod(position + offset, count)
                order = torch.randperm(count, generator=torch.Generator().manual_seed(_seed_for(self.config.seed, stream, epoch)))
                indices.append(int(order[within]))
            index = torch.tensor(indices)
            generator = torch.Generator().manual_seed(_seed_for(self.config.seed, stream, "latent", position))
            mean, std = encoded.latent_mean[index], encoded.latent_std[index]
            latents = mean + std * torch.randn(mean.shape, generator=generator)
            prompt = encoded.prompt_index[index]
            return normalisation.apply(latents), encoded.prompt_embeds[prompt], encoded.pooled_prompt_embeds[prompt]

        latents, prompt_embeds, pooled = pick(instance_set, "instance")
        if class_set is not None:
            class_latents, class_prompt_embeds, class_pooled = pick(class_set, "class")
            latents = torch.cat([latents, class_latents])
            prompt_embeds = torch.cat([prompt_embeds, class_prompt_embeds])
            pooled = torch.cat([pooled, class_pooled])
        return {"latents": latents, "prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def _make_ema(self, transformer: Any) -> Any:
        if self.config.ema_decay is None:
            return None
        from fluxbooth.train.ema import CpuEma

        return CpuEma.from_model(
            self.accelerator.unwrap_model(transformer),
            decay=self.config.ema_decay,
            is_main_process=self.accelerator.is_main_process,
        )

    # ---------------------------------------------------------------- checkpoints

    def _checkpoint_root(self) -> Path:
        return Path(self.config.checkpoint_dir or Path(self.config.output_dir).parent / "checkpoints")

    def _save_checkpoint(self, step: int) -> None:
        """*Collective.* accelerate/DeepSpeed state after `step` optimizer steps, written under a temporary
        name and renamed, so a checkpoint folder either is complete or does not exist."""
        accelerator = self.accelerator
        root = self._checkpoint_root()
        final = root / f"{CHECKPOINT_PREFIX}{step}"
        staging = root / f".{CHECKPOINT_PREFIX}{step}.partial"
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with self.clock.stage("checkpoint", step=step):
            save_arguments: dict[str, Any] = {}
            if self.deepspeed_config is not None and self.config.training_type == "lora":
                # Without this every LoRA checkpoint would carry the whole frozen base model.
                save_arguments["exclude_frozen_parameters"] = True
            accelerator.save_state(str(staging), **save_arguments)
            if accelerator.is_main_process:
                state = {
                    "step": step,
                    "seed": self.config.seed,
                    "training_type": self.config.training_type,
                    "zero_stage": self.zero_stage,
                    "num_processes": accelerator.num_processes,
                    "scheduler": None if self.scheduler_stepped_by_engine else self.scheduler.state_dict(),
                    "ema": None,
                }
                if self.ema is not None:
                    import torch

                    torch.save(self.ema.state_dict(), staging / "ema.pt")
                    state["ema"] = "ema.pt"
                (staging / CHECKPOINT_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staging, final)
                self._prune_checkpoints(root, keep=self.config.checkpoints_keep)
                self.reporter.emit("checkpoint", step=step, path=str(final))
            accelerator.wait_for_everyone()

    def _prune_checkpoints(self, root: Path, keep: int) -> None:
        found = sorted(
            (int(path.name.removeprefix(CHECKPOINT_PREFIX)), path)
            for path in root.glob(f"{CHECKPOINT_PREFIX}*")
            if path.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
        )
        for _, path in found[: max(0, len(found) - max(1, keep))]:
            shutil.rmtree(path, ignore_errors=True)

    def _resolve_resume(self) -> Path | None:
        resume = self.config.resume_from
        if not resume:
            return None
        if resume == "latest":
            root = self._checkpoint_root()
            found = sorted(
                (int(path.name.removeprefix(CHECKPOINT_PREFIX)), path)
                for path in root.glob(f"{CHECKPOINT_PREFIX}*")
                if path.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and (path / CHECKPOINT_STATE_NAME).is_file()
            )
            return found[-1][1] if found else None
        path = Path(resume)
        if not (path / CHECKPOINT_STATE_NAME).is_file():
            raise TrainerFailure(
                "resume_failed", f"resume_from {path.name!r} is not a fluxbooth checkpoint (no {CHECKPOINT_STATE_NAME}); pass a checkpoint-N folder"
            )
        return path

    def _maybe_resume(self) -> int:
        """*Collective.* Restore a checkpoint's model, optimizer, schedule and RNG state; return its step."""
        self._resume_ema_state: Path | None = None
        path = self._resolve_resume()
        if path is None:
            return 0
        state = json.loads((path / CHECKPOINT_STATE_NAME).read_text())
        for name, expected in (("training_type", self.config.training_type), ("zero_stage", self.zero_stage), ("num_processes", self.accelerator.num_processes)):
            if state.get(name) != expected:
                raise TrainerFailure(
                    "resume_failed",
                    f"checkpoint {path.name} was made with {name}={state.get(name)!r}, this run has {expected!r}; resume with the same settings",
                )
        step = int(state["step"])
        if step >= self.config.steps:
            raise TrainerFailure("resume_failed", f"checkpoint {path.name} is at step {step}, not before steps={self.config.steps}")
        load_arguments: dict[str, Any] = {}
        if self.deepspeed_config is not None:
            # LoRA checkpoints hold only the adapter (exclude_frozen_parameters), so the base must not be required.
            load_arguments["load_module_strict"] = self.config.training_type != "lora"
        self.accelerator.load_state(str(path), **load_arguments)
        if state.get("scheduler") is not None and not self.scheduler_stepped_by_engine:
            self.scheduler.load_state_dict(state["scheduler"])
        self._resume_ema_state = path / state["ema"] if state.get("ema") else None
        self.reporter.emit("stage", stage="train", status="resumed", step=step, checkpoint=path.name)
        return step

    # ---------------------------------------------------------------- save / export

    def _save_and_export(self) -> list[Any]:
        from fluxbooth.train.export import Artifact

        accelerator = self.accelerator
        config = self.config
        output_dir = Path(config.output_dir)
        model = accelerator.unwrap_model(self.engine)
        artifacts: list[Artifact] = []
        with self.clock.stage("save"):
            if config.training_type == "full":
                samples = self._save_full(model, output_dir / "transformer")
            else:
                lora_state = self._lora_state(model)
        with self.clock.stage("export", formats=list(config.export_formats)):
            if accelerator.is_main_process:
                if config.training_type == "full":
                    artifacts += self._export_full(output_dir, samples)
                else:
                    artifacts += self._export_lora(output_dir, lora_state, "", "lora")
            if self.ema is not None:
                artifacts += self._export_ema(model, output_dir)
            accelerator.wait_for_everyone()
        # The engine's memory is released before the validation pipeline is loaded.
        self.engine = self.optimizer = self.scheduler = None
        del model
        accelerator.free_memory()
        self._free_memory()
        if config.validation_prompts:
            with self.clock.stage("validate", prompts=len(config.validation_prompts)):
                if accelerator.is_main_process:
                    artifacts += self._render_validation_images(output_dir)
                accelerator.wait_for_everyone()
        return artifacts

    def _save_full(self, model: Any, folder: Path) -> dict[str, Any]:
        from fluxbooth.train.export import sample_names, save_transformer

        if self.zero_stage != 3:
            # Not partitioned: diffusers' own writer, from the unwrapped model, on the main process.
            if not self.accelerator.is_main_process:
                return {}
            model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=self.config.max_shard_size)
            state = model.state_dict()
            return {name: state[name].detach().cpu().clone() for name in sample_names(list(state))}
        return save_transformer(
            model, folder, is_main_process=self.accelerator.is_main_process, max_shard_size=self.config.max_shard_size
        )

    def _export_full(self, output_dir: Path, samples: dict[str, Any]) -> list[Any]:
        from fluxbooth.train.export import Artifact, export_single_file, verify_saved_transformer

        folder = output_dir / "transformer"
        verify_saved_transformer(folder, samples)
        artifacts = []
        if "diffusers" in self.config.export_formats:
            artifacts.append(Artifact(name="transformer", path="transformer", kind="diffusers_transformer"))
        if "single_file" in self.config.export_formats:
            single = output_dir / "flux_transformer.safetensors"
            export_single_file(folder, single)
            artifacts.append(Artifact(name="transformer_single_file", path=single.name, kind="single_file_transformer"))
        return artifacts

    def _lora_state(self, model: Any) -> dict[str, Any]:
        from fluxbooth.train.export import lora_state_dict

        return lora_state_dict(model, is_main_process=self.accelerator.is_main_process)

    def _export_lora(self, output_dir: Path, state: dict[str, Any], prefix: str, folder_name: str) -> list[Any]:
        """Each requested LoRA format; `prefix` ("" or "ema_") goes in front of artifact names and kinds."""
        from diffusers import FluxTransformer2DModel

        from fluxbooth.train.export import Artifact, save_lora_comfyui, save_lora_diffusers
        from fluxbooth.train.model import lora_adapter_metadata, resolve_model_folder

        artifacts = []
        folder = output_dir / folder_name
        folder.mkdir(parents=True, exist_ok=True)
        if "diffusers" in self.config.export_formats:
            save_lora_diffusers(state, folder, lora_adapter_metadata(self.config.lora))
            artifacts.append(
                Artifact(name=f"{prefix}lora", path=f"{folder_name}/pytorch_lora_weights.safetensors", kind=f"{prefix}lora_diffusers")
            )
        if "comfyui" in self.config.export_formats:
            transformer_config = FluxTransformer2DModel.load_config(
                str(resolve_model_folder(self.config.base_model)), subfolder="transformer"
            )
            comfy = folder / "lora_comfyui.safetensors"
            save_lora_comfyui(state, comfy, self.config.lora, transformer_config)
            artifacts.append(Artifact(name=f"{prefix}lora_comfyui", path=f"{folder_name}/{comfy.name}", kind=f"{prefix}lora_comfyui"))
        return artifacts

    def _export_ema(self, model: Any, output_dir: Path) -> list[Any]:
        """*Collective for nothing* (EMA lives on the main process's CPU): EMA weights in the same formats."""
        if not self.accelerator.is_main_process:
            return []
        ema_state = self.ema.export_state()
        if self.config.training_type == "lora":
            return self._export_lora(output_dir, ema_state, "ema_", "ema_lora")
        from diffusers import FluxTransformer2DModel

        from fluxbooth.train.export import Artifact, verify_saved_transformer
        from fluxbooth.train.model import resolve_model_folder

        folder = output_dir / "ema_transformer"
        config = FluxTransformer2DModel.load_config(str(resolve_model_folder(self.config.base_model)), subfolder="transformer")
        import torch

        with torch.device("meta"):
            skeleton = FluxTransformer2DModel.from_config(config)
        skeleton.load_state_dict(ema_state, assign=True)
        skeleton.save_pretrained(str(folder), safe_serialization=True, max_shard_size=self.config.max_shard_size)
        verify_saved_transformer(folder, {name: ema_state[name] for name in list(ema_state)[:4]})
        return [Artifact(name="ema_transformer", path="ema_transformer", kind="ema_diffusers_transformer")]

    def _render_validation_images(self, output_dir: Path) -> list[Any]:
        """Render validation_prompts with the exported weights, loaded the way a user would load them."""
        import torch
        from diffusers import FluxPipeline, FluxTransformer2DModel

        from fluxbooth.train.export import Artifact

        config = self.config
        device = self.accelerator.device
        dtype = self.precision.text_dtype
        with _without_transformers_zero3_init():
            if config.training_type == "full":
                transformer = FluxTransformer2DModel.from_pretrained(str(output_dir / "transformer"), torch_dtype=dtype)
                pipeline = FluxPipeline.from_pretrained(config.base_model, transformer=transformer, torch_dtype=dtype)
            else:
                pipeline = FluxPipeline.from_pretrained(config.base_model, torch_dtype=dtype)
                pipeline.load_lora_weights(str(output_dir / "lora"), weight_name="pytorch_lora_weights.safetensors")
        if device.type == "cuda":
            pipeline.enable_model_cpu_offload(device=device)
        pipeline.set_progress_bar_config(disable=True)
        folder = output_dir / "validation"
        folder.mkdir(parents=True, exist_ok=True)
        width, height = config.resolution
        artifacts = list(self.validation_artifacts)
        for index, prompt in enumerate(config.validation_prompts):
            seed = self._validation_seed(index)
            image = pipeline(
                prompt=prompt,
                width=width,
                height=height,
                num_inference_steps=config.validation_inference_steps,
                guidance_scale=config.validation_guidance_scale,
                generator=torch.Generator("cpu").manual_seed(seed),
                max_sequence_length=config.max_sequence_length,
            ).images[0]
            name = f"validation_{index:02d}.png"
            image.save(folder / name)
            self.validation_records.append(self._validation_record(name, prompt, seed, config.steps))
            artifacts.append(Artifact(name=f"validation_{index:02d}", path=f"validation/{name}", kind="validation_image"))
        self._write_validation_index()
        artifacts.append(Artifact(name="validation_index", path="validation/validation.json", kind="validation_index"))
        del pipeline
        gc.collect()
        return artifacts

    def _validation_seed(self, index: int) -> int:
        """The same per prompt at every step and at the end, so the images of a run compare."""
        return _seed_for(self.config.seed, "validation", index) % (2**32)

    def _validation_record(self, file: str, prompt: str, seed: int, training_step: int) -> dict[str, Any]:
        """`file` is relative to validation/; `steps` counts inference steps, `training_step` optimizer steps."""
        return {
            "file": file,
            "prompt": prompt,
            "seed": seed,
            "steps": self.config.validation_inference_steps,
            "training_step": training_step,
        }

    def _write_validation_index(self) -> None:
        from fluxbooth.train.export import write_json

        write_json(
            Path(self.config.output_dir) / "validation" / "validation.json",
            {"images": self.validation_records, "guidance_scale": self.config.validation_guidance_scale},
        )

    def _render_validation_during_training(self, engine: Any, step: int) -> None:
        """*Collective under ZeRO-3*, where every rank holds a slice of each layer and the forward gathers
        them together; below it only the main process renders. The validation prompts, from their cached
        embeddings (no text encoders), through the weights being trained, with the seeds of the final
        validation; written to validation/step-NNNNNN/."""
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        from fluxbooth.train.cache import decoding_device, load_vae
        from fluxbooth.train.export import Artifact

        class PipelineOnDevice(FluxPipeline):
            """The pipeline guesses where to compute from its modules' parameters; under ZeRO-3 those are empty
            partitions that may sit on the CPU (offload) while the forward gathers them on the accelerator."""

            @property
            def _execution_device(self) -> torch.device:
                return device

        accelerator, config = self.accelerator, self.config
        device = accelerator.device
        is_main = accelerator.is_main_process
        with self.clock.stage("validate", step=step, prompts=len(config.validation_prompts)):
            if is_main or self.zero_stage == 3:
                dtype = self.precision.input_dtype
                # Loaded for each render, not kept: training steps never share memory with it.
                vae = load_vae(config.base_model, self._plain_loading(), dtype=dtype)
                if is_main:
                    vae.to(decoding_device(self._encoder_device(), vae, config.resolution))
                pipeline = PipelineOnDevice(
                    scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(config.base_model, subfolder="scheduler"),
                    vae=vae,
                    text_encoder=None,
                    tokenizer=None,
                    text_encoder_2=None,
                    tokenizer_2=None,
                    transformer=accelerator.unwrap_model(engine),
                )
                pipeline.set_progress_bar_config(disable=True)
                folder = Path(config.output_dir) / "validation" / f"step-{step:06d}"
                folder.mkdir(parents=True, exist_ok=True)
                width, height = config.resolution
                embeddings = self.validation_embeddings
                engine.eval()
                try:
                    for index, prompt in enumerate(config.validation_prompts):
                        seed = self._validation_seed(index)
                        rendered = pipeline(
                            prompt_embeds=embeddings.prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
                            pooled_prompt_embeds=embeddings.pooled_prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
                            width=width,
                            height=height,
                            num_inference_steps=config.validation_inference_steps,
                            guidance_scale=config.validation_guidance_scale,
                            generator=torch.Generator("cpu").manual_seed(seed),
                            # The other ranks only lend their slices to the forward.
                            output_type="pil" if is_main else "latent",
                        ).images[0]
                        if is_main:
                            name = f"validation_{index:02d}.png"
                            rendered.save(folder / name)
                            file = f"{folder.name}/{name}"
                            self.validation_records.append(self._validation_record(file, prompt, seed, step))
                            self.validation_artifacts.append(
                                Artifact(name=f"validation_step{step:06d}_{index:02d}", path=f"validation/{file}", kind="validation_image")
                            )
                finally:
                    engine.train()
                    # As after the fixed-noise loss: a forward without backward leaves ZeRO-3's prefetched
                    # parameters gathered, which the next training step would trip over.
                    if hasattr(engine, "empty_partition_cache"):
                        engine.empty_partition_cache()
                    del pipeline, vae
                    self._free_memory()
                if is_main:
                    self._write_validation_index()
            accelerator.wait_for_everyone()
