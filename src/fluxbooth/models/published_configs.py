"""The configs black-forest-labs publishes for FLUX, written out field by field so nothing is downloaded:
pure data, no torch. One owner for the planner's sizing (fluxbooth.sizing), which sizes a known hub id from
them, and the synthetic builders (fluxbooth.synthetic, fluxbooth.synthetic.tiny), which build pipelines of them.

FLUX.1: the configs black-forest-labs/FLUX.1-dev and FLUX.1-schnell ship (transformer/, text_encoder/ = CLIP
ViT-L/14's text tower, text_encoder_2/ = google/t5-v1_1-xxl's encoder, vae/, scheduler/). schnell differs
from dev only in the transformer's guidance embedding and the scheduler's shift;
black-forest-labs/FLUX.1-Kontext-dev ships FLUX.1-dev's configs under FluxKontextPipeline.

FLUX.2 (each repository's `*/config.json` as published on the Hugging Face Hub):
- transformers: black-forest-labs/FLUX.2-dev, FLUX.2-klein-4B, FLUX.2-klein-9B `transformer/config.json`,
  the same values diffusers' `scripts/convert_flux2_to_diffusers.py` (`get_flux2_transformer_config`)
  writes for "flux2-dev", "klein-4b" and "klein-9b";
- VAE: `vae/config.json` of the three repositories (one AutoencoderKLFlux2, 32 latent channels, patched
  2x2 and batch-normalised to 128);
- text encoders: FLUX.2 [dev]'s is mistralai/Mistral-Small-3.x-24B-Instruct's Mistral3ForConditionalGeneration
  (text 5120 wide, 40 layers; Pixtral vision tower 1024 wide, 24 layers); [klein] 4B's is Qwen/Qwen3-4B
  (2560 wide, 36 layers, tied embeddings), [klein] 9B's Qwen/Qwen3-8B (4096 wide, 36 layers). Each
  transformer's `joint_attention_dim` is three of its text encoder's widths: the pipelines stack the hidden
  states of three layers ((10, 20, 30) for Mistral, (9, 18, 27) for Qwen3).
- scheduler: FLUX.1-dev's FlowMatchEulerDiscreteScheduler config, which the conversion script copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# ---- FLUX.1 ------------------------------------------------------------------------------------------------

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

# The encoder/decoder layout both families' AutoencoderKL share; they differ in latents and normalisation.
_AUTOENCODER_BLOCKS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
}

FLUX1_VAE: dict[str, Any] = {
    **_AUTOENCODER_BLOCKS,
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

# ---- FLUX.2 ------------------------------------------------------------------------------------------------

FLUX2_COMMON_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 128,
    "out_channels": None,
    "attention_head_dim": 128,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-06,
}
FLUX2_DEV_TRANSFORMER: dict[str, Any] = {
    **FLUX2_COMMON_TRANSFORMER,
    "num_layers": 8,
    "num_single_layers": 48,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "guidance_embeds": True,
}
FLUX2_KLEIN_4B_TRANSFORMER: dict[str, Any] = {
    **FLUX2_COMMON_TRANSFORMER,
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "guidance_embeds": False,
}
FLUX2_KLEIN_9B_TRANSFORMER: dict[str, Any] = {
    **FLUX2_COMMON_TRANSFORMER,
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
    "guidance_embeds": False,
}

FLUX2_VAE: dict[str, Any] = {
    **_AUTOENCODER_BLOCKS,
    "latent_channels": 32,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "force_upcast": True,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
}

# Qwen3ForCausalLM: the published Qwen/Qwen3-4B and Qwen/Qwen3-8B configs (the fields the model reads).
QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 151936,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
QWEN3_4B: dict[str, Any] = {**QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}
QWEN3_8B: dict[str, Any] = {
    **QWEN3_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}

# Mistral3ForConditionalGeneration: mistralai/Mistral-Small-3.1-24B-Instruct-2503's config. Its language
# model keeps its own lm_head (24,011,361,280 parameters in all); that config says so only inside
# text_config, and transformers 5 reads the top-level flag, which defaults to tying (23.34 B), so it is
# written out here.
MISTRAL_SMALL_TEXT: dict[str, Any] = {
    "model_type": "mistral",
    "vocab_size": 131072,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}
PIXTRAL_VISION: dict[str, Any] = {
    "model_type": "pixtral",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "head_dim": 64,
    "hidden_act": "silu",
    "image_size": 1540,
    "patch_size": 14,
    "num_channels": 3,
    "rope_theta": 10000.0,
    "attention_dropout": 0.0,
}
MISTRAL_SMALL_3: dict[str, Any] = {
    "text_config": MISTRAL_SMALL_TEXT,
    "vision_config": PIXTRAL_VISION,
    "image_token_index": 10,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "multimodal_projector_bias": False,
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class PublishedPipeline:
    """One published pipeline: its family (fluxbooth.models.families name) and each component's config."""

    family: str
    transformer: Mapping[str, Any]
    text_encoder: Mapping[str, Any]
    text_encoder_2: Mapping[str, Any] | None  # None: a FLUX.2 family (one text encoder)
    vae: Mapping[str, Any]
    scheduler: Mapping[str, Any]


# The published pipelines by name (the synthetic presets of the same names build them).
PUBLISHED_PIPELINES: dict[str, PublishedPipeline] = {
    "flux1-dev": PublishedPipeline(
        "flux1", FLUX1_TRANSFORMER, CLIP_L_TEXT, T5_XXL_ENCODER, FLUX1_VAE, FLUX1_DEV_SCHEDULER
    ),
    "flux1-schnell": PublishedPipeline(
        "flux1",
        {**FLUX1_TRANSFORMER, "guidance_embeds": False},
        CLIP_L_TEXT,
        T5_XXL_ENCODER,
        FLUX1_VAE,
        FLUX1_SCHNELL_SCHEDULER,
    ),
    "flux1-kontext-dev": PublishedPipeline(
        "flux1-kontext", FLUX1_TRANSFORMER, CLIP_L_TEXT, T5_XXL_ENCODER, FLUX1_VAE, FLUX1_DEV_SCHEDULER
    ),
    "flux2-dev": PublishedPipeline(
        "flux2", FLUX2_DEV_TRANSFORMER, MISTRAL_SMALL_3, None, FLUX2_VAE, FLUX1_DEV_SCHEDULER
    ),
    "flux2-klein-4b": PublishedPipeline(
        "flux2-klein", FLUX2_KLEIN_4B_TRANSFORMER, QWEN3_4B, None, FLUX2_VAE, FLUX1_DEV_SCHEDULER
    ),
    "flux2-klein-9b": PublishedPipeline(
        "flux2-klein", FLUX2_KLEIN_9B_TRANSFORMER, QWEN3_8B, None, FLUX2_VAE, FLUX1_DEV_SCHEDULER
    ),
}
