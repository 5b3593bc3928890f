"""Stage "train"'s batches: which cached samples each micro-batch holds.

A micro-batch holds one training shape (aspect bucket), so its latents stack. Each pass over the instance
samples (an image at one size) is planned whole: every bucket's samples in a fresh seeded order, cut into
batches (the last one topped up from the same bucket), and the batches of all buckets shuffled together.
Class images (prior preservation) come from the same bucket, and a seeded share of instance captions is
replaced by the empty prompt (caption dropout). Every choice is a pure function of the seed and the
micro-batch's number, so a resumed run, or another rank, sees exactly the data it would have seen.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from fluxbooth.contract.buckets import Shape
from fluxbooth.train.family_ops import VaeNormalisation
from fluxbooth.train.state import CachedData, EncodedImages, EncodedPrompts, seed_for

Batch = tuple[Shape, tuple[int, ...]]  # a bucket, and the rows of its samples


def _permutation(count: int, seed: int) -> list[int]:
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()


@lru_cache(maxsize=4)
def epoch_batches(
    seed: int, bucket_sizes: tuple[tuple[Shape, int], ...], batch_size: int, epoch: int
) -> tuple[Batch, ...]:
    """The micro-batches of one pass over the instance samples (`bucket_sizes`: samples per bucket), in
    training order: ceil(samples / batch_size) of each bucket."""
    batches: list[Batch] = []
    for shape, count in bucket_sizes:
        order = _permutation(count, seed_for(seed, "instance", shape, epoch))
        filled = [order[position % count] for position in range(math.ceil(count / batch_size) * batch_size)]
        batches += [(shape, tuple(filled[start : start + batch_size])) for start in range(0, len(filled), batch_size)]
    return tuple(batches[index] for index in _permutation(len(batches), seed_for(seed, "instance_batches", epoch)))


def instance_batch(seed: int, batch_size: int, encoded: EncodedImages, index: int) -> Batch:
    """The bucket and rows of the `index`-th micro-batch of the run (counted over steps, accumulation
    micro-steps and ranks)."""
    bucket_sizes = tuple((shape, len(bucket)) for shape, bucket in sorted(encoded.buckets.items()))
    per_epoch = sum(math.ceil(count / batch_size) for _, count in bucket_sizes)
    epoch, within = divmod(index, per_epoch)
    return epoch_batches(seed, bucket_sizes, batch_size, epoch)[within]


def _stream_rows(seed: int, batch_size: int, count: int, stream: tuple[object, ...], index: int) -> tuple[int, ...]:
    """`batch_size` rows of a bucket of `count` samples at the `index`-th batch of a stream that passes over
    the bucket in a fresh seeded order each time."""
    rows = []
    for position in range(index * batch_size, (index + 1) * batch_size):
        epoch, within = divmod(position, count)
        rows.append(_permutation(count, seed_for(seed, *stream, epoch))[within])
    return tuple(rows)


def _samples(
    seed: int, encoded: EncodedImages, shape: Shape, rows: tuple[int, ...], stream: str, index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latents drawn from each sample's posterior, prompt embeddings, pooled embeddings) of `rows` of a bucket."""
    bucket = encoded.buckets[shape]
    picked = torch.tensor(rows, dtype=torch.long)
    mean, std = bucket.latent_mean[picked], bucket.latent_std[picked]
    generator = torch.Generator().manual_seed(seed_for(seed, stream, "latent", index))
    latents = mean + std * torch.randn(mean.shape, generator=generator)
    prompt = encoded.prompt_index[bucket.image_index[picked]]
    return latents, encoded.prompt_embeds[prompt], encoded.pooled_prompt_embeds[prompt]


def _controls(encoded: EncodedImages, shape: Shape, rows: tuple[int, ...]) -> torch.Tensor | None:
    """The control latents of `rows` of a bucket (Kontext pairs; their posterior's mean), or None without pairs."""
    control = encoded.buckets[shape].control_mean
    return None if control is None else control[torch.tensor(rows, dtype=torch.long)]


def _drop_captions(
    prompt_embeds: torch.Tensor, pooled: torch.Tensor, empty: EncodedPrompts, rate: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's embeddings replaced by the empty prompt's with probability `rate`, drawn from `seed`."""
    dropped = torch.rand(prompt_embeds.shape[0], generator=torch.Generator().manual_seed(seed)) < rate
    prompt_embeds = torch.where(dropped[:, None, None], empty.prompt_embeds[:1].expand_as(prompt_embeds), prompt_embeds)
    pooled = torch.where(dropped[:, None], empty.pooled_prompt_embeds[:1].expand_as(pooled), pooled)
    return prompt_embeds, pooled


def micro_batch(
    seed: int,
    batch_size: int,
    data: CachedData,
    index: int,
    normalisation: VaeNormalisation,
    caption_dropout: float = 0.0,
) -> dict[str, Any]:
    """The `index`-th micro-batch of the run: `batch_size` instance samples of one bucket (then as many class
    images of the same shape), their latents normalised, with caption dropout applied."""
    shape, rows = instance_batch(seed, batch_size, data.instance_set, index)
    latents, prompt_embeds, pooled = _samples(seed, data.instance_set, shape, rows, "instance", index)
    control = _controls(data.instance_set, shape, rows)
    if caption_dropout > 0 and data.empty_prompt is not None:
        dropout_seed = seed_for(seed, "caption_dropout", index)
        prompt_embeds, pooled = _drop_captions(prompt_embeds, pooled, data.empty_prompt, caption_dropout, dropout_seed)
    if data.class_set is not None:
        class_rows = _stream_rows(seed, batch_size, len(data.class_set.buckets[shape]), ("class", shape), index)
        class_latents, class_prompt_embeds, class_pooled = _samples(
            seed, data.class_set, shape, class_rows, "class", index
        )
        latents = torch.cat([latents, class_latents])
        prompt_embeds = torch.cat([prompt_embeds, class_prompt_embeds])
        pooled = torch.cat([pooled, class_pooled])
    batch = {"latents": normalisation.apply(latents), "prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
    return batch if control is None else {**batch, "control_latents": normalisation.apply(control)}


def first_samples(encoded: EncodedImages, count: int) -> list[dict[str, torch.Tensor]]:
    """Up to `count` single-sample batches (posterior means and control latents, not normalised), the first of
    each bucket in turn: a fixed set to measure the loss on."""
    rows = [(shape, row) for row in range(max(map(len, encoded.buckets.values()))) for shape in sorted(encoded.buckets)]
    chosen = [(shape, row) for shape, row in rows if row < len(encoded.buckets[shape])][:count]
    batches = []
    for shape, row in chosen:
        bucket = encoded.buckets[shape]
        prompt = encoded.prompt_index[bucket.image_index[row : row + 1]]
        sample = {
            "latents": bucket.latent_mean[row : row + 1],
            "prompt_embeds": encoded.prompt_embeds[prompt],
            "pooled_prompt_embeds": encoded.pooled_prompt_embeds[prompt],
        }
        control = _controls(encoded, shape, (row,))
        batches.append(sample if control is None else {**sample, "control_latents": control})
    return batches
