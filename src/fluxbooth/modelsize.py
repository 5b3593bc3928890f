"""How big a FLUX pipeline is, computed from its configs without loading any weights.

The family (fluxbooth.families) decides which formulas apply: FLUX.1 and FLUX.1 Kontext share the
formulas below; FLUX.2's transformer and text encoders are in `modelsize_flux2`. For FLUX.2,
`text_encoder_2_params` (the role of FLUX.1's T5: the encoder whose hidden states are the prompt sequence)
holds its one text encoder, and `text_encoder_params` (the pooled-embedding role of CLIP) is 0.

Parameter counts are analytic: each formula mirrors the layer layout of the diffusers /
transformers class that the config instantiates (FluxTransformer2DModel, CLIPTextModel,
T5EncoderModel, AutoencoderKL). tests/test_plan.py checks every formula against
`sum(p.numel())` of the real classes built on the meta device, and the presets below against
the published FLUX.1 sizes (transformer 11,901,408,320 for dev; CLIP-L 123,060,480;
T5-XXL encoder 4,762,310,656; VAE 83,819,683).

No torch here: this runs in the handler process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fluxbooth.contract.precision import block_of, is_quantised_layer
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.families import FLUX1, Family, family_named, family_of, unreadable_config
from fluxbooth.jsonfiles import read_json_file
from fluxbooth.model_configs import check_model_configs
from fluxbooth.synthetic.presets import CLIP_L_TEXT, FLUX1_TRANSFORMER, FLUX1_VAE, T5_XXL_ENCODER, preset

FLUX_DEV_NAME = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL_NAME = "black-forest-labs/FLUX.1-schnell"
# Hub ids the planner sizes without their files: each maps to the synthetic preset with its published configs.
PRESET_OF_MODEL: dict[str, str] = {
    FLUX_DEV_NAME: "flux1-dev",
    FLUX_SCHNELL_NAME: "flux1-schnell",
    "black-forest-labs/FLUX.1-Krea-dev": "flux1-dev",  # FLUX.1-dev's configs unchanged
    "black-forest-labs/FLUX.1-Kontext-dev": "flux1-kontext-dev",
    "black-forest-labs/FLUX.2-dev": "flux2-dev",
    "black-forest-labs/FLUX.2-klein-4B": "flux2-klein-4b",
    "black-forest-labs/FLUX.2-klein-base-4B": "flux2-klein-4b",
    "black-forest-labs/FLUX.2-klein-9B": "flux2-klein-9b",
    "black-forest-labs/FLUX.2-klein-base-9B": "flux2-klein-9b",
}

# The published FLUX.1 configs have one owner, the synthetic presets (pure data, no torch); sizing reads
# only these fields of each.
_FLUX_TRANSFORMER_CONFIG: dict[str, Any] = dict(FLUX1_TRANSFORMER)
_CLIP_L_CONFIG: dict[str, Any] = {
    key: CLIP_L_TEXT[key]
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings",
    )
}
_T5_XXL_CONFIG: dict[str, Any] = {
    key: T5_XXL_ENCODER[key]
    for key in (
        "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "feed_forward_proj",
        "relative_attention_num_buckets",
    )
}
_FLUX_VAE_CONFIG: dict[str, Any] = {
    key: FLUX1_VAE[key]
    for key in (
        "in_channels", "out_channels", "block_out_channels", "layers_per_block", "latent_channels",
        "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention",
    )
}


@dataclass(frozen=True)
class LinearLayer:
    """One nn.Linear of the transformer, by its module name (what LoRA targets match)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = True

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class TransformerShape:
    """The dimensions of a FluxTransformer2DModel that memory and time depend on."""

    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    in_channels: int
    joint_attention_dim: int
    pooled_projection_dim: int
    patch_size: int
    out_channels: int
    guidance_embeds: bool

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def num_blocks(self) -> int:
        return self.num_layers + self.num_single_layers


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of a FLUX pipeline's parts; sizes in elements, not bytes."""

    name: str
    transformer_params: int
    largest_layer_params: int
    text_encoder_params: int
    text_encoder_2_params: int
    vae_params: int
    transformer: TransformerShape
    text_encoder_2_hidden_size: int
    linear_layers: tuple[LinearLayer, ...] = field(repr=False, default=())
    source: str = "preset"
    family: str = FLUX1.name
    # The LoRA targets when a request names none: the family's (fluxbooth.families), for this config.
    default_lora_targets: tuple[str, ...] = field(repr=False, default=())
    # Images whose tokens share the transformer's sequence: 2 for FLUX.1 Kontext, planned for its image pairs
    # (the control image's tokens follow the target's; a Kontext job without pairs is planned on the safe side).
    sequence_images: int = 1

    @property
    def encoder_params(self) -> int:
        """Everything that only runs while embeddings and latents are cached."""
        return self.text_encoder_params + self.text_encoder_2_params + self.vae_params

    @property
    def total_params(self) -> int:
        return self.transformer_params + self.encoder_params

    def lora_params(self, rank: int, target_modules: Iterable[str]) -> int:
        """Trainable parameters that peft adds: rank * (in + out) for every targeted Linear."""
        targets = tuple(target_modules)
        return sum(
            rank * (layer.in_features + layer.out_features)
            for layer in self.linear_layers
            if matches_lora_target(layer.name, targets)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "source": self.source,
            "transformer_params": self.transformer_params,
            "largest_layer_params": self.largest_layer_params,
            "text_encoder_params": self.text_encoder_params,
            "text_encoder_2_params": self.text_encoder_2_params,
            "vae_params": self.vae_params,
            "hidden_size": self.transformer.hidden_size,
            "num_layers": self.transformer.num_layers,
            "num_single_layers": self.transformer.num_single_layers,
        }


