"""Key layouts: diffusers FLUX names ↔ the original (BFL) FLUX names that ComfyUI and kohya use.

Pure tensor functions, no I/O, so they are unit-testable against diffusers' own converters.

The original layout fuses projections that diffusers keeps apart: a double block's image attention
`qkv` is diffusers' to_q/to_k/to_v stacked, a single block's `linear1` is to_q/to_k/to_v/proj_mlp
stacked, and the final adaLN modulation stores (shift, scale) where diffusers stores (scale, shift).
FLUX.2 has its own tables (`FLUX2_TABLES`, diffusers' scripts/convert_flux2_to_diffusers.py read
backwards): the same fused qkv in double blocks, single blocks whose fused layers diffusers keeps fused
(`attn.to_qkv_mlp_proj` is `linear1`, `attn.to_out` is `linear2`), and shared modulation layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# diffusers module (relative to the block) → original module, for 1:1 layers of a double block.
DOUBLE_BLOCK_LINEARS = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
}
DOUBLE_BLOCK_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
DOUBLE_BLOCK_NORMS = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
SINGLE_BLOCK_LINEARS = {"proj_out": "linear2", "norm.linear": "modulation.lin"}
SINGLE_BLOCK_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
SINGLE_BLOCK_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
TOP_LEVEL_LINEARS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
}
# diffusers' AdaLayerNormContinuous emits (scale, shift); the original final layer (shift, scale).
SWAPPED_LINEARS = {"norm_out.linear": "final_layer.adaLN_modulation.1"}


@dataclass(frozen=True)
class KeyTables:
    """One family's diffusers → original module names: 1:1 Linears, fused Linears and RMS norms of each
    block kind, the top-level Linears, and those whose row halves are swapped."""

    double_linears: dict[str, str]
    double_fused: Mapping[str, tuple[str, ...]]
    double_norms: dict[str, str]
    single_linears: dict[str, str]
    single_fused: Mapping[str, tuple[str, ...]]
    single_norms: dict[str, str]
    top_linears: dict[str, str]
    swapped_linears: dict[str, str]


FLUX1_TABLES = KeyTables(
    DOUBLE_BLOCK_LINEARS,
    DOUBLE_BLOCK_FUSED,
    DOUBLE_BLOCK_NORMS,
    SINGLE_BLOCK_LINEARS,
    SINGLE_BLOCK_FUSED,
    SINGLE_BLOCK_NORMS,
    TOP_LEVEL_LINEARS,
    SWAPPED_LINEARS,
)
FLUX2_TABLES = KeyTables(
    double_linears={
        "attn.to_out.0": "img_attn.proj",
        "attn.to_add_out": "txt_attn.proj",
        "ff.linear_in": "img_mlp.0",
        "ff.linear_out": "img_mlp.2",
        "ff_context.linear_in": "txt_mlp.0",
        "ff_context.linear_out": "txt_mlp.2",
    },
    double_fused=DOUBLE_BLOCK_FUSED,
    double_norms=DOUBLE_BLOCK_NORMS,
    single_linears={"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"},
    single_fused={},
    single_norms=SINGLE_BLOCK_NORMS,
    top_linears={
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "proj_out": "final_layer.linear",
    },
    swapped_linears=SWAPPED_LINEARS,
)

_BLOCK_KEY = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


@dataclass(frozen=True)
class ModuleMap:
    """Every module of a FLUX transformer with its name in both layouts (for the given block indices)."""

    linears: list[tuple[str, str, bool]]  # (diffusers, original, rows swapped in halves)
    fused: list[tuple[tuple[str, ...], str, str]]  # (diffusers pieces, original, key into split sizes)
    norms: list[tuple[str, str]]  # (diffusers RMSNorm, original RMSNorm)


def module_map(double_blocks: list[int], single_blocks: list[int], tables: KeyTables = FLUX1_TABLES) -> ModuleMap:
    linears: list[tuple[str, str, bool]] = []
    fused: list[tuple[tuple[str, ...], str, str]] = []
    norms: list[tuple[str, str]] = []
    blocks = (
        (
            "transformer_blocks",
            "double_blocks",
            double_blocks,
            tables.double_linears,
            tables.double_fused,
            tables.double_norms,
        ),
        (
            "single_transformer_blocks",
            "single_blocks",
            single_blocks,
            tables.single_linears,
            tables.single_fused,
            tables.single_norms,
        ),
    )
    for diffusers_prefix, original_prefix, indices, block_linears, block_fused, block_norms in blocks:
        for index in indices:
            here, there = f"{diffusers_prefix}.{index}", f"{original_prefix}.{index}"
            linears += [(f"{here}.{name}", f"{there}.{target}", False) for name, target in block_linears.items()]
            fused += [
                (tuple(f"{here}.{name}" for name in names), f"{there}.{target}", target)
                for target, names in block_fused.items()
            ]
            norms += [(f"{here}.{name}", f"{there}.{target}") for name, target in block_norms.items()]
    linears += [(name, target, False) for name, target in tables.top_linears.items()]
    linears += [(name, target, True) for name, target in tables.swapped_linears.items()]
    return ModuleMap(linears, fused, norms)


def _diffusers_block_indices(keys: Iterable[str], prefix: str) -> list[int]:
    return sorted(
        {int(match.group(2)) for key in keys if (match := _BLOCK_KEY.match(key)) and match.group(1) == prefix}
    )


def _diffusers_module_map(keys: Iterable[str], tables: KeyTables) -> ModuleMap:
    keys = list(keys)
    indices = (
        _diffusers_block_indices(keys, "transformer_blocks"),
        _diffusers_block_indices(keys, "single_transformer_blocks"),
    )
    return module_map(*indices, tables)


def _original_module_map(keys: Iterable[str], tables: KeyTables) -> ModuleMap:
    keys = list(keys)
    indices = {
        prefix: sorted({int(key.split(".")[1]) for key in keys if key.startswith(f"{prefix}.")})
        for prefix in ("double_blocks", "single_blocks")
    }
    return module_map(indices["double_blocks"], indices["single_blocks"], tables)


def _weight_and_bias(source_module: str, target_module: str) -> list[tuple[str, str]]:
    return [(f"{source_module}.{suffix}", f"{target_module}.{suffix}") for suffix in ("weight", "bias")]


@dataclass(frozen=True)
class OriginalTensor:
    """One tensor of the original layout: the diffusers tensors it is made of (stacked along rows when
    several), with its row halves exchanged when `swapped`."""

    name: str
    sources: tuple[str, ...]
    swapped: bool = False

    def build(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        joined = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return swap_halves(joined) if self.swapped else joined


def single_file_layout(diffusers_keys: Iterable[str], tables: KeyTables = FLUX1_TABLES) -> list[OriginalTensor]:
    """How every tensor of a diffusers transformer state dict (of the family `tables` name) maps to the
    original single-file layout, one entry per original tensor; refuses a key it has no original name for."""
    keys = set(diffusers_keys)
    modules = _diffusers_module_map(keys, tables)
    layout = []
    for name, target, swapped in modules.linears:
        layout += [OriginalTensor(new, (old,), swapped) for old, new in _weight_and_bias(name, target) if old in keys]
    for names, target, _ in modules.fused:
        for suffix in ("weight", "bias"):
            pieces = tuple(f"{name}.{suffix}" for name in names)
            if all(piece in keys for piece in pieces):
                layout.append(OriginalTensor(f"{target}.{suffix}", pieces))
    layout += [
        OriginalTensor(f"{target}.scale", (f"{name}.weight",))
        for name, target in modules.norms
        if f"{name}.weight" in keys
    ]
    unmapped = keys - {source for entry in layout for source in entry.sources}
    if unmapped:
        raise ValueError(f"no original FLUX name for {sorted(unmapped)[:5]} ({len(unmapped)} tensors)")
    return layout


def diffusers_to_original_transformer(
    state_dict: dict[str, torch.Tensor], tables: KeyTables = FLUX1_TABLES
) -> dict[str, torch.Tensor]:
    """A full diffusers transformer state dict → the original single-file layout."""
    return {
        entry.name: entry.build([state_dict[source] for source in entry.sources])
        for entry in single_file_layout(state_dict, tables)
    }


def original_to_diffusers_transformer(
    state_dict: dict[str, torch.Tensor], split_sizes: dict[str, list[int]], tables: KeyTables = FLUX1_TABLES
) -> dict[str, torch.Tensor]:
    """The inverse of `diffusers_to_original_transformer`; `split_sizes` gives, per fused original module
    name without the block index ("img_attn.qkv", "txt_attn.qkv", "linear1"), the row counts to split."""
    source = dict(state_dict)
    converted: dict[str, torch.Tensor] = {}
    modules = _original_module_map(state_dict, tables)
    for name, target, swapped in modules.linears:
        for old, new in _weight_and_bias(target, name):
            if old in source:
                converted[new] = swap_halves(source.pop(old)) if swapped else source.pop(old)
    for names, target, sizes_key in modules.fused:
        for suffix in ("weight", "bias"):
            if f"{target}.{suffix}" in source:
                pieces = torch.split(source.pop(f"{target}.{suffix}"), split_sizes[sizes_key], dim=0)
                converted.update(
                    {f"{name}.{suffix}": piece.contiguous() for name, piece in zip(names, pieces, strict=True)}
                )
    for name, target in modules.norms:
        if f"{target}.scale" in source:
            converted[f"{name}.weight"] = source.pop(f"{target}.scale")
    if source:
        raise ValueError(f"no diffusers FLUX name for {sorted(source)[:5]} ({len(source)} tensors)")
    return converted


def fused_split_sizes(transformer_config: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each fused original module's pieces' output sizes (FLUX.2 fuses only the double blocks' qkv)."""
    inner = int(transformer_config["num_attention_heads"]) * int(transformer_config["attention_head_dim"])
    sizes = {"img_attn.qkv": [inner] * 3, "txt_attn.qkv": [inner] * 3}
    if "mlp_ratio" not in transformer_config:
        sizes["linear1"] = [inner] * 3 + [inner * 4]  # FLUX.1's single blocks, mlp_ratio 4
    return sizes


