"""Stage "cache": text embeddings and VAE latents, computed once and kept on disk.

The text encoders (CLIP for the pooled vector, T5 for the sequence) and the VAE are loaded only here
and released before the transformer is loaded, so they never share memory with the DeepSpeed engine.
Latents are stored as the VAE's Gaussian (mean, std) so every step can draw a fresh sample, as
diffusers' FLUX DreamBooth script does when it caches latents.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fluxbooth.train.data import TrainingImage, pixel_batch

CACHE_FORMAT_VERSION = 1
TEXT_BATCH = 8
IMAGE_BATCH = 4
# Decoding-memory estimate: FLUX's VAE decoder ends with 128-channel feature maps at full resolution,
# of which a few are alive at once.
DECODE_CHANNELS = 128
DECODE_LIVE_FEATURE_MAPS = 4


@dataclass
class EncodedImages:
    """One image set (instance or class), ready for training: everything indexed by image."""

    latent_mean: torch.Tensor  # [N, C, h, w] float32, raw VAE space (not yet shifted/scaled)
    latent_std: torch.Tensor  # [N, C, h, w] float32
    prompt_index: torch.Tensor  # [N] int64 into the prompt tensors
    prompt_embeds: torch.Tensor  # [P, L, D] T5 sequence embeddings
    pooled_prompt_embeds: torch.Tensor  # [P, D] CLIP pooled embeddings
    prompts: list[str]

    def __len__(self) -> int:
        return int(self.latent_mean.shape[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "latent_mean": self.latent_mean,
            "latent_std": self.latent_std,
            "prompt_index": self.prompt_index,
            "prompt_embeds": self.prompt_embeds,
            "pooled_prompt_embeds": self.pooled_prompt_embeds,
            "prompts": list(self.prompts),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncodedImages:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class VaeNormalisation:
    """FLUX's latent normalisation: (latent - shift) * scale."""

    shift_factor: float
    scaling_factor: float

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.shift_factor) * self.scaling_factor


class ReleaseTracker:
    """Weak references to the encoders and VAE, to prove they are gone before the transformer loads."""

    def __init__(self) -> None:
        self._references: list[tuple[str, weakref.ref[Any]]] = []

    def track(self, name: str, module: Any) -> None:
        self._references.append((name, weakref.ref(module)))

    def alive(self) -> list[str]:
        gc.collect()
        return [name for name, reference in self._references if reference() is not None]

    @property
    def tracked(self) -> list[str]:
        return [name for name, _ in self._references]


def cache_fingerprint(
    base_model: str, images: Sequence[TrainingImage], resolution: tuple[int, int], max_sequence_length: int, text_dtype: str
) -> str:
    """Changes whenever anything that shapes the cached tensors changes."""
    return _fingerprint(
        {
            "base_model": str(base_model),
            "resolution": list(resolution),
            "max_sequence_length": max_sequence_length,
            "text_dtype": text_dtype,
            "images": [
                [image.path.name, image.path.stat().st_size, image.path.stat().st_mtime_ns, image.prompt] for image in images
            ],
        }
    )


def _fingerprint(description: dict[str, Any]) -> str:
    """A short stable hash of what shaped a cache file, cache format version included."""
    versioned = {"version": CACHE_FORMAT_VERSION, **description}
    return hashlib.sha256(json.dumps(versioned, sort_keys=True).encode()).hexdigest()[:32]


def free_accelerator_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pick_encoding_device(preferred: torch.device, bytes_needed: int) -> torch.device:
    """The accelerator when the encoder fits in its free memory with room to spare, else the CPU.
    Pass the CPU as `preferred` to force it (the planner's `cache_encoders_on_cpu`)."""
    if preferred.type != "cuda":
        return preferred
    free_bytes, _ = torch.cuda.mem_get_info(preferred)
    return preferred if bytes_needed * 1.3 < free_bytes else torch.device("cpu")


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())


