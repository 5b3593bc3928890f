"""Stage "cache": every prompt set (instance, class, validation) and image set encoded once and kept on
disk, one process per machine encoding while the others wait.

The text encoders (CLIP for the pooled vector, T5 for the sequence) load once for all prompt sets and the
VAE once for all image sets, and both are released before the transformer is loaded, so they never share
memory with the DeepSpeed engine. Latents are stored as the VAE's Gaussian (mean, std) so every step can
draw a fresh sample, as diffusers' FLUX DreamBooth script does when it caches latents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fluxbooth.contract.buckets import Resolution, Shape
from fluxbooth.train.data import TrainingImage, discover_images, oriented_size, pixel_batch, with_controls
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.family_ops import FamilyOps
from fluxbooth.train.runtime import ReleaseTracker, free_accelerator_memory
from fluxbooth.train.state import (
    CachedData,
    ClassImageSet,
    EncodedBucket,
    EncodedImages,
    EncodedPrompts,
    Session,
    without_transformers_zero3_init,
)

CACHE_FORMAT_VERSION = 2  # 2: latents per training shape (aspect buckets)
TEXT_BATCH = 8
IMAGE_BATCH = 4
# Decoding-memory estimate: FLUX's VAE decoder ends with 128-channel feature maps at full resolution,
# of which a few are alive at once.
DECODE_CHANNELS = 128
DECODE_LIVE_FEATURE_MAPS = 4
VALIDATION_SET = "validation"
CLASS_SET = "class"
# The class prompt alone, when class images are still to render: encoded with the other prompts.
CLASS_PROMPT_SET = "class_prompt"
# Caption dropout's stand-in caption: the empty prompt, encoded once.
EMPTY_PROMPT_SET = "empty_prompt"


def build_caches(session: Session, class_images: ClassImageSet | None) -> CachedData:
    """*Collective.* `class_images`: prior preservation's (None without it); when some are still to render, the
    class set is left for `cache_class_set` and only the class prompt is encoded here."""
    config, accelerator = session.config, session.accelerator
    tracker = ReleaseTracker()
    to_render = class_images if class_images is not None and class_images.missing else None
    with session.clock.stage("cache"):
        image_sets = _image_sets(session, class_images if to_render is None else None)
        samples = _samples_per_shape(config.resolution, image_sets)
        paths = {
            name: cache_path(
                Path(config.cache_dir),
                name,
                cache_fingerprint(
                    config.base_model, images, samples[name], config.sampling.max_sequence_length, _text_dtype(session)
                ),
            )
            for name, images in image_sets.items()
        }
        prompt_sets = _prompt_sets(session, to_render)
        prompt_paths = {
            name: cache_path(
                Path(config.cache_dir),
                name,
                prompts_fingerprint(
                    config.base_model, prompts, config.sampling.max_sequence_length, _text_dtype(session)
                ),
            )
            for name, prompts in prompt_sets.items()
        }
        if accelerator.is_local_main_process:
            prompt_files = {name: (prompt_sets[name], path) for name, path in prompt_paths.items()}
            _encode_missing(session, image_sets, samples, paths, prompt_files, tracker)
        accelerator.wait_for_everyone()
        loaded = {name: load_encoded(path) for name, path in paths.items()}
        loaded_prompts = {name: load_encoded_prompts(path) for name, path in prompt_paths.items()}
        if to_render is None:
            report_cache_ready(session, loaded["instance"], loaded.get(CLASS_SET))
    free_accelerator_memory()
    still_alive = tracker.alive()
    if still_alive:
        session.reporter.warning(f"{still_alive} still in memory after caching; the engine will share memory with them")
    return CachedData(
        instance_set=loaded["instance"],
        class_set=loaded.get(CLASS_SET),
        validation_prompts=loaded_prompts.get(VALIDATION_SET),
        released_before_training=[] if still_alive else tracker.tracked,
        empty_prompt=loaded_prompts.get(EMPTY_PROMPT_SET),
        class_images_to_render=to_render,
        class_prompt=loaded_prompts.get(CLASS_PROMPT_SET),
    )


def report_cache_ready(session: Session, instance_set: EncodedImages, class_set: EncodedImages | None) -> None:
    """The cache's one "ready" status, once every image set training reads is encoded."""
    session.reporter.stage(
        "cache",
        instance_images=len(instance_set),
        class_images=len(class_set) if class_set is not None else 0,
        image_pairs=sum(len(bucket) for bucket in instance_set.buckets.values() if bucket.control_mean is not None),
        buckets=instance_set.bucket_counts(),
        status="ready",
    )


