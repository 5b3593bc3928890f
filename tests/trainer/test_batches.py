"""Which samples each micro-batch holds (fluxbooth.train.batches): one bucket per batch, every sample once per
pass, a pure function of the seed and the batch's number (so a resumed run sees the same data), and caption
dropout's empty prompt in place of some instance captions."""

from __future__ import annotations

import math
from collections import Counter

import torch

from fluxbooth.train.batches import epoch_batches, first_samples, instance_batch, micro_batch
from fluxbooth.train.family_ops import VaeNormalisation
from fluxbooth.train.state import CachedData, EncodedBucket, EncodedImages, EncodedPrompts

IDENTITY = VaeNormalisation(shift_factor=0.0, scaling_factor=1.0)
EMPTY = EncodedPrompts([""], torch.zeros(1, 3, 2), torch.zeros(1, 2))
# Instance samples per bucket: (width, height) → how many; latents are 1 x height/8 x width/8.
INSTANCE_BUCKETS = {(32, 16): 3, (16, 16): 5, (16, 32): 1}


def image_set(buckets: dict[tuple[int, int], int], fill: float, images: int) -> EncodedImages:
    """`images` images, image i with its own prompt whose embeddings are all `fill + i`; in each bucket,
    sample k is image k % images, its latent filled with a number unique to (bucket, k)."""
    encoded_buckets = {}
    for order, ((width, height), count) in enumerate(sorted(buckets.items())):
        values = torch.arange(count, dtype=torch.float32) + 100 * order
        encoded_buckets[(width, height)] = EncodedBucket(
            image_index=torch.arange(count) % images,
            latent_mean=values.view(count, 1, 1, 1).expand(count, 1, height // 8, width // 8).clone(),
            latent_std=torch.zeros(count, 1, height // 8, width // 8),
        )
    rows = fill + torch.arange(images, dtype=torch.float32)
    return EncodedImages(
        prompt_index=torch.arange(images),
        prompt_embeds=rows.view(images, 1, 1).expand(images, 3, 2).clone(),
        pooled_prompt_embeds=rows.view(images, 1).expand(images, 2).clone(),
        prompts=[f"caption {index}" for index in range(images)],
        buckets=encoded_buckets,
    )


def cached(with_class: bool = False) -> CachedData:
    return CachedData(
        instance_set=image_set(INSTANCE_BUCKETS, fill=1.0, images=5),
        class_set=image_set(dict.fromkeys(INSTANCE_BUCKETS, 2), fill=100.0, images=2) if with_class else None,
        validation_prompts=None,
        released_before_training=[],
        empty_prompt=EMPTY,
    )


def per_pass(batch_size: int) -> int:
    return sum(math.ceil(count / batch_size) for count in INSTANCE_BUCKETS.values())


# ------------------------------------------------------------------------------------------ buckets


def test_each_micro_batch_holds_one_bucket() -> None:
    data = cached()
    for index in range(3 * per_pass(2)):
        shape, _ = instance_batch(5, 2, data.instance_set, index)
        latents = micro_batch(5, 2, data, index, IDENTITY)["latents"]
        assert latents.shape == (2, 1, shape[1] // 8, shape[0] // 8)


def test_one_pass_trains_every_sample_of_every_bucket() -> None:
    data = cached()
    seen = {instance_batch(5, 2, data.instance_set, index) for index in range(per_pass(2))}

    covered = {(shape, row) for shape, rows in seen for row in rows}
    assert covered == {(shape, row) for shape, count in INSTANCE_BUCKETS.items() for row in range(count)}


def test_a_pass_holds_each_bucket_as_often_as_its_samples_fill_batches() -> None:
    bucket_sizes = tuple(sorted(INSTANCE_BUCKETS.items()))

    shapes = Counter(shape for shape, _ in epoch_batches(5, bucket_sizes, 2, 0))

    assert shapes == {(32, 16): 2, (16, 16): 3, (16, 32): 1}


def test_a_bucket_smaller_than_the_batch_is_topped_up_from_itself() -> None:
    bucket_sizes = (((16, 32), 1),)

    assert epoch_batches(5, bucket_sizes, 3, 0) == (((16, 32), (0, 0, 0)),)


def test_the_order_is_the_same_for_the_same_seed_and_differs_between_seeds_and_passes() -> None:
    def order(seed: int, first: int) -> list[object]:
        return [instance_batch(seed, 2, cached().instance_set, index) for index in range(first, first + per_pass(2))]

    assert order(5, 0) == order(5, 0)
    assert order(5, 0) != order(6, 0)
    assert order(5, 0) != order(5, per_pass(2))


def test_a_batch_depends_only_on_the_seed_and_its_number() -> None:
    later = micro_batch(5, 2, cached(), 7, IDENTITY)

    for index in range(7):
        micro_batch(5, 2, cached(), index, IDENTITY)
    again = micro_batch(5, 2, cached(), 7, IDENTITY)

    assert all(torch.equal(later[name], again[name]) for name in later)


def test_class_images_come_from_the_instance_batch_bucket() -> None:
    data = cached(with_class=True)
    for index in range(per_pass(2)):
        batch = micro_batch(5, 2, data, index, IDENTITY)
        instance, class_images = batch["latents"].chunk(2)
        assert instance.shape == class_images.shape
        assert (batch["pooled_prompt_embeds"][2:] >= 100).all()


def test_the_fixed_loss_samples_take_the_first_sample_of_each_bucket_in_turn() -> None:
    samples = first_samples(cached().instance_set, 4)

    assert [tuple(sample["latents"].shape) for sample in samples] == [
        (1, 1, 2, 2),
        (1, 1, 4, 2),
        (1, 1, 2, 4),
        (1, 1, 2, 2),
    ]


# ---------------------------------------------------------------------------------- caption dropout


def dropped(batch: dict[str, torch.Tensor]) -> list[bool]:
    """Which samples of a batch carry the empty prompt's (all-zero) embeddings."""
    return [bool((row == 0).all()) for row in batch["pooled_prompt_embeds"]]


def dropout_pattern(seed: int, rate: float, batches: int = 200) -> list[bool]:
    data = cached()
    pattern: list[bool] = []
    for index in range(batches):
        pattern += dropped(micro_batch(seed, 2, data, index, IDENTITY, rate))
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
    kept = micro_batch(3, 2, cached(), 10, IDENTITY, 0.0)
    emptied = micro_batch(3, 2, cached(), 10, IDENTITY, 1.0)

    assert torch.equal(kept["latents"], emptied["latents"])


def test_class_captions_are_never_dropped() -> None:
    batch = micro_batch(1, 2, cached(with_class=True), 0, IDENTITY, 1.0)

    assert dropped(batch) == [True, True, False, False]