@contextlib.contextmanager
def _on_device(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")


def encode_prompts(
    base_model: str,
    prompts: Sequence[str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int,
    loading_context: Callable[[], contextlib.AbstractContextManager[Any]],
    tracker: ReleaseTracker,
) -> EncodedPrompts:
    """T5 sequence embeddings [P, L, D] and CLIP pooled embeddings [P, D] of each prompt, on the CPU; the
    text encoders are loaded for this call only."""
    from diffusers import FluxPipeline

    with loading_context():
        pipeline = FluxPipeline.from_pretrained(base_model, transformer=None, vae=None, torch_dtype=dtype)
    encoders = [pipeline.text_encoder, pipeline.text_encoder_2]
    tracker.track("text_encoder", pipeline.text_encoder)
    tracker.track("text_encoder_2", pipeline.text_encoder_2)
    encoding_device = pick_encoding_device(device, sum(_parameter_bytes(encoder) for encoder in encoders))
    sequences, pooled = [], []
    try:
        for encoder in encoders:
            encoder.to(encoding_device)
        with torch.no_grad():
            for start in range(0, len(prompts), TEXT_BATCH):
                chunk = list(prompts[start : start + TEXT_BATCH])
                prompt_embeds, pooled_prompt_embeds, _ = pipeline.encode_prompt(
                    prompt=chunk, prompt_2=chunk, device=encoding_device, max_sequence_length=max_sequence_length
                )
                sequences.append(prompt_embeds.to("cpu"))
                pooled.append(pooled_prompt_embeds.to("cpu"))
    finally:
        del encoders, pipeline
        free_accelerator_memory()
    return EncodedPrompts(list(prompts), torch.cat(sequences), torch.cat(pooled))


def load_vae(
    base_model: str, loading_context: Callable[[], contextlib.AbstractContextManager[Any]], dtype: torch.dtype = torch.float32
) -> Any:
    from diffusers import AutoencoderKL

    with loading_context():
        # float32 by default: the VAE is small (84 M parameters for FLUX) and its latents are the training targets.
        return AutoencoderKL.from_pretrained(base_model, subfolder="vae", torch_dtype=dtype).eval()


def decoding_device(preferred: torch.device, vae: Any, resolution: tuple[int, int]) -> torch.device:
    """Where to decode validation latents while the engine holds the accelerator: there only when the VAE
    and its full-resolution activations (a few 128-channel feature maps) fit beside it, else the CPU."""
    width, height = resolution
    activation_bytes = DECODE_LIVE_FEATURE_MAPS * DECODE_CHANNELS * width * height * torch.finfo(next(vae.parameters()).dtype).bits // 8
    return pick_encoding_device(preferred, _parameter_bytes(vae) + activation_bytes)


@dataclass
class EncodedPrompts:
    """Prompts encoded once while the text encoders are loaded, for rendering later without them."""

    prompts: list[str]
    prompt_embeds: torch.Tensor  # [P, L, D] T5 sequence embeddings
    pooled_prompt_embeds: torch.Tensor  # [P, D] CLIP pooled embeddings

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": list(self.prompts), "prompt_embeds": self.prompt_embeds, "pooled_prompt_embeds": self.pooled_prompt_embeds}


def prompts_fingerprint(base_model: str, prompts: Sequence[str], max_sequence_length: int, text_dtype: str) -> str:
    return _fingerprint(
        {
            "base_model": str(base_model),
            "prompts": list(prompts),
            "max_sequence_length": max_sequence_length,
            "text_dtype": text_dtype,
        }
    )


def save_encoded_prompts(encoded: EncodedPrompts, path: Path) -> None:
    _save_atomically(encoded.to_dict(), path)


def load_encoded_prompts(path: Path) -> EncodedPrompts:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return EncodedPrompts(prompts=list(data["prompts"]), prompt_embeds=data["prompt_embeds"], pooled_prompt_embeds=data["pooled_prompt_embeds"])


def vae_normalisation(base_model: str) -> VaeNormalisation:
    from diffusers import AutoencoderKL

    config = AutoencoderKL.load_config(base_model, subfolder="vae")
    return VaeNormalisation(
        shift_factor=float(config.get("shift_factor") or 0.0), scaling_factor=float(config["scaling_factor"])
    )


def encode_images(
    vae: Any, paths: Sequence[Path], resolution: tuple[int, int], *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE posterior for each image, [N, C, h, w] float32 on the CPU."""
    means, stds = [], []
    with _on_device(vae, pick_encoding_device(device, _parameter_bytes(vae))) as on_device, torch.no_grad():
        vae_device = next(on_device.parameters()).device
        for start in range(0, len(paths), IMAGE_BATCH):
            pixels = pixel_batch(list(paths[start : start + IMAGE_BATCH]), resolution).to(vae_device)
            posterior = on_device.encode(pixels).latent_dist
            means.append(posterior.mean.float().cpu())
            stds.append(posterior.std.float().cpu())
    return torch.cat(means), torch.cat(stds)


def encode_image_set(
    images: Sequence[TrainingImage], prompts: EncodedPrompts, *, vae: Any, resolution: tuple[int, int], device: torch.device
) -> EncodedImages:
    """The image set's latents, with the embeddings of its prompts taken from `prompts` (encoded beforehand
    together with every other prompt set, so the text encoders load once)."""
    own_prompts = sorted({image.prompt for image in images})
    rows = torch.tensor([prompts.prompts.index(prompt) for prompt in own_prompts], dtype=torch.long)
    latent_mean, latent_std = encode_images(vae, [image.path for image in images], resolution, device=device)
    return EncodedImages(
        latent_mean=latent_mean,
        latent_std=latent_std,
        prompt_index=torch.tensor([own_prompts.index(image.prompt) for image in images], dtype=torch.long),
        prompt_embeds=prompts.prompt_embeds[rows],
        pooled_prompt_embeds=prompts.pooled_prompt_embeds[rows],
        prompts=own_prompts,
    )


def cache_path(cache_dir: Path, name: str, fingerprint: str) -> Path:
    return cache_dir / f"{name}-{fingerprint}.pt"


def save_encoded(encoded: EncodedImages, path: Path) -> None:
    _save_atomically(encoded.to_dict(), path)


def _save_atomically(tensors: dict[str, Any], path: Path) -> None:
    """A reader on another rank sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(tensors, staging)
    os.replace(staging, path)


def load_encoded(path: Path) -> EncodedImages:
    return EncodedImages.from_dict(torch.load(path, map_location="cpu", weights_only=True))
