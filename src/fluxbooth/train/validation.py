"""Stage "validate": the validation prompts rendered from their cached embeddings (no text encoders),
with the same seed per prompt every time, during training and at the end, always through the weights being
trained in the placement training used (ZeRO-3's shards, the block-swapped or quantised base): a render never
needs more of the GPU than a training step planned for. Reloading the exported weights for the final round put
the whole base on one GPU (diffusers' model offload moves a module whole); the exported files are checked by
their own reload in the export stage. validation.json indexes every image."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fluxbooth.contract.layout import (
    VALIDATION_FOLDER,
    VALIDATION_INDEX_NAME,
    step_folder_name,
    validation_render_name,
)
from fluxbooth.train.cache import decoding_device, load_vae
from fluxbooth.train.data import load_image, resize_and_center_crop
from fluxbooth.train.family_ops import FamilyOps
from fluxbooth.train.quantize import residency
from fluxbooth.train.runtime import free_accelerator_memory
from fluxbooth.train.state import (
    Artifact,
    EncodedPrompts,
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


def render_prompts(
    state: TrainerState, pipeline: Any, target: RenderTarget, *, dtype: torch.dtype, writes: bool
) -> None:
    """Render every validation prompt through `pipeline` from its cached embeddings; the process that
    `writes` saves the images and records them (others only lend their ZeRO-3 slices to the forward)."""
    session, embeddings = state.session, _embeddings(state)
    config, device = session.config, session.accelerator.device
    width, height = config.resolution.render_shape
    output_dir = Path(config.output_dir)
    target.folder.mkdir(parents=True, exist_ok=True)
    ops = session.base.ops
    negative = negative_embeddings(state, ops, device, dtype)
    for index, prompt in enumerate(config.validation.prompts):
        seed = validation_seed(config.optimisation.seed, index)
        prompt_arguments = ops.render_arguments(
            embeddings.prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
            embeddings.pooled_prompt_embeds[index : index + 1].to(device=device, dtype=dtype),
            negative,
            _control_image(config, index),
        )
        rendered = pipeline(
            **prompt_arguments,
            **ops.size_arguments((width, height)),
            num_inference_steps=config.sampling.validation_inference_steps,
            guidance_scale=config.sampling.validation_guidance_scale,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="pil" if writes else "latent",
        ).images[0]
        if not writes:
            continue
        name = validation_render_name(index)
        rendered.save(target.folder / name)
        file = (target.folder / name).relative_to(output_dir / VALIDATION_FOLDER).as_posix()
        state.validation.records.append(
            {
                "file": file,
                "prompt": prompt,
                "seed": seed,
                "steps": config.sampling.validation_inference_steps,
                "training_step": target.training_step,
            }
        )
        state.validation.artifacts.append(
            Artifact(
                name=f"{target.artifact_stem}_{index:02d}", path=f"{VALIDATION_FOLDER}/{file}", kind="validation_image"
            )
        )
    if writes:
        write_json(
            output_dir / VALIDATION_FOLDER / VALIDATION_INDEX_NAME,
            {"images": state.validation.records, "guidance_scale": config.sampling.validation_guidance_scale},
        )


def _embeddings(state: TrainerState) -> EncodedPrompts:
    embeddings = state.cached().validation_prompts
    if embeddings is None:
        raise RuntimeError("validation prompts were not encoded in the cache stage")
    return embeddings


def negative_embeddings(
    state: TrainerState, ops: FamilyOps, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """The empty prompt's embeddings when the family renders with true classifier-free guidance (FLUX.2 [klein]
    base checkpoints): encoded in the cache stage, so no text encoder is loaded here."""
    if not ops.needs_negative_prompt(state.session.config.sampling.validation_guidance_scale):
        return None
    empty = state.cached().empty_prompt
    if empty is None:
        raise RuntimeError("the empty prompt was not encoded in the cache stage")
    return empty.prompt_embeds[:1].to(device=device, dtype=dtype)


def _control_image(config: Any, index: int) -> Any:
    """The validation prompt's control image (FLUX.1 Kontext), at the render size; None without one."""
    images = config.validation.images
    if index >= len(images):
        return None
    return resize_and_center_crop(load_image(Path(images[index])), config.resolution.render_shape)


def render_during_training(state: TrainerState, step: int) -> None:
    """*Collective under ZeRO-3*: one round of renders at `step`, written to validation/step-NNNNNN/."""
    folder = Path(state.session.config.output_dir) / VALIDATION_FOLDER / step_folder_name(step)
    _render_in_training_placement(state, RenderTarget(folder, step, f"validation_step{step:06d}"), {"step": step})


