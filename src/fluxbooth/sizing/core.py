"""What every FLUX family's sizing shares: the sizes a planner reads (ModelSize), the transformer's Linears
and what they act on, the parameter counts FLUX.1 and FLUX.2 count alike (the q/k RMS norms, the VAE's
encoder/decoder blocks), and the rules that name layers (LoRA targets, quantised layers).

No torch here: this runs in the handler process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property, lru_cache
from typing import Any

from fluxbooth.contract.precision import block_of, is_quantised_layer
from fluxbooth.models.families import FLUX1


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
    # The LoRA targets when a request names none: the family's (fluxbooth.models.families), for this config.
    default_lora_targets: tuple[str, ...] = field(repr=False, default=())
    # Images whose tokens share the transformer's sequence: 2 for FLUX.1 Kontext, planned for its image pairs
    # (the control image's tokens follow the target's; a Kontext job without pairs is planned on the safe side).
    sequence_images: int = 1

    # The planner's caches key on the model. The generated hash and equality would hash and compare every
    # Linear's record on each lookup (millions of calls for one `plan --runpod-gpu all`, and each plan sizes
    # its own equal copy); the fields never change, so they are read once into plain tuples compared in C.
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ModelSize):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    @cached_property
    def _key(self) -> tuple[Any, ...]:
        layers = tuple((layer.name, layer.in_features, layer.out_features, layer.bias) for layer in self.linear_layers)
        return tuple(layers if entry.name == "linear_layers" else getattr(self, entry.name) for entry in fields(self))

    @cached_property
    def _hash(self) -> int:
        return hash(self._key)

    @cached_property
    def linear_elements_by_block(self) -> Mapping[str, Mapping[str, int]]:
        """in x out of the Linears by block (`block_of`: `transformer_blocks.3`; a module outside the blocks is its
        own) and by the tokens each multiplies (`linear_stream`): what the time model sums, read once per model
        (the planner prices thousands of candidates)."""
        by_block: dict[str, dict[str, int]] = {}
        for layer in self.linear_layers:
            streams = by_block.setdefault(block_of(layer.name), {})
            stream = linear_stream(layer.name)
            streams[stream] = streams.get(stream, 0) + layer.in_features * layer.out_features
        return by_block

    @property
    def encoder_params(self) -> int:
        """Everything that only runs while embeddings and latents are cached."""
        return self.text_encoder_params + self.text_encoder_2_params + self.vae_params

    @property
    def total_params(self) -> int:
        return self.transformer_params + self.encoder_params

    def lora_params(self, rank: int, target_modules: Iterable[str]) -> int:
        """Trainable parameters that peft adds: rank * (in + out) for every targeted Linear."""
        return rank * _lora_features(self, tuple(target_modules))

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


# Bounded: the targets come from requests. The planner asks for every candidate; this walks every Linear.
@lru_cache(maxsize=1024)
def _lora_features(model: ModelSize, targets: tuple[str, ...]) -> int:
    """in + out summed over the Linears LoRA adapts with `targets`."""
    return sum(
        layer.in_features + layer.out_features
        for layer in model.linear_layers
        if matches_lora_target(layer.name, targets)
    )


# Bounded: the targets come from requests. The planner asks it for every Linear of every candidate it prices.
@lru_cache(maxsize=65536)
def matches_lora_target(module_name: str, targets: tuple[str, ...]) -> bool:
    """peft's rule for a list of target names: the full name or its dotted suffix matches."""
    return any(module_name == target or module_name.endswith("." + target) for target in targets)


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
# VAE (diffusers AutoencoderKL; FLUX.2's AutoencoderKLFlux2 has the same blocks and a parameter-free batch norm)
# ---------------------------------------------------------------------------------------------


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
# Layer names: which tokens each Linear acts on, LoRA targets, quantised layers
# ---------------------------------------------------------------------------------------------

# Which tokens each Linear of FLUX.1 and FLUX.2 acts on (their module names): the modulation and the time,
# guidance and pooled-text embedders act on one vector per sample; a double-stream block's weights act on
# their own stream's tokens only (the `add_*`, `to_add_out` and `ff_context` weights on the prompt's, the rest
# on the image's); a single-stream block's on the joined sequence.
_VECTOR_LAYER_PREFIXES = (
    "time_text_embed.",
    "time_guidance_embed.",
    "norm_out.",
    "double_stream_modulation_",
    "single_stream_modulation",
)
_VECTOR_LAYER_PARTS = (".norm1.linear", ".norm1_context.linear", ".norm.linear")
_TEXT_LAYER_PARTS = (".attn.add_q_proj", ".attn.add_k_proj", ".attn.add_v_proj", ".attn.to_add_out", ".ff_context.")


def linear_stream(module_name: str) -> str:
    """ "vector", "text", "image" or "joint": the tokens the Linear `module_name` multiplies (time model)."""
    if module_name.startswith(_VECTOR_LAYER_PREFIXES) or any(part in module_name for part in _VECTOR_LAYER_PARTS):
        return "vector"
    if module_name == "context_embedder" or (
        module_name.startswith("transformer_blocks.") and any(part in module_name for part in _TEXT_LAYER_PARTS)
    ):
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
