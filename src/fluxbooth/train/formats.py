"""Key layouts: diffusers FLUX names ↔ the original (BFL) FLUX names that ComfyUI and kohya use.

Pure tensor functions, no I/O, so they are unit-testable against diffusers' own converters.

The original layout fuses projections that diffusers keeps apart: a double block's image attention
`qkv` is diffusers' to_q/to_k/to_v stacked, a single block's `linear1` is to_q/to_k/to_v/proj_mlp
stacked, and the final adaLN modulation stores (shift, scale) where diffusers stores (scale, shift).
"""

from __future__ import annotations

import re
from collections.abc import Callable

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

_BLOCK_KEY = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _block_indices(state_dict: dict[str, torch.Tensor], prefix: str) -> list[int]:
    return sorted({int(match.group(2)) for key in state_dict if (match := _BLOCK_KEY.match(key)) and match.group(1) == prefix})


def _move_linear(
    source: dict[str, torch.Tensor],
    converted: dict[str, torch.Tensor],
    source_module: str,
    target_module: str,
    transform: Callable[[torch.Tensor], torch.Tensor] | None,
) -> None:
    """Move a module's weight and bias (those present) from `source` to `converted` under a new name."""
    for suffix in ("weight", "bias"):
        key = f"{source_module}.{suffix}"
        if key in source:
            tensor = source.pop(key)
            converted[f"{target_module}.{suffix}"] = transform(tensor) if transform else tensor