def cache_class_set(
    session: Session, class_images: ClassImageSet, instance_set: EncodedImages, class_prompt: EncodedPrompts
) -> EncodedImages:
    """*Collective.* The class images' latents at every instance shape (prior preservation pairs them), encoded
    once their renders are on disk, by one process per machine. The engine holds the accelerator by then: the VAE
    and a batch's activations go there only when they fit beside it, else the CPU encodes."""
    config, accelerator = session.config, session.accelerator
    samples = {shape: list(range(len(class_images.images))) for shape in sorted(instance_set.buckets)}
    fingerprint = cache_fingerprint(
        config.base_model, class_images.images, samples, config.sampling.max_sequence_length, _text_dtype(session)
    )
    path = cache_path(Path(config.cache_dir), CLASS_SET, fingerprint)
    if accelerator.is_local_main_process and not path.is_file():
        vae = load_vae(session.base.ops, without_transformers_zero3_init)
        try:
            device = decoding_device(session.encoder_device, vae, max(samples, key=_pixels), images=IMAGE_BATCH)
            encoded = encode_image_set(
                class_images.images,
                samples,
                class_prompt,
                vae=vae,
                device=device,
                samples_posterior=session.base.ops.samples_posterior,
            )
            save_encoded(encoded, path)
        finally:
            del vae
            free_accelerator_memory()
    accelerator.wait_for_everyone()
    return load_encoded(path)


def _pixels(shape: Shape) -> int:
    return shape[0] * shape[1]


def _text_dtype(session: Session) -> str:
    return str(session.precision.text_dtype).removeprefix("torch.")


def _image_sets(session: Session, class_images: ClassImageSet | None) -> dict[str, list[TrainingImage]]:
    """The image sets encoded now: the instance images, and the class images when all of them are on disk."""
    config = session.config
    instance = discover_images(
        Path(config.instance_dir), config.prompts.instance_prompt, trigger_word=config.prompts.trigger_word
    )
    if not instance:
        raise TrainerFailure(
            "invalid_dataset",
            f"no images in the instance folder {Path(config.instance_dir).name}/; add PNG or JPEG files",
        )
    instance = _paired(session, instance)
    sets = {"instance": instance}
    if class_images is not None and class_images.images:
        sets[CLASS_SET] = class_images.images
    return sets


def _paired(session: Session, instance: list[TrainingImage]) -> list[TrainingImage]:
    """The instance images with their control images when the dataset has pairs and the family trains on them
    (FLUX.1 Kontext); pairs for another family are left unused, with a warning."""
    config = session.config
    if not config.control_dir:
        return instance
    family = session.base.ops.family
    if not family.control_images:
        session.reporter.warning(
            f"the dataset's control/ images are unused: {family.title} does not train on image pairs"
        )
        return instance
    if config.prompts.with_prior_preservation:
        raise TrainerFailure(
            "invalid_config",
            "with_prior_preservation needs class images with control images, which image-pair datasets do not "
            "have; turn with_prior_preservation off, or train without the control/ folder",
        )
    return with_controls(instance, Path(config.control_dir))