def matches_lora_target(module_name: str, targets: Iterable[str]) -> bool:
    """peft's rule for a list of target names: the full name or its dotted suffix matches."""
    return any(module_name == target or module_name.endswith("." + target) for target in targets)


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


def norm_params_per_module(shape: TransformerShape) -> dict[str, int]:
    """Parameters outside Linear layers, by owning module (RMSNorm weights of q/k norms)."""
    head = shape.attention_head_dim
    norms: dict[str, int] = {}
    for index in range(shape.num_layers):
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            norms[f"transformer_blocks.{index}.attn.{norm}"] = head
    for index in range(shape.num_single_layers):
        for norm in ("norm_q", "norm_k"):
            norms[f"single_transformer_blocks.{index}.attn.{norm}"] = head
    return norms


def transformer_params(shape: TransformerShape, layers: tuple[LinearLayer, ...]) -> tuple[int, int]:
    """(total parameters, parameters of the largest single module) — as DeepSpeed's
    `model_to_params` counts them: a module's own parameters, not its children's."""
    linear_sizes = [layer.params for layer in layers]
    norm_sizes = list(norm_params_per_module(shape).values())
    total = sum(linear_sizes) + sum(norm_sizes)
    return total, max(linear_sizes + norm_sizes)


# ---------------------------------------------------------------------------------------------
# Text encoders and VAE
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


def _conv(in_channels: int, out_channels: int, kernel: int) -> int:
    return in_channels * out_channels * kernel * kernel + out_channels


def _group_norm(channels: int) -> int:
    return 2 * channels


def _resnet(in_channels: int, out_channels: int) -> int:
    shortcut = _conv(in_channels, out_channels, 1) if in_channels != out_channels else 0
    return (
        _group_norm(in_channels)
        + _conv(in_channels, out_channels, 3)
        + _group_norm(out_channels)
        + _conv(out_channels, out_channels, 3)
        + shortcut
    )


def _mid_block(channels: int, with_attention: bool) -> int:
    attention = _group_norm(channels) + 4 * (channels * channels + channels) if with_attention else 0
    return 2 * _resnet(channels, channels) + attention


def vae_params(config: Mapping[str, Any]) -> int:
    """diffusers AutoencoderKL with DownEncoderBlock2D / UpDecoderBlock2D blocks."""
    channels = [int(value) for value in config.get("block_out_channels", [64])]
    layers_per_block = int(config.get("layers_per_block", 1))
    latent = int(config.get("latent_channels", 4))
    image_in = int(config.get("in_channels", 3))
    image_out = int(config.get("out_channels", 3))
    with_attention = bool(config.get("mid_block_add_attention", True))

    encoder = _conv(image_in, channels[0], 3)
    previous = channels[0]
    for index, width in enumerate(channels):
        for layer in range(layers_per_block):
            encoder += _resnet(previous if layer == 0 else width, width)
        previous = width
        if index < len(channels) - 1:
            encoder += _conv(width, width, 3)  # Downsample2D
    encoder += _mid_block(channels[-1], with_attention)
    encoder += _group_norm(channels[-1]) + _conv(channels[-1], 2 * latent, 3)

    reversed_channels = list(reversed(channels))
    decoder = _conv(latent, reversed_channels[0], 3) + _mid_block(reversed_channels[0], with_attention)
    previous = reversed_channels[0]
    for index, width in enumerate(reversed_channels):
        for layer in range(layers_per_block + 1):
            decoder += _resnet(previous if layer == 0 else width, width)
        previous = width
        if index < len(reversed_channels) - 1:
            decoder += _conv(width, width, 3)  # Upsample2D
    decoder += _group_norm(channels[0]) + _conv(channels[0], image_out, 3)

    quant = 0
    if config.get("use_quant_conv", True):
        quant += _conv(2 * latent, 2 * latent, 1)
    if config.get("use_post_quant_conv", True):
        quant += _conv(latent, latent, 1)
    return encoder + decoder + quant


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


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


def flux2_model_size(
    name: str, family: Family, transformer_config: Mapping[str, Any], text_encoder_config: Mapping[str, Any],
    vae_config: Mapping[str, Any], *, source: str,
) -> ModelSize:
    """A FLUX.2 model ([dev], [klein]) from its components' configs."""
    from fluxbooth.modelsize_flux2 import flux2_linear_layers, flux2_text_encoder_params, flux2_transformer_shape

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


