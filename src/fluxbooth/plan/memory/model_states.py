"""Where the model states live under each strategy: the weights, gradients and optimizer states on the GPU, in
host RAM or on NVMe, per ZeRO stage and offload target (docs/memory.md, "Model states"). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from fluxbooth.contract import deepspeed_numbers as ds
from fluxbooth.host.pinned import BLOCK_SWAP_DEVICE_SLOTS
from fluxbooth.plan.host_buffers import (
    allocated_bytes,
    block_store_bytes,
    block_store_sizes,
    block_tensor_bytes,
    parameter_numels,
    zero3_optimizer_offload_allocations,
    zero3_param_offload_allocations,
    zero12_offload_allocations,
)
from fluxbooth.plan.memory.weights import FUSED_STEP_BYTES_PER_PARAM, adafactor_state_bytes, frozen_base_bytes
from fluxbooth.plan.types import Strategy
from fluxbooth.sizing import ModelSize


def _zero12_states(
    strategy: Strategy,
    trainable: int,
    weights: dict[str, int],
    n: int,
    width: int,
    state: int,
    on_cuda: bool,
    largest_parameter: int = 0,
) -> tuple[dict[str, int], dict[str, int]]:
    partitioned_state, _ = _state_bytes(width, state)
    device: dict[str, int] = dict(weights)
    host: dict[str, int] = {}
    if strategy.offload_optimizer == "none":
        if strategy.zero_stage == 1:
            device["gradients"] = trainable * width
            device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
        else:
            device["optimizer_states_partition"] = trainable * partitioned_state // n
    else:
        # DeepSpeed's own buffers as it allocates them (plan/host_buffers.py): pinned ones rounded up to a
        # power of two by PyTorch's caching host allocator (launch_files.py pins them on CUDA).
        allocations = zero12_offload_allocations(trainable, largest_parameter, n, width, state, pinned=on_cuda)
        for allocation in allocations:
            host[f"offload_{allocation.name}"] = host.get(f"offload_{allocation.name}", 0) + allocation.allocated_bytes
    # DeepSpeed allocates whole buckets: the CUDA allocator reserves them, while on the CPU only
    # the pages written (at most the trainable parameters) become resident. With overlap_comm
    # (CUDA only, see launch_files.py) the reduce bucket is double-buffered.
    # Sized as launch_files.py writes them: for what is trained (ds.zero2_bucket_elements).
    reduce_bucket = ds.zero2_bucket_elements(ds.ZERO2_REDUCE_BUCKET_ELEMENTS, trainable)
    if on_cuda:
        device["gradient_buckets"] = reduce_bucket * width * 2
        if n > 1:
            device["allgather_bucket"] = ds.zero2_bucket_elements(ds.ZERO2_ALLGATHER_BUCKET_ELEMENTS, trainable) * width
    else:
        device["gradient_buckets"] = min(trainable, reduce_bucket) * width
    return device, host


def _state_bytes(width: int, state: int) -> tuple[int, int]:
    """(partitioned on the device, offloaded to the host) bytes per trainable parameter: 16-bit grads,
    fp32 grads, the fp32 master (only when training in 16 bits) and the optimizer state."""
    master = 4 if width == 2 else 0
    partitioned = width + 4 + master + state if width == 2 else 4 + state
    offloaded = 4 + master + state if width == 2 else 4 + state
    return partitioned, offloaded


def _frozen_placement(
    strategy: Strategy, model: ModelSize, trainable: int, width: int, processes: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of the weights outside ZeRO-3: the trainable ones in 16 bits, the frozen
    base as stored, whole on each GPU; or, block-swapped, its blocks in pinned host RAM and two of them on the
    GPU at a time (the one computing and the one prefetched, in the swapper's device slots), the rest of it
    (embedders, output) on the GPU;
    each process pins its own copy of the blocks. The fused full fine-tune swaps its trained bf16 blocks the
    same way (each written back to its pinned copy after its backward)."""
    frozen = frozen_base_bytes(model, strategy.base_precision, width) if strategy.training_type == "lora" else {}
    device = {
        "weights_16bit": trainable * width if strategy.training_type == "lora" else model.transformer_params * width
    }
    if not strategy.block_swap:
        device.update(frozen)
        return device, {}
    in_blocks = sum(sum(sizes) for sizes in block_tensor_bytes(model, strategy.base_precision, width).values())
    # Each block's tensors pinned in place at their own size (fluxbooth.host.pinned), streamed through
    # BLOCK_SWAP_DEVICE_SLOTS device buffers of the largest block's size, allocated once (train/blockswap.py).
    swapped = BLOCK_SWAP_DEVICE_SLOTS * max(
        block_store_sizes(model, strategy.base_precision, width).values(), default=0
    )
    pinned = processes * sum(block_store_bytes(model, strategy.base_precision, width).values())
    if strategy.training_type == "full":
        outside = device["weights_16bit"] - in_blocks
        return {"weights_outside_blocks": outside, "swapped_blocks": swapped}, {"trained_blocks_pinned": pinned}
    device["frozen_weights_outside_blocks"] = int(sum(frozen.values()) - in_blocks)
    device["swapped_blocks"] = swapped
    return device, {"frozen_blocks_pinned": pinned}


