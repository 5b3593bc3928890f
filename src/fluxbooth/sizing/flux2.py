"""How big a FLUX.2 pipeline is ([dev], [klein]), from its configs: the layer layout of diffusers'
Flux2Transformer2DModel and of the text encoders its pipelines load (transformers' Qwen3ForCausalLM for
[klein], Mistral3ForConditionalGeneration for [dev]). Its q/k RMS norms have FLUX.1's names and sizes (its
LayerNorms no parameters), so core.transformer_params counts them. Each formula mirrors the class's modules;
tests/models/test_families.py checks them against `sum(p.numel())` of the real classes built on the meta device. The
VAE (AutoencoderKLFlux2) has FLUX.1's encoder/decoder blocks with quant convs and a parameter-free batch
norm: core.vae_params counts it.

For FLUX.2, ModelSize's `text_encoder_2_params` (the role of FLUX.1's T5: the encoder whose hidden states are
the prompt sequence) holds its one text encoder, and `text_encoder_params` (the pooled-embedding role of
CLIP) is 0.

No torch here: this runs in the handler process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fluxbooth.models.families import Family
from fluxbooth.sizing.core import LinearLayer, ModelSize, TransformerShape, transformer_params, vae_params


def _linear(name: str, in_features: int, out_features: int) -> LinearLayer:
    """FLUX.2's Linears carry no bias."""
    return LinearLayer(name, in_features, out_features, bias=False)


def flux2_transformer_shape(config: Mapping[str, Any]) -> TransformerShape:
    in_channels = int(config.get("in_channels", 128))
    return TransformerShape(
        num_layers=int(config.get("num_layers", 8)),
        num_single_layers=int(config.get("num_single_layers", 48)),
        num_attention_heads=int(config.get("num_attention_heads", 48)),
        attention_head_dim=int(config.get("attention_head_dim", 128)),
        in_channels=in_channels,
        joint_attention_dim=int(config.get("joint_attention_dim", 15360)),
        pooled_projection_dim=0,  # FLUX.2 has no pooled text embedding
        patch_size=int(config.get("patch_size", 1)),
        out_channels=int(config.get("out_channels") or in_channels),
        guidance_embeds=bool(config.get("guidance_embeds", True)),
    )


def flux2_linear_layers(shape: TransformerShape, config: Mapping[str, Any]) -> tuple[LinearLayer, ...]:
    """Every Linear in Flux2Transformer2DModel, named as the module tree names them."""
    d = shape.hidden_size
    mlp = int(d * float(config.get("mlp_ratio", 3.0)))
    time_channels = int(config.get("timestep_guidance_channels", 256))
    embedders = ["timestep_embedder"] + (["guidance_embedder"] if shape.guidance_embeds else [])
    layers = []
    for embedder in embedders:
        layers += [
            _linear(f"time_guidance_embed.{embedder}.linear_1", time_channels, d),
            _linear(f"time_guidance_embed.{embedder}.linear_2", d, d),
        ]
    layers += [
        _linear("double_stream_modulation_img.linear", d, 6 * d),
        _linear("double_stream_modulation_txt.linear", d, 6 * d),
        _linear("single_stream_modulation.linear", d, 3 * d),
        _linear("x_embedder", shape.in_channels, d),
        _linear("context_embedder", shape.joint_attention_dim, d),
    ]
    for index in range(shape.num_layers):
        prefix = f"transformer_blocks.{index}."
        for projection in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            layers.append(_linear(prefix + "attn." + projection, d, d))
        for feed_forward in ("ff", "ff_context"):
            # SwiGLU: linear_in holds the gate and the value.
            layers += [
                _linear(prefix + feed_forward + ".linear_in", d, 2 * mlp),
                _linear(prefix + feed_forward + ".linear_out", mlp, d),
            ]
    for index in range(shape.num_single_layers):
        prefix = f"single_transformer_blocks.{index}.attn."
        layers += [_linear(prefix + "to_qkv_mlp_proj", d, 3 * d + 2 * mlp), _linear(prefix + "to_out", d + mlp, d)]
    layers += [
        _linear("norm_out.linear", d, 2 * d),
        _linear("proj_out", d, shape.patch_size * shape.patch_size * shape.out_channels),
    ]
    return tuple(layers)


