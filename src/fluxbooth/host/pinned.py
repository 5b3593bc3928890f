"""Pinned (page-locked) host memory as it is really allocated: the one owner of the rounding rule and of the
block stores' layout, shared by the planner (`fluxbooth.plan.memory`), the block swapper
(`fluxbooth.train.blockswap`) and the tests that compare them. Torch-free and import-free on purpose, like
`fluxbooth.contract.deepspeed_numbers`: the planner and the trainer both import it without importing each other.

Two ways host memory gets pinned in a training run:
- `tensor.pin_memory()` and `pin_memory=True` go through PyTorch's caching host allocator, which rounds every
  allocation up to the next power of two (aten/src/ATen/core/CachingHostAllocator.h, `PowerOf2Ceil`, when the
  size is under `pinned_max_round_threshold_mb`, unlimited by default). DeepSpeed's CPU offload pins this way
  (`get_accelerator().pin_memory`, its default `DS_PIN_MEMORY_BACKEND=torch`), so a buffer of 44.4 GiB takes
  64 GiB: `caching_host_allocation_bytes`.
- The block swapper pins at the size it stores: each tensor of a block is copied into page-aligned anonymous
  memory of its own, page-locked in place with `cudaHostRegister`, which locks whole pages and nothing more
  (`registered_bytes`, `block_store_pinned_bytes`). On the device a block's tensors sit back to back in a
  slot (`block_store_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence

# Offsets of a block's tensors inside a device slot: what the CUDA caching allocator aligns device blocks to,
# so a view's data pointer suits every dtype and DMA engine.
STORE_TENSOR_ALIGNMENT = 512
# Linux's page size on x86_64 and arm64 servers: cudaHostRegister locks whole pages.
HOST_PAGE_BYTES = 4096


def caching_host_allocation_bytes(requested: int) -> int:
    """The bytes PyTorch's caching host allocator pins for a request of `requested` bytes: the next power of
    two (a request of 0 allocates nothing)."""
    if requested <= 0:
        return 0
    return 1 << (requested - 1).bit_length()


def aligned(offset: int, alignment: int = STORE_TENSOR_ALIGNMENT) -> int:
    return -(-offset // alignment) * alignment


def block_store_layout(tensor_bytes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(offset of each tensor, store size in bytes): the tensors of one block back to back in the order given,
    each starting and ending on a multiple of STORE_TENSOR_ALIGNMENT (so the size does not depend on the order:
    the planner sums the same sizes without knowing it)."""
    offsets = []
    end = 0
    for size in tensor_bytes:
        offsets.append(end)
        end += aligned(size)
    return tuple(offsets), end


def registered_bytes(size: int) -> int:
    """Host bytes page-locked by cudaHostRegister over anonymous memory of `size` bytes (an mmap: it starts on
    a page, and whole pages are locked)."""
    return aligned(size, HOST_PAGE_BYTES)


def block_store_pinned_bytes(tensor_bytes: Sequence[int]) -> int:
    """Pinned host bytes of one swapped block whose tensors have these sizes (each in memory of its own)."""
    return sum(registered_bytes(size) for size in tensor_bytes)


# Device buffers the block swapper streams blocks through, each the size of the largest block's store: the
# block computing and the next one being copied in (train/blockswap.py). The planner charges exactly these.
BLOCK_SWAP_DEVICE_SLOTS = 2