def diffusers_to_original_transformer(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full diffusers FluxTransformer2DModel state dict → the original single-file layout."""
    source = dict(state_dict)
    converted: dict[str, torch.Tensor] = {}

    def move(source_module: str, target_module: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        _move_linear(source, converted, source_module, target_module, transform)

    def fuse(source_modules: tuple[str, ...], target_module: str) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{module}.{suffix}" for module in source_modules]
            if all(key in source for key in keys):
                converted[f"{target_module}.{suffix}"] = torch.cat([source.pop(key) for key in keys], dim=0)

    def move_norm(source_module: str, target_module: str) -> None:
        key = f"{source_module}.weight"
        if key in source:
            converted[f"{target_module}.scale"] = source.pop(key)

    for index in _block_indices(state_dict, "transformer_blocks"):
        here, there = f"transformer_blocks.{index}", f"double_blocks.{index}"
        for name, target in DOUBLE_BLOCK_LINEARS.items():
            move(f"{here}.{name}", f"{there}.{target}")
        for target, names in DOUBLE_BLOCK_FUSED.items():
            fuse(tuple(f"{here}.{name}" for name in names), f"{there}.{target}")
        for name, target in DOUBLE_BLOCK_NORMS.items():
            move_norm(f"{here}.{name}", f"{there}.{target}")
    for index in _block_indices(state_dict, "single_transformer_blocks"):
        here, there = f"single_transformer_blocks.{index}", f"single_blocks.{index}"
        for name, target in SINGLE_BLOCK_LINEARS.items():
            move(f"{here}.{name}", f"{there}.{target}")
        for target, names in SINGLE_BLOCK_FUSED.items():
            fuse(tuple(f"{here}.{name}" for name in names), f"{there}.{target}")
        for name, target in SINGLE_BLOCK_NORMS.items():
            move_norm(f"{here}.{name}", f"{there}.{target}")
    for name, target in TOP_LEVEL_LINEARS.items():
        move(name, target)
    for name, target in SWAPPED_LINEARS.items():
        move(name, target, swap_halves)
    if source:
        raise ValueError(f"no original FLUX name for {sorted(source)[:5]} ({len(source)} tensors)")
    return converted


def original_to_diffusers_transformer(
    state_dict: dict[str, torch.Tensor], split_sizes: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """The inverse of `diffusers_to_original_transformer`; `split_sizes` gives, per fused original module
    name without the block index ("img_attn.qkv", "txt_attn.qkv", "linear1"), the row counts to split."""
    source = dict(state_dict)
    converted: dict[str, torch.Tensor] = {}

    def move(source_module: str, target_module: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        _move_linear(source, converted, source_module, target_module, transform)

    def split(source_module: str, sizes: list[int], target_modules: tuple[str, ...]) -> None:
        for suffix in ("weight", "bias"):
            key = f"{source_module}.{suffix}"
            if key in source:
                for target, part in zip(target_modules, torch.split(source.pop(key), sizes, dim=0), strict=True):
                    converted[f"{target}.{suffix}"] = part.contiguous()

    def move_norm(source_module: str, target_module: str) -> None:
        key = f"{source_module}.scale"
        if key in source:
            converted[f"{target_module}.weight"] = source.pop(key)

    double = sorted({int(key.split(".")[1]) for key in source if key.startswith("double_blocks.")})
    single = sorted({int(key.split(".")[1]) for key in source if key.startswith("single_blocks.")})
    for index in double:
        here, there = f"double_blocks.{index}", f"transformer_blocks.{index}"
        for name, target in DOUBLE_BLOCK_LINEARS.items():
            move(f"{here}.{target}", f"{there}.{name}")
        for target, names in DOUBLE_BLOCK_FUSED.items():
            split(f"{here}.{target}", split_sizes[target], tuple(f"{there}.{name}" for name in names))
        for name, target in DOUBLE_BLOCK_NORMS.items():
            move_norm(f"{here}.{target}", f"{there}.{name}")
    for index in single:
        here, there = f"single_blocks.{index}", f"single_transformer_blocks.{index}"
        for name, target in SINGLE_BLOCK_LINEARS.items():
            move(f"{here}.{target}", f"{there}.{name}")
        for target, names in SINGLE_BLOCK_FUSED.items():
            split(f"{here}.{target}", split_sizes[target], tuple(f"{there}.{name}" for name in names))
        for name, target in SINGLE_BLOCK_NORMS.items():
            move_norm(f"{here}.{target}", f"{there}.{name}")
    for name, target in TOP_LEVEL_LINEARS.items():
        move(target, name)
    for name, target in SWAPPED_LINEARS.items():
        move(target, name, swap_halves)
    if source:
        raise ValueError(f"no diffusers FLUX name for {sorted(source)[:5]} ({len(source)} tensors)")
    return converted


def fused_split_sizes(transformer_config: dict[str, object]) -> dict[str, list[int]]:
    inner = int(transformer_config["num_attention_heads"]) * int(transformer_config["attention_head_dim"])
    mlp_hidden = inner * 4  # FLUX's mlp_ratio
    return {"img_attn.qkv": [inner] * 3, "txt_attn.qkv": [inner] * 3, "linear1": [inner] * 3 + [mlp_hidden]}


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
    lora_state_dict: dict[str, torch.Tensor], *, alpha: float, rank: int, fused_out_features: dict[str, list[int]]
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

    def single(source_module: str, target_module: str, transform: object = None) -> None:
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

    for index in sorted({int(m.group(2)) for key in pairs if (m := _BLOCK_KEY.match(key)) and m.group(1) == "transformer_blocks"}):
        here, there = f"transformer_blocks.{index}", f"double_blocks.{index}"
        for name, target in DOUBLE_BLOCK_LINEARS.items():
            single(f"{here}.{name}", f"{there}.{target}")
        for target, names in DOUBLE_BLOCK_FUSED.items():
            fused(tuple(f"{here}.{name}" for name in names), f"{there}.{target}", fused_out_features[target])
    for index in sorted(
        {int(m.group(2)) for key in pairs if (m := _BLOCK_KEY.match(key)) and m.group(1) == "single_transformer_blocks"}
    ):
        here, there = f"single_transformer_blocks.{index}", f"single_blocks.{index}"
        for name, target in SINGLE_BLOCK_LINEARS.items():
            single(f"{here}.{name}", f"{there}.{target}")
        for target, names in SINGLE_BLOCK_FUSED.items():
            fused(tuple(f"{here}.{name}" for name in names), f"{there}.{target}", fused_out_features[target])
    for name, target in TOP_LEVEL_LINEARS.items():
        single(name, target)
    for name, target in SWAPPED_LINEARS.items():
        single(name, target, swap_halves)
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


def diffusers_lora_effects(lora_state_dict: dict[str, torch.Tensor], *, alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """{diffusers module: (B @ A * alpha / rank) @ probe}, as peft changes that layer."""
    return {
        module: up.float() @ (down.float() @ probe(down.shape[1])) * (alpha / rank)
        for module, (down, up) in _lora_pairs(lora_state_dict).items()
    }


def diffusers_effects_as_comfyui(effects: dict[str, torch.Tensor], split_sizes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Effects keyed by diffusers module → keyed by kohya module. The layout conversion only stacks and
    swaps rows, so it applies to effects as to weights; untrained pieces of a fused layer are zero rows."""
    as_weights = {f"{module}.weight": effect for module, effect in effects.items()}
    for key in list(as_weights):
        match = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)\.weight$", key)
        if match is None:
            continue
        fused_table = DOUBLE_BLOCK_FUSED if match.group(1) == "transformer_blocks" else SINGLE_BLOCK_FUSED
        for target, names in fused_table.items():
            if match.group(3) in names:
                for name, rows in zip(names, split_sizes[target], strict=True):
                    sibling = f"{match.group(1)}.{match.group(2)}.{name}.weight"
                    as_weights.setdefault(sibling, torch.zeros(rows, as_weights[key].shape[1]))
    original = diffusers_to_original_transformer(as_weights)
    return {"lora_unet_" + key[: -len(".weight")].replace(".", "_"): value for key, value in original.items()}