def _render_in_training_placement(state: TrainerState, target: RenderTarget, event: dict[str, Any]) -> None:
    """*Collective under ZeRO-3*, where every rank holds a slice of each layer and the forward gathers
    them together; below it only the main process renders. `event`: the validate stage's own fields."""
    session = state.session
    config, accelerator = session.config, session.accelerator
    with session.clock.stage("validate", **event, prompts=len(config.validation.prompts)):
        if session.is_main or session.zero_stage == 3:
            with placement_pipeline(state, "validate", event, decodes=session.is_main) as pipeline:
                dtype = session.precision.input_dtype
                render_prompts(state, pipeline, target, dtype=dtype, writes=session.is_main)
        accelerator.wait_for_everyone()


@contextmanager
def placement_pipeline(state: TrainerState, stage: str, event: dict[str, Any], *, decodes: bool) -> Iterator[Any]:
    """The family's pipeline around the engine's transformer as training placed it (ZeRO-3's shards, the
    block-swapped or quantised base), with the VAE and scheduler, for one round of renders on this process. The
    process that `decodes` keeps the VAE on its device when it fits beside the engine (others render latents only).
    Announced as `stage` "rendering" with `event`'s fields and the transformer's residency."""
    session, run = state.session, state.training()
    config, accelerator = session.config, session.accelerator
    # Loaded for each round, not kept: training steps never share memory with it. Under accelerate's own mixed
    # precision (no DeepSpeed) the prepared model returns fp32, so the latents it denoises reach the VAE in fp32
    # and a bf16 VAE refuses them.
    vae_dtype = torch.float32 if accelerator.native_amp else session.precision.input_dtype
    vae = load_vae(session.base.ops, without_transformers_zero3_init, dtype=vae_dtype)
    if decodes:
        vae.to(decoding_device(session.encoder_device, vae, config.resolution.render_shape))
    pipeline = session.base.ops.pipeline_on(
        accelerator.device,
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(session.base.folder), subfolder="scheduler"),
        vae=vae,
        transformer=accelerator.unwrap_model(run.engine),
    )
    pipeline.set_progress_bar_config(disable=True)
    session.reporter.stage(stage, status="rendering", **event, transformer=residency(pipeline.transformer))
    run.engine.eval()
    try:
        yield pipeline
    finally:
        run.engine.train()
        release_prefetched_partitions(run.engine)
        del pipeline, vae
        free_accelerator_memory()


def render_base_model(state: TrainerState) -> None:
    """*Collective.* Step 0: the validation prompts through the base model, with the seeds of every later round
    (the zero of the likeness scale). A resumed full fine-tune keeps no base to render, so it has no step 0 (said in
    a warning)."""
    session, run = state.session, state.training()
    if run.start_step and session.config.training_type != "lora":
        session.reporter.warning(
            f"likeness: the run resumed at step {run.start_step} has no base-model renders (step 0): a full fine-tune "
            "keeps no copy of the base weights to render them with"
        )
        return
    with base_weights(state):
        render_during_training(state, 0)


@contextmanager
def base_weights(state: TrainerState) -> Iterator[None]:
    """The engine's transformer as the base model, for the duration: before the first step it is (a LoRA's B starts
    at zero, a full fine-tune has not stepped); a resumed LoRA run switches its adapters off. A resumed full
    fine-tune keeps no base: callers check that first."""
    session, run = state.session, state.training()
    if run.start_step == 0:
        yield
        return
    assert session.config.training_type == "lora", "a resumed full fine-tune has no base weights"
    model = session.accelerator.unwrap_model(run.engine)
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def render_final(state: TrainerState) -> list[Artifact]:
    """*Collective* under ZeRO-3 (below it the others wait). Every prompt through the trained weights, before
    the engine is released; the validation images and their index as artifacts (main process)."""
    config = state.session.config
    if not config.validation.prompts:
        return []
    target = RenderTarget(Path(config.output_dir) / VALIDATION_FOLDER, config.optimisation.steps, "validation")
    _render_in_training_placement(state, target, {})
    if not state.session.is_main:
        return []
    index = Artifact(
        name="validation_index", path=f"{VALIDATION_FOLDER}/{VALIDATION_INDEX_NAME}", kind="validation_index"
    )
    return [*state.validation.artifacts, index]