def _samples_per_shape(
    resolution: Resolution, image_sets: dict[str, list[TrainingImage]]
) -> dict[str, dict[Shape, list[int]]]:
    """Which images of each set are encoded at each training shape: every instance image at its bucket of
    each size (or the fixed shape), every class image at every instance shape, so that prior preservation
    can pair each instance batch with class images of the same shape."""
    instance: dict[Shape, list[int]] = {}
    for index, image in enumerate(image_sets["instance"]):
        for shape in resolution.shapes_for(*oriented_size(image.path)):
            instance.setdefault(shape, []).append(index)
    samples = {"instance": dict(sorted(instance.items()))}
    if CLASS_SET in image_sets:
        everyone = list(range(len(image_sets[CLASS_SET])))
        samples[CLASS_SET] = {shape: everyone for shape in samples["instance"]}
    return samples


def _prompt_sets(session: Session, class_images_to_render: ClassImageSet | None) -> dict[str, list[str]]:
    """The prompts encoded for later without images: validation prompts, the class prompt when class images are
    still to render, and the empty prompt for caption dropout and for renders with true classifier-free guidance
    (FLUX.2 [klein] base checkpoints)."""
    config = session.config
    sets = {}
    if config.validation.prompts:
        sets[VALIDATION_SET] = list(config.validation.prompts)
    if class_images_to_render is not None:
        sets[CLASS_PROMPT_SET] = [config.prompts.class_prompt or ""]
    renders = bool(config.validation.prompts) or class_images_to_render is not None
    guided = renders and session.base.ops.needs_negative_prompt(config.sampling.validation_guidance_scale)
    if config.prompts.caption_dropout > 0 or guided:
        sets[EMPTY_PROMPT_SET] = [""]
    return sets


def _encode_missing(
    session: Session,
    image_sets: dict[str, list[TrainingImage]],
    samples: dict[str, dict[Shape, list[int]]],
    paths: dict[str, Path],
    prompt_sets: dict[str, tuple[list[str], Path]],
    tracker: ReleaseTracker,
) -> None:
    """Encode what the cache lacks: all missing prompts in one load of the text encoders, then all missing
    images in one load of the VAE. `prompt_sets`: each prompt-only set's prompts and cache file."""
    config = session.config
    missing = [name for name in image_sets if not paths[name].is_file()]
    prompts = {image.prompt for name in missing for image in image_sets[name]}
    missing_prompt_sets = [(set_prompts, path) for set_prompts, path in prompt_sets.values() if not path.is_file()]
    for set_prompts, _ in missing_prompt_sets:
        prompts.update(set_prompts)
    if not prompts:
        return
    encoded = encode_prompts(
        session.base.ops,
        sorted(prompts),
        device=session.encoder_device,
        dtype=session.precision.text_dtype,
        max_sequence_length=config.sampling.max_sequence_length,
        loading_context=without_transformers_zero3_init,
        tracker=tracker,
    )
    for set_prompts, path in missing_prompt_sets:
        save_encoded_prompts(_subset(encoded, set_prompts), path)
    if not missing:
        return
    vae = load_vae(session.base.ops, without_transformers_zero3_init)
    tracker.track("vae", vae)
    try:
        for name in missing:
            encoded_set = encode_image_set(
                image_sets[name],
                samples[name],
                encoded,
                vae=vae,
                device=session.encoder_device,
                samples_posterior=session.base.ops.samples_posterior,
            )
            save_encoded(encoded_set, paths[name])
    finally:
        del vae


def _subset(encoded: EncodedPrompts, prompts: list[str]) -> EncodedPrompts:
    rows = [encoded.prompts.index(prompt) for prompt in prompts]
    return EncodedPrompts(prompts, encoded.prompt_embeds[rows], encoded.pooled_prompt_embeds[rows])


