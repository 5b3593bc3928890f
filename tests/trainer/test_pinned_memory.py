"""Pinned host memory counted as it is allocated (fluxbooth.host.pinned, fluxbooth.plan.host_buffers): the rounding
rule of PyTorch's caching host allocator, the block swapper's tensors pinned at their own size, DeepSpeed's
ZeRO-2 CPU-offload buffers as DeepSpeed allocates them, and the planner's FLUX.1 host charges equal to the
rounded sum of every pinned allocation its plan makes."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from fluxbooth.host.hardware import GIB, MIB, Hardware, hypothetical_hardware
from fluxbooth.host.pinned import (
    BLOCK_SWAP_DEVICE_SLOTS,
    block_store_layout,
    block_store_pinned_bytes,
    caching_host_allocation_bytes,
)
from fluxbooth.models.published_configs import FLUX1_TRANSFORMER
from fluxbooth.plan.host_buffers import HostAllocation, block_tensor_bytes, zero12_offload_allocations
from fluxbooth.plan.memory import estimate_memory
from fluxbooth.plan.types import JobShape, Strategy
from fluxbooth.sizing import model_size
from fluxbooth.train.blockswap import BlockSwapper, flux_blocks, swapped_tensor_bytes

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
SWAPPED_LORA = Strategy("lora", False, 0, "none", "none", "bf16", block_swap=True)
ZERO2_CPU_OFFLOAD_FULL = Strategy("full", True, 2, "cpu", "none")


def gpu(memory_gib: int, host_gib: int) -> Hardware:
    return hypothetical_hardware(
        gpus=1, gpu_memory_bytes=memory_gib * GIB, host_memory_bytes=host_gib * GIB, disk_bytes=500 * GIB
    )


def flux1_dev_on_meta() -> torch.nn.Module:
    """FLUX.1-dev's transformer as diffusers builds it, in bf16 without memory (the meta device), frozen."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**{**FLUX1_TRANSFORMER, "guidance_embeds": True})
    return model.to(torch.bfloat16).requires_grad_(False)


def test_pytorch_pins_every_allocation_at_the_next_power_of_two() -> None:
    assert caching_host_allocation_bytes(18 * MIB) == 32 * MIB  # a 3072x3072 bf16 weight
    assert caching_host_allocation_bytes(72 * MIB) == 128 * MIB  # a 12288x3072 bf16 weight
    assert caching_host_allocation_bytes(64 * MIB) == 64 * MIB
    assert caching_host_allocation_bytes(0) == 0


def test_a_block_store_aligns_every_tensor_and_its_size_does_not_depend_on_the_order() -> None:
    offsets, size = block_store_layout([256, 6144, 1000])
    assert offsets == (0, 512, 6656) and size == 7680
    assert block_store_layout([1000, 6144, 256])[1] == size
    assert block_store_pinned_bytes([256, 6144, 1000]) == 4096 + 8192 + 4096  # each tensor: whole 4 KiB pages


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nf4"])
def test_the_planner_lists_each_tiny_block_as_the_swapper_stores_it(tiny_base: Path, precision: str) -> None:
    from fluxbooth.train.quantize import load_quantised_base

    if precision == "bf16":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel.from_pretrained(
            str(tiny_base), subfolder="transformer", torch_dtype=torch.bfloat16
        )
    else:
        model = load_quantised_base(str(tiny_base), precision, torch.device("cpu"), torch.bfloat16)
    swapper = BlockSwapper(flux_blocks(model.requires_grad_(False)), torch.device("cpu"))
    planned = [
        block_store_layout(sizes)[1] for sizes in block_tensor_bytes(model_size(str(tiny_base)), precision, 2).values()
    ]
    assert swapper.store_bytes() == planned


def test_the_swapper_takes_from_flux1_exactly_the_tensors_the_planner_lists() -> None:
    blocks = flux_blocks(flux1_dev_on_meta())
    planned = list(block_tensor_bytes(model_size(FLUX_DEV), "bf16", 2).values())
    assert [sorted(swapped_tensor_bytes(block)) for block in blocks] == [sorted(sizes) for sizes in planned]


def test_a_swapped_bf16_lora_of_flux1_on_a_24_gib_card_is_charged_its_blocks_as_pinned() -> None:
    job = JobShape(resolution=(1024, 1024))
    estimate = estimate_memory(SWAPPED_LORA, model_size(FLUX_DEV), job, gpu(24, 62), "bf16")
    allocations = [block_store_pinned_bytes(swapped_tensor_bytes(block)) for block in flux_blocks(flux1_dev_on_meta())]
    assert estimate.breakdown["host.frozen_blocks_pinned"] == sum(allocations)
    assert 22.0 * GIB < sum(allocations) < 22.1 * GIB  # not the 34.5 GiB that pinning each tensor would take
    largest_store = max(
        block_store_layout(swapped_tensor_bytes(block))[1] for block in flux_blocks(flux1_dev_on_meta())
    )
    assert estimate.breakdown["gpu.swapped_blocks"] == BLOCK_SWAP_DEVICE_SLOTS * largest_store