# Cached: one allocation per parameter and process, priced for every ZeRO-3 parameter-offload candidate.
@lru_cache(maxsize=256)
def _offloaded_parameter_bytes(
    model: ModelSize,
    training_type: str,
    lora: tuple[int, tuple[str, ...]],
    trainable: int,
    processes: int,
    width: int,
    pinned: bool,
) -> int:
    numels = parameter_numels(model, training_type, *lora)
    return allocated_bytes(zero3_param_offload_allocations(numels, trainable, processes, width, pinned))


def model_state_bytes(
    strategy: Strategy,
    model: ModelSize,
    trainable: int,
    processes: int,
    width: int,
    on_cuda: bool = True,
    state: int = 8,
    largest_parameter: int = 0,
    lora: tuple[int, Sequence[str]] = (0, ()),
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(device, host, disk) terms of the model states. DeepSpeed's estimators
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) without
    their 1.5x buffer factor — margins are applied once, in `fits` — extended to frozen weights
    (LoRA's base, quantised or not) and to NVMe. Device terms are per GPU, host and disk terms for the
    node. `state`: the optimizer's fp32 state bytes per trainable parameter (8 for Adam); `largest_parameter`:
    the elements of the largest trainable parameter (DeepSpeed's CPU offload sizes a pinned buffer by it);
    `lora`: the LoRA's rank and targets (ZeRO-3's parameter offload pins every parameter's partition)."""
    lora_rank, targets = lora
    n = processes
    weights, host = _frozen_placement(strategy, model, trainable, width, processes)
    disk: dict[str, int] = {}
    if strategy.fused_backward_pass:
        # Every weight in bf16 (no fp32 master copy), Adafactor's factored state, no gradient buffer.
        device = dict(weights)
        device["optimizer_states_factored"] = adafactor_state_bytes(model)
        device["fused_step_working"] = FUSED_STEP_BYTES_PER_PARAM * model.largest_layer_params
        return device, host, disk
    if not strategy.use_deepspeed:
        # Plain accelerate: fp32 trainable weights under autocast, fp32 grads, optimizer state; frozen
        # weights as stored.
        device = {key: value for key, value in weights.items() if key != "weights_16bit"}
        device["trainable_weights_grads_optimizer"] = trainable * (8 + state)
        return device, host, disk
    if strategy.zero_stage in (1, 2):
        device, offloaded = _zero12_states(strategy, trainable, weights, n, width, state, on_cuda, largest_parameter)
        return device, {**host, **offloaded}, disk
    partitioned_state, _ = _state_bytes(width, state)
    master = 4 if width == 2 else 0
    frozen = model.transformer_params if strategy.training_type == "lora" else 0
    device = {"largest_layer_gathered": 4 * model.largest_layer_params}
    # ZeRO-3: the largest layer is gathered (weights and grads, 16-bit) while it computes.
    reduce_bucket = ds.ZERO3_REDUCE_BUCKET_ELEMENTS if on_cuda else min(trainable, ds.ZERO3_REDUCE_BUCKET_ELEMENTS)
    prefetch = min(model.transformer_params, ds.ZERO3_PREFETCH_BUCKET_ELEMENTS)
    device["zero3_buckets"] = (reduce_bucket + prefetch) * width
    weights_16bit = (trainable + frozen) * width
    if strategy.offload_param == "none":
        device["weights_16bit_partition"] = weights_16bit // n
    elif strategy.offload_param == "cpu":
        host["weights_16bit_offloaded"] = _offloaded_parameter_bytes(
            model, strategy.training_type, (lora_rank, tuple(targets)), trainable, n, width, on_cuda
        )
    else:
        disk["weights_16bit_swapped"] = weights_16bit
        host["param_swap_buffers"] = (
            ds.PARAM_SWAP_BUFFER_COUNT * min(model.transformer_params, ds.PARAM_SWAP_BUFFER_ELEMENTS) * width
        )
        host["weights_16bit_kept_in_cpu"] = min(trainable + frozen, ds.PARAMS_KEPT_IN_CPU_ELEMENTS) * width
    if strategy.offload_optimizer == "none":
        device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
    elif strategy.offload_optimizer == "cpu":
        allocations = zero3_optimizer_offload_allocations(trainable, n, state, ds.ZERO3_SUB_GROUP_ELEMENTS, on_cuda)
        host["optimizer_states_offloaded"] = allocated_bytes(allocations)
    else:
        # ZeRO-Infinity swaps the fp32 master and optimizer states; fp32 gradients stay in host RAM.
        host["gradients_fp32"] = trainable * 4
        disk["optimizer_states_swapped"] = trainable * (master + state)
        # Pinned fp32 buffers of one sub-group each (launch_files.py: sub_group_size) for the master and state.
        host["optimizer_swap_buffers"] = (
            ds.OPTIMIZER_SWAP_BUFFER_COUNT * min(trainable, ds.ZERO3_SUB_GROUP_ELEMENTS) * 4
        )
    return device, host, disk


def ema_host_bytes(trainable: int, largest_parameter: int, width: int) -> dict[str, int]:
    """train/ema.py: an fp32 copy of every trained weight on the main process's CPU (exported beside them), and
    while it updates, one weight at a time copied to the host and cast to fp32 (the largest sets the peak)."""
    return {"ema_shadow": trainable * 4, "ema_update_working": largest_parameter * (width + 4)}
