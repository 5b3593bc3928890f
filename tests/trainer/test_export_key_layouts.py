"""Key-layout conversions of the trainer's exports, checked against diffusers' own converters at the
real FLUX.1 shapes (3072 hidden, 12288 MLP), with only a few blocks so they stay small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fluxbooth.train.export.key_layouts import (
    comfyui_lora_effects,
    diffusers_effects_as_comfyui,
    diffusers_lora_effects,
    diffusers_lora_to_comfyui,
    diffusers_to_original_transformer,
    fused_split_sizes,
    original_to_diffusers_transformer,
    probe,
)

FLUX_DEV_CONFIG = {"num_attention_heads": 24, "attention_head_dim": 128}
INNER, MLP = 3072, 12288

# One double block, one single block and the top-level layers, with FLUX.1-dev's (in, out) sizes.
LORA_MODULES = {
    "transformer_blocks.0.attn.to_q": (INNER, INNER),
    "transformer_blocks.0.attn.to_k": (INNER, INNER),
    "transformer_blocks.0.attn.to_v": (INNER, INNER),
    "transformer_blocks.0.attn.to_out.0": (INNER, INNER),
    "transformer_blocks.0.attn.add_q_proj": (INNER, INNER),
    "transformer_blocks.0.attn.add_k_proj": (INNER, INNER),
    "transformer_blocks.0.attn.add_v_proj": (INNER, INNER),
    "transformer_blocks.0.attn.to_add_out": (INNER, INNER),
    "transformer_blocks.0.ff.net.0.proj": (INNER, MLP),
    "transformer_blocks.0.ff.net.2": (MLP, INNER),
    "transformer_blocks.0.ff_context.net.0.proj": (INNER, MLP),
    "transformer_blocks.0.ff_context.net.2": (MLP, INNER),
    "single_transformer_blocks.0.attn.to_q": (INNER, INNER),
    "single_transformer_blocks.0.attn.to_k": (INNER, INNER),
    "single_transformer_blocks.0.attn.to_v": (INNER, INNER),
    "single_transformer_blocks.0.proj_mlp": (INNER, MLP),
    "single_transformer_blocks.0.proj_out": (INNER + MLP, INNER),
    "proj_out": (INNER, 64),
}


def fake_lora(modules: dict[str, tuple[int, int]], rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for module, (in_features, out_features) in modules.items():
        state[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / rank
        state[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) / 10
    return state


def diffusers_reading_of(comfyui: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What diffusers' `load_lora_weights` makes of a kohya-format file (its own converter)."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    return _convert_kohya_flux_lora_to_diffusers({key: value.clone() for key, value in comfyui.items()})


def test_comfyui_lora_uses_kohya_unet_names_with_fused_qkv() -> None:
    converted = diffusers_lora_to_comfyui(
        fake_lora(LORA_MODULES, rank=2), alpha=2.0, rank=2, fused_out_features=fused_split_sizes(FLUX_DEV_CONFIG)
    )
    names = {key.split(".")[0] for key in converted}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names
    assert "lora_unet_double_blocks_0_txt_attn_qkv" in names
    assert "lora_unet_single_blocks_0_linear1" in names
    assert "lora_unet_final_layer_linear" in names
    assert all(key.startswith("lora_unet_") for key in converted)
    assert converted["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (3 * INNER, 3 * 2)


@pytest.mark.parametrize(("rank", "alpha"), [(2, 2.0), (4, 16.0)])
def test_diffusers_reads_the_comfyui_lora_back_to_the_same_weight_changes(rank: int, alpha: float) -> None:
    lora = fake_lora(LORA_MODULES, rank=rank)
    converted = diffusers_lora_to_comfyui(
        lora, alpha=alpha, rank=rank, fused_out_features=fused_split_sizes(FLUX_DEV_CONFIG)
    )

    read_back = diffusers_reading_of(converted)

    # diffusers folds alpha/rank into lora_A and loads with scale 1, so B @ A is the whole change. (Its
    # converter leaves the final layer's keys without the "transformer." prefix; the loader adds it.)
    read_back = {key.removeprefix("transformer."): value for key, value in read_back.items()}
    expected = diffusers_lora_effects(lora, alpha=alpha, rank=rank)
    assert {key[: -len(".lora_A.weight")] for key in read_back if key.endswith(".lora_A.weight")} == set(expected)
    for module, effect in expected.items():
        a, b = read_back[f"{module}.lora_A.weight"], read_back[f"{module}.lora_B.weight"]
        assert torch.allclose(b.float() @ (a.float() @ probe(a.shape[1])), effect, atol=1e-4), module


def test_comfyui_effects_equal_the_trained_effects_stacked_for_fused_layers() -> None:
    lora = fake_lora(LORA_MODULES, rank=2)
    converted = diffusers_lora_to_comfyui(
        lora, alpha=4.0, rank=2, fused_out_features=fused_split_sizes(FLUX_DEV_CONFIG)
    )
    effects = comfyui_lora_effects(converted)
    trained = diffusers_lora_effects(lora, alpha=4.0, rank=2)
    qkv = torch.cat([trained[f"transformer_blocks.0.attn.to_{name}"] for name in "qkv"])
    assert torch.allclose(effects["lora_unet_double_blocks_0_img_attn_qkv"], qkv, atol=1e-5)
    assert effects.keys() == diffusers_effects_as_comfyui(trained, fused_split_sizes(FLUX_DEV_CONFIG)).keys()


def test_untrained_pieces_of_a_fused_layer_change_nothing() -> None:
    only_q = {name: shape for name, shape in LORA_MODULES.items() if name == "transformer_blocks.0.attn.to_q"}
    converted = diffusers_lora_to_comfyui(
        fake_lora(only_q, rank=2), alpha=2.0, rank=2, fused_out_features=fused_split_sizes(FLUX_DEV_CONFIG)
    )
    effect = comfyui_lora_effects(converted)["lora_unet_double_blocks_0_img_attn_qkv"]
    assert effect[INNER:].abs().max() == 0
    assert effect[:INNER].abs().max() > 0


def test_single_file_layout_matches_diffusers_single_file_converter() -> None:
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    # FLUX.1-dev's widths with one block of each kind, on the meta device: shapes without memory.
    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    state = model.state_dict()

    original = diffusers_to_original_transformer(state)
    back = convert_flux_transformer_checkpoint_to_diffusers(dict(original))

    assert {key: tuple(value.shape) for key, value in back.items()} == {
        key: tuple(value.shape) for key, value in state.items()
    }


def test_single_file_round_trip_is_exact() -> None:
    from diffusers import FluxTransformer2DModel

    config = {
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "in_channels": 64,
        "guidance_embeds": True,
        "axes_dims_rope": (4, 6, 6),
    }
    torch.manual_seed(0)
    state = FluxTransformer2DModel(**config).state_dict()

    back = original_to_diffusers_transformer(diffusers_to_original_transformer(state), fused_split_sizes(config))

    assert set(back) == set(state)
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_final_layer_modulation_is_stored_shift_first() -> None:
    scale, shift = torch.ones(4, 2), torch.zeros(4, 2)
    original = diffusers_to_original_transformer({"norm_out.linear.weight": torch.cat([scale, shift])})
    assert torch.equal(original["final_layer.adaLN_modulation.1.weight"], torch.cat([shift, scale]))


# --- the diffusers-format LoRA file, read by diffusers and by ComfyUI ------------------------------


def comfyui_change_from_diffusers_format(file_state: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The weight change ComfyUI applies for a diffusers-format key (comfy/weight_adapter/lora.py, the
    `lora_B`/`lora_A` branch): up @ down scaled by `<key>.alpha` / rank when that tensor exists, else by 1."""
    key = f"transformer.{module}"
    up, down = file_state[f"{key}.lora_B.weight"].float(), file_state[f"{key}.lora_A.weight"].float()
    alpha = file_state.get(f"{key}.alpha")
    scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
    return scale * (up @ down)


