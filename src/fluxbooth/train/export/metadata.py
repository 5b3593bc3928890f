"""What every exported safetensors file says about itself: the Stability AI model spec's `modelspec.*` keys
(github.com/Stability-AI/ModelSpec, version 1.0.1) and kohya's `ss_*` training keys, spelled as kohya's
sd-scripts writes them (library/sai_model_spec.py, train_network.py), which ComfyUI, A1111/Forge and
Civitai read and show: the trigger phrase, the base model, rank and alpha, steps, learning rate,
resolution, the captions' tag frequency.

Pure and torch-free: one `TrainingRecord` (the run, read once at export) gives each file layout its
`dict[str, str]`. safetensors metadata holds only strings, so numbers and booleans are written with
`str()` (kohya's spelling: "16.0", "True") and the nested keys as JSON.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from pathlib import PurePosixPath

from fluxbooth.contract.trainer_config import TrainerConfig

MODELSPEC_VERSION = "1.0.1"
# ModelSpec's "implementation" names the codebase whose key names a file uses: diffusers' for the diffusers
# layouts, Black Forest Labs' original code for the single file and kohya's LoRA layout (as sd-scripts writes).
DIFFUSERS_IMPLEMENTATION = "diffusers"
ORIGINAL_FLUX_IMPLEMENTATION = "https://github.com/black-forest-labs/flux"
LORA_ADAPTER = "lora"
# The kohya network module whose key layout (`lora_unet_...`) the ComfyUI LoRA file follows.
KOHYA_FLUX_LORA_MODULE = "networks.lora_flux"
TRAINER_NAME = "fluxbooth"


class FileLayout(Enum):
    """The key layout of an exported file, which decides its architecture suffix and implementation."""

    LORA_DIFFUSERS = "lora_diffusers"
    LORA_KOHYA = "lora_kohya"
    TRANSFORMER_DIFFUSERS = "transformer_diffusers"
    TRANSFORMER_ORIGINAL = "transformer_original"

    @property
    def is_lora(self) -> bool:
        return self in (FileLayout.LORA_DIFFUSERS, FileLayout.LORA_KOHYA)

    @property
    def implementation(self) -> str:
        if self in (FileLayout.LORA_DIFFUSERS, FileLayout.TRANSFORMER_DIFFUSERS):
            return DIFFUSERS_IMPLEMENTATION
        return ORIGINAL_FLUX_IMPLEMENTATION


@dataclass(frozen=True)
class TrainingRecord:
    """One training run as its files describe it: the trainer's config and what the stages found."""

    config: TrainerConfig
    architecture: str  # the base model's ModelSpec architecture, e.g. "flux-1-dev" (its family says)
    base_model_version: str  # kohya's name of the base model's kind, e.g. "flux1" (its family says)
    started_at: float  # unix time
    finished_at: float
    optimizer: str  # the optimizer class that stepped
    total_batch_size: int  # images per optimizer step, over every process and accumulation step
    resolution: tuple[int, int]  # (width, height) the files are meant to be used at
    captions: dict[str, list[str]]  # image set ("instance", "class") → the caption of each of its images
    buckets: dict[str, int] = field(default_factory=dict)  # "WxH" → images trained in it (aspect buckets)
    steps_trained: int | None = None  # a validation step's LoRA (keep_best_step): its step; None: the whole run


def safetensors_metadata(record: TrainingRecord, layout: FileLayout, *, ema: bool = False) -> dict[str, str]:
    """Every metadata key of one exported file; `ema` marks the files holding the EMA weights."""
    return {"format": "pt", **modelspec_keys(record, layout, ema=ema), **kohya_keys(record, layout)}


def modelspec_keys(record: TrainingRecord, layout: FileLayout, *, ema: bool) -> dict[str, str]:
    config = record.config
    width, height = record.resolution
    kind = "LoRA" if layout.is_lora else "Checkpoint"
    title = config.export.model_name or f"{kind}@{int(record.started_at)}"
    keys = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": f"{record.architecture}/{LORA_ADAPTER}" if layout.is_lora else record.architecture,
        "modelspec.implementation": layout.implementation,
        "modelspec.title": f"{title} (EMA)" if ema else title,
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.description": _description(record, layout, ema=ema),
        "modelspec.date": datetime.fromtimestamp(record.finished_at, tz=UTC).isoformat(timespec="seconds"),
    }
    # No prediction_type: the spec defines it for Stable Diffusion (v or epsilon); sd-scripts leaves it out
    # for FLUX, whose flow-matching objective a reader would misread as either.
    if config.prompts.trigger_word:
        keys["modelspec.trigger_phrase"] = config.prompts.trigger_word
        keys["modelspec.usage_hint"] = f"Trigger word: {config.prompts.trigger_word}"
    return keys