def cache_fingerprint(
    base_model: str,
    images: Sequence[TrainingImage],
    samples: dict[Shape, list[int]],
    max_sequence_length: int,
    text_dtype: str,
) -> str:
    """Changes whenever anything that shapes the cached tensors changes."""
    return _fingerprint(
        {
            "base_model": str(base_model),
            "samples": {f"{width}x{height}": indices for (width, height), indices in samples.items()},
            "max_sequence_length": max_sequence_length,
            "text_dtype": text_dtype,
            "images": [
                [image.path.name, image.path.stat().st_size, image.path.stat().st_mtime_ns, image.prompt]
                + (
                    []
                    if image.control is None
                    else [image.control.name, image.control.stat().st_size, image.control.stat().st_mtime_ns]
                )
                for image in images
            ],
        }
    )


def _fingerprint(description: dict[str, Any]) -> str:
    """A short stable hash of what shaped a cache file, cache format version included."""
    versioned = {"version": CACHE_FORMAT_VERSION, **description}
    return hashlib.sha256(json.dumps(versioned, sort_keys=True).encode()).hexdigest()[:32]


def pick_encoding_device(preferred: torch.device, bytes_needed: int) -> torch.device:
    """The accelerator when the encoder fits in its free memory with room to spare, else the CPU.
    Pass the CPU as `preferred` to force it (the planner's `cache_encoders_on_cpu`)."""
    if preferred.type != "cuda":
        return preferred
    free_bytes, _ = torch.cuda.mem_get_info(preferred)
    return preferred if bytes_needed * 1.3 < free_bytes else torch.device("cpu")


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())


