"""The host buffers a plan allocates, listed one allocation at a time with the bytes requested and whether it is
pinned, so the planner charges each as it is really allocated (`fluxbooth.host.pinned` owns the rounding):
- the block swapper's tensors, each pinned in place at its own size (to the page);
- DeepSpeed ZeRO-1/2's CPU-offload buffers, as deepspeed/runtime/zero/stage_1_and_2.py (0.19) allocates them
  per process and per parameter group (the trainer gives DeepSpeed one group): the fp32 master partition and
  its fp32 gradient partition, the 16-bit staging buffer the updated partition is copied through to the GPU
  (`param_buffer_of_bit16_for_cpu_offload_groups`) and the 16-bit buffer one gradient is copied through
  (`temp_grad_buffer_for_cpu_offload`, the largest parameter's size), each pinned with `pin_memory()` when
  the DeepSpeed config says `pin_memory` (launch_files.py: on CUDA); and the optimizer's state, which
  DeepSpeedCPUAdam creates pageable (`torch.zeros_like` on the master partition);
- DeepSpeed ZeRO-3's (deepspeed/runtime/zero/stage3.py, partition_parameters.py): with `offload_optimizer:
  cpu` its fp32 master partitions (pageable copies), the flat fp32 gradient buffer of every partition
  (`grad_partitions_flat_buffer`, pinned) and one sub-group's fp32 gradient buffer (`subgroup_gradient_buffer`,
  pinned, cached and reused from sub-group to sub-group); with `offload_param: cpu` each parameter's 16-bit
  partition, pinned one by one as zero.Init partitions it (then moved into the flat buffer: the freed blocks
  stay in PyTorch's pinned cache), and the flat 16-bit buffer (`param_groups_fp16_flat_cpu_memory`, pinned).
No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from fluxbooth.contract.precision import block_of, is_quantised_layer
from fluxbooth.host.pinned import block_store_layout, block_store_pinned_bytes, caching_host_allocation_bytes
from fluxbooth.sizing import ModelSize, matches_lora_target, norm_params_per_module

# The ZeRO-1/2 flat partition is padded to this many elements per process (stage_1_and_2.py:
# nccl_start_alignment_factor, 4-byte alignment of 16-bit elements).
ZERO12_PARTITION_ALIGNMENT = 2
# Quantised layers' stored tensors (fluxbooth.train.quantize): NF4 blocks of 64 weights, one fp32 scale per
# 256 block absmax values plus their mean, a 16-value NF4 table and a 256-value dynamic map in fp32.
NF4_BLOCK = 64
NF4_ABSMAX_PER_SCALE = 256
NF4_LAYER_TABLES_BYTES = 4 * (16 + 256)


@dataclass(frozen=True)
class HostAllocation:
    """One host allocation: what is requested, and whether it is pinned through PyTorch's caching host
    allocator (rounded up to a power of two) or is pageable (`pinned` False)."""

    name: str
    requested_bytes: int
    pinned: bool

    @property
    def allocated_bytes(self) -> int:
        return caching_host_allocation_bytes(self.requested_bytes) if self.pinned else self.requested_bytes


def _layer_tensor_bytes(in_features: int, out_features: int, bias: bool, precision: str, width: int) -> list[int]:
    weights = in_features * out_features
    bias_bytes = [out_features * width] if bias else []
    if precision == "fp8":
        return [weights, 4 * out_features, *bias_bytes]
    if precision == "nf4":
        blocks = math.ceil(weights / NF4_BLOCK)
        scales = 4 * (1 + math.ceil(blocks / NF4_ABSMAX_PER_SCALE))
        return [blocks * NF4_BLOCK // 2, blocks, scales, 16 * 4, 256 * 4, *bias_bytes]
    return [weights * width, *bias_bytes]


def block_tensor_bytes(model: ModelSize, precision: str, width: int) -> dict[str, list[int]]:
    """Every tensor of each transformer block in bytes, as the block swapper takes them: the Linears' weights
    (quantised ones with their scales and tables) and biases, and the attention norms' weights, in `width`."""
    return {name: list(sizes) for name, sizes in _block_tensor_bytes(model, precision, width).items()}


# Cached: the planner prices thousands of candidates over one model, and this walks every Linear.
@lru_cache(maxsize=64)
def _block_tensor_bytes(model: ModelSize, precision: str, width: int) -> dict[str, list[int]]:
    blocks: dict[str, list[int]] = {}
    for layer in model.linear_layers:
        if is_quantised_layer(layer.name):
            sizes = _layer_tensor_bytes(layer.in_features, layer.out_features, layer.bias, precision, width)
            blocks.setdefault(block_of(layer.name), []).extend(sizes)
    for module, params in norm_params_per_module(model.transformer).items():
        blocks.setdefault(block_of(module), []).append(params * width)
    return blocks


def block_store_sizes(model: ModelSize, precision: str, width: int) -> dict[str, int]:
    """Each block's bytes laid out in a device slot (fluxbooth.host.pinned.block_store_layout)."""
    return dict(_block_store_sizes(model, precision, width))


