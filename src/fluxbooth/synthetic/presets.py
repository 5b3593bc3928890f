"""The architectures each synthetic preset builds: pure data, no torch.

The full-size presets build the published pipelines (fluxbooth.models.published_configs, which names their
sources); the tiny ones narrow them to a few dozen wide (FLUX.1's in fluxbooth.synthetic.tiny, FLUX.2's below). Each
preset names its family (fluxbooth.models.families), which decides its component classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import fluxbooth.synthetic.tiny as tiny
from fluxbooth.models.published_configs import (
    FLUX1_DEV_SCHEDULER,
    FLUX1_SCHNELL_SCHEDULER,
    FLUX2_COMMON_TRANSFORMER,
    FLUX2_VAE,
    MISTRAL_SMALL_3,
    MISTRAL_SMALL_TEXT,
    PIXTRAL_VISION,
    PUBLISHED_PIPELINES,
    QWEN3_COMMON,
)

GB = 1000**3

# The tiny FLUX.2 variants for tests: the same classes a few dozen wide. The text encoders keep enough layers for
# the pipelines' stacked hidden states (27 for Qwen3's (9, 18, 27), 30 for Mistral's (10, 20, 30)).
TINY_TEXT_WIDTH = 16
TINY_FLUX2_LATENT_CHANNELS = 4
TINY_FLUX2_TRANSFORMER: dict[str, Any] = {
    **FLUX2_COMMON_TRANSFORMER,
    "in_channels": TINY_FLUX2_LATENT_CHANNELS * 4,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 3 * TINY_TEXT_WIDTH,
    "timestep_guidance_channels": 32,
    "axes_dims_rope": [4, 4, 4, 4],
}
TINY_FLUX2_VAE: dict[str, Any] = {**FLUX2_VAE, **tiny.TINY_VAE_NARROWING, "latent_channels": TINY_FLUX2_LATENT_CHANNELS}
TINY_QWEN3: dict[str, Any] = {
    **QWEN3_COMMON,
    "hidden_size": TINY_TEXT_WIDTH,
    "intermediate_size": 32,
    "num_hidden_layers": 27,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
TINY_MISTRAL3: dict[str, Any] = {
    **MISTRAL_SMALL_3,
    "text_config": {
        **MISTRAL_SMALL_TEXT,
        "hidden_size": TINY_TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": 30,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 1024,
    },
    "vision_config": {
        **PIXTRAL_VISION,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "image_size": 28,
    },
}

# The bench's scaled transformer (bench/memory.py): FLUX.1's head dim and block types, 4 heads,
# 4 + 8 blocks, about 70 M parameters, over the tiny model's encoders.
SCALED_TRANSFORMER_OVERRIDES: dict[str, Any] = {
    "num_layers": 4,
    "num_single_layers": 8,
    "attention_head_dim": 128,
    "num_attention_heads": 4,
    "axes_dims_rope": [16, 56, 56],
}

# What diffusers and transformers write by default: FLUX.1-dev's transformer ships as three ~10 GB
# shards, its T5 encoder as two ~5 GB shards.
DIFFUSERS_MAX_SHARD_BYTES = 10 * GB
TRANSFORMERS_MAX_SHARD_BYTES = 5 * GB


@dataclass(frozen=True)
class Preset:
    """One pipeline: the config of each component, the tokenizers' kind, and the storage dtype.

    `tokenizers` is "tiny" (fluxbooth.synthetic.tiny's small byte-level vocabularies, sized into the encoders'
    configs) or "full" (vocabularies with CLIP-L's 49,408 and T5's 32,100 entries)."""

    name: str
    transformer: dict[str, Any]
    text_encoder: dict[str, Any]
    text_encoder_2: dict[str, Any] | None  # None: a FLUX.2 family (one text encoder)
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    tokenizers: str
    dtype: str = "bfloat16"
    family: str = "flux1"  # fluxbooth.models.families name
    distilled: bool = False  # FLUX.2 [klein]: the step-distilled checkpoint (model_index.json is_distilled)
    max_shard_bytes: dict[str, int] = field(
        default_factory=lambda: {
            "transformer": DIFFUSERS_MAX_SHARD_BYTES,
            "vae": DIFFUSERS_MAX_SHARD_BYTES,
            "text_encoder": TRANSFORMERS_MAX_SHARD_BYTES,
            "text_encoder_2": TRANSFORMERS_MAX_SHARD_BYTES,
        }
    )

    def with_layers(self, double: int, single: int) -> Preset:
        """The same pipeline with another transformer depth (reduced-depth benchmarks and tests)."""
        if double < 0 or single < 0 or double + single == 0:
            raise ValueError(f"--layers {double},{single}: needs at least one block and no negative counts")
        return replace(self, transformer={**self.transformer, "num_layers": double, "num_single_layers": single})

    def with_max_shard_bytes(self, limit: int) -> Preset:
        if limit <= 0:
            raise ValueError("--max-shard-size must be positive")
        return replace(self, max_shard_bytes={component: limit for component in self.max_shard_bytes})


def _tiny_preset_configs() -> dict[str, dict[str, Any]]:
    return {
        "transformer": dict(tiny.TRANSFORMER_CONFIG),
        "text_encoder": dict(tiny.CLIP_TEXT_CONFIG),
        "text_encoder_2": dict(tiny.T5_CONFIG),
        "vae": dict(tiny.VAE_CONFIG),
        "scheduler": dict(tiny.SCHEDULER_CONFIG),
    }


def _tiny_flux2_preset(name: str, transformer: dict[str, Any], text_encoder: dict[str, Any]) -> Preset:
    return Preset(
        name=name,
        transformer=dict(transformer),
        text_encoder=dict(text_encoder),
        text_encoder_2=None,
        vae=dict(TINY_FLUX2_VAE),
        scheduler=dict(FLUX1_DEV_SCHEDULER),
        tokenizers="tiny",
        family="flux2" if "klein" not in name else "flux2-klein",
        # The tiny [klein] is a base checkpoint (sampled with classifier-free guidance, so its validation path is the harder one).
        dtype="float32",
    )


def _published_preset(name: str) -> Preset:
    published = PUBLISHED_PIPELINES[name]
    return Preset(
        name=name,
        transformer=dict(published.transformer),
        text_encoder=dict(published.text_encoder),
        text_encoder_2=None if published.text_encoder_2 is None else dict(published.text_encoder_2),
        vae=dict(published.vae),
        scheduler=dict(published.scheduler),
        tokenizers="full",
        family=published.family,
        # The published [klein] 4B and 9B are the step-distilled checkpoints.
        distilled=name.startswith("flux2-klein"),
    )


TINY_FLUX2_PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny-flux2": ({**TINY_FLUX2_TRANSFORMER, "guidance_embeds": True}, TINY_MISTRAL3),
    "tiny-flux2-klein": ({**TINY_FLUX2_TRANSFORMER, "guidance_embeds": False}, TINY_QWEN3),
}


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError naming the choices otherwise."""
    if name in ("tiny", "scaled", "tiny-kontext", "tiny-schnell"):
        configs = _tiny_preset_configs()
        if name == "scaled":
            configs["transformer"] = {**configs["transformer"], **SCALED_TRANSFORMER_OVERRIDES}
        if name == "tiny-schnell":
            # schnell differs from dev as at full size: no guidance embedding, the scheduler's fixed shift.
            configs["transformer"] = {**configs["transformer"], "guidance_embeds": False}
            configs["scheduler"] = dict(FLUX1_SCHNELL_SCHEDULER)
        family = "flux1-kontext" if name == "tiny-kontext" else "flux1"
        # fluxbooth.synthetic.tiny's pipeline is float32; the tiny variants built here match it.
        dtype = "float32" if name in ("tiny-kontext", "tiny-schnell") else "bfloat16"
        return Preset(
            name=name,
            transformer=configs["transformer"],
            text_encoder=configs["text_encoder"],
            text_encoder_2=configs["text_encoder_2"],
            vae=configs["vae"],
            scheduler=configs["scheduler"],
            tokenizers="tiny",
            family=family,
            dtype=dtype,
        )
    if name in PUBLISHED_PIPELINES:
        return _published_preset(name)
    if name in TINY_FLUX2_PRESETS:
        return _tiny_flux2_preset(name, *TINY_FLUX2_PRESETS[name])
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


PRESET_NAMES = (
    "tiny",
    "scaled",
    "flux1-dev",
    "flux1-schnell",
    "flux1-kontext-dev",
    "flux2-dev",
    "flux2-klein-4b",
    "flux2-klein-9b",
    "tiny-kontext",
    "tiny-schnell",
    "tiny-flux2",
    "tiny-flux2-klein",
)
