"""The LoRA's files: the diffusers/peft format and the kohya/ComfyUI format, each checked by reading it
back the way its users' loaders do.

`lora_state_dict` is *collective*: every rank calls it (ZeRO-3 gathers the partitioned LoRA
parameters with collectives); only the main process writes files.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.train.export.key_layouts import (
    FLUX1_TABLES,
    KeyTables,
    comfyui_lora_effects,
    diffusers_effects_as_comfyui,
    diffusers_lora_effects,
    diffusers_lora_to_comfyui,
    fused_split_sizes,
)
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.family_ops import FLUX1_LORA_FILE, LoraFileFormat
from fluxbooth.train.state import gathered

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def lora_state_dict(model: Any, *, is_main_process: bool) -> dict[str, torch.Tensor]:
    """*Collective.* The peft LoRA weights of `model` (unwrapped, possibly ZeRO-3 partitioned), with
    diffusers' module keys: no `module.` prefix from DeepSpeed, no `.default` adapter name from peft.
    Only the LoRA parameters are gathered, never the frozen base."""
    lora_parameters = [parameter for name, parameter in model.named_parameters() if ".lora_" in name]
    state: dict[str, torch.Tensor] = {}
    with gathered(lora_parameters):
        if is_main_process:
            state = {
                key: value.detach().to("cpu", copy=True).contiguous()
                for key, value in get_peft_model_state_dict(model).items()
            }
    if is_main_process:
        bad = [key for key in state if key.startswith("module.") or ".default" in key or "lora_" not in key]
        if bad or not state:
            raise TrainerFailure("export_failed", f"LoRA state dict has unexpected keys, e.g. {bad[:3]}")
    return state


def save_lora_diffusers(
    state: dict[str, torch.Tensor],
    out_dir: Path,
    alpha: float,
    metadata: dict[str, str],
    lora_file: LoraFileFormat = FLUX1_LORA_FILE,
) -> Path:
    """diffusers/peft format (`transformer.<module>.lora_A.weight`, ...) written by the model generation's
    pipeline class, with alpha where its loader reads it (`lora_file`, family_ops.LoraFileFormat: FLUX.1's
    loader and ComfyUI read a `transformer.<module>.alpha` tensor beside each module; FLUX.2's, adapter metadata). `metadata` (the
    file's own description) goes in through our save function; diffusers' default one writes only "format".
    Checked by parsing it back with that pipeline's own `lora_state_dict`."""
    tensors, adapter_metadata = lora_file.contents(state, alpha)
    lora_file.pipeline_class.save_lora_weights(
        str(out_dir),
        transformer_lora_layers=tensors,
        safe_serialization=True,
        save_function=partial(save_file, metadata={**metadata, **adapter_metadata}),
    )
    path = out_dir / LORA_WEIGHTS_NAME
    try:
        parsed_state, parsed_alphas = lora_file.read(out_dir, LORA_WEIGHTS_NAME)
    except Exception as error:  # whatever diffusers raises, the export is unusable
        raise TrainerFailure("export_failed", f"{path.name} does not parse in diffusers: {error}") from error
    expected = {f"transformer.{key}": value for key, value in state.items()}
    if set(parsed_state) != set(expected) or any(not torch.equal(parsed_state[key], expected[key]) for key in expected):
        raise TrainerFailure("export_failed", f"{path.name} does not read back as the trained LoRA weights")
    modules = {key.rsplit(".lora_", 1)[0] for key in expected}
    if parsed_alphas != dict.fromkeys(modules, float(alpha)):
        raise TrainerFailure("export_failed", f"{path.name} does not read back with alpha {alpha} for every module")
    return path


def save_lora_comfyui(
    state: dict[str, torch.Tensor],
    out_file: Path,
    settings: LoraSettings,
    transformer_config: dict[str, Any],
    metadata: dict[str, str],
    tables: KeyTables = FLUX1_TABLES,
) -> Path:
    """kohya/ComfyUI format over the original (BFL) module names of the model's family, `tables`
    (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, ...): ComfyUI maps `lora_unet_` + every
    weight of the model it loaded, dots as underscores, whatever the model. Checked by recomputing every
    module's change from the file and comparing it with the trained adapter's."""
    split_sizes = fused_split_sizes(transformer_config)
    converted = diffusers_lora_to_comfyui(
        state, alpha=settings.alpha, rank=settings.rank, fused_out_features=split_sizes, tables=tables
    )
    save_file(converted, str(out_file), metadata=metadata)
    file_effects = comfyui_lora_effects(load_file(str(out_file)))
    trained = diffusers_effects_as_comfyui(
        diffusers_lora_effects(state, alpha=settings.alpha, rank=settings.rank), split_sizes, tables
    )
    if set(file_effects) != set(trained):
        raise TrainerFailure("export_failed", f"{out_file.name} has different modules than the trained LoRA")
    for name, effect in trained.items():
        tolerance = 1e-5 + 2e-3 * float(effect.abs().max())
        if not torch.allclose(file_effects[name], effect, rtol=2e-3, atol=tolerance):
            raise TrainerFailure("export_failed", f"{out_file.name} changes {name} differently from the trained LoRA")
    return out_file
