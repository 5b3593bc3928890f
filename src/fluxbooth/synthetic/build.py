"""Build a preset's pipeline on disk, one safetensors shard at a time.

Each large component is constructed on the meta device (no memory), its state dict is split into
shards by module, and each shard's modules alone are materialised on `device`, initialised with the
class's own initialiser, written and dropped again, so the host never holds more than one shard
(plus safetensors' serialisation copy) whatever the model's size. Components whose state dict holds
buffers their constructor fills (CLIP's position ids) are small and built whole.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fluxbooth.synthetic.tiny as tiny
from fluxbooth.models.families import family_named
from fluxbooth.synthetic.chat_tokenizers import mistral_tokenizer, qwen_tokenizer
from fluxbooth.synthetic.presets import Preset
from fluxbooth.synthetic.staging import remove_abandoned_staging, staging_folder
from fluxbooth.synthetic.vocab import full_size_tokenizers

# (library, class, weights file stem) per component, as each family's model_index.json names them.
COMPONENTS: dict[str, tuple[str, str, str]] = {
    "transformer": ("diffusers", "FluxTransformer2DModel", "diffusion_pytorch_model"),
    "vae": ("diffusers", "AutoencoderKL", "diffusion_pytorch_model"),
    "text_encoder": ("transformers", "CLIPTextModel", "model"),
    "text_encoder_2": ("transformers", "T5EncoderModel", "model"),
}
FLUX2_COMPONENTS: dict[str, tuple[str, str, str]] = {
    "transformer": ("diffusers", "Flux2Transformer2DModel", "diffusion_pytorch_model"),
    "vae": ("diffusers", "AutoencoderKLFlux2", "diffusion_pytorch_model"),
    "text_encoder": ("transformers", "Mistral3ForConditionalGeneration", "model"),
}
FLUX2_KLEIN_COMPONENTS: dict[str, tuple[str, str, str]] = {
    **FLUX2_COMPONENTS,
    "text_encoder": ("transformers", "Qwen3ForCausalLM", "model"),
}
FAMILY_COMPONENTS = {
    "flux1": COMPONENTS,
    "flux1-kontext": COMPONENTS,
    "flux2": FLUX2_COMPONENTS,
    "flux2-klein": FLUX2_KLEIN_COMPONENTS,
}
# The transformers config class of each text encoder class.
CONFIG_CLASSES = {
    "CLIPTextModel": "CLIPTextConfig",
    "T5EncoderModel": "T5Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Mistral3ForConditionalGeneration": "Mistral3Config",
}
# Every component gets its own seed stream, so changing one component's shape never changes another's weights.
_SEED_STRIDE = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3}
MARKER_FILE = "fluxbooth_synthetic.json"


@dataclass(frozen=True)
class Shard:
    """The modules (by name) whose own parameters go into one file, and those parameters' names."""

    modules: tuple[str, ...]
    tensors: tuple[str, ...]
    nbytes: int