def deepspeed_zero2_offload_allocations(parameters: int, largest_parameter: int) -> list[HostAllocation]:
    """What deepspeed/runtime/zero/stage_1_and_2.py (0.19.8) allocates on the host for one process and one
    bf16 parameter group with `offload_optimizer: {device: cpu, pin_memory: true}`."""
    partition = parameters + parameters % 2  # padded to nccl_start_alignment_factor (2) x 1 process
    return [
        HostAllocation("fp32 master: weights_partition, pinned", 4 * partition, True),
        HostAllocation("bf16 staging: param_buffer_of_bit16_for_cpu_offload_groups", 2 * partition, True),
        HostAllocation("temp_grad_buffer_for_cpu_offload: largest parameter, bf16", 2 * largest_parameter, True),
        HostAllocation("fp32 gradient partition: single_partition_of_fp32_groups[i].grad", 4 * partition, True),
        HostAllocation("AdamW's exp_avg and exp_avg_sq, created pageable by the optimizer", 8 * partition, False),
    ]


def test_a_zero2_cpu_offload_full_finetune_of_flux1_on_an_80_gib_card_is_charged_what_deepspeed_pins() -> None:
    model = model_size(FLUX_DEV)
    largest = max(layer.in_features * layer.out_features for layer in model.linear_layers)
    estimate = estimate_memory(ZERO2_CPU_OFFLOAD_FULL, model, JobShape(resolution=(1024, 1024)), gpu(80, 251), "bf16")
    charged = sum(value for name, value in estimate.breakdown.items() if name.startswith("host.offload_"))
    expected = deepspeed_zero2_offload_allocations(model.transformer_params, largest)
    assert charged == sum(allocation.allocated_bytes for allocation in expected)
    # 44.3 GiB of fp32 master and of fp32 gradients take 64 GiB each, the 22.2 GiB staging buffer 32 GiB.
    assert [allocation.allocated_bytes for allocation in expected[:2]] == [64 * GIB, 32 * GIB]


def test_a_zero2_cpu_offload_full_finetune_of_flux1_on_an_80_gib_card_with_251_gib_host_is_refused() -> None:
    from fluxbooth.plan.memory import HOST_MARGIN

    estimate = estimate_memory(
        ZERO2_CPU_OFFLOAD_FULL, model_size(FLUX_DEV), JobShape(resolution=(1024, 1024)), gpu(80, 251), "bf16"
    )
    assert estimate.host_bytes * (1 + HOST_MARGIN) > 251 * GIB
    assert estimate.host_bytes > 290 * GIB


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_real_deepspeed_pins_exactly_the_buffers_the_planner_lists(tiny_base: Path, torch_extensions_dir: Path) -> None:
    """DeepSpeed itself (ZeRO-2, CPU offload with pin_memory) on the tiny transformer: every tensor it asks its
    accelerator to pin is one the planner's allocation list names, at the same size."""
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir)}
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.pinned_probe", str(tiny_base), str(free_port())],
        capture_output=True, text=True, timeout=600, env=environment, check=True,
    )  # fmt: skip
    probe = json.loads(completed.stdout.strip().splitlines()[-1])
    model = model_size(str(tiny_base))
    largest = max(layer.in_features * layer.out_features for layer in model.linear_layers)
    planned = zero12_offload_allocations(model.transformer_params, largest, 1, 2, 8, pinned=True)
    assert probe["parameters"] == model.transformer_params
    assert sorted(probe["pinned_requests"]) == sorted(item.requested_bytes for item in planned if item.pinned)


def test_a_swapped_tensors_host_memory_lives_as_long_as_the_tensor(tiny_base: Path) -> None:
    """A swapped tensor's host memory is what is page-locked on CUDA and unregistered when it is freed: it must
    outlive the swapper while the detached model still uses the tensor, and go with the model."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(str(tiny_base), subfolder="transformer", torch_dtype=torch.bfloat16)
    swapper = BlockSwapper(flux_blocks(model.requires_grad_(False)), torch.device("cpu"))
    memory = weakref.ref(swapper._blocks[0].memories[0])  # the mmap behind the first tensor
    swapper.detach()
    del swapper
    gc.collect()
    assert memory() is not None
    del model
    gc.collect()
    assert memory() is None


def test_the_installed_torch_can_release_its_pinned_host_cache() -> None:
    """train/runtime.release_pinned_host_cache relies on it between phases (on CUDA; the CPU has no pinned cache)."""
    assert callable(torch.accelerator.empty_host_cache)


def test_swapped_trained_weights_share_no_storage_so_savers_keep_every_one(tiny_base: Path) -> None:
    """accelerate and safetensors drop or refuse tensors that share a storage: every swapped tensor has its own."""
    from accelerate.utils import id_tensor_storage
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(str(tiny_base), subfolder="transformer", torch_dtype=torch.bfloat16)
    BlockSwapper(flux_blocks(model), torch.device("cpu"), swap_trainable=True)
    state = model.state_dict()
    assert len({id_tensor_storage(tensor) for tensor in state.values()}) == len(state)
