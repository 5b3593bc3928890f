"""The FLOPs of a training step: each Linear with the tokens it multiplies, attention over the joined sequence,
and the forward the checkpointed blocks run again (docs/memory.md, "Time"). No torch here.
"""

from __future__ import annotations

from functools import lru_cache

from fluxbooth.contract.settings_groups import checkpointed_blocks
from fluxbooth.plan.memory import image_tokens, sequence_tokens
from fluxbooth.plan.types import JobShape
from fluxbooth.sizing import ModelSize


def forward_flops(model: ModelSize, job: JobShape) -> float:
    """One forward pass of one sample: 2 * in * out * tokens for each Linear, with the tokens it really
    multiplies (sizing.linear_stream: one vector for the modulation and the embedders, its own stream's tokens
    for a double-stream weight, the joined sequence in a single-stream block), and 4*T^2*D per block for
    attention over the joined sequence."""
    return _forward_flops_of(model, job, *_linear_elements_by_stream(model, None))


def recomputed_flops(model: ModelSize, job: JobShape, checkpoint_every: int) -> float:
    """The forward of the checkpointed blocks (every `checkpoint_every`-th of each stack), which the backward
    runs again: the cost of activation checkpointing."""
    streams, blocks = _linear_elements_by_stream(model, checkpoint_every)
    return _forward_flops_of(model, job, streams, blocks) if blocks else 0.0


# Cached: the planner prices thousands of candidates over one model; the sums only change with the model.
@lru_cache(maxsize=256)
def _linear_elements_by_stream(
    model: ModelSize, checkpoint_every: int | None
) -> tuple[tuple[tuple[str, int], ...], int]:
    """in x out of the Linears by the tokens each multiplies, and the number of blocks: of the whole transformer
    (None), or of the blocks checkpointed every `checkpoint_every`-th of each stack."""
    by_block, shape = model.linear_elements_by_block, model.transformer
    names = (
        list(by_block)
        if checkpoint_every is None
        else [
            f"{stack}.{index}"
            for stack, count in (
                ("transformer_blocks", shape.num_layers),
                ("single_transformer_blocks", shape.num_single_layers),
            )
            for index in checkpointed_blocks(count, checkpoint_every)
        ]
    )
    totals: dict[str, int] = {}
    for streams in (by_block.get(name, {}) for name in names):
        for stream, elements in streams.items():
            totals[stream] = totals.get(stream, 0) + elements
    return tuple(totals.items()), shape.num_blocks if checkpoint_every is None else len(names)


def _forward_flops_of(
    model: ModelSize, job: JobShape, elements_by_stream: tuple[tuple[str, int], ...], blocks: int
) -> float:
    """forward_flops of Linears with `elements_by_stream` (in x out by the tokens each multiplies) and the
    attention of `blocks` blocks."""
    image = image_tokens(job.resolution) * model.sequence_images
    tokens_of = {"vector": 1, "text": job.max_sequence_length, "image": image, "joint": image + job.max_sequence_length}
    weights = sum(2 * elements * tokens_of[stream] for stream, elements in elements_by_stream)
    tokens = sequence_tokens(model, job)
    return weights + 4 * tokens * tokens * model.transformer.hidden_size * blocks


def training_flops_per_sample(model: ModelSize, job: JobShape, training_type: str, checkpoint_every: int = 1) -> float:
    """Forward, backward 2x forward (1x when weights are frozen: no weight gradients), plus the checkpointed
    blocks' forward again (`recomputed_flops`)."""
    backward_factor = 2.0 if training_type == "full" else 1.0
    return forward_flops(model, job) * (1 + backward_factor) + recomputed_flops(model, job, checkpoint_every)