def _decoder_layers(config: Mapping[str, Any], qk_norms: bool) -> int:
    """One decoder stack (embeddings, layers, final norm) of a Llama-style model: bias-free projections with
    grouped key/value heads, a gated MLP, RMS norms (and per-head q/k norms in Qwen3)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(config["intermediate_size"])
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden + (2 * head_dim if qk_norms else 0)
    return int(config["vocab_size"]) * hidden + int(config["num_hidden_layers"]) * per_layer + hidden


def _language_model_head(config: Mapping[str, Any], tied: bool) -> int:
    return 0 if tied else int(config["vocab_size"]) * int(config["hidden_size"])


def qwen3_params(config: Mapping[str, Any]) -> int:
    """transformers Qwen3ForCausalLM (FLUX.2 [klein]'s text encoder)."""
    return _decoder_layers(config, qk_norms=True) + _language_model_head(
        config, bool(config.get("tie_word_embeddings", False))
    )


def _pixtral_params(vision: Mapping[str, Any]) -> int:
    hidden = int(vision["hidden_size"])
    inner = int(vision["num_attention_heads"]) * int(
        vision.get("head_dim") or hidden // int(vision["num_attention_heads"])
    )
    patch = int(vision["patch_size"])
    per_layer = 2 * hidden + 3 * hidden * int(vision["intermediate_size"]) + 4 * hidden * inner
    return (
        int(vision.get("num_channels", 3)) * patch * patch * hidden
        + hidden
        + int(vision["num_hidden_layers"]) * per_layer
    )


def mistral3_params(config: Mapping[str, Any]) -> int:
    """transformers Mistral3ForConditionalGeneration (FLUX.2 [dev]'s text encoder): the Pixtral vision tower,
    the projector (RMS norm, 2x2 patch merger, two Linears), the Mistral language model and its head."""
    text, vision = config["text_config"], config["vision_config"]
    vision_hidden, text_hidden = int(vision["hidden_size"]), int(text["hidden_size"])
    merge = int(config.get("spatial_merge_size", 2))
    bias = bool(config.get("multimodal_projector_bias", False))
    projector = (
        vision_hidden
        + vision_hidden * merge * merge * vision_hidden
        + vision_hidden * text_hidden
        + (text_hidden if bias else 0)
        + text_hidden * text_hidden
        + (text_hidden if bias else 0)
    )
    head = _language_model_head(text, bool(config.get("tie_word_embeddings", True)))
    return _pixtral_params(vision) + projector + _decoder_layers(text, qk_norms=False) + head


def flux2_text_encoder_params(config: Mapping[str, Any]) -> int:
    """The text encoder of a FLUX.2 pipeline, told by its config's shape."""
    return mistral3_params(config) if "text_config" in config else qwen3_params(config)


def flux2_model_size(
    name: str,
    family: Family,
    transformer_config: Mapping[str, Any],
    text_encoder_config: Mapping[str, Any],
    vae_config: Mapping[str, Any],
    *,
    source: str,
) -> ModelSize:
    """A FLUX.2 model ([dev], [klein]) from its components' configs."""
    shape = flux2_transformer_shape(transformer_config)
    layers = flux2_linear_layers(shape, transformer_config)
    total, largest = transformer_params(shape, layers)
    return ModelSize(
        name=name,
        transformer_params=total,
        largest_layer_params=largest,
        text_encoder_params=0,
        text_encoder_2_params=flux2_text_encoder_params(text_encoder_config),
        vae_params=vae_params(vae_config),
        transformer=shape,
        # The cached prompt sequence: three of the text encoder's hidden states side by side.
        text_encoder_2_hidden_size=shape.joint_attention_dim,
        linear_layers=layers,
        source=source,
        family=family.name,
        default_lora_targets=family.default_lora_targets(transformer_config),
    )
