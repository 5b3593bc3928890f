"""How big a FLUX.1-layout pipeline is (FLUX.1 [dev], [schnell], Krea, FLUX.1 Kontext), from its configs.

Each formula mirrors the layer layout of the diffusers / transformers class the config instantiates
(FluxTransformer2DModel, CLIPTextModel, T5EncoderModel; the VAE is counted in `core`). tests/plan/test_plan.py
checks every formula against `sum(p.numel())` of the real classes built on the meta device, and the published
configs against the published FLUX.1 sizes (transformer 11,901,408,320 for dev; CLIP-L 123,060,480; T5-XXL
encoder 4,762,310,656; VAE 83,819,683).

No torch here: this runs in the handler process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.families import FLUX1, Family
from fluxbooth.models.published_configs import CLIP_L_TEXT, FLUX1_TRANSFORMER, FLUX1_VAE, T5_XXL_ENCODER
from fluxbooth.sizing.core import LinearLayer, ModelSize, TransformerShape, transformer_params, vae_params

# The fields of the published FLUX.1 configs (fluxbooth.models.published_configs) that these formulas read.
_FLUX_TRANSFORMER_CONFIG: dict[str, Any] = dict(FLUX1_TRANSFORMER)
_CLIP_L_CONFIG: dict[str, Any] = {
    key: CLIP_L_TEXT[key]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    )
}
_T5_XXL_CONFIG: dict[str, Any] = {
    key: T5_XXL_ENCODER[key]
    for key in (
        "vocab_size",
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_heads",
        "feed_forward_proj",
        "relative_attention_num_buckets",
    )
}
_FLUX_VAE_CONFIG: dict[str, Any] = {
    key: FLUX1_VAE[key]
    for key in (
        "in_channels",
        "out_channels",
        "block_out_channels",
        "layers_per_block",
        "latent_channels",
        "use_quant_conv",
        "use_post_quant_conv",
        "mid_block_add_attention",
    )
}


# ---------------------------------------------------------------------------------------------
# Transformer (diffusers FluxTransformer2DModel)
# ---------------------------------------------------------------------------------------------


def _linear(name: str, in_features: int, out_features: int) -> LinearLayer:
    return LinearLayer(name, in_features, out_features)


def transformer_shape(config: Mapping[str, Any]) -> TransformerShape:
    try:
        in_channels = int(config.get("in_channels", 64))
        return TransformerShape(
            num_layers=int(config.get("num_layers", 19)),
            num_single_layers=int(config.get("num_single_layers", 38)),
            num_attention_heads=int(config.get("num_attention_heads", 24)),
            attention_head_dim=int(config.get("attention_head_dim", 128)),
            in_channels=in_channels,
            joint_attention_dim=int(config.get("joint_attention_dim", 4096)),
            pooled_projection_dim=int(config.get("pooled_projection_dim", 768)),
            patch_size=int(config.get("patch_size", 1)),
            out_channels=int(config.get("out_channels") or in_channels),
            guidance_embeds=bool(config.get("guidance_embeds", False)),
        )
    except (TypeError, ValueError) as error:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"base_model: transformer/config.json has a non-numeric dimension ({error}); "
            "use a FluxTransformer2DModel config",
        ) from error


def transformer_linear_layers(shape: TransformerShape) -> tuple[LinearLayer, ...]:
    """Every Linear in FluxTransformer2DModel, named as the module tree names them."""
    d = shape.hidden_size
    mlp = 4 * d  # FluxTransformerBlock's FeedForward(mult=4) and FluxSingleTransformerBlock(mlp_ratio=4)
    layers = [
        _linear("time_text_embed.timestep_embedder.linear_1", 256, d),
        _linear("time_text_embed.timestep_embedder.linear_2", d, d),
    ]
    if shape.guidance_embeds:
        layers += [
            _linear("time_text_embed.guidance_embedder.linear_1", 256, d),
            _linear("time_text_embed.guidance_embedder.linear_2", d, d),
        ]
    layers += [
        _linear("time_text_embed.text_embedder.linear_1", shape.pooled_projection_dim, d),
        _linear("time_text_embed.text_embedder.linear_2", d, d),
        _linear("context_embedder", shape.joint_attention_dim, d),
        _linear("x_embedder", shape.in_channels, d),
    ]
    for index in range(shape.num_layers):
        prefix = f"transformer_blocks.{index}."
        layers += [
            _linear(prefix + "norm1.linear", d, 6 * d),
            _linear(prefix + "norm1_context.linear", d, 6 * d),
        ]
        for projection in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            layers.append(_linear(prefix + "attn." + projection, d, d))
        for feed_forward in ("ff", "ff_context"):
            layers += [
                _linear(prefix + feed_forward + ".net.0.proj", d, mlp),
                _linear(prefix + feed_forward + ".net.2", mlp, d),
            ]
    for index in range(shape.num_single_layers):
        prefix = f"single_transformer_blocks.{index}."
        layers += [
            _linear(prefix + "norm.linear", d, 3 * d),
            _linear(prefix + "proj_mlp", d, mlp),
            _linear(prefix + "proj_out", d + mlp, d),
            _linear(prefix + "attn.to_q", d, d),
            _linear(prefix + "attn.to_k", d, d),
            _linear(prefix + "attn.to_v", d, d),
        ]
    layers += [
        _linear("norm_out.linear", d, 2 * d),
        _linear("proj_out", d, shape.patch_size * shape.patch_size * shape.out_channels),
    ]
    return tuple(layers)


# ---------------------------------------------------------------------------------------------
# Text encoders
# ---------------------------------------------------------------------------------------------


def clip_text_params(config: Mapping[str, Any]) -> int:
    """transformers CLIPTextModel (no projection head)."""
    hidden = int(config.get("hidden_size", 768))
    intermediate = int(config.get("intermediate_size", 3072))
    layers = int(config.get("num_hidden_layers", 12))
    embeddings = int(config.get("vocab_size", 49408)) * hidden + int(config.get("max_position_embeddings", 77)) * hidden
    per_layer = (
        4 * (hidden * hidden + hidden)  # q, k, v, out projections with bias
        + 2 * (2 * hidden)  # two LayerNorms
        + (hidden * intermediate + intermediate)
        + (intermediate * hidden + hidden)
    )
    final_norm = 2 * hidden
    return embeddings + layers * per_layer + final_norm


def t5_encoder_params(config: Mapping[str, Any]) -> int:
    """transformers T5EncoderModel: bias-free projections, RMS norms, relative bias in layer 0."""
    d_model = int(config.get("d_model", 4096))
    inner = int(config.get("num_heads", 64)) * int(config.get("d_kv", 64))
    d_ff = int(config.get("d_ff", 10240))
    layers = int(config.get("num_layers", 24))
    gated = str(config.get("feed_forward_proj", "relu")).startswith("gated")
    attention = 4 * d_model * inner
    feed_forward = (3 if gated else 2) * d_model * d_ff
    per_layer = attention + feed_forward + 2 * d_model
    relative_bias = int(config.get("relative_attention_num_buckets", 32)) * int(config.get("num_heads", 64))
    embeddings = int(config.get("vocab_size", 32128)) * d_model
    return embeddings + layers * per_layer + relative_bias + d_model


def model_size_from_configs(
    name: str,
    transformer_config: Mapping[str, Any],
    text_encoder_config: Mapping[str, Any],
    text_encoder_2_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    *,
    source: str,
    family: Family = FLUX1,
) -> ModelSize:
    """A FLUX.1-layout model (FLUX.1, FLUX.1 Kontext) from its components' configs."""
    shape = transformer_shape(transformer_config)
    layers = transformer_linear_layers(shape)
    total, largest = transformer_params(shape, layers)
    return ModelSize(
        name=name,
        transformer_params=total,
        largest_layer_params=largest,
        text_encoder_params=clip_text_params(text_encoder_config),
        text_encoder_2_params=t5_encoder_params(text_encoder_2_config),
        vae_params=vae_params(vae_config),
        transformer=shape,
        text_encoder_2_hidden_size=int(text_encoder_2_config.get("d_model", 4096)),
        linear_layers=layers,
        source=source,
        family=family.name,
        default_lora_targets=family.default_lora_targets(transformer_config),
        sequence_images=2 if family.control_images else 1,
    )
