"""The one state the trainer's stages hand each other, and the small helpers every stage shares.

`Session` is made once by the session stage and only read afterwards; `TrainerState` holds it and
gains each later stage's product in turn (cached data, the training run, artifacts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import torch
import transformers.integrations.deepspeed as transformers_deepspeed

from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.train.base_model import BaseModel
from fluxbooth.train.data import TrainingImage
from fluxbooth.train.runtime import EventReporter, ReleaseTracker, StageClock


@dataclass(frozen=True)
class Artifact:
    """A file or folder the trainer wrote for the worker to upload (announced in the `done` event)."""

    name: str
    path: str  # relative to the output directory
    kind: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path, "kind": self.kind}


@dataclass(frozen=True)
class Precision:
    """How the transformer is held and fed. Under DeepSpeed the engine casts the module to bf16/fp16
    itself and keeps fp32 master weights in the optimizer; without it, accelerate autocasts."""

    load_dtype: torch.dtype
    input_dtype: torch.dtype
    text_dtype: torch.dtype
    name: str


@dataclass
class Session:
    """The accelerator and everything decided before any model is loaded."""

    config: TrainerConfig
    reporter: EventReporter
    clock: StageClock
    accelerator: Any
    deepspeed_config: dict[str, Any] | None
    zero_stage: int
    precision: Precision
    optimizer_name: str  # validated, canonical
    nvme_paths: list[Path]
    base: BaseModel  # resolved once, when the session opened
    cuda_memory_fraction: float | None = None  # FLUXBOOTH_CUDA_MEMORY_FRACTION as applied (card emulation)
    started_at: float = field(default_factory=time.time)  # unix time the session opened (the files' metadata)

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def encoder_device(self) -> torch.device:
        """Where the text encoders and the VAE run: the CPU when the planner keeps them off the GPU."""
        return torch.device("cpu") if self.config.memory.encoders_on_cpu else self.accelerator.device

    def offload_device(self, section: str) -> str:
        """Where DeepSpeed really keeps the optimizer state / parameters ("none" below ZeRO-3 for
        parameters, where DeepSpeed ignores offload_param)."""
        if section == "offload_param" and self.zero_stage != 3:
            return "none"
        zero = (self.deepspeed_config or {}).get("zero_optimization", {})
        return str((zero.get(section) or {}).get("device", "none"))


@dataclass
class EncodedPrompts:
    """Prompts encoded once while the text encoders are loaded, for rendering later without them."""

    prompts: list[str]
    prompt_embeds: torch.Tensor  # [P, L, D] T5 sequence embeddings
    pooled_prompt_embeds: torch.Tensor  # [P, D] CLIP pooled embeddings

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": list(self.prompts),
            "prompt_embeds": self.prompt_embeds,
            "pooled_prompt_embeds": self.pooled_prompt_embeds,
        }


@dataclass
class EncodedBucket:
    """One image set's latents at one training shape, so they stack into a batch: a sample is an image at
    one size (aspect buckets), or the image itself (one fixed shape)."""

    image_index: torch.Tensor  # [S] int64: which image of the set each sample is
    latent_mean: torch.Tensor  # [S, C, h, w] float32, raw VAE space (not yet shifted/scaled)
    latent_std: torch.Tensor  # [S, C, h, w] float32
    control_mean: torch.Tensor | None = (
        None  # [S, C, h, w]: each sample's control image at the same shape (Kontext pairs)
    )

    def __len__(self) -> int:
        return int(self.image_index.shape[0])


@dataclass
class EncodedImages:
    """One image set (instance or class), ready for training: each image's prompt, and its latents in every
    training shape it has (aspect buckets; one shape when the resolution is fixed)."""

    prompt_index: torch.Tensor  # [N] int64: each image's row in the prompt tensors
    prompt_embeds: torch.Tensor  # [P, L, D] T5 sequence embeddings
    pooled_prompt_embeds: torch.Tensor  # [P, D] CLIP pooled embeddings
    prompts: list[str]
    buckets: dict[tuple[int, int], EncodedBucket]  # by (width, height)

    def __len__(self) -> int:
        return int(self.prompt_index.shape[0])

    def bucket_counts(self) -> dict[str, int]:
        """Samples per training shape, as "WxH"."""
        return {f"{width}x{height}": len(bucket) for (width, height), bucket in sorted(self.buckets.items())}

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "prompt_embeds": self.prompt_embeds,
            "pooled_prompt_embeds": self.pooled_prompt_embeds,
            "prompts": list(self.prompts),
            "buckets": {
                f"{width}x{height}": {
                    "image_index": bucket.image_index,
                    "latent_mean": bucket.latent_mean,
                    "latent_std": bucket.latent_std,
                    **({} if bucket.control_mean is None else {"control_mean": bucket.control_mean}),
                }
                for (width, height), bucket in self.buckets.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncodedImages:
        buckets = {}
        for name, bucket in data["buckets"].items():
            width, height = (int(side) for side in name.split("x"))
            buckets[(width, height)] = EncodedBucket(
                bucket["image_index"], bucket["latent_mean"], bucket["latent_std"], bucket.get("control_mean")
            )
        return cls(
            data["prompt_index"], data["prompt_embeds"], data["pooled_prompt_embeds"], list(data["prompts"]), buckets
        )


@dataclass(frozen=True)
class ClassImageSet:
    """Prior preservation's class images: every one trained on (the supplied ones, then the generated ones, all
    with the class prompt), and which generated ones are not on disk yet. Those are rendered once the engine holds
    the base as training places it (train/class_images.py), so the set is encoded only then."""

    images: list[TrainingImage]
    folder: Path  # where the generated ones are (or will be) written
    missing: tuple[int, ...]  # indices of generated images still to render (file names: class_image_name)


@dataclass
class CachedData:
    """What the cache stage leaves for training: encoded image sets and validation prompts."""

    instance_set: EncodedImages
    class_set: EncodedImages | None
    validation_prompts: EncodedPrompts | None
    # Loaded while caching (this process), all released before the transformer loads; empty when some were not.
    released_before_training: list[str]
    empty_prompt: EncodedPrompts | None = None  # caption dropout's stand-in caption
    # Class images still to render, and their prompt's embeddings (class_set is None until they are encoded).
    class_images_to_render: ClassImageSet | None = None
    class_prompt: EncodedPrompts | None = None


@dataclass
class TrainingRun:
    """The engine and everything the loop steps, checkpoints and exports."""

    engine: Any
    optimizer: Any
    scheduler: Any
    scheduler_stepped_by_engine: bool
    optimizer_class: str  # the optimizer that really steps (accelerate may swap it)
    ema: Any
    sampler: Any
    normalisation: Any
    guidance_scale: float | None
    start_step: int = 0
    final_loss: float = math.nan
    fixed_noise_loss: dict[str, float] = field(default_factory=dict)
    nvme_swap_peak_bytes: dict[str, int] = field(default_factory=dict)
    # Weak references to the engine and optimizer: proof they are gone before export.
    engine_references: ReleaseTracker = field(default_factory=ReleaseTracker)
    alive_at_export: list[str] = field(default_factory=list)
    # The step the run stopped at because its stop time (TrainerConfig.stop_at_unix_seconds) came; None: not stopped.
    stopped_at_step: int | None = None

    def release(self) -> None:
        """Drop the engine, optimizer and schedule, so their memory can go before export."""
        self.engine = self.optimizer = self.scheduler = None


@dataclass
class ValidationLog:
    """Validation images rendered so far (during training and at the end), for validation.json."""

    records: list[dict[str, Any]] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)


@dataclass
class TrainerState:
    session: Session
    data: CachedData | None = None
    loading_report: dict[str, Any] = field(default_factory=dict)
    run: TrainingRun | None = None
    validation: ValidationLog = field(default_factory=ValidationLog)
    artifacts: list[Artifact] = field(default_factory=list)

    def cached(self) -> CachedData:
        if self.data is None:
            raise RuntimeError("the cache stage has not run")
        return self.data

    def training(self) -> TrainingRun:
        if self.run is None:
            raise RuntimeError("training has not started")
        return self.run


def seed_for(*parts: object) -> int:
    """A 63-bit seed mixed from `parts`: the same parts always give the same stream, on any rank or resume."""
    digest = hashlib.sha256(json.dumps([str(part) for part in parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def without_transformers_zero3_init() -> Iterator[None]:
    """transformers partitions every model it loads while accelerate's HfDeepSpeedConfig says ZeRO-3, which
    would shard the text encoders we only run once. accelerate's `zero3_init_context_manager(enable=False)`
    re-registers a config that still says stage 3, so the registration itself is hidden for the duration."""
    saved = transformers_deepspeed._hf_deepspeed_config_weak_ref
    transformers_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        transformers_deepspeed._hf_deepspeed_config_weak_ref = saved


def gathered(parameters: list[torch.nn.Parameter]) -> Any:
    """A context in which ZeRO-3 partitioned `parameters` are whole on every rank (nothing when none is)."""
    if parameters and any(hasattr(parameter, "ds_id") for parameter in parameters):
        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
    return contextlib.nullcontext()


def release_prefetched_partitions(engine: Any) -> None:
    """A forward without backward leaves ZeRO-3's prefetched parameters gathered ("in flight"), which the
    next gather (a training step, the export) would trip over; hand them back to their partitions."""
    if hasattr(engine, "empty_partition_cache"):
        engine.empty_partition_cache()


def write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True, allow_nan=False) + "\n")
