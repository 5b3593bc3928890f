"""Which samples each micro-batch holds: a pure function of the seed and the batch's position (so a resumed
run sees the same data), with caption dropout's empty prompt in place of some instance captions."""

from __future__ import annotations

import torch

from fluxbooth.train.cache import VaeNormalisation
from fluxbooth.train.loop import micro_batch
from fluxbooth.train.state import CachedData, EncodedImages, EncodedPrompts

IDENTITY = VaeNormalisation(shift_factor=0.0, scaling_factor=1.0)
EMPTY = EncodedPrompts([""], torch.zeros(1, 3, 2), torch.zeros(1, 2))


def image_set(count: int, prompts: int, fill: float) -> EncodedImages:
    """`count` images with 1x4x4 latents; image i has prompt i % prompts, whose embeddings are all `fill + row`."""
    rows = torch.arange(prompts, dtype=torch.float32)
    return EncodedImages(
        latent_mean=torch.arange(count, dtype=torch.float32).view(count, 1, 1, 1).expand(count, 1, 4, 4).clone(),
        latent_std=torch.zeros(count, 1, 4, 4),
        prompt_index=torch.arange(count) % prompts,
        prompt_embeds=(fill + rows).view(prompts, 1, 1).expand(prompts, 3, 2).clone(),
        pooled_prompt_embeds=(fill + rows).view(prompts, 1).expand(prompts, 2).clone(),
        prompts=[f"caption {row}" for row in range(prompts)],
    )


def cached(with_class: bool = False) -> CachedData:
    return CachedData(
        instance_set=image_set(5, 5, fill=1.0),
        class_set=image_set(3, 1, fill=100.0) if with_class else None,
        validation_prompts=None,
        released_before_training=[],
        empty_prompt=EMPTY,
    )


def dropped(batch: dict[str, torch.Tensor]) -> list[bool]:
    """Which samples of a batch carry the empty prompt's (all-zero) embeddings."""
    return [bool((row == 0).all()) for row in batch["pooled_prompt_embeds"]]


def dropout_pattern(seed: int, rate: float, batches: int = 200, batch_size: int = 2) -> list[bool]:
    data = cached()
    pattern: list[bool] = []
    for index in range(batches):
        pattern += dropped(micro_batch(seed, batch_size, data, index * batch_size, IDENTITY, rate))
    return pattern


def test_without_caption_dropout_every_caption_is_kept() -> None:
    assert not any(dropout_pattern(seed=1, rate=0.0))


def test_at_caption_dropout_1_every_caption_is_the_empty_prompt() -> None:
    assert all(dropout_pattern(seed=1, rate=1.0))


def test_caption_dropout_replaces_about_its_share_of_captions() -> None:
    pattern = dropout_pattern(seed=1, rate=0.25, batches=400)

    assert 0.2 < sum(pattern) / len(pattern) < 0.3


def test_caption_dropout_is_the_same_for_the_same_seed_and_differs_between_seeds() -> None:
    assert dropout_pattern(seed=1, rate=0.25) == dropout_pattern(seed=1, rate=0.25)
    assert dropout_pattern(seed=1, rate=0.25) != dropout_pattern(seed=2, rate=0.25)


def test_a_dropped_caption_keeps_its_image() -> None:
    data = cached()
    kept = micro_batch(3, 2, data, 10, IDENTITY, 0.0)
    emptied = micro_batch(3, 2, data, 10, IDENTITY, 1.0)

    assert torch.equal(kept["latents"], emptied["latents"])


def test_class_captions_are_never_dropped() -> None:
    batch = micro_batch(1, 2, cached(with_class=True), 0, IDENTITY, 1.0)

    assert dropped(batch) == [True, True, False, False]
