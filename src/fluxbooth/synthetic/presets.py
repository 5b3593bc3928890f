"""The architectures each synthetic preset builds: pure data, no torch.

The full-size configs are those black-forest-labs/FLUX.1-dev and FLUX.1-schnell ship (transformer/,
text_encoder/ = CLIP ViT-L/14's text tower, text_encoder_2/ = google/t5-v1_1-xxl's encoder, vae/,
scheduler/), written out field by field so nothing is downloaded. schnell differs from dev only in
the transformer's guidance embedding and the scheduler's shift. black-forest-labs/FLUX.1-Kontext-dev
ships FLUX.1-dev's configs under FluxKontextPipeline; the FLUX.2 configs and their sources are in
`flux2_presets`. Each preset names its family (fluxbooth.families), which decides its component classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fluxbooth.synthetic import flux2_presets as flux2

GB = 1000**3

FLUX1_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}

CLIP_L_TEXT: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

T5_XXL_ENCODER: dict[str, Any] = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-06,
    "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "tie_word_embeddings": False,
    "use_cache": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "classifier_dropout": 0.0,
    "torch_dtype": "bfloat16",
}

FLUX1_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}

FLUX1_DEV_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
FLUX1_SCHNELL_SCHEDULER: dict[str, Any] = {**FLUX1_DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}

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

    `tokenizers` is "tiny" (fluxbooth.tiny's small byte-level vocabularies, sized into the encoders'
    configs) or "full" (vocabularies with CLIP-L's 49,408 and T5's 32,100 entries)."""

    name: str
    transformer: dict[str, Any]
    text_encoder: dict[str, Any]
    text_encoder_2: dict[str, Any] | None  # None: a FLUX.2 family (one text encoder)
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    tokenizers: str
    dtype: str = "bfloat16"
    family: str = "flux1"  # fluxbooth.families name
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
    from fluxbooth import tiny

    return {
        "transformer": dict(tiny.TRANSFORMER_CONFIG),
        "text_encoder": dict(tiny.CLIP_TEXT_CONFIG),
        "text_encoder_2": dict(tiny.T5_CONFIG),
        "vae": dict(tiny.VAE_CONFIG),
        "scheduler": dict(tiny.SCHEDULER_CONFIG),
    }


def _flux2_preset(name: str, transformer: dict[str, Any], text_encoder: dict[str, Any], vae: dict[str, Any], tokenizers: str) -> Preset:
    return Preset(
        name=name, transformer=dict(transformer), text_encoder=dict(text_encoder), text_encoder_2=None, vae=dict(vae),
        scheduler=dict(FLUX1_DEV_SCHEDULER), tokenizers=tokenizers, family="flux2" if "klein" not in name else "flux2-klein",
        # The published [klein] 4B and 9B are the step-distilled checkpoints; the tiny one is a base (sampled
        # with classifier-free guidance, so its validation path is the harder one).
        distilled=name.startswith("flux2-klein"),
        dtype="float32" if tokenizers == "tiny" else "bfloat16",
    )


FLUX2_PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]] = {
    "flux2-dev": (flux2.FLUX2_DEV_TRANSFORMER, flux2.MISTRAL_SMALL_3, flux2.FLUX2_VAE, "full"),
    "flux2-klein-4b": (flux2.FLUX2_KLEIN_4B_TRANSFORMER, flux2.QWEN3_4B, flux2.FLUX2_VAE, "full"),
    "flux2-klein-9b": (flux2.FLUX2_KLEIN_9B_TRANSFORMER, flux2.QWEN3_8B, flux2.FLUX2_VAE, "full"),
    "tiny-flux2": ({**flux2.TINY_FLUX2_TRANSFORMER, "guidance_embeds": True}, flux2.TINY_MISTRAL3, flux2.TINY_FLUX2_VAE, "tiny"),
    "tiny-flux2-klein": ({**flux2.TINY_FLUX2_TRANSFORMER, "guidance_embeds": False}, flux2.TINY_QWEN3, flux2.TINY_FLUX2_VAE, "tiny"),
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
        # fluxbooth.tiny's pipeline is float32; the tiny variants built here match it.
        dtype = "float32" if name in ("tiny-kontext", "tiny-schnell") else "bfloat16"
        return Preset(name=name, tokenizers="tiny", family=family, dtype=dtype, **configs)
    if name in ("flux1-dev", "flux1-schnell", "flux1-kontext-dev"):
        dev = name != "flux1-schnell"
        return Preset(
            name=name,
            transformer={**FLUX1_TRANSFORMER, "guidance_embeds": dev},
            text_encoder=dict(CLIP_L_TEXT),
            text_encoder_2=dict(T5_XXL_ENCODER),
            vae=dict(FLUX1_VAE),
            scheduler=dict(FLUX1_DEV_SCHEDULER if dev else FLUX1_SCHNELL_SCHEDULER),
            tokenizers="full",
            family="flux1-kontext" if name == "flux1-kontext-dev" else "flux1",
        )
    if name in FLUX2_PRESETS:
        return _flux2_preset(name, *FLUX2_PRESETS[name])
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


PRESET_NAMES = (
    "tiny", "scaled", "flux1-dev", "flux1-schnell", "flux1-kontext-dev", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b",
    "tiny-kontext", "tiny-schnell", "tiny-flux2", "tiny-flux2-klein",
)
