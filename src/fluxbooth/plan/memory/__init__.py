"""The memory model: predicted GPU, host-RAM and disk bytes of one strategy, per phase.

Every formula is written down in docs/memory.md and followed here term by term (the names in
`MemoryEstimate.breakdown` are the terms of that document):

- `activations`: tokens, what a micro-step saves for backward, what a render keeps alive;
- `weights`: the weights as stored (quantised or not, per block) and the optimizer state per weight;
- `model_states`: where weights, gradients and optimizer states live under each ZeRO stage and offload;
- `estimate`: the terms summed per phase with the fixed costs and margins, `estimate_memory`.

No torch here.
"""

from fluxbooth.plan.memory.activations import (
    SAVED_BYTES_PER_TOKEN_HIDDEN,
    activation_bytes,
    compute_dtype_bytes,
    image_tokens,
    inference_activation_bytes,
    largest_block_coefficient,
    sequence_tokens,
    token_hidden,
)
from fluxbooth.plan.memory.estimate import (
    CPU_ALLOCATOR_RETENTION,
    CPU_ALLOCATOR_RETENTION_ZERO3,
    CUDA_CONTEXT_GPU_BYTES,
    CUDA_RUNTIME_HOST_BYTES,
    DEEPSPEED_RUNTIME_BYTES,
    DISK_MARGIN,
    GPU_MARGIN,
    HOST_MARGIN,
    LAUNCHER_PROCESS_BYTES,
    OUTSIDE_TRAINER_PHASES,
    REPORT_HOST_BYTES,
    SCORING_GPU_BYTES,
    SCORING_HOST_BYTES,
    TRAINER_PROCESS_BASELINE_BYTES,
    cached_bytes,
    encoder_bytes,
    estimate_memory,
    layer_being_loaded,
    pinned_blocks_bytes,
    training_only_bytes,
)
from fluxbooth.plan.memory.model_states import (
    ema_host_bytes,
    model_state_bytes,
)
from fluxbooth.plan.memory.weights import (
    FP8_BYTES_PER_PARAM,
    FP8_SCALE_BYTES_PER_OUTPUT,
    FUSED_STEP_BYTES_PER_PARAM,
    NF4_BITS_PER_PARAM,
    NF4_TABLE_BYTES_PER_LAYER,
    OPTIMIZER_STATE_BYTES,
    QUANTISER_WORKING_BYTES_PER_PARAM,
    adafactor_state_bytes,
    frozen_base_bytes,
    frozen_block_bytes,
    largest_quantised_layer_params,
    layer_being_quantised,
    optimizer_state_bytes,
    quantised_layer_bytes,
    trainable_params,
)

__all__ = [
    "OUTSIDE_TRAINER_PHASES",
    "CPU_ALLOCATOR_RETENTION",
    "CPU_ALLOCATOR_RETENTION_ZERO3",
    "CUDA_CONTEXT_GPU_BYTES",
    "CUDA_RUNTIME_HOST_BYTES",
    "DEEPSPEED_RUNTIME_BYTES",
    "DISK_MARGIN",
    "FP8_BYTES_PER_PARAM",
    "FP8_SCALE_BYTES_PER_OUTPUT",
    "FUSED_STEP_BYTES_PER_PARAM",
    "GPU_MARGIN",
    "HOST_MARGIN",
    "LAUNCHER_PROCESS_BYTES",
    "NF4_BITS_PER_PARAM",
    "NF4_TABLE_BYTES_PER_LAYER",
    "OPTIMIZER_STATE_BYTES",
    "QUANTISER_WORKING_BYTES_PER_PARAM",
    "REPORT_HOST_BYTES",
    "SAVED_BYTES_PER_TOKEN_HIDDEN",
    "SCORING_GPU_BYTES",
    "SCORING_HOST_BYTES",
    "TRAINER_PROCESS_BASELINE_BYTES",
    "activation_bytes",
    "adafactor_state_bytes",
    "cached_bytes",
    "compute_dtype_bytes",
    "ema_host_bytes",
    "encoder_bytes",
    "estimate_memory",
    "frozen_base_bytes",
    "frozen_block_bytes",
    "image_tokens",
    "inference_activation_bytes",
    "largest_block_coefficient",
    "largest_quantised_layer_params",
    "layer_being_loaded",
    "layer_being_quantised",
    "model_state_bytes",
    "optimizer_state_bytes",
    "pinned_blocks_bytes",
    "quantised_layer_bytes",
    "sequence_tokens",
    "token_hidden",
    "trainable_params",
    "training_only_bytes",
]
