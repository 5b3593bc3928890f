"""Block swapping: a frozen transformer's blocks live in (pinned) host memory and stream to the accelerator
as the forward and the backward reach them, at most two at a time (the block computing and the next one).

The swapper takes each block's frozen tensors (parameters that do not train, and buffers: a quantised base's
codes and scales too) out of the module's registries and keeps them as plain attributes that it points at the
host copy or at a device copy. So nothing else moves them: `module.to(device)` (accelerate's and DeepSpeed's
placement, diffusers' model offload) moves only what stays registered (the embedders, the output layers and
the trainable LoRA weights inside the blocks), and casts never touch them. Frozen tensors never change, so
sending a block back is only dropping its device copy.

When blocks are needed (forward pre-hooks; with gradient checkpointing the backward recomputes each block's
forward, so the same hooks fire in backward order):
- forward (no backward running): block i is made resident, block i + 1 is prefetched, any other is dropped;
- backward (the recompute of block i runs inside the autograd engine): block i, then i - 1 prefetched. The
  backward of block i + 1 has finished when block i is recomputed, so i + 1 is dropped then.
On CUDA the copies run on their own stream from pinned memory and the compute stream waits for a block's
copy only when the block is needed, so the transfer of block i + 1 overlaps the compute of block i. On the CPU
the same code runs with the CPU as the accelerator (the copies are plain), which is how the tests check it.

Gradient checkpointing is required: without it autograd would keep every block's device weights alive for the
backward (as saved tensors), and a quantised layer rebuilds its weight from its codes in the backward, which
must then be on the device. Written for any model whose repeated blocks run in order (issue 23's full
fine-tune reuses it); `flux_blocks` names FLUX's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _SwappedTensor:
    module: torch.nn.Module
    name: str
    host: torch.Tensor
    registered_as: str  # "parameter", "buffer" or "non_persistent_buffer": how `detach` gives it back


@dataclass
class _Block:
    tensors: list[_SwappedTensor]
    device_copies: list[torch.Tensor] | None = None
    ready: Any = None  # the CUDA event its copy records; None on the CPU


@dataclass(frozen=True)
class SwapEvent:
    """One block made resident, with what was resident afterwards (the swapper's log, for tests and metrics)."""

    block: int
    backward: bool
    resident: tuple[int, ...]


@dataclass
class SwapStatistics:
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    most_resident: int = 0
    events: list[SwapEvent] = field(default_factory=list)


def flux_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """FLUX's blocks in the order its forward runs them: the double-stream blocks, then the single-stream ones."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def frozen_tensor_bytes(module: torch.nn.Module) -> int:
    return sum(
        tensor.numel() * tensor.element_size()
        for tensor in [*module.buffers(), *(parameter for parameter in module.parameters() if not parameter.requires_grad)]
    )


class BlockSwapper:
    """Streams the frozen tensors of `blocks` between host memory and `device` (see the module docstring).

    `keep_log`: record a SwapEvent per block made resident (tests; a few per block and step)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device, *, keep_log: bool = False) -> None:
        self.device = torch.device(device)
        self.keep_log = keep_log
        self.statistics = SwapStatistics()
        self._blocks = [_Block(_take_frozen_tensors(block, pin=self.device.type == "cuda")) for block in blocks]
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._resident: set[int] = set()
        self._handles = [
            block.register_forward_pre_hook(self._before_block(index)) for index, block in enumerate(blocks)
        ]

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(sorted(self._resident))

    def host_bytes(self) -> int:
        return sum(item.host.numel() * item.host.element_size() for block in self._blocks for item in block.tensors)

    def largest_block_bytes(self) -> int:
        return max(
            (sum(item.host.numel() * item.host.element_size() for item in block.tensors) for block in self._blocks),
            default=0,
        )

    def release(self) -> None:
        """Send every block back (after a pass, before something else needs the device memory)."""
        for index in list(self._resident):
            self._evict(index)

    def detach(self) -> None:
        """Remove the hooks and give every tensor back to its module, registered again, on the host."""
        self.release()
        for handle in self._handles:
            handle.remove()
        for block in self._blocks:
            for item in block.tensors:
                object.__delattr__(item.module, item.name)
                if item.registered_as == "parameter":
                    item.module.register_parameter(item.name, torch.nn.Parameter(item.host, requires_grad=False))
                else:
                    item.module.register_buffer(item.name, item.host, persistent=item.registered_as == "buffer")
        self._blocks = []

    def _before_block(self, index: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any) -> None:
            backward = torch._C._current_graph_task_id() != -1
            following = index - 1 if backward else index + 1
            keep = {index, following} if 0 <= following < len(self._blocks) else {index}
            for other in self._resident - keep:
                self._evict(other)
            self._make_resident(index)
            if following in keep:
                self._prefetch(following)
            self.statistics.most_resident = max(self.statistics.most_resident, len(self._resident))
            if self.keep_log:
                self.statistics.events.append(SwapEvent(index, backward, self.resident))

        return hook

    def _prefetch(self, index: int) -> None:
        block = self._blocks[index]
        if block.device_copies is not None:
            return
        if self._copy_stream is None:
            block.device_copies = [item.host.to(self.device, copy=True) for item in block.tensors]
        else:
            # The copy may not start before the compute stream has finished with the memory it reuses.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                block.device_copies = [item.host.to(self.device, non_blocking=True) for item in block.tensors]
                block.ready = torch.cuda.Event()
                block.ready.record(self._copy_stream)
        self._resident.add(index)
        self.statistics.blocks_loaded += 1
        self.statistics.bytes_loaded += sum(item.host.numel() * item.host.element_size() for item in block.tensors)

    def _make_resident(self, index: int) -> None:
        self._prefetch(index)
        block = self._blocks[index]
        assert block.device_copies is not None
        if block.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(block.ready)
            for copy in block.device_copies:
                # Allocated on the copy stream, used on the compute stream: the allocator must not hand the
                # memory out again before the compute stream is done with it.
                copy.record_stream(compute)
            block.ready = None
        for item, copy in zip(block.tensors, block.device_copies, strict=True):
            object.__setattr__(item.module, item.name, copy)

    def _evict(self, index: int) -> None:
        block = self._blocks[index]
        for item in block.tensors:
            object.__setattr__(item.module, item.name, item.host)
        block.device_copies = None
        block.ready = None
        self._resident.discard(index)


