"""Tokens and activations: what one micro-step saves for backward and what a render keeps alive (docs/memory.md,
"Activations"). No torch here.
"""

from __future__ import annotations

import math

from fluxbooth.contract.settings_groups import checkpointed_blocks
from fluxbooth.plan.types import JobShape
from fluxbooth.sizing import ModelSize

# ---- Activation coefficients (bench/activations.py, docs/memory.md "Activations"). -------------
# Bytes saved for backward per (token x hidden unit) by one block, measured with
# torch.autograd.graph.saved_tensors_hooks on FLUX blocks with FLUX's head dim (128) and 2-4 heads
# at 512^2 and 1024^2; linear in heads and tokens to within 4 %. Attention is the SDPA kernel
# (saves q, k, v, output and log-sum-exp, no tokens^2 matrix), as on GPUs with flash/mem-efficient.
SAVED_BYTES_PER_TOKEN_HIDDEN = {
    # compute dtype bytes -> (double-stream block, single-stream block, embedders and output)
    2: (56.1, 50.8, 4.0),
    4: (96.2, 85.5, 8.1),
}


def compute_dtype_bytes(mixed_precision: str) -> int:
    return 4 if mixed_precision == "no" else 2


def image_tokens(resolution: tuple[int, int]) -> int:
    """FLUX packs 2x2 patches of 8x-downsampled latents: one token per 16x16 pixels."""
    width, height = resolution
    return math.ceil(height / 16) * math.ceil(width / 16)


def sequence_tokens(model: ModelSize, job: JobShape) -> int:
    """Tokens in the transformer's sequence: the image's (with FLUX.1 Kontext's pairs, the control image's too)
    and the prompt's."""
    return image_tokens(job.resolution) * model.sequence_images + job.max_sequence_length


def token_hidden(model: ModelSize, job: JobShape) -> int:
    return sequence_tokens(model, job) * model.transformer.hidden_size


def activation_bytes(
    model: ModelSize, job: JobShape, mixed_precision: str, checkpoint_every: int = 1
) -> dict[str, int]:
    """Activation memory of one micro-step at its peak (docs/memory.md, "Activations"), with every
    `checkpoint_every`-th block of each stack checkpointed (0: none, 1: every block).

    Saved: everything the plain blocks saved and the checkpointed blocks' inputs. Working: the gradient flowing
    back at the start of backward, or, where more, a checkpointed block's full activations while it is recomputed
    and back-propagated, less what the plain blocks after it have freed by then (`recompute_coefficient`)."""
    shape = model.transformer
    width = compute_dtype_bytes(mixed_precision)
    double, single, outer = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    tokens = sequence_tokens(model, job)
    hidden = token_hidden(model, job)
    samples = job.samples_per_micro_step
    inputs = (
        job.max_sequence_length * shape.joint_attention_dim
        + image_tokens(job.resolution) * model.sequence_images * shape.in_channels
    ) * width
    embedders = outer * hidden + inputs
    checked_double = len(checkpointed_blocks(shape.num_layers, checkpoint_every))
    checked_single = len(checkpointed_blocks(shape.num_single_layers, checkpoint_every))
    # Float: the per-block coefficients are measured bytes per token and hidden unit.
    saved: float = (
        (shape.num_layers - checked_double) * double
        + (shape.num_single_layers - checked_single) * single
        + (checked_double + checked_single) * width
    ) * hidden
    working = max(2.0 * width, recompute_coefficient(model, width, checkpoint_every)) * hidden
    # Rotary tables (cos, sin in fp32) are shared by all blocks.
    rotary = 2 * tokens * shape.attention_head_dim * 4
    return {
        "activations_saved": int(samples * (saved + embedders) + rotary),
        "activations_working": int(samples * working),
    }


def recompute_coefficient(model: ModelSize, width: int, checkpoint_every: int) -> float:
    """Bytes per token and hidden unit a recomputed block adds to the saved activations at its backward, at the
    worst such block: the backward runs the single stack from its last block, then the double stack, and the
    first checkpointed block it meets in each stack recomputes its whole activations while the plain blocks it
    has passed have freed theirs (0 when none is checkpointed, or when those freed more)."""
    double, single, _ = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    shape = model.transformer
    checked_double = checkpointed_blocks(shape.num_layers, checkpoint_every)
    checked_single = checkpointed_blocks(shape.num_single_layers, checkpoint_every)
    worst = 0.0
    if checked_single:
        worst = single - (shape.num_single_layers - 1 - checked_single[-1]) * single
    if checked_double:
        freed = (shape.num_single_layers - len(checked_single)) * single
        freed += (shape.num_layers - 1 - checked_double[-1]) * double
        worst = max(worst, double - freed)
    return worst


def largest_block_coefficient(model: ModelSize, width: int) -> float:
    double, single, _ = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    shape = model.transformer
    return max(double if shape.num_layers else 0.0, single if shape.num_single_layers else 0.0)


def inference_activation_bytes(model: ModelSize, job: JobShape, mixed_precision: str) -> int:
    """One image rendered without gradients: at most one block's activations are alive at a time."""
    width = compute_dtype_bytes(mixed_precision)
    return int(largest_block_coefficient(model, width) * token_hidden(model, job))