def _sized(name: str, family: Family, configs: Mapping[str, Mapping[str, Any]], source: str) -> ModelSize:
    if family.is_flux2:
        return flux2_model_size(name, family, configs["transformer"], configs["text_encoder"], configs["vae"], source=source)
    return model_size_from_configs(
        name, configs["transformer"], configs["text_encoder"], configs["text_encoder_2"], configs["vae"], source=source, family=family,
    )


def _preset(name: str) -> ModelSize | None:
    """A known hub id sized from its published configs (the synthetic preset that holds them)."""
    preset_name = PRESET_OF_MODEL.get(name)
    if preset_name is None:
        return None
    chosen = preset(preset_name)
    configs = {"transformer": chosen.transformer, "text_encoder": chosen.text_encoder, "text_encoder_2": chosen.text_encoder_2 or {},
               "vae": chosen.vae}
    return _sized(name, family_named(chosen.family), configs, "preset")


def _read_config(folder: Path, component: str) -> dict[str, Any]:
    path = folder / component / "config.json"
    try:
        data = read_json_file(path)
    except FileNotFoundError as error:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"base_model: {path} is missing; point base_model at a complete diffusers pipeline folder",
        ) from error
    except (OSError, ValueError) as error:
        raise unreadable_config(path, error) from None
    if not isinstance(data, dict):
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"base_model: {path} must hold a JSON object")
    return data


def model_size(base_model_path_or_name: str) -> ModelSize:
    """Size a FLUX model by a known hub id (PRESET_OF_MODEL: no download) or from the configs of a local
    diffusers folder, after telling its family from its own files (an unknown one is `invalid_input`)."""
    folder = Path(base_model_path_or_name).expanduser()
    if folder.is_dir():
        family = family_of(folder)
        components = ("transformer", "vae", *family.text_encoders)
        configs = {component: _read_config(folder, component) for component in components}
        check_model_configs(folder, family, configs)
        return _sized(str(folder), family, configs, "config")
    sized = _preset(base_model_path_or_name)
    if sized is not None:
        return sized
    raise FluxboothError(
        ErrorCode.INVALID_INPUT,
        f"base_model: {base_model_path_or_name!r} is neither a local diffusers folder nor a known "
        f"model ({', '.join(PRESET_OF_MODEL)}); bake the model into the image or mount it "
        "and pass its path",
    )


# ---------------------------------------------------------------------------------------------
# Quantised bases: which layers are stored quantised (one rule for the planner and the trainer)
# ---------------------------------------------------------------------------------------------

# Which tokens each Linear of FLUX.1 and FLUX.2 acts on (their module names): the modulation and the time,
# guidance and pooled-text embedders act on one vector per sample; a double-stream block's weights act on
# their own stream's tokens only (the `add_*`, `to_add_out` and `ff_context` weights on the prompt's, the rest
# on the image's); a single-stream block's on the joined sequence.
_VECTOR_LAYER_PREFIXES = ("time_text_embed.", "time_guidance_embed.", "norm_out.", "double_stream_modulation_", "single_stream_modulation")
_VECTOR_LAYER_PARTS = (".norm1.linear", ".norm1_context.linear", ".norm.linear")
_TEXT_LAYER_PARTS = (".attn.add_q_proj", ".attn.add_k_proj", ".attn.add_v_proj", ".attn.to_add_out", ".ff_context.")


def linear_stream(module_name: str) -> str:
    """"vector", "text", "image" or "joint": the tokens the Linear `module_name` multiplies (time model)."""
    if module_name.startswith(_VECTOR_LAYER_PREFIXES) or any(part in module_name for part in _VECTOR_LAYER_PARTS):
        return "vector"
    if module_name == "context_embedder" or (module_name.startswith("transformer_blocks.") and any(part in module_name for part in _TEXT_LAYER_PARTS)):
        return "text"
    if module_name.startswith("single_transformer_blocks."):
        return "joint"
    return "image"


def linear_module_names(model: ModelSize) -> tuple[str, ...]:
    """The names LoRA targets can match, read from the configs (no weights)."""
    return tuple(layer.name for layer in model.linear_layers)


def unmatched_lora_targets(model: ModelSize, targets: Iterable[str]) -> list[str]:
    """Targets that match no Linear of the transformer under peft's rule."""
    names = linear_module_names(model)
    return [target for target in targets if not any(matches_lora_target(name, (target,)) for name in names)]


def lora_target_suffixes(model: ModelSize) -> list[str]:
    """The names a target list would use: a block's Linear by its name within the block (`attn.to_q`),
    any other Linear by its full name (`context_embedder`), deduplicated in module order."""
    suffixes: dict[str, None] = {}
    for name in linear_module_names(model):
        inside_block = is_quantised_layer(name)
        suffixes[name[len(block_of(name)) + 1 :] if inside_block else name] = None
    return list(suffixes)
