"""Stage "cache": every prompt set (instance, class, validation) and image set encoded once and kept on
disk, one process per machine encoding while the others wait. The text encoders load once for all
prompt sets, the VAE once for all image sets, and both are gone before the transformer loads."""

from __future__ import annotations

from pathlib import Path

from fluxbooth.train.cache import (
    EncodedPrompts,
    ReleaseTracker,
    cache_fingerprint,
    cache_path,
    encode_image_set,
    encode_prompts,
    free_accelerator_memory,
    load_encoded,
    load_encoded_prompts,
    load_vae,
    prompts_fingerprint,
    save_encoded,
    save_encoded_prompts,
)
from fluxbooth.train.class_images import class_images
from fluxbooth.train.data import TrainingImage, discover_images
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.state import CachedData, Session, without_transformers_zero3_init

VALIDATION_SET = "validation"


def build_caches(session: Session) -> CachedData:
    config, accelerator = session.config, session.accelerator
    tracker = ReleaseTracker()
    with session.clock.stage("cache"):
        image_sets = _image_sets(session)
        text_dtype_name = str(session.precision.text_dtype).removeprefix("torch.")
        paths = {
            name: cache_path(
                Path(config.cache_dir),
                name,
                cache_fingerprint(config.base_model, images, config.resolution, config.max_sequence_length, text_dtype_name),
            )
            for name, images in image_sets.items()
        }
        validation_path = None
        if config.validation_prompts:
            fingerprint = prompts_fingerprint(config.base_model, config.validation_prompts, config.max_sequence_length, text_dtype_name)
            validation_path = cache_path(Path(config.cache_dir), VALIDATION_SET, fingerprint)
        if accelerator.is_local_main_process:
            _encode_missing(session, image_sets, paths, validation_path, tracker)
        accelerator.wait_for_everyone()
        loaded = {name: load_encoded(path) for name, path in paths.items()}
        session.reporter.stage(
            "cache",
            instance_images=len(loaded["instance"]),
            class_images=len(loaded["class"]) if "class" in loaded else 0,
            status="ready",
        )
    free_accelerator_memory()
    still_alive = tracker.alive()
    if still_alive:
        session.reporter.warning(f"{still_alive} still in memory after caching; the engine will share memory with them")
    return CachedData(
        instance_set=loaded["instance"],
        class_set=loaded.get("class"),
        validation_prompts=None if validation_path is None else load_encoded_prompts(validation_path),
        released_before_training=[] if still_alive else tracker.tracked,
    )


def _image_sets(session: Session) -> dict[str, list[TrainingImage]]:
    config = session.config
    instance = discover_images(Path(config.instance_dir), config.instance_prompt)
    if not instance:
        raise TrainerFailure("invalid_dataset", f"no images in the instance folder {Path(config.instance_dir).name}/; add PNG or JPEG files")
    sets = {"instance": instance}
    if config.with_prior_preservation:
        generated_or_supplied = class_images(session)
        if generated_or_supplied:
            sets["class"] = generated_or_supplied
    return sets


def _encode_missing(
    session: Session,
    image_sets: dict[str, list[TrainingImage]],
    paths: dict[str, Path],
    validation_path: Path | None,
    tracker: ReleaseTracker,
) -> None:
    """Encode what the cache lacks: all missing prompts in one load of the text encoders, then all missing
    images in one load of the VAE."""
    config = session.config
    missing = [name for name in image_sets if not paths[name].is_file()]
    prompts = {image.prompt for name in missing for image in image_sets[name]}
    validation_missing = validation_path is not None and not validation_path.is_file()
    if validation_missing:
        prompts.update(config.validation_prompts)
    if not prompts:
        return
    encoded = encode_prompts(
        config.base_model,
        sorted(prompts),
        device=session.encoder_device,
        dtype=session.precision.text_dtype,
        max_sequence_length=config.max_sequence_length,
        loading_context=without_transformers_zero3_init,
        tracker=tracker,
    )
    if validation_missing and validation_path is not None:
        save_encoded_prompts(_subset(encoded, list(config.validation_prompts)), validation_path)
    if not missing:
        return
    vae = load_vae(config.base_model, without_transformers_zero3_init)
    tracker.track("vae", vae)
    try:
        for name in missing:
            images = image_sets[name]
            encoded_set = encode_image_set(images, encoded, vae=vae, resolution=config.resolution, device=session.encoder_device)
            save_encoded(encoded_set, paths[name])
    finally:
        del vae


def _subset(encoded: EncodedPrompts, prompts: list[str]) -> EncodedPrompts:
    rows = [encoded.prompts.index(prompt) for prompt in prompts]
    return EncodedPrompts(prompts, encoded.prompt_embeds[rows], encoded.pooled_prompt_embeds[rows])