@lru_cache(maxsize=64)
def _block_store_sizes(model: ModelSize, precision: str, width: int) -> tuple[tuple[str, int], ...]:
    blocks = _block_tensor_bytes(model, precision, width)
    return tuple((name, block_store_layout(sizes)[1]) for name, sizes in blocks.items())


def block_store_bytes(model: ModelSize, precision: str, width: int) -> dict[str, int]:
    """Each block's tensors as pinned (fluxbooth.host.pinned.block_store_pinned_bytes): what block swapping pins."""
    return dict(_block_store_bytes(model, precision, width))


@lru_cache(maxsize=64)
def _block_store_bytes(model: ModelSize, precision: str, width: int) -> tuple[tuple[str, int], ...]:
    blocks = _block_tensor_bytes(model, precision, width)
    return tuple((name, block_store_pinned_bytes(sizes)) for name, sizes in blocks.items())


def largest_trainable_parameter(model: ModelSize, training_type: str, lora_rank: int, targets: Sequence[str]) -> int:
    """Elements of the largest single trainable parameter (DeepSpeed sizes its gradient copy buffer by it)."""
    return _largest_trainable_parameter(model, training_type, lora_rank, tuple(targets))


# Cached: asked for every candidate, and it walks every Linear.
@lru_cache(maxsize=256)
def _largest_trainable_parameter(model: ModelSize, training_type: str, lora_rank: int, names: tuple[str, ...]) -> int:
    if training_type == "lora":
        return max(
            (
                lora_rank * max(layer.in_features, layer.out_features)
                for layer in model.linear_layers
                if matches_lora_target(layer.name, names)
            ),
            default=0,
        )
    return max((layer.in_features * layer.out_features for layer in model.linear_layers), default=0)


def zero12_partition_elements(trainable: int, processes: int) -> int:
    """Elements of one process's flat partition: the group padded to a multiple of alignment x processes."""
    alignment = ZERO12_PARTITION_ALIGNMENT * processes
    return math.ceil(trainable / alignment) * alignment // processes


def zero12_offload_allocations(
    trainable: int, largest_parameter: int, processes: int, width: int, state: int, pinned: bool
) -> list[HostAllocation]:
    """Every host buffer ZeRO-1/2 with `offload_optimizer: cpu` allocates, per process (see the module doc).
    `state`: the optimizer's fp32 state bytes per element; `width`: the training dtype's bytes."""
    partition = zero12_partition_elements(trainable, processes)
    per_process = [
        HostAllocation("fp32_master_partition", 4 * partition, pinned),
        HostAllocation("fp32_gradient_partition", 4 * partition, pinned),
        HostAllocation("bit16_staging_buffer", width * partition, pinned),
        HostAllocation("gradient_copy_buffer", width * largest_parameter, pinned),
        HostAllocation("optimizer_states", state * partition, False),
    ]
    return per_process * processes


def allocated_bytes(allocations: Sequence[HostAllocation]) -> int:
    return sum(allocation.allocated_bytes for allocation in allocations)


def zero3_optimizer_offload_allocations(
    trainable: int, processes: int, state: int, sub_group: int, pinned: bool
) -> list[HostAllocation]:
    """ZeRO-3's host buffers with `offload_optimizer: cpu`, for every process (see the module doc)."""
    partition = math.ceil(trainable / processes)
    per_process = [
        HostAllocation("fp32_master_partition", 4 * partition, False),
        HostAllocation("fp32_gradient_flat_buffer", 4 * partition, pinned),
        HostAllocation("fp32_subgroup_gradient_buffer", 4 * min(partition, sub_group), pinned),
        HostAllocation("optimizer_states", state * partition, False),
    ]
    return per_process * processes


def parameter_numels(model: ModelSize, training_type: str, lora_rank: int, targets: Sequence[str]) -> list[int]:
    """Elements of every parameter of the transformer (and, for a LoRA, of its A and B matrices)."""
    return list(_parameter_numels(model, training_type, lora_rank, tuple(targets)))


# Cached: ZeRO-3 parameter offload prices each parameter's partition for every candidate.
@lru_cache(maxsize=256)
def _parameter_numels(model: ModelSize, training_type: str, lora_rank: int, names: tuple[str, ...]) -> tuple[int, ...]:
    numels = []
    for layer in model.linear_layers:
        numels.append(layer.in_features * layer.out_features)
        if layer.bias:
            numels.append(layer.out_features)
        if training_type == "lora" and matches_lora_target(layer.name, names):
            numels += [lora_rank * layer.in_features, lora_rank * layer.out_features]
    return (*numels, *norm_params_per_module(model.transformer).values())


def zero3_param_offload_allocations(
    numels: Sequence[int], trainable: int, processes: int, width: int, pinned: bool
) -> list[HostAllocation]:
    """ZeRO-3's host buffers with `offload_param: cpu`, for every process: each parameter's partition, and the
    flat buffer the trained ones (the optimizer's groups) end up in (see the module doc)."""
    partitions = [math.ceil(numel / processes) for numel in numels]
    per_process = [HostAllocation("parameter_partition", width * partition, pinned) for partition in partitions]
    per_process.append(HostAllocation("flat_16bit_buffer", width * math.ceil(trainable / processes), pinned))
    return per_process * processes