def kohya_keys(record: TrainingRecord, layout: FileLayout) -> dict[str, str]:
    config = record.config
    width, height = record.resolution
    instance_count = len(record.captions.get("instance", []))
    class_count = len(record.captions.get("class", []))
    keys = {
        "ss_output_name": config.export.model_name,
        "ss_sd_model_name": _model_name_for_metadata(config.export.base_model_name),
        "ss_base_model_version": record.base_model_version,
        "ss_training_started_at": str(record.started_at),
        "ss_training_finished_at": str(record.finished_at),
        "ss_steps": str(record.steps_trained or config.optimisation.steps),
        "ss_max_train_steps": str(config.optimisation.steps),
        "ss_learning_rate": str(config.optimisation.learning_rate),
        "ss_lr_scheduler": config.optimisation.lr_scheduler,
        "ss_lr_warmup_steps": str(config.optimisation.lr_warmup_steps),
        "ss_optimizer": record.optimizer,
        "ss_max_grad_norm": str(config.optimisation.max_grad_norm),
        "ss_batch_size_per_device": str(config.optimisation.batch_size),
        "ss_total_batch_size": str(record.total_batch_size),
        "ss_gradient_accumulation_steps": str(config.optimisation.gradient_accumulation_steps),
        "ss_gradient_checkpointing": str(config.memory.gradient_checkpointing),
        "ss_mixed_precision": config.memory.mixed_precision,
        "ss_seed": str(config.optimisation.seed),
        "ss_resolution": str((width, height)),
        "ss_num_train_images": str(instance_count),
        "ss_num_reg_images": str(class_count),
        "ss_prior_loss_weight": str(config.prompts.prior_loss_weight),
        "ss_guidance_scale": str(config.sampling.guidance_scale),
        "ss_weighting_scheme": config.optimisation.weighting_scheme,
        "ss_caption_dropout_rate": str(config.prompts.caption_dropout),
        "ss_dataset_dirs": json.dumps({"instance": {"n_repeats": 1, "img_count": instance_count}}),
        "ss_tag_frequency": json.dumps(tag_frequency(record.captions)),
        "ss_enable_bucket": str(bool(record.buckets)),
    }
    if class_count:
        keys["ss_reg_dataset_dirs"] = json.dumps({"class": {"n_repeats": 1, "img_count": class_count}})
    if record.buckets:
        keys["ss_bucket_info"] = json.dumps(bucket_info(record.buckets))
    if layout.is_lora:
        keys |= _network_keys(config, layout)
    return {name: value for name, value in keys.items() if value}


def _network_keys(config: TrainerConfig, layout: FileLayout) -> dict[str, str]:
    keys = {
        "ss_network_dim": str(config.lora.rank),
        "ss_network_alpha": str(float(config.lora.alpha)),
        "ss_network_dropout": str(float(config.lora.dropout)),
        "ss_fp8_base": str(config.memory.base_precision == "fp8"),
    }
    # Readers pick a kohya network module by this name: only the file in that module's key layout names it.
    if layout is FileLayout.LORA_KOHYA:
        keys["ss_network_module"] = KOHYA_FLUX_LORA_MODULE
    return keys


def tag_frequency(captions: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """kohya's ss_tag_frequency: per image set, how many images' captions hold each comma-separated tag
    (stripped, lower-cased)."""
    frequency: dict[str, dict[str, int]] = {}
    for image_set, set_captions in captions.items():
        counts: Counter[str] = Counter()
        for caption in set_captions:
            counts.update(tag.strip().lower() for tag in caption.split(",") if tag.strip())
        frequency[image_set] = dict(counts)
    return frequency


def bucket_info(buckets: dict[str, int]) -> dict[str, object]:
    """kohya's ss_bucket_info: {"buckets": {index: {"resolution": [w, h], "count": n}}}."""
    shapes = sorted((tuple(int(side) for side in name.split("x")), count) for name, count in buckets.items())
    return {
        "buckets": {
            str(index): {"resolution": list(shape), "count": count} for index, (shape, count) in enumerate(shapes)
        }
    }


def _model_name_for_metadata(name: str) -> str:
    """A hub id as given; a local folder by its last part only (the worker's paths are not the user's)."""
    return PurePosixPath(name).name if name.startswith("/") else name


def _description(record: TrainingRecord, layout: FileLayout, *, ema: bool) -> str:
    config = record.config
    width, height = record.resolution
    what = (
        f"LoRA (rank {config.lora.rank}, alpha {config.lora.alpha:g})" if layout.is_lora else "fine-tuned transformer"
    )
    images = len(record.captions.get("instance", []))
    base = _model_name_for_metadata(config.export.base_model_name) or record.architecture
    text = (
        f"FLUX {what} of {base}, trained with {TRAINER_NAME}: {config.optimisation.steps} steps at learning rate "
        f"{config.optimisation.learning_rate:g} on {images} images at {width}x{height}"
    )
    if record.buckets:
        text += f" in {len(record.buckets)} aspect buckets"
    if ema:
        text += "; these are the exponential moving average of the trained weights"
    if config.prompts.trigger_word:
        text += f". Trigger word: {config.prompts.trigger_word}"
    return text + "."
