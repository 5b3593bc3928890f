"""The published FLUX.2 configs, written out field by field so nothing is downloaded: pure data, no torch.

Sources (each repository's `*/config.json` as published on the Hugging Face Hub):
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

from typing import Any

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
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
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
QWEN3_8B: dict[str, Any] = {**QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}

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

# ---- tiny variants for tests: the same classes a few dozen wide. The text encoders keep enough layers for
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
TINY_FLUX2_VAE: dict[str, Any] = {
    **FLUX2_VAE,
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "latent_channels": TINY_FLUX2_LATENT_CHANNELS,
    "norm_num_groups": 4,
    "sample_size": 64,
}
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
    "vision_config": {**PIXTRAL_VISION, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "head_dim": 8, "image_size": 28},
}