def _take_frozen_tensors(block: torch.nn.Module, *, pin: bool) -> list[_SwappedTensor]:
    """Unregister every frozen tensor of `block` (parameters that do not train, buffers) and keep it as a plain
    attribute holding the host copy (pinned, for asynchronous copies to a CUDA device)."""
    taken = []
    for module in block.modules():
        frozen = [name for name, parameter in module._parameters.items() if parameter is not None and not parameter.requires_grad]
        for name in frozen:
            tensor = module._parameters.pop(name).detach()
            taken.append(_SwappedTensor(module, name, _on_host(tensor, pin), "parameter"))
        for name in [name for name, buffer in module._buffers.items() if buffer is not None]:
            persistent = name not in module._non_persistent_buffers_set
            module._non_persistent_buffers_set.discard(name)
            registered_as = "buffer" if persistent else "non_persistent_buffer"
            taken.append(_SwappedTensor(module, name, _on_host(module._buffers.pop(name), pin), registered_as))
    for item in taken:
        object.__setattr__(item.module, item.name, item.host)
    return taken


def _on_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    host = tensor.to("cpu")
    return host.pin_memory() if pin and not host.is_pinned() else host


@contextmanager
def swapping_blocks(transformer: torch.nn.Module, device: torch.device, *, keep_log: bool = False) -> Iterator[BlockSwapper]:
    """A BlockSwapper over FLUX's blocks for the duration of the block (tests, one-off passes)."""
    swapper = BlockSwapper(flux_blocks(transformer), device, keep_log=keep_log)
    try:
        yield swapper
    finally:
        swapper.detach()


def check_block_swap(training_type: str, gradient_checkpointing: bool, zero_stage: int) -> None:
    """The trainer's own check of what the planner only ever plans (a hand-written train.json too)."""
    from fluxbooth.train.failures import TrainerFailure

    if training_type != "lora":
        raise TrainerFailure("invalid_config", "block_swap streams a frozen base: it needs training_type 'lora'")
    if not gradient_checkpointing:
        raise TrainerFailure(
            "invalid_config",
            "block_swap needs gradient_checkpointing: without it the backward keeps every block's weights on the device",
        )
    if zero_stage == 3:
        raise TrainerFailure("invalid_config", "block_swap keeps the blocks outside DeepSpeed: use zero_stage 2 or no DeepSpeed")