def test_diffusers_format_lora_changes_each_layer_equally_in_diffusers_and_comfyui_when_alpha_is_not_rank(
    tiny_base: Path, tmp_path: Path
) -> None:
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from fluxbooth.train.export.lora import LORA_WEIGHTS_NAME, save_lora_diffusers

    pipeline = FluxPipeline.from_pretrained(tiny_base, torch_dtype=torch.float32)
    transformer = pipeline.transformer
    modules = [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.ff.net.2",
        "single_transformer_blocks.0.proj_mlp",
    ]
    layers = {module: transformer.get_submodule(module) for module in modules}
    shapes = {module: (layer.in_features, layer.out_features) for module, layer in layers.items()}
    rank, alpha = 4, 16.0
    save_lora_diffusers(fake_lora(shapes, rank), tmp_path, alpha, {"format": "pt"})
    base_weights = {module: layer.weight.detach().clone() for module, layer in layers.items()}

    pipeline.load_lora_weights(str(tmp_path), weight_name=LORA_WEIGHTS_NAME)
    pipeline.fuse_lora()
    file_state = load_file(str(tmp_path / LORA_WEIGHTS_NAME))
    for module in modules:
        diffusers_change = transformer.get_submodule(module).weight.detach() - base_weights[module]
        comfyui_change = comfyui_change_from_diffusers_format(file_state, module)
        assert torch.allclose(diffusers_change, comfyui_change, atol=1e-5), module
        assert float(comfyui_change.abs().max()) > 0