def text_encoder_configs(preset: Preset, tokenizers: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The text encoders' configs by component; the tiny tokenizers size the tiny encoders' vocabularies."""
    if preset.family.startswith("flux2"):
        return {"text_encoder": _flux2_text_encoder_config(preset, tokenizers)}
    if preset.tokenizers == "tiny":
        clip, t5 = tiny.text_encoder_configs(tokenizers or tiny.build_tokenizers())
        return {
            "text_encoder": {**clip, **preset.text_encoder},
            "text_encoder_2": {**t5, **(preset.text_encoder_2 or {})},
        }
    return {"text_encoder": dict(preset.text_encoder), "text_encoder_2": dict(preset.text_encoder_2 or {})}


def _flux2_text_encoder_config(preset: Preset, tokenizers: dict[str, Any] | None) -> dict[str, Any]:
    """The FLUX.2 text encoder's config; a tiny one's vocabulary and special ids come from its tokenizer."""
    config = dict(preset.text_encoder)
    if preset.tokenizers != "tiny":
        return config
    tokenizer = (tokenizers or build_tokenizers(preset))["tokenizer"]
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if "text_config" in config:
        return {**config, "text_config": {**config["text_config"], **ids}}
    return {**config, **ids}


def component_configs(preset: Preset, tokenizers: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    return {"transformer": preset.transformer, "vae": preset.vae, **text_encoder_configs(preset, tokenizers)}


def construct(component: str, config: dict[str, Any], device: Any, dtype: Any = None, *, family: str = "flux1") -> Any:
    """The family's class for `component` built from `config` under `device` (meta: shapes only, no memory),
    its floating-point tensors created in `dtype` (default: float32)."""
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import diffusers
    import torch
    import transformers

    library, class_name, _ = FAMILY_COMPONENTS[family][component]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            if library == "diffusers":
                # from_config: published configs carry keys no constructor takes (force_upcast).
                return getattr(diffusers, class_name).from_config(config)
            config_class = getattr(transformers, CONFIG_CLASSES[class_name])
            settings = {key: value for key, value in config.items() if key != "torch_dtype"}
            return getattr(transformers, class_name)(config_class(**settings))
    finally:
        torch.set_default_dtype(previous)


def parameter_count(model: Any) -> int:
    """Parameters counted once each (T5's tied input embedding is `shared`)."""
    return sum(parameter.numel() for parameter in model.parameters())


def count_parameters(preset: Preset) -> dict[str, int]:
    """Each component's parameter count, from meta-device models: nothing is allocated."""
    configs = component_configs(preset, _sizing_tokenizers(preset))
    return {
        component: parameter_count(construct(component, configs[component], "meta", family=preset.family))
        for component in FAMILY_COMPONENTS[preset.family]
    }


def _sizing_tokenizers(preset: Preset) -> dict[str, Any] | None:
    """Tiny FLUX.2 encoders are sized by their tokenizers; every other preset's configs are complete."""
    return build_tokenizers(preset) if preset.tokenizers == "tiny" and preset.family.startswith("flux2") else None


def unique_state_names(model: Any) -> list[str]:
    """State-dict names, one per tensor: tied parameters are written once, under their first name."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def plan_shards(model: Any, names: list[str], max_bytes: int, dtype: Any) -> list[Shard]:
    """Split `names` into shards of at most `max_bytes` (a module larger than that gets its own),
    never splitting one module's own parameters between two files."""
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import torch

    state = model.state_dict(keep_vars=True)
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[Shard] = []
    modules: list[str] = []
    tensors: list[str] = []
    size = 0
    for module, module_names in by_module.items():
        module_bytes = sum(state[name].numel() * element for name in module_names)
        if tensors and size + module_bytes > max_bytes:
            shards.append(Shard(tuple(modules), tuple(tensors), size))
            modules, tensors, size = [], [], 0
        modules.append(module)
        tensors.extend(module_names)
        size += module_bytes
    if tensors:
        shards.append(Shard(tuple(modules), tuple(tensors), size))
    return shards


def shard_file_names(stem: str, count: int) -> list[str]:
    """diffusers' and transformers' names: `stem.safetensors`, or `stem-00001-of-00003.safetensors`, ..."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def _materialise(model: Any, modules: tuple[str, ...], device: Any) -> list[Any]:
    owners = [model.get_submodule(name) for name in modules]
    for owner in owners:
        owner.to_empty(device=device, recurse=False)
    return owners


def _initialise(model: Any, owners: list[Any]) -> None:
    """The class's own initialisation, applied where memory now exists (meta tensors ignore it)."""
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import torch

    with torch.no_grad():
        if hasattr(model, "_init_weights"):
            # transformers: the model's initialiser, over every module in the order `post_init` uses.
            model.apply(model._init_weights)
            return
        for owner in owners:
            if hasattr(owner, "reset_parameters"):
                owner.reset_parameters()
                continue
            for name, parameter in owner.named_parameters(recurse=False):
                parameter.fill_(1.0 if name == "weight" else 0.0)


def _release(owners: list[Any]) -> None:
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import torch

    for owner in owners:
        for name, parameter in list(owner._parameters.items()):
            if parameter is not None:
                owner._parameters[name] = torch.nn.Parameter(
                    torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
                )


def _streamable(model: Any) -> bool:
    """Only parameters in the state dict: every tensor can be initialised from its module."""
    parameters = {id(parameter) for parameter in model.parameters()}
    return all(id(tensor) in parameters for tensor in model.state_dict(keep_vars=True).values())


def write_component(
    component: str,
    config: dict[str, Any],
    folder: Path,
    *,
    max_shard_bytes: int,
    dtype_name: str,
    device: str,
    seed: int,
    family: str = "flux1",
) -> dict[str, Any]:
    """Write `folder/config.json` and the weights shard by shard; returns a summary."""
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import torch
    from safetensors.torch import save_file

    library, _, stem = FAMILY_COMPONENTS[family][component]
    dtype = getattr(torch, dtype_name)
    folder.mkdir(parents=True, exist_ok=True)
    model = construct(component, config, "meta", dtype, family=family)
    streaming = _streamable(model)
    if not streaming:
        torch.manual_seed(seed * 1_000_003 + _SEED_STRIDE[component])
        model = construct(component, config, device, dtype, family=family)
    _save_config(model, library, folder, dtype_name)
    names = unique_state_names(model)
    shards = plan_shards(model, names, max_shard_bytes, dtype)
    files = shard_file_names(stem, len(shards))
    weight_map: dict[str, str] = {}
    for index, (shard, file_name) in enumerate(zip(shards, files, strict=True)):
        owners: list[Any] = []
        if streaming:
            torch.manual_seed(seed * 1_000_003 + _SEED_STRIDE[component] * 10_007 + index)
            owners = _materialise(model, shard.modules, device)
            _initialise(model, owners)
        state = model.state_dict(keep_vars=True)
        tensors = {name: state[name].detach().to("cpu").contiguous() for name in shard.tensors}
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        del tensors, state
        weight_map.update({name: file_name for name in shard.tensors})
        _release(owners)
    if len(files) > 1:
        index_document = {"metadata": {"total_size": sum(shard.nbytes for shard in shards)}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(
            json.dumps(index_document, indent=2, sort_keys=True) + "\n"
        )
    return {"parameters": parameter_count(model), "shards": len(files), "bytes": sum(shard.nbytes for shard in shards)}


def _save_config(model: Any, library: str, folder: Path, dtype_name: str) -> None:
    if library == "diffusers":
        model.save_config(folder)
        return
    model.config.dtype = dtype_name
    model.config.save_pretrained(folder)


def _model_index(preset: Preset, tokenizers: dict[str, Any]) -> dict[str, Any]:
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    import diffusers

    family = family_named(preset.family)
    index: dict[str, Any] = {"_class_name": family.pipeline_class, "_diffusers_version": diffusers.__version__}
    if family.name == "flux2-klein":
        index["is_distilled"] = preset.distilled
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    for component, (library, class_name, _) in FAMILY_COMPONENTS[preset.family].items():
        index[component] = [library, class_name]
    for name, tokenizer in tokenizers.items():
        index[name] = ["transformers", type(tokenizer).__name__]
    return dict(sorted(index.items()))


def build_tokenizers(preset: Preset) -> dict[str, Any]:
    """The preset's tokenizers by pipeline component: CLIP and T5 for FLUX.1, one chat tokenizer for FLUX.2."""
    if preset.family.startswith("flux2"):
        full_size = None if preset.tokenizers == "tiny" else _vocabulary_size(preset.text_encoder)
        build = qwen_tokenizer if preset.family == "flux2-klein" else mistral_tokenizer
        return {"tokenizer": build(full_size)}
    if preset.tokenizers == "tiny":
        return tiny.build_tokenizers()
    return full_size_tokenizers()


def _vocabulary_size(config: dict[str, Any]) -> int:
    return int(config.get("text_config", config)["vocab_size"])


def is_complete(folder: Path, description: dict[str, Any]) -> bool:
    marker = folder / MARKER_FILE
    try:
        return json.loads(marker.read_text()) == description
    except (OSError, ValueError):
        return False


def describe(preset: Preset, seed: int) -> dict[str, Any]:
    """What a finished folder was built from; a folder with another description is rebuilt."""
    description = {
        "preset": preset.name,
        "seed": seed,
        "dtype": preset.dtype,
        "transformer": preset.transformer,
        "max_shard_bytes": preset.max_shard_bytes,
    }
    return json.loads(json.dumps(description, sort_keys=True))


def _write_all(preset: Preset, staging: Path, seed: int, device: str) -> None:
    # Deferred: the synthetic package imports without torch (the presets are read by torch-free code).
    from diffusers import FlowMatchEulerDiscreteScheduler

    tokenizers = build_tokenizers(preset)
    configs = component_configs(preset, tokenizers)
    for component in FAMILY_COMPONENTS[preset.family]:
        write_component(
            component,
            configs[component],
            staging / component,
            max_shard_bytes=preset.max_shard_bytes[component],
            dtype_name=preset.dtype,
            device=device,
            seed=seed,
            family=preset.family,
        )
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(staging / name)
    FlowMatchEulerDiscreteScheduler(**preset.scheduler).save_pretrained(staging / "scheduler")
    (staging / "model_index.json").write_text(json.dumps(_model_index(preset, tokenizers), indent=2) + "\n")


def shared_entries(preset: Preset) -> tuple[str, ...]:
    """What a reduced-depth variant links from a built pipeline: everything but the transformer."""
    components = [component for component in FAMILY_COMPONENTS[preset.family] if component != "transformer"]
    tokenizers = ("tokenizer",) if preset.family.startswith("flux2") else ("tokenizer", "tokenizer_2")
    return (*components, *tokenizers, "scheduler", "model_index.json")


def _write_transformer_beside(preset: Preset, staging: Path, seed: int, device: str, shared: Path) -> None:
    """Only the transformer is written; every other component links to `shared`'s (a reduced-depth
    variant of a full-size model needs no second 9.5 GB T5 encoder)."""
    entries = shared_entries(preset)
    missing = [entry for entry in entries if not (shared / entry).exists()]
    if missing:
        raise ValueError(f"--share-encoders-with {shared}: not a complete pipeline folder (missing {missing})")
    write_component(
        "transformer",
        dict(preset.transformer),
        staging / "transformer",
        max_shard_bytes=preset.max_shard_bytes["transformer"],
        dtype_name=preset.dtype,
        device=device,
        seed=seed,
        family=preset.family,
    )
    for entry in entries:
        (staging / entry).symlink_to(shared.absolute() / entry)


def build_pipeline(
    preset: Preset, out_dir: Path, *, seed: int = 0, device: str = "cpu", share_encoders_with: Path | None = None
) -> Path:
    """Write `preset`'s pipeline to `out_dir` (reused when already complete) and return its path.
    With `share_encoders_with`, only the transformer is written and the rest links to that folder.

    Written under a temporary name beside `out_dir` and renamed into place: a reader never sees half
    a pipeline."""
    out_dir = Path(out_dir).absolute()
    description = describe(preset, seed)
    if share_encoders_with is not None:
        description["share_encoders_with"] = str(Path(share_encoders_with).absolute())
    if is_complete(out_dir, description):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(out_dir)
    staging = staging_folder(out_dir)
    try:
        if share_encoders_with is None:
            _write_all(preset, staging, seed, device)
        else:
            _write_transformer_beside(preset, staging, seed, device, Path(share_encoders_with))
        (staging / MARKER_FILE).write_text(json.dumps(description, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
