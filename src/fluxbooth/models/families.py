"""The FLUX model families fluxbooth trains, and which one a diffusers folder holds.

A family is read from the model's own files before anything else runs: `model_index.json` names the
diffusers pipeline class (FluxPipeline, FluxKontextPipeline, Flux2Pipeline, Flux2KleinPipeline); a
folder holding only a transformer is told by its `transformer/config.json` class. Every stage asks the
family what differs (the pipeline folders and their classes, the text encoders, the LoRA targets, the
sampling defaults, whether training images come in pairs) and nothing else branches on the model.

FLUX.1 [dev], [schnell] and Krea [dev] share FLUX.1's layout: schnell is told apart by its transformer
(no guidance embedding) and sampled as timestep-distilled; Krea ships FLUX.1-dev's configs unchanged
(the same classes and sizes), so it is trained and sampled as FLUX.1-dev.

No torch here: the handler process reads families too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fluxbooth.contract.names import DEFAULT_LORA_TARGET_MODULES, SamplingDefaults
from fluxbooth.contract.names import sampling_defaults as flux1_sampling_defaults
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.jsonfiles import JSONBoundError, read_json_file

# The file kinds of a diffusers pipeline's component folders (tokenizers add merges.txt, sentencepiece
# models and chat templates). Anything else in a repository (single-file checkpoints, sample images) is
# never downloaded.
PIPELINE_FILE_KINDS = ("json", "safetensors", "txt", "model", "jinja")

# FLUX.1 Kontext [dev]'s pipeline defaults (FluxKontextPipeline.__call__ in diffusers 0.42.1).
KONTEXT_SAMPLING = SamplingDefaults(max_sequence_length=512, inference_steps=28, guidance_scale=3.5)
# FLUX.2 [dev] is guidance-distilled and sampled in 50 steps at guidance 4 (Flux2Pipeline.__call__);
# FLUX.2 [klein]'s distilled checkpoints are step-distilled (4 steps, guidance ignored) and its base
# checkpoints are sampled like [dev] with true classifier-free guidance (Flux2KleinPipeline's docs).
FLUX2_SAMPLING = SamplingDefaults(max_sequence_length=512, inference_steps=50, guidance_scale=4.0)
FLUX2_DISTILLED_SAMPLING = SamplingDefaults(max_sequence_length=512, inference_steps=4, guidance_scale=1.0)

# diffusers' FLUX.1 Kontext LoRA script's default targets (train_dreambooth_lora_flux_kontext.py).
KONTEXT_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
)
# diffusers' FLUX.2 LoRA scripts' defaults (train_dreambooth_lora_flux2.py, ..._flux2_klein.py): the double
# blocks' attention projections, the single blocks' fused qkv+mlp input, and each single block's output
# projection by its full name ("attn.to_out" alone would also name the double blocks' to_out ModuleList,
# which peft cannot adapt). The scripts list single blocks 0-23; every single block is listed here.
FLUX2_LORA_BLOCK_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")


# Model spec ids of the families sd-scripts has none for, spelled as its FLUX.1 ones ("flux-1-dev").
MODELSPEC_ARCHITECTURES = {"flux1-kontext": "flux-1-kontext-dev", "flux2": "flux-2-dev", "flux2-klein": "flux-2-klein"}


@dataclass(frozen=True)
class Family:
    """What differs between the FLUX families, as data."""

    name: str  # the family's key: "flux1", "flux1-kontext", "flux2", "flux2-klein"
    title: str  # for messages
    pipeline_class: str  # diffusers pipeline class, as model_index.json names it
    transformer_class: str
    vae_class: str
    text_encoders: tuple[str, ...]  # pipeline components holding text encoders, in order
    tokenizers: tuple[str, ...]
    control_images: bool = False  # trains on (control, target) image pairs when the dataset has them

    @property
    def weight_folders(self) -> tuple[str, ...]:
        return ("transformer", "vae", *self.text_encoders)

    @property
    def pipeline_folders(self) -> tuple[str, ...]:
        return ("scheduler", *self.tokenizers, *self.weight_folders)

    @property
    def required_files(self) -> tuple[str, ...]:
        """The configs a complete folder of this family has (weights are checked per folder)."""
        return (
            "model_index.json",
            "scheduler/scheduler_config.json",
            "transformer/config.json",
            "vae/config.json",
        ) + tuple(f"{folder}/config.json" for folder in self.text_encoders)

    @property
    def is_flux2(self) -> bool:
        return self.transformer_class == "Flux2Transformer2DModel"

    def default_lora_targets(self, transformer_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The layers LoRA adapts when a request names none: diffusers' LoRA script's set for the family."""
        if self.name == "flux1-kontext":
            return KONTEXT_LORA_TARGETS
        if self.is_flux2:
            singles = int(transformer_config.get("num_single_layers", 0))
            return FLUX2_LORA_BLOCK_TARGETS + tuple(
                f"single_transformer_blocks.{index}.attn.to_out" for index in range(singles)
            )
        return DEFAULT_LORA_TARGET_MODULES

    def sampling_defaults(
        self, transformer_config: Mapping[str, Any], model_index: Mapping[str, Any]
    ) -> SamplingDefaults:
        """How this model is prompted and sampled when the request leaves it open, from its own files."""
        if self.name == "flux1-kontext":
            return KONTEXT_SAMPLING
        if self.name == "flux2":
            return FLUX2_SAMPLING
        if self.name == "flux2-klein":
            return FLUX2_DISTILLED_SAMPLING if model_index.get("is_distilled", False) else FLUX2_SAMPLING
        # FLUX.1-dev and Krea embed the guidance scale; schnell is timestep-distilled (no guidance embedding).
        return flux1_sampling_defaults(dict(transformer_config))

    def modelspec_architecture(self, transformer_config: Mapping[str, Any]) -> str:
        """The base model's id in the Stability AI model spec, which every exported file's metadata names
        (`modelspec.architecture`): FLUX.1's as kohya's sd-scripts writes them, the others after them."""
        if self.name == "flux1":
            return "flux-1-dev" if transformer_config.get("guidance_embeds", True) else "flux-1-schnell"
        return MODELSPEC_ARCHITECTURES[self.name]

    @property
    def kohya_base_model_version(self) -> str:
        """kohya's `ss_base_model_version` (sd-scripts writes "flux1" for every FLUX.1 model)."""
        return "flux2" if self.is_flux2 else "flux1"


