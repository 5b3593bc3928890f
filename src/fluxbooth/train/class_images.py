"""Prior preservation's class images: the supplied ones, topped up with images of the class prompt rendered by
the base model as training holds it.

The missing ones are rendered once the engine exists, before the first step, through the training placement
(ZeRO-3's shards, the block-swapped or quantised base: the validation renders' pipeline), from the class prompt
encoded in the cache stage: no render needs more of the GPU than a training step planned for, no second copy of
the base is loaded, and the weights move once for the whole set. Then the set is encoded (cache.cache_class_set).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fluxbooth.train.cache import cache_class_set, report_cache_ready
from fluxbooth.train.data import TrainingImage, list_image_files
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.state import ClassImageSet, EncodedPrompts, Session, TrainerState, seed_for
from fluxbooth.train.validation import base_weights, negative_embeddings, placement_pipeline


def class_image_name(index: int) -> str:
    return f"class_{index:05d}.png"


def class_image_set(session: Session) -> ClassImageSet | None:
    """Supplied class images (class_dir), topped up with generated ones to num_class_images; None without
    prior preservation."""
    config = session.config
    if not config.prompts.with_prior_preservation:
        return None
    supplied = list_image_files(Path(config.class_dir)) if config.class_dir else []
    supplied = supplied[: config.prompts.num_class_images]
    folder = class_image_folder(session)
    generated = range(config.prompts.num_class_images - len(supplied))
    missing = tuple(index for index in generated if not (folder / class_image_name(index)).is_file())
    paths = supplied + [folder / class_image_name(index) for index in generated]
    prompt = config.prompts.class_prompt or ""
    return ClassImageSet([TrainingImage(path=path, prompt=prompt) for path in paths], folder, missing)


def class_image_folder(session: Session) -> Path:
    """Where generated class images live: a folder per (model, how it is held, prompt, size, sampler settings,
    seed) under class_image_cache_dir when the worker keeps one across jobs, else inside this job's cache."""
    config = session.config
    if not config.class_image_cache_dir:
        return Path(config.cache_dir) / "class_images"
    recipe = {
        "base_model": config.base_model,
        # A quantised base renders (slightly) other images than the bf16 one.
        "base_precision": config.memory.base_precision,
        "class_prompt": config.prompts.class_prompt,
        "resolution": list(config.resolution.render_shape),
        "steps": config.sampling.class_image_inference_steps,
        "guidance_scale": config.sampling.validation_guidance_scale,
        "max_sequence_length": config.sampling.max_sequence_length,
        "seed": config.optimisation.seed,
        "dtype": session.precision.name,
    }
    fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.class_image_cache_dir) / fingerprint


def complete_class_images(state: TrainerState) -> None:
    """*Collective.* Before the first step: render the class images the cache stage found missing, then encode
    the whole class set into the state. Nothing to do when every class image was on disk."""
    session, data = state.session, state.cached()
    pending = data.class_images_to_render
    if pending is None:
        return
    assert data.class_prompt is not None, "the cache stage encodes the class prompt when class images are missing"
    with session.clock.stage("cache", what="class_images", count=len(pending.missing)):
        session.reporter.stage("cache", status="generating_class_images", count=len(pending.missing))
        _render_missing(state, pending, data.class_prompt)
        class_set = cache_class_set(session, pending, data.instance_set, data.class_prompt)
        report_cache_ready(session, data.instance_set, class_set)
    state.data = replace(data, class_set=class_set, class_images_to_render=None)


def _render_missing(state: TrainerState, pending: ClassImageSet, class_prompt: EncodedPrompts) -> None:
    """*Collective.* Under ZeRO-3 every rank takes part in every render (each holds a slice of each layer) and each
    machine's main process writes; below it each process holds the whole base and renders its machine's share. A
    finished image is written under a temporary name and renamed, so an interrupted job resumes where it stopped."""
    session, run = state.session, state.training()
    config, accelerator = session.config, session.accelerator
    if run.start_step and config.training_type != "lora":
        raise TrainerFailure(
            "invalid_config",
            f"a resumed full fine-tune keeps no base weights to render its {len(pending.missing)} missing class "
            "images: supply num_class_images images in the dataset's class folder, or start the run again",
        )
    # Each machine writes the images to its own disk, as it encodes its own cache.
    together = session.zero_stage == 3
    local_rank, local_world = accelerator.local_process_index, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = pending.missing if together else pending.missing[local_rank::local_world]
    writes = accelerator.is_local_main_process or not together
    pending.folder.mkdir(parents=True, exist_ok=True)
    if mine:
        event = {"what": "class_images"}
        with base_weights(state), placement_pipeline(state, "cache", event, decodes=writes) as pipeline:
            for index in mine:
                image = _render_one(state, pipeline, class_prompt, index, writes=writes)
                if image is not None:
                    target = pending.folder / class_image_name(index)
                    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp.png")
                    image.save(staging)
                    os.replace(staging, target)
    accelerator.wait_for_everyone()


def _render_one(
    state: TrainerState, pipeline: Any, class_prompt: EncodedPrompts, index: int, *, writes: bool
) -> Any | None:
    """Class image `index`, seeded by its index (the same image whichever process renders it); None on a process
    that only lends its ZeRO-3 slices to the forward."""
    session = state.session
    config, device, ops = session.config, session.accelerator.device, session.base.ops
    dtype = session.precision.input_dtype
    arguments = ops.render_arguments(
        class_prompt.prompt_embeds[:1].to(device=device, dtype=dtype),
        class_prompt.pooled_prompt_embeds[:1].to(device=device, dtype=dtype),
        negative_embeddings(state, ops, device, dtype),
        None,
    )
    generator = torch.Generator("cpu").manual_seed(seed_for(config.optimisation.seed, "class_image", index))
    rendered = pipeline(
        **arguments,
        **ops.size_arguments(config.resolution.render_shape),
        num_inference_steps=config.sampling.class_image_inference_steps,
        guidance_scale=config.sampling.validation_guidance_scale,
        generator=generator,
        output_type="pil" if writes else "latent",
    ).images[0]
    return rendered if writes else None
