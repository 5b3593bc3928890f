"""What the trainer does differently per model family (fluxbooth.models.families), in one place: which diffusers
classes load the model, how prompts are encoded, how VAE latents are normalised and laid out for the
transformer, what the transformer is called with, and how a render is asked for from cached embeddings.

Each objective follows diffusers' DreamBooth LoRA script for the family:
- FLUX.1 (train_dreambooth_lora_flux.py): latents sampled from the VAE posterior, shifted and scaled, packed
  into 2x2 patches with 3-axis position ids; CLIP's pooled and T5's sequence embeddings;
- FLUX.1 Kontext (train_dreambooth_lora_flux_kontext.py): the same, with the control image's latents packed
  after the target's (position ids with first axis 1), and the prediction cut back to the target's tokens;
- FLUX.2 [dev] and [klein] (train_dreambooth_lora_flux2.py, ..._flux2_klein.py): the posterior's mode,
  patchified to 4x the channels and normalised by the VAE's batch-norm statistics, packed as one token per
  patch with 4-axis (t, h, w, l) position ids; the text encoder's stacked hidden states as the sequence;
  guidance embedded only by models that embed it ([dev]).
Every stage reaches these through the session's base model (train.base_model), resolved once; nothing else
branches on the family.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import Flux2Pipeline, FluxPipeline
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from safetensors import safe_open
from transformers import AutoTokenizer

from fluxbooth.models.families import Family, read_model_index
from fluxbooth.train.export.key_layouts import FLUX1_TABLES, FLUX2_TABLES


@dataclass(frozen=True)
class VaeNormalisation:
    """FLUX's latent normalisation: (latent - shift) * scale."""

    shift_factor: float
    scaling_factor: float

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.shift_factor) * self.scaling_factor


@dataclass(frozen=True)
class PatchedBatchNorm:
    """FLUX.2's: 2x2 patches stacked into channels ([B, C, h, w] -> [B, 4C, h/2, w/2]), then normalised by
    the VAE's batch-norm running statistics, as Flux2Pipeline._encode_vae_image does."""

    mean: torch.Tensor  # [4C]
    std: torch.Tensor  # [4C]: sqrt(running_var + eps)

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        patched = Flux2Pipeline._patchify_latents(latents)
        return (patched - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)


def _vae_tensors(folder: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Named tensors of the VAE's weights, read from its safetensors without building the model."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted((folder / "vae").glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            found.update({name: handle.get_tensor(name).float() for name in names if name in handle.keys()})
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{folder / 'vae'} has no {missing}")
    return found


@dataclass(frozen=True)
class LoraFileFormat:
    """The diffusers-format LoRA file of a model generation, written and read by its pipeline's LoRA loader.
    FLUX.1's loader (FLUX.1 and Kontext pipelines) reads each module's alpha from a `<module>.alpha` tensor
    (network alphas), which ComfyUI reads too; FLUX.2's takes no alpha tensors (every key must name a LoRA
    weight) and builds its adapter from diffusers' adapter metadata, as diffusers' FLUX.2 scripts save it."""

    pipeline_class_name: str
    alpha_in_metadata: bool

    @property
    def pipeline_class(self) -> Any:
        return getattr(diffusers, self.pipeline_class_name)

    def contents(self, state: dict[str, torch.Tensor], alpha: float) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, extra safetensors metadata) of the file for the LoRA `state` (peft keys)."""
        modules = sorted({key.rsplit(".lora_", 1)[0] for key in state})
        if not self.alpha_in_metadata:
            return {**state, **{f"{module}.alpha": torch.tensor(float(alpha)) for module in modules}}, {}
        rank = next(int(value.shape[0]) for key, value in state.items() if key.endswith("lora_A.weight"))
        adapter = {"r": rank, "lora_alpha": float(alpha), "target_modules": modules}
        prefixed = {f"transformer.{key}": value for key, value in adapter.items()}
        return dict(state), {LORA_ADAPTER_METADATA_KEY: json.dumps(prefixed, indent=2, sort_keys=True)}

    def read(self, folder: Path, weight_name: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(tensors as diffusers' loader parses them, alpha per module) of a written file."""
        if not self.alpha_in_metadata:
            state, alphas = self.pipeline_class.lora_state_dict(
                str(folder), weight_name=weight_name, return_alphas=True
            )
            return state, {key.removesuffix(".alpha"): float(value) for key, value in (alphas or {}).items()}
        state, metadata = self.pipeline_class.lora_state_dict(
            str(folder), weight_name=weight_name, return_lora_metadata=True
        )
        alpha = (metadata or {}).get("transformer.lora_alpha")
        modules = {key.rsplit(".lora_", 1)[0] for key in state}
        return state, ({} if alpha is None else dict.fromkeys(modules, float(alpha)))