FLUX1 = Family(
    name="flux1",
    title="FLUX.1 [dev], [schnell] and Krea [dev] (FluxPipeline)",
    pipeline_class="FluxPipeline",
    transformer_class="FluxTransformer2DModel",
    vae_class="AutoencoderKL",
    text_encoders=("text_encoder", "text_encoder_2"),
    tokenizers=("tokenizer", "tokenizer_2"),
)
FLUX1_KONTEXT = replace(
    FLUX1,
    name="flux1-kontext",
    title="FLUX.1 Kontext [dev] (FluxKontextPipeline)",
    pipeline_class="FluxKontextPipeline",
    control_images=True,
)
FLUX2 = Family(
    name="flux2",
    title="FLUX.2 [dev] (Flux2Pipeline)",
    pipeline_class="Flux2Pipeline",
    transformer_class="Flux2Transformer2DModel",
    vae_class="AutoencoderKLFlux2",
    text_encoders=("text_encoder",),
    tokenizers=("tokenizer",),
)
FLUX2_KLEIN = replace(
    FLUX2,
    name="flux2-klein",
    title="FLUX.2 [klein] 4B and 9B (Flux2KleinPipeline)",
    pipeline_class="Flux2KleinPipeline",
)
FAMILIES: tuple[Family, ...] = (FLUX1, FLUX1_KONTEXT, FLUX2, FLUX2_KLEIN)
# Every folder any family's pipeline has: what a download fetches (a family's absent folders match nothing).
ALL_PIPELINE_FOLDERS: tuple[str, ...] = tuple(
    dict.fromkeys(folder for family in FAMILIES for folder in family.pipeline_folders)
)