@contextlib.contextmanager
def _on_device(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")


def encode_prompts(
    ops: FamilyOps,
    prompts: Sequence[str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int,
    loading_context: Callable[[], contextlib.AbstractContextManager[Any]],
    tracker: ReleaseTracker,
) -> EncodedPrompts:
    """Sequence embeddings [P, L, D] and pooled embeddings [P, D] of each prompt, as the model's family
    encodes them (FLUX.1: T5's and CLIP's; FLUX.2: stacked hidden states of its one encoder, no pooled
    embedding: [P, 0]), on the CPU; the text encoders are loaded for this call only."""
    with loading_context():
        pipeline = ops.text_pipeline(dtype)
    encoders = ops.text_encoders(pipeline)
    for name, encoder in zip(ops.family.text_encoders, encoders, strict=True):
        tracker.track(name, encoder)
    encoding_device = pick_encoding_device(device, sum(_parameter_bytes(encoder) for encoder in encoders))
    sequences, pooled = [], []
    try:
        for encoder in encoders:
            encoder.to(encoding_device)
        with torch.no_grad():
            for start in range(0, len(prompts), TEXT_BATCH):
                chunk = list(prompts[start : start + TEXT_BATCH])
                prompt_embeds, pooled_prompt_embeds = ops.encode(pipeline, chunk, encoding_device, max_sequence_length)
                sequences.append(prompt_embeds)
                pooled.append(pooled_prompt_embeds)
    finally:
        del encoders, pipeline
        free_accelerator_memory()
    return EncodedPrompts(list(prompts), torch.cat(sequences), torch.cat(pooled))


def load_vae(
    ops: FamilyOps,
    loading_context: Callable[[], contextlib.AbstractContextManager[Any]],
    dtype: torch.dtype = torch.float32,
) -> Any:
    with loading_context():
        # float32 by default: the VAE is small (84 M parameters for FLUX) and its latents are the training targets.
        return ops.load_vae(dtype)


def decoding_device(preferred: torch.device, vae: Any, resolution: tuple[int, int], images: int = 1) -> torch.device:
    """Where the VAE decodes (or encodes) `images` at a time while the engine holds the accelerator: there only
    when the VAE and their full-resolution activations (a few 128-channel feature maps each) fit beside it, else
    the CPU."""
    width, height = resolution
    activation_bytes = (
        images
        * DECODE_LIVE_FEATURE_MAPS
        * DECODE_CHANNELS
        * width
        * height
        * torch.finfo(next(vae.parameters()).dtype).bits
        // 8
    )
    return pick_encoding_device(preferred, _parameter_bytes(vae) + activation_bytes)


def prompts_fingerprint(base_model: str, prompts: Sequence[str], max_sequence_length: int, text_dtype: str) -> str:
    return _fingerprint(
        {
            "base_model": str(base_model),
            "prompts": list(prompts),
            "max_sequence_length": max_sequence_length,
            "text_dtype": text_dtype,
        }
    )


def save_encoded_prompts(encoded: EncodedPrompts, path: Path) -> None:
    _save_atomically(encoded.to_dict(), path)


def load_encoded_prompts(path: Path) -> EncodedPrompts:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return EncodedPrompts(
        prompts=list(data["prompts"]),
        prompt_embeds=data["prompt_embeds"],
        pooled_prompt_embeds=data["pooled_prompt_embeds"],
    )


def encode_images(
    vae: Any, paths: Sequence[Path], shape: Shape, *, device: torch.device, samples_posterior: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE posterior for each image scaled to cover `shape` and centre-cropped to it,
    [N, C, h, w] float32 on the CPU. Without `samples_posterior` (the families whose objective takes the
    posterior's mode) the std is zero, so every draw is the mean."""
    means, stds = [], []
    with _on_device(vae, pick_encoding_device(device, _parameter_bytes(vae))) as on_device, torch.no_grad():
        vae_device = next(on_device.parameters()).device
        for start in range(0, len(paths), IMAGE_BATCH):
            pixels = pixel_batch(list(paths[start : start + IMAGE_BATCH]), shape).to(vae_device)
            posterior = on_device.encode(pixels).latent_dist
            means.append(posterior.mean.float().cpu())
            spread = posterior.std if samples_posterior else torch.zeros_like(posterior.mean)
            stds.append(spread.float().cpu())
    return torch.cat(means), torch.cat(stds)


def encode_image_set(
    images: Sequence[TrainingImage],
    samples: dict[Shape, list[int]],
    prompts: EncodedPrompts,
    *,
    vae: Any,
    device: torch.device,
    samples_posterior: bool = True,
) -> EncodedImages:
    """The image set's latents at each training shape (`samples`: the images encoded at it), and its control
    images' at the same shape when the images come in pairs, with the embeddings of its prompts taken from
    `prompts` (encoded beforehand together with every other prompt set, so the text encoders load once)."""
    own_prompts = sorted({image.prompt for image in images})
    rows = torch.tensor([prompts.prompts.index(prompt) for prompt in own_prompts], dtype=torch.long)
    buckets = {}
    for shape, indices in samples.items():
        picked = [images[index] for index in indices]
        latent_mean, latent_std = encode_images(
            vae, [image.path for image in picked], shape, device=device, samples_posterior=samples_posterior
        )
        control_mean = None
        controls = [image.control for image in picked if image.control is not None]
        if len(controls) == len(picked):
            control_mean, _ = encode_images(vae, controls, shape, device=device, samples_posterior=False)
        buckets[shape] = EncodedBucket(torch.tensor(indices, dtype=torch.long), latent_mean, latent_std, control_mean)
    return EncodedImages(
        prompt_index=torch.tensor([own_prompts.index(image.prompt) for image in images], dtype=torch.long),
        prompt_embeds=prompts.prompt_embeds[rows],
        pooled_prompt_embeds=prompts.pooled_prompt_embeds[rows],
        prompts=own_prompts,
        buckets=buckets,
    )


def cache_path(cache_dir: Path, name: str, fingerprint: str) -> Path:
    return cache_dir / f"{name}-{fingerprint}.pt"


def save_encoded(encoded: EncodedImages, path: Path) -> None:
    _save_atomically(encoded.to_dict(), path)


def _save_atomically(tensors: dict[str, Any], path: Path) -> None:
    """A reader on another rank sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(tensors, staging)
    os.replace(staging, path)


def load_encoded(path: Path) -> EncodedImages:
    return EncodedImages.from_dict(torch.load(path, map_location="cpu", weights_only=True))
