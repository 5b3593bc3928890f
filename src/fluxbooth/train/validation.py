"""Stage "validate": the validation prompts rendered from their cached embeddings (no text encoders),
with the same seed per prompt every time, during training (through the weights being trained) and
at the end (through the exported weights, loaded the way a user would load them). One render loop
serves both; validation.json indexes every image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fluxbooth.contract.layout import VALIDATION_FOLDER, VALIDATION_INDEX_NAME, step_folder_name
from fluxbooth.train.blockswap import swapped_for_rendering
from fluxbooth.train.cache import decoding_device, load_vae
from fluxbooth.train.data import load_image, resize_and_center_crop
from fluxbooth.train.export.lora import LORA_WEIGHTS_NAME
from fluxbooth.train.export.stage import TRANSFORMER_FOLDER, lora_for_rendering
from fluxbooth.train.family_ops import FamilyOps
from fluxbooth.train.quantize import QuantisedLinear, quantised_transformer_for, residency
from fluxbooth.train.runtime import free_accelerator_memory
from fluxbooth.train.state import (
    Artifact,
    EncodedPrompts,
    Session,
    TrainerState,
    release_prefetched_partitions,
    seed_for,
    without_transformers_zero3_init,
    write_json,
)


@dataclass(frozen=True)
class RenderTarget:
    """Where one round of validation images goes and how its files and artifacts are named."""

    folder: Path  # under output_dir/validation/
    training_step: int
    artifact_stem: str  # "validation" or "validation_stepNNNNNN"


def validation_seed(seed: int, index: int) -> int:
    """The same per prompt at every step and at the end, so the images of a run compare."""
    return seed_for(seed, "validation", index) % (2**32)


def render_prompts(state: TrainerState, pipeline: Any, target: RenderTarget, *, dtype: torch.dtype, writes: bool) -> None:
    """Render every validation prompt through `pipeline` from its cached embeddings; the process that
    `writes` saves the images and records them (others only lend their ZeRO-3 slices to the forward)."""
    session, embeddings = state.session, _embeddings(state)
    config, device = session.config, session.accelerator.device
    width, height = config.resolution.render_shape
    output_dir = Path(config.output_dir)
    target.folder.mkdir(parents=True, exist_ok=True)
    ops = session.base.ops
    negative = _negative_embeddings(state, ops, device, dtype)
    for index, prompt in enumerate(config.validation_prompts):
        seed = validation_seed(config.seed, index)
        prompt_arguments = ops.render_arguments(
            embeddings.prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
            embeddings.pooled_prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
            negative,
            _control_image(config, index),
        )
        rendered = pipeline(
            **prompt_arguments,
            **ops.size_arguments((width, height)),
            num_inference_steps=config.validation_inference_steps,
            guidance_scale=config.validation_guidance_scale,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pil" if writes else "latent",
        ).images[0]
        if not writes:
            continue
        name = f"validation_{index:02d}.png"
        rendered.save(target.folder / name)
        file = (target.folder / name).relative_to(output_dir / VALIDATION_FOLDER).as_posix()
        state.validation.records.append(
            {"file": file, "prompt": prompt, "seed": seed, "steps": config.validation_inference_steps, "training_step": target.training_step}
        )
        state.validation.artifacts.append(
            Artifact(name=f"{target.artifact_stem}_{index:02d}", path=f"{VALIDATION_FOLDER}/{file}", kind="validation_image")
        )
    if writes:
        write_json(
            output_dir / VALIDATION_FOLDER / VALIDATION_INDEX_NAME,
            {"images": state.validation.records, "guidance_scale": config.validation_guidance_scale},
        )


def _embeddings(state: TrainerState) -> EncodedPrompts:
    embeddings = state.cached().validation_prompts
    if embeddings is None:
        raise RuntimeError("validation prompts were not encoded in the cache stage")
    return embeddings


def _negative_embeddings(state: TrainerState, ops: FamilyOps, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The empty prompt's embeddings when the family renders with true classifier-free guidance (FLUX.2 [klein]
    base checkpoints): encoded in the cache stage, so no text encoder is loaded here."""
    if not ops.needs_negative_prompt(state.session.config.validation_guidance_scale):
        return None
    empty = state.cached().empty_prompt
    if empty is None:
        raise RuntimeError("the empty prompt was not encoded in the cache stage")
    return empty.prompt_embeds[:1].to(device=device, dtype=dtype)


def _control_image(config: Any, index: int) -> Any:
    """The validation prompt's control image (FLUX.1 Kontext), at the render size; None without one."""
    images = config.validation_images
    if index >= len(images):
        return None
    return resize_and_center_crop(load_image(Path(images[index])), config.resolution.render_shape)


