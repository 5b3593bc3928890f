"""A model's configs checked before anything is planned from them: the type and bounds of every field the
planner reads (layers, heads, dimensions, channels, vocabularies) and the transformer's class against the
pipeline's family. A base model may be a user's own hub repository, so its configs are input like any other:
a value out of bounds is `invalid_input` naming the file and the field, never hours of planning."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.families import Family

# The largest FLUX transformer has 57 blocks and its text encoders 40 layers: 1000 leaves room for any real
# model while keeping planning (about a millisecond per layer) to a second or two.
MAX_LAYERS = 1000
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_WIDTH = 262_144
MAX_VOCABULARY = 1_048_576
MAX_VAE_BLOCKS = 8

# Every integer field the sizing formulas (fluxbooth.sizing) read, with its smallest and largest value.
INTEGER_BOUNDS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_layers", "num_single_layers", "num_hidden_layers", "layers_per_block"), (0, MAX_LAYERS)),
    **dict.fromkeys(("num_attention_heads", "num_heads", "num_key_value_heads"), (1, MAX_HEADS)),
    **dict.fromkeys(("attention_head_dim", "head_dim", "d_kv"), (1, MAX_HEAD_DIM)),
    **dict.fromkeys(
        (
            "hidden_size",
            "d_model",
            "joint_attention_dim",
            "pooled_projection_dim",
            "intermediate_size",
            "d_ff",
            "in_channels",
            "out_channels",
            "latent_channels",
            "timestep_guidance_channels",
            "num_channels",
        ),
        (1, MAX_WIDTH),
    ),
    **dict.fromkeys(("vocab_size", "max_position_embeddings"), (1, MAX_VOCABULARY)),
    **dict.fromkeys(("patch_size", "spatial_merge_size"), (1, 64)),
    "relative_attention_num_buckets": (1, 4096),
}
# Fields a config may give per axis ([2, 2]: FLUX.2's VAE patch), each value within the field's bounds.
PER_AXIS_FIELDS = frozenset({"patch_size"})
NUMBER_BOUNDS: dict[str, tuple[float, float]] = {"mlp_ratio": (0.0, 64.0)}


def _refusal(path: Path, field: str, problem: str) -> FluxboothError:
    return FluxboothError(
        ErrorCode.INVALID_INPUT,
        f"base_model: {path}: {field} {problem}; give a diffusers FLUX model with its published configs",
    )


def _fields(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(dotted name, key, value) of every field, nested objects (a text encoder's text_config) included."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _fields(value, f"{name}.")
        else:
            yield name, str(key), value


def _integer_problem(value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"is {value!r:.40}, not a whole number"
    if not low <= value <= high:
        return f"is {value:,}, outside {low:,} to {high:,}"
    return None


def _number_problem(value: Any, low: float, high: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"is {value!r:.40}, not a number"
    if not low < value <= high:
        return f"is {value:g}, outside {low:g} (exclusive) to {high:g}"
    return None


def check_config(path: Path, config: Mapping[str, Any], *, per_axis: bool = True) -> None:
    """Every field the planner reads has a value of its type within its bounds (an absent or null one takes the
    class's default); `per_axis`: PER_AXIS_FIELDS may be lists (not in a transformer, whose sizing reads one)."""
    for name, key, value in _fields(config):
        if value is None:
            continue
        problem = None
        if per_axis and key in PER_AXIS_FIELDS and isinstance(value, list):
            problem = _per_axis_problem(value, *INTEGER_BOUNDS[key])
        elif key in INTEGER_BOUNDS:
            problem = _integer_problem(value, *INTEGER_BOUNDS[key])
        elif key in NUMBER_BOUNDS:
            problem = _number_problem(value, *NUMBER_BOUNDS[key])
        elif key == "block_out_channels":
            problem = _channels_problem(value)
        if problem is not None:
            raise _refusal(path, name, problem)


def _per_axis_problem(value: list[Any], low: int, high: int) -> str | None:
    if not 1 <= len(value) <= 3:
        return "must be a whole number or a list of 1 to 3 of them"
    for item in value:
        if (problem := _integer_problem(item, low, high)) is not None:
            return f"holds a value that {problem}"
    return None


def _channels_problem(value: Any) -> str | None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_VAE_BLOCKS:
        return f"must be a list of 1 to {MAX_VAE_BLOCKS} channel counts"
    for item in value:
        if (problem := _integer_problem(item, 1, MAX_WIDTH)) is not None:
            return f"holds a value that {problem}"
    return None


def check_transformer_class(folder: Path, family: Family, config: Mapping[str, Any]) -> None:
    """The transformer is the class the pipeline's family trains (a FLUX.2 [klein] pipeline over a FLUX.1
    transformer cannot be planned, loaded or trained)."""
    class_name = config.get("_class_name")
    if class_name is not None and class_name != family.transformer_class:
        raise _refusal(
            folder / "transformer" / "config.json",
            "_class_name",
            f"is {class_name!r:.80}, but {family.title} needs {family.transformer_class}",
        )


def check_model_configs(folder: Path, family: Family, configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Each component's config of the model in `folder`, before it is sized."""
    check_transformer_class(folder, family, configs.get("transformer", {}))
    for component, config in configs.items():
        check_config(folder / component / "config.json", config, per_axis=component != "transformer")