def supported_families() -> str:
    return "; ".join(family.title for family in FAMILIES)


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown family {name!r}; one of {[family.name for family in FAMILIES]}")


def unreadable_config(path: Path, error: Exception) -> FluxboothError:
    """A model file that is not JSON the worker reads (malformed, too large, nested too deep)."""
    why = str(error) if isinstance(error, JSONBoundError) else f"not readable JSON ({error.__class__.__name__})"
    return FluxboothError(ErrorCode.INVALID_INPUT, f"base_model: {path} is {why}; give a diffusers FLUX model")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise unreadable_config(path, error) from None
    return data if isinstance(data, dict) else {}


def read_model_index(folder: Path) -> dict[str, Any]:
    """`model_index.json` of a pipeline folder, or {} when the folder holds only components."""
    return _read_json(Path(folder) / "model_index.json") or {}


def _unsupported(folder: Path, what: str) -> FluxboothError:
    return FluxboothError(
        ErrorCode.INVALID_INPUT,
        f"base_model: {folder} is {what}; fluxbooth trains these model families: {supported_families()}",
    )


def _family_of_transformer(folder: Path) -> Family:
    """A folder without model_index.json: its transformer's class (FLUX.2 [dev] embeds guidance, [klein] not)."""
    config = _read_json(folder / "transformer" / "config.json")
    if config is None:
        raise _unsupported(folder, "not a diffusers pipeline folder (no model_index.json, no transformer/config.json)")
    class_name = config.get("_class_name")
    if class_name == FLUX2.transformer_class:
        return FLUX2 if config.get("guidance_embeds", True) else FLUX2_KLEIN
    if class_name == FLUX1.transformer_class or (class_name is None and "num_single_layers" in config):
        return FLUX1
    raise FluxboothError(
        ErrorCode.INVALID_INPUT,
        f"base_model: {folder / 'transformer' / 'config.json'} is not a FLUX transformer "
        f"(class {class_name!r}); fluxbooth trains these model families: {supported_families()}",
    )


def default_lora_targets_of(folder: Path) -> tuple[str, ...]:
    """The LoRA targets of a request that names none, for the model in `folder` (its family's, for its config)."""
    return family_of(folder).default_lora_targets(_read_json(Path(folder) / "transformer" / "config.json") or {})


def family_of(folder: Path | str) -> Family:
    """The family of a local diffusers folder, from its model_index.json (else its transformer's config);
    `invalid_input` naming the supported families for anything else."""
    folder = Path(folder)
    index = _read_json(folder / "model_index.json")
    if index is None:
        return _family_of_transformer(folder)
    class_name = index.get("_class_name")
    for family in FAMILIES:
        if family.pipeline_class == class_name:
            return family
    raise _unsupported(folder, f"a {class_name or 'nameless'} pipeline (model_index.json)")


# FLUX.2 [klein]'s undistilled checkpoints: what its trainers steer users to (a LoRA trained on the step-distilled
# checkpoint tends to collapse; one trained on the base applies to either).
KLEIN_BASE_CHECKPOINTS = ("black-forest-labs/FLUX.2-klein-base-4B", "black-forest-labs/FLUX.2-klein-base-9B")


def distilled_base_warning(family: str, model_index: Mapping[str, Any], base_model: str) -> str | None:
    """A warning for a FLUX.2 [klein] job on a step-distilled checkpoint, naming the base checkpoint to train
    instead (docs/families.md); None for any other base."""
    if family != FLUX2_KLEIN.name or not model_index.get("is_distilled", False):
        return None
    size = "9B" if "9b" in base_model.lower() else "4B"
    base = next(checkpoint for checkpoint in KLEIN_BASE_CHECKPOINTS if checkpoint.endswith(size))
    return (
        f"base_model: {base_model} is a step-distilled FLUX.2 [klein] checkpoint (model_index.json is_distilled); "
        f"LoRAs trained on a distilled checkpoint tend to collapse or lose its few-step sampling: train on {base} "
        "instead, and use the LoRA with either"
    )