FLUX1_LORA_FILE = LoraFileFormat("FluxPipeline", alpha_in_metadata=False)
FLUX2_LORA_FILE = LoraFileFormat("Flux2Pipeline", alpha_in_metadata=True)


class FamilyOps:
    """FLUX.1 [dev], [schnell], Krea [dev]: FluxPipeline's layout."""

    # Whether each step draws a fresh sample from the VAE posterior (diffusers' FLUX.1 script) or takes its mode.
    samples_posterior = True

    def __init__(self, family: Family, folder: Path) -> None:
        self.family = family
        self.folder = folder
        self.model_index = read_model_index(folder)

    # ---- classes --------------------------------------------------------------------------------------

    @property
    def transformer_class(self) -> Any:
        return getattr(diffusers, self.family.transformer_class)

    @property
    def pipeline_class(self) -> Any:
        return getattr(diffusers, self.family.pipeline_class)

    @property
    def vae_class(self) -> Any:
        return getattr(diffusers, self.family.vae_class)

    def transformer_config(self) -> dict[str, Any]:
        return dict(self.transformer_class.load_config(str(self.folder), subfolder="transformer"))

    # ---- prompts --------------------------------------------------------------------------------------

    def pipeline(self, dtype: torch.dtype, **components: Any) -> Any:
        """The family's pipeline from the base model's folder, `components` replacing its own."""
        return self.pipeline_class.from_pretrained(
            str(self.folder), torch_dtype=dtype, **self._tokenizers(), **components
        )

    def _tokenizers(self) -> dict[str, Any]:
        """Tokenizers loaded here rather than by the pipeline (none: the pipeline loads its own)."""
        return {}

    def text_pipeline(self, dtype: torch.dtype) -> Any:
        """The family's pipeline with only its text encoders and tokenizers loaded."""
        return self.pipeline(dtype, transformer=None, vae=None)

    def text_encoders(self, pipeline: Any) -> list[Any]:
        return [getattr(pipeline, name) for name in self.family.text_encoders]

    def encode(
        self, pipeline: Any, prompts: list[str], device: torch.device, max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence embeddings [P, L, D], pooled embeddings [P, D]) on the CPU."""
        prompt_embeds, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=prompts, device=device, max_sequence_length=max_sequence_length
        )
        return prompt_embeds.to("cpu"), pooled.to("cpu")

    # ---- latents --------------------------------------------------------------------------------------

    def load_vae(self, dtype: torch.dtype) -> Any:
        return self.vae_class.from_pretrained(str(self.folder), subfolder="vae", torch_dtype=dtype).eval()

    def latent_normalisation(self) -> Any:
        """FLUX.1's: (latent - shift) * scale, from the VAE's config."""
        config = self.vae_class.load_config(str(self.folder), subfolder="vae")
        return VaeNormalisation(float(config.get("shift_factor") or 0.0), float(config["scaling_factor"]))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents [B, C, h, w] -> tokens [B, h/2 * w/2, 4C]."""
        batch, channels, height, width = latents.shape
        return FluxPipeline._pack_latents(latents, batch, channels, height, width)

    def image_ids(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        batch, _, height, width = latents.shape
        return FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, device, dtype)

    def control_tokens(
        self, control: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, position ids) of normalised control latents, packed after the target's tokens. Only a family
        that trains on image pairs (Family.control_images: Kontext) has them; cache._paired drops the pairs of
        any other, so reaching this is a bug."""
        raise NotImplementedError(f"{self.family.name} does not train on control images")

    def unpack(self, prediction: torch.Tensor, latent_shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Tokens [B, h/2 * w/2, 4C] -> [B, C, h, w] (the inverse of `pack`)."""
        batch, channels, height, width = latent_shape
        prediction = prediction.view(batch, height // 2, width // 2, channels, 2, 2)
        return prediction.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)

    # ---- the transformer ------------------------------------------------------------------------------

    def transformer_inputs(
        self, inputs: Any, batch: dict[str, Any], device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        """Keyword arguments of the transformer's forward for one micro-batch (`inputs`: flow.FlowInputs)."""
        prompt_embeds = batch["prompt_embeds"].to(device=device, dtype=dtype)
        return {
            "hidden_states": inputs.hidden_states,
            "timestep": inputs.timestep,
            "guidance": inputs.guidance,
            "pooled_projections": batch["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_hidden_states": prompt_embeds,
            "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
            "img_ids": inputs.img_ids,
            "return_dict": False,
        }

    # ---- the diffusers LoRA file and the original (BFL) key layout -------------------------------------

    @property
    def key_tables(self) -> Any:
        """diffusers -> original module names, for ComfyUI's LoRA files and the single-file export."""
        return FLUX2_TABLES if self.family.is_flux2 else FLUX1_TABLES

    @property
    def lora_file(self) -> LoraFileFormat:
        return FLUX2_LORA_FILE if self.family.is_flux2 else FLUX1_LORA_FILE

    # ---- rendering ------------------------------------------------------------------------------------

    def no_text_encoders(self) -> dict[str, None]:
        """Pipeline components left out when prompts come embedded."""
        return dict.fromkeys((*self.family.text_encoders, *self.family.tokenizers))

    def pipeline_on(self, device: torch.device, **components: Any) -> Any:
        """The family's pipeline around given components, computing on `device` whatever its modules' parameters
        say: under ZeRO-3 those are empty partitions that may sit on the CPU (offload) while the forward gathers
        them on the accelerator."""

        # mypy takes a base class only by name, not from an expression (the family's diffusers class).
        class PipelineOnDevice(self.pipeline_class):  # type: ignore[name-defined]
            @property
            def _execution_device(self) -> torch.device:
                return device

        extra = (
            {"is_distilled": bool(self.model_index.get("is_distilled", False))}
            if self.family.name == "flux2-klein"
            else {}
        )
        return PipelineOnDevice(**self.no_text_encoders(), **components, **extra)

    def needs_negative_prompt(self, guidance_scale: float) -> bool:
        """Whether a render at `guidance_scale` runs true classifier-free guidance (an empty-prompt pass)."""
        return False

    def render_arguments(
        self, embeds: torch.Tensor, pooled: torch.Tensor, negative: torch.Tensor | None, control: Any
    ) -> dict[str, Any]:
        """The pipeline call's prompt (and control image) arguments from cached embeddings on the device."""
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def size_arguments(self, size: tuple[int, int]) -> dict[str, Any]:
        """The pipeline call's arguments for a render of `size` (width, height)."""
        width, height = size
        return {"width": width, "height": height}


class KontextOps(FamilyOps):
    """FLUX.1 Kontext [dev]: FLUX.1's layout, with the control image's tokens after the target's."""

    samples_posterior = False  # the Kontext script's default --vae_encode_mode "mode"

    def control_tokens(
        self, control: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, position ids) of normalised control latents: the ids' first axis is 1, the target's 0."""
        ids = self.image_ids(control, device, dtype)
        ids[..., 0] = 1
        return self.pack(control), ids

    def render_arguments(
        self, embeds: torch.Tensor, pooled: torch.Tensor, negative: torch.Tensor | None, control: Any
    ) -> dict[str, Any]:
        arguments = super().render_arguments(embeds, pooled, negative, control)
        if control is not None:
            # The control image at the requested size, not resized to Kontext's preferred resolutions.
            arguments.update(image=control, _auto_resize=False)
        return arguments

    def size_arguments(self, size: tuple[int, int]) -> dict[str, Any]:
        # FluxKontextPipeline rescales every render to `max_area` pixels: the requested size is kept instead.
        return {**super().size_arguments(size), "max_area": size[0] * size[1]}


class Flux2Ops(FamilyOps):
    """FLUX.2 [dev]: one Mistral-Small-3 text encoder, 128-channel patched latents, 4-axis position ids."""

    samples_posterior = False

    def _tokenizers(self) -> dict[str, Any]:
        """[dev] names a PixtralProcessor as its tokenizer, whose image half needs torchvision; text prompts
        need only its tokenizer (the processor's chat template is the tokenizer's), loaded on its own."""
        return {"tokenizer": AutoTokenizer.from_pretrained(str(self.folder / "tokenizer"))}

    def encode(
        self, pipeline: Any, prompts: list[str], device: torch.device, max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_embeds, _ = pipeline.encode_prompt(
            prompt=prompts, device=device, max_sequence_length=max_sequence_length
        )
        return prompt_embeds.to("cpu"), prompt_embeds.new_zeros((prompt_embeds.shape[0], 0)).to("cpu")

    def latent_normalisation(self) -> Any:
        config = self.vae_class.load_config(str(self.folder), subfolder="vae")
        stats = _vae_tensors(self.folder, ("bn.running_mean", "bn.running_var"))
        std = torch.sqrt(stats["bn.running_var"] + float(config.get("batch_norm_eps", 1e-4)))
        return PatchedBatchNorm(stats["bn.running_mean"], std)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Patched latents [B, C', h', w'] -> tokens [B, h' * w', C']."""
        return Flux2Pipeline._pack_latents(latents)

    def image_ids(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return Flux2Pipeline._prepare_latent_ids(latents).to(device)

    def unpack(self, prediction: torch.Tensor, latent_shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Tokens [B, h' * w', C'] -> [B, C', h', w'] (the ids are row-major: Flux2Pipeline._unpack_latents_with_ids)."""
        batch, channels, height, width = latent_shape
        return prediction.reshape(batch, height, width, channels).permute(0, 3, 1, 2)

    def transformer_inputs(
        self, inputs: Any, batch: dict[str, Any], device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        prompt_embeds = batch["prompt_embeds"].to(device=device, dtype=dtype)
        return {
            "hidden_states": inputs.hidden_states,
            "encoder_hidden_states": prompt_embeds,
            "timestep": inputs.timestep,
            "img_ids": inputs.img_ids,
            "txt_ids": Flux2Pipeline._prepare_text_ids(prompt_embeds).to(device),
            "guidance": inputs.guidance,
            "return_dict": False,
        }

    def render_arguments(
        self, embeds: torch.Tensor, pooled: torch.Tensor, negative: torch.Tensor | None, control: Any
    ) -> dict[str, Any]:
        return {"prompt_embeds": embeds}


class Flux2KleinOps(Flux2Ops):
    """FLUX.2 [klein]: a Qwen3 text encoder; its base checkpoints render with true classifier-free guidance."""

    def _tokenizers(self) -> dict[str, Any]:
        return {}

    def needs_negative_prompt(self, guidance_scale: float) -> bool:
        # Flux2KleinPipeline.do_classifier_free_guidance; the distilled checkpoints ignore guidance.
        return guidance_scale > 1 and not self.model_index.get("is_distilled", False)

    def render_arguments(
        self, embeds: torch.Tensor, pooled: torch.Tensor, negative: torch.Tensor | None, control: Any
    ) -> dict[str, Any]:
        arguments = {"prompt_embeds": embeds}
        if negative is not None:
            arguments["negative_prompt_embeds"] = negative
        return arguments


def transformer_class_in(folder: Path) -> Any:
    """The diffusers class a transformer folder's config.json names (FLUX.1's or FLUX.2's)."""
    config = diffusers.FluxTransformer2DModel.load_config(str(folder))
    return getattr(diffusers, config.get("_class_name") or "FluxTransformer2DModel")


OPS_BY_FAMILY = {"flux1": FamilyOps, "flux1-kontext": KontextOps, "flux2": Flux2Ops, "flux2-klein": Flux2KleinOps}