def render_during_training(state: TrainerState, step: int) -> None:
    """*Collective under ZeRO-3*, where every rank holds a slice of each layer and the forward gathers
    them together; below it only the main process renders. Written to validation/step-NNNNNN/."""
    session, run = state.session, state.training()
    config, accelerator = session.config, session.accelerator
    device = accelerator.device

    with session.clock.stage("validate", step=step, prompts=len(config.validation_prompts)):
        if session.is_main or session.zero_stage == 3:
            dtype = session.precision.input_dtype
            # Loaded for each render, not kept: training steps never share memory with it. Under accelerate's
            # own mixed precision (no DeepSpeed) the prepared model returns fp32, so the latents it denoises
            # reach the VAE in fp32 and a bf16 VAE refuses them.
            vae_dtype = torch.float32 if accelerator.native_amp else dtype
            vae = load_vae(session.base.ops, without_transformers_zero3_init, dtype=vae_dtype)
            if session.is_main:
                vae.to(decoding_device(session.encoder_device, vae, config.resolution.render_shape))
            pipeline = session.base.ops.pipeline_on(
                device,
                scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(session.base.folder), subfolder="scheduler"),
                vae=vae,
                transformer=accelerator.unwrap_model(run.engine),
            )
            pipeline.set_progress_bar_config(disable=True)
            folder = Path(config.output_dir) / VALIDATION_FOLDER / step_folder_name(step)
            session.reporter.stage("validate", status="rendering", step=step, transformer=residency(pipeline.transformer))
            run.engine.eval()
            try:
                render_prompts(state, pipeline, RenderTarget(folder, step, f"validation_step{step:06d}"), dtype=dtype, writes=session.is_main)
            finally:
                run.engine.train()
                release_prefetched_partitions(run.engine)
                del pipeline, vae
                free_accelerator_memory()
        accelerator.wait_for_everyone()


def render_base_model(state: TrainerState) -> None:
    """*Collective.* Step 0: the validation prompts through the base model, with the seeds of every later round
    (the zero of the likeness scale). Before the first step the model being trained is the base (a LoRA's B starts
    at zero); a resumed LoRA run renders with its adapters switched off; a resumed full fine-tune keeps no base to
    render, so it has no step 0 (said in a warning)."""
    session, run = state.session, state.training()
    if run.start_step == 0:
        render_during_training(state, 0)
        return
    if session.config.training_type != "lora":
        session.reporter.warning(
            f"likeness: the run resumed at step {run.start_step} has no base-model renders (step 0): a full fine-tune "
            "keeps no copy of the base weights to render them with"
        )
        return
    model = session.accelerator.unwrap_model(run.engine)
    model.disable_adapters()
    try:
        render_during_training(state, 0)
    finally:
        model.enable_adapters()


def render_final(state: TrainerState) -> list[Artifact]:
    """*Collective* (the others wait). The exported weights, loaded as a user would, render every prompt."""
    session = state.session
    config, accelerator = session.config, session.accelerator
    if not config.validation_prompts:
        return []
    artifacts: list[Artifact] = []
    with session.clock.stage("validate", prompts=len(config.validation_prompts)):
        if session.is_main:
            pipeline = _exported_pipeline(session)
            session.reporter.stage("validate", status="rendering", transformer=residency(pipeline.transformer))
            render_prompts(
                state,
                pipeline,
                RenderTarget(Path(config.output_dir) / VALIDATION_FOLDER, config.steps, "validation"),
                dtype=session.precision.text_dtype,
                writes=True,
            )
            artifacts = [*state.validation.artifacts]
            artifacts.append(Artifact(name="validation_index", path=f"{VALIDATION_FOLDER}/{VALIDATION_INDEX_NAME}", kind="validation_index"))
            del pipeline
            free_accelerator_memory()
        accelerator.wait_for_everyone()
    return artifacts


def _exported_pipeline(session: Session) -> Any:
    """The base pipeline (without text encoders: prompts come embedded) with the exported weights."""
    config = session.config
    output_dir = Path(config.output_dir)
    dtype = session.precision.text_dtype
    base_folder, ops = str(session.base.folder), session.base.ops
    no_text_encoders = ops.no_text_encoders()
    with without_transformers_zero3_init():
        if config.training_type == "full":
            transformer = ops.transformer_class.from_pretrained(str(output_dir / TRANSFORMER_FOLDER), torch_dtype=dtype)
            if config.block_swap:
                # Rendered as it trained: the trained blocks streamed from host RAM, the rest on the device.
                transformer = swapped_for_rendering(transformer, session.accelerator.device)
            pipeline = ops.pipeline_class.from_pretrained(base_folder, transformer=transformer, torch_dtype=dtype, **no_text_encoders)
        else:
            quantised = quantised_transformer_for(config, session.base.folder, session.accelerator.device, dtype)
            pipeline = ops.pipeline_class.from_pretrained(base_folder, torch_dtype=dtype, **no_text_encoders, **quantised)
            _load_exported_lora(pipeline, str(lora_for_rendering(session)), swapped=config.block_swap)
    if session.accelerator.device.type == "cuda":
        pipeline.enable_model_cpu_offload(device=session.accelerator.device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _load_exported_lora(pipeline: Any, folder: str, *, swapped: bool) -> None:
    """The exported LoRA file, loaded as diffusers loads it. Over a quantised or block-swapped base, through
    the transformer's own loader (the same peft injection): the pipeline's loader first compares each Linear's
    weight shape, read from the transformer's state dict, with the LoRA's to widen layers for Control LoRAs; a
    packed 4-bit weight has another shape, and a swapped block's weights are the swapper's, not in the state dict."""
    if swapped or any(isinstance(module, QuantisedLinear) for module in pipeline.transformer.modules()):
        pipeline.transformer.load_lora_adapter(folder, weight_name=LORA_WEIGHTS_NAME, prefix="transformer")
    else:
        pipeline.load_lora_weights(folder, weight_name=LORA_WEIGHTS_NAME)