# --- LoRA -------------------------------------------------------------------------------------------------


def _lora_pairs(lora_state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{diffusers module: (A [r, in], B [out, r])} from peft keys `<module>.lora_A.weight` / `.lora_B.weight`."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, tensor in lora_state_dict.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            pairs[module] = (tensor, lora_state_dict[f"{module}.lora_B.weight"])
    return pairs


def diffusers_lora_to_comfyui(
    lora_state_dict: dict[str, torch.Tensor],
    *,
    alpha: float,
    rank: int,
    fused_out_features: dict[str, list[int]],
    tables: KeyTables = FLUX1_TABLES,
) -> dict[str, torch.Tensor]:
    """peft/diffusers FLUX LoRA (module keys without prefix) → kohya/ComfyUI `lora_unet_...` keys.

    The LoRA scale alpha/rank is folded into `lora_down` and every module gets `alpha` = its rank, so
    every loader computes exactly up @ down. Modules the original layout fuses get a block-diagonal
    `lora_up` over stacked `lora_down`s (rank = pieces x rank); pieces that were not trained are zero.
    `fused_out_features` maps "img_attn.qkv", "txt_attn.qkv", "linear1" to their pieces' output sizes.
    """
    pairs = _lora_pairs(lora_state_dict)
    scale = alpha / rank
    converted: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def put(target_module: str, down: torch.Tensor, up: torch.Tensor) -> None:
        name = "lora_unet_" + target_module.replace(".", "_")
        converted[f"{name}.lora_down.weight"] = (down.float() * scale).to(down.dtype).contiguous()
        converted[f"{name}.lora_up.weight"] = up.contiguous()
        converted[f"{name}.alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)

    def single(
        source_module: str, target_module: str, transform: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> None:
        if source_module in pairs:
            down, up = pairs[source_module]
            put(target_module, down, transform(up) if transform else up)
            used.add(source_module)

    def fused(source_modules: tuple[str, ...], target_module: str, out_sizes: list[int]) -> None:
        present = [module for module in source_modules if module in pairs]
        if not present:
            return
        reference_down, reference_up = pairs[present[0]]
        in_features = reference_down.shape[1]
        downs, ups = [], []
        for module, out_features in zip(source_modules, out_sizes, strict=True):
            if module in pairs:
                down, up = pairs[module]
                used.add(module)
            else:
                down = reference_down.new_zeros((rank, in_features))
                up = reference_up.new_zeros((out_features, rank))
            downs.append(down)
            ups.append(up)
        put(target_module, torch.cat(downs, dim=0), torch.block_diag(*ups))

    modules = _diffusers_module_map(pairs, tables)
    for name, target, swapped in modules.linears:
        single(name, target, swap_halves if swapped else None)
    for names, target, sizes_key in modules.fused:
        fused(names, target, fused_out_features[sizes_key])
    unconverted = set(pairs) - used
    if unconverted:
        raise ValueError(f"no ComfyUI name for LoRA modules {sorted(unconverted)[:5]}")
    return converted


PROBE_COLUMNS = 8


def probe(in_features: int) -> torch.Tensor:
    """A fixed random [in_features, 8] matrix. A LoRA's effect on it (delta @ probe) identifies the delta
    with overwhelming probability, at a fraction of the cost of forming [out, in] deltas of FLUX size."""
    return torch.randn(in_features, PROBE_COLUMNS, generator=torch.Generator().manual_seed(in_features))


def comfyui_lora_effects(comfyui_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{kohya module: (up @ down * alpha / rank) @ probe}, as ComfyUI would change that layer."""
    effects = {}
    for key, down in comfyui_state_dict.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        up = comfyui_state_dict[f"{name}.lora_up.weight"]
        alpha = float(comfyui_state_dict.get(f"{name}.alpha", torch.tensor(float(down.shape[0]))))
        effects[name] = up.float() @ (down.float() @ probe(down.shape[1])) * (alpha / down.shape[0])
    return effects


def diffusers_lora_effects(
    lora_state_dict: dict[str, torch.Tensor], *, alpha: float, rank: int
) -> dict[str, torch.Tensor]:
    """{diffusers module: (B @ A * alpha / rank) @ probe}, as peft changes that layer."""
    return {
        module: up.float() @ (down.float() @ probe(down.shape[1])) * (alpha / rank)
        for module, (down, up) in _lora_pairs(lora_state_dict).items()
    }


def diffusers_effects_as_comfyui(
    effects: dict[str, torch.Tensor], split_sizes: dict[str, list[int]], tables: KeyTables = FLUX1_TABLES
) -> dict[str, torch.Tensor]:
    """Effects keyed by diffusers module → keyed by kohya module. The layout conversion only stacks and
    swaps rows, so it applies to effects as to weights; untrained pieces of a fused layer are zero rows."""
    as_weights = {f"{module}.weight": effect for module, effect in effects.items()}
    for key in list(as_weights):
        match = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)\.weight$", key)
        if match is None:
            continue
        fused_table = tables.double_fused if match.group(1) == "transformer_blocks" else tables.single_fused
        for target, names in fused_table.items():
            if match.group(3) in names:
                for name, rows in zip(names, split_sizes[target], strict=True):
                    sibling = f"{match.group(1)}.{match.group(2)}.{name}.weight"
                    as_weights.setdefault(sibling, torch.zeros(rows, as_weights[key].shape[1]))
    original = diffusers_to_original_transformer(as_weights, tables)
    return {"lora_unet_" + key[: -len(".weight")].replace(".", "_"): value for key, value in original.items()}
