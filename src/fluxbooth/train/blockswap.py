"""Block swapping: a transformer's blocks live in (pinned) host memory and stream to the accelerator as the
forward and the backward reach them, at most two at a time (the block computing and the next one). The blocks'
frozen tensors (a LoRA's base) always; with `swap_trainable`, their trained parameters too (the fused Adafactor
full fine-tune, as kohya's `--blocks_to_swap` with `--fused_backward_pass`).

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
Memory is held to the plan on both sides (fluxbooth.host.pinned owns the layout and the rounding rule):
- host: each tensor is copied into page-aligned anonymous memory of its own (its own storage: state dicts,
  accelerate's and safetensors' savers see no shared tensors), page-locked in place with cudaHostRegister on
  CUDA and unregistered when the tensor is freed, so a block pins exactly what it stores, to the page
  (PyTorch's `pin_memory()` would round every tensor up to a power of two: a 72 MiB weight would take 128 MiB);
- device: BLOCK_SWAP_DEVICE_SLOTS byte buffers of the largest block's size ("slots", each block's tensors laid
  out by `block_store_layout`), allocated once; a block is made resident by copying its tensors into a free
  slot at their offsets, and its tensors are views into that slot, so no
  more blocks than that are ever on the device, however far the CPU runs ahead of the GPU. On CUDA the copies
  run on their own stream; a copy into a slot waits for the compute stream's work queued before it (the last
  use of the block that held the slot), a write-back is queued on the same copy stream before any copy that
  reuses its slot, and the compute stream waits for a block's copy only when the block is needed, so the
  transfer of block i + 1 overlaps the compute of block i. Nothing is freed through `record_stream`. On the
  CPU the same code runs with the CPU as the accelerator (the copies are plain), which is how the tests check it.

Trained parameters (`swap_trainable`) stay registered: the optimizer, its hooks and autograd hold the
`nn.Parameter` objects, so only their `.data` moves, to the device copy while the block is resident and back to
the pinned host tensor when it is not (`module.to` would move them: the trainer places the rest of the model
itself and keeps accelerate's placement off). The fused pass (train/fused_adafactor.py) steps each parameter
on the device inside its block's backward; a block made resident by a backward is therefore written back to
its host copy when it is evicted (on CUDA on the copy stream, after the compute stream, into pinned memory).
A block is evicted in backward only when the block before it is recomputed, and autograd runs the block's
weight-gradient accumulations (AccumulateGrad nodes, with the fused step hooked onto each) before any node of
the block before it, so every step of a block has finished when its write-back is queued. A forward alone
changes nothing, so its evictions only drop the copies. `release()` writes back what is resident and waits for
the copies: the trainer calls it after each optimizer step, so checkpoints, the EMA, renders and the export
read the trained values from the host. The optimizer's state (Adafactor's factored moments) is created where
the step runs, on the device, and stays there (small: rows and columns).

Gradient checkpointing is required: without it autograd would keep every block's device weights alive for the
backward (as saved tensors), and a quantised layer rebuilds its weight from its codes in the backward, which
must then be on the device. Written for any model whose repeated blocks run in order; `flux_blocks` names
FLUX's.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fluxbooth.host.pinned import BLOCK_SWAP_DEVICE_SLOTS, block_store_layout
from fluxbooth.train.failures import TrainerFailure

# Where `attach_swapper` keeps a model's swapper (a plain attribute: not a submodule, not in the state dict).
SWAPPER_ATTRIBUTE = "_fluxbooth_block_swapper"


@dataclass
class _SwappedTensor:
    module: torch.nn.Module
    name: str
    host: torch.Tensor  # the host copy, in memory of its own
    registered_as: str  # "parameter", "buffer" or "non_persistent_buffer": how `detach` gives it back
    trained: torch.nn.Parameter | None = None  # a trained parameter, still registered: its `.data` is pointed


@dataclass
class _Block:
    tensors: list[_SwappedTensor]
    offsets: tuple[int, ...]  # each tensor's place in a device slot (fluxbooth.host.pinned.block_store_layout)
    size: int  # the bytes it takes in a slot
    memories: list[Any] = field(default_factory=list)  # the _HostStore behind each host tensor (not empty ones)
    slot: int | None = None  # the device slot holding its copy while resident
    ready: Any = None  # the CUDA event its copy records; None on the CPU
    stepped: bool = False  # made resident by a backward, where its trained parameters are stepped


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
    blocks_written_back: int = 0
    most_resident: int = 0
    events: list[SwapEvent] = field(default_factory=list)


def flux_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """FLUX's blocks in the order its forward runs them: the double-stream blocks, then the single-stream ones."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def frozen_tensor_bytes(module: torch.nn.Module) -> int:
    return sum(
        tensor.numel() * tensor.element_size()
        for tensor in [
            *module.buffers(),
            *(parameter for parameter in module.parameters() if not parameter.requires_grad),
        ]
    )


class BlockSwapper:
    """Streams the frozen tensors of `blocks`, and with `swap_trainable` their trained parameters, between host
    memory and `device` (see the module docstring) through `slots` device buffers.

    `keep_log`: record a SwapEvent per block made resident (tests; a few per block and step)."""

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        device: torch.device,
        *,
        swap_trainable: bool = False,
        keep_log: bool = False,
        slots: int = BLOCK_SWAP_DEVICE_SLOTS,
    ) -> None:
        if slots < 2:
            raise ValueError(
                f"block swapping needs at least 2 device slots (the block computing and the next), not {slots}"
            )
        self.device = torch.device(device)
        self.keep_log = keep_log
        self.statistics = SwapStatistics()
        pin = self.device.type == "cuda"
        self._blocks = [
            _stored_block(_take_block_tensors(block, trainable=swap_trainable), pin=pin) for block in blocks
        ]
        slot_bytes = max((block.size for block in self._blocks), default=0)
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._resident: set[int] = set()
        self._handles = [
            block.register_forward_pre_hook(self._before_block(index)) for index, block in enumerate(blocks)
        ]

    @property
    def resident(self) -> tuple[int, ...]:
        return tuple(sorted(self._resident))

    @property
    def device_slots(self) -> tuple[torch.Tensor, ...]:
        """The device buffers every resident block's tensors are views into: allocated once, never more."""
        return tuple(self._slots)

    @property
    def trains(self) -> bool:
        """Whether any swapped tensor is a trained parameter (then evictions after a backward write back)."""
        return any(item.trained is not None for block in self._blocks for item in block.tensors)

    def host_bytes(self) -> int:
        """What the blocks' tensors hold on the host (pinned in place on CUDA, to the page)."""
        return sum(item.host.numel() * item.host.element_size() for block in self._blocks for item in block.tensors)

    def store_bytes(self) -> list[int]:
        """Each block's size in a device slot, in block order (fluxbooth.host.pinned.block_store_layout)."""
        return [block.size for block in self._blocks]

    def largest_block_bytes(self) -> int:
        return max(self.store_bytes(), default=0)

    def place_the_rest(self, model: torch.nn.Module) -> None:
        """`model.to(device)` for every tensor `model` still registers but the swapped trained parameters (which
        `module.to` would move with the rest: every block onto the device at once)."""
        swapped = {id(item.trained) for block in self._blocks for item in block.tensors if item.trained is not None}
        for module in model.modules():
            for parameter in module._parameters.values():
                if parameter is not None and id(parameter) not in swapped:
                    parameter.data = parameter.data.to(self.device)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)

    def release(self) -> None:
        """Send every block back, its trained values written to the host copies and the copies waited for
        (after an optimizer step, before anything reads the weights or needs the device memory)."""
        for index in list(self._resident):
            self._evict(index)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def detach(self) -> None:
        """Remove the hooks and give every tensor back to its module, registered again, on the host (views into
        memory of their own), and let the device slots go."""
        self.release()
        for handle in self._handles:
            handle.remove()
        for block in self._blocks:
            for item in block.tensors:
                if item.trained is not None:
                    continue  # never unregistered; its `.data` is the host copy again
                object.__delattr__(item.module, item.name)
                if item.registered_as == "parameter":
                    item.module.register_parameter(item.name, torch.nn.Parameter(item.host, requires_grad=False))
                else:
                    item.module.register_buffer(item.name, item.host, persistent=item.registered_as == "buffer")
        self._blocks = []
        self._slots = []

    def _before_block(self, index: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any) -> None:
            backward = torch._C._current_graph_task_id() != -1
            following = index - 1 if backward else index + 1
            keep = {index, following} if 0 <= following < len(self._blocks) else {index}
            for other in self._resident - keep:
                self._evict(other)
            self._make_resident(index)
            self._blocks[index].stepped |= backward
            if following in keep:
                self._prefetch(following)
            self.statistics.most_resident = max(self.statistics.most_resident, len(self._resident))
            if self.keep_log:
                self.statistics.events.append(SwapEvent(index, backward, self.resident))

        return hook

    def _free_slot(self) -> int:
        taken = {self._blocks[index].slot for index in self._resident}
        free = [slot for slot in range(len(self._slots)) if slot not in taken]
        if not free:
            raise RuntimeError(f"block swap: all {len(self._slots)} device slots hold resident blocks {self.resident}")
        return free[0]

    def _prefetch(self, index: int) -> None:
        block = self._blocks[index]
        if block.slot is not None:
            return
        slot = self._free_slot()
        target = self._slots[slot]
        if self._copy_stream is None:
            for view, item in zip(_views_into(target, block), block.tensors, strict=True):
                view.copy_(item.host)
        else:
            # The copy may not start before the compute stream has finished with the block that held the slot
            # (its last kernels were queued before it was evicted, so before this point).
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                for view, item in zip(_views_into(target, block), block.tensors, strict=True):
                    view.copy_(item.host, non_blocking=True)
                block.ready = torch.cuda.Event()
                block.ready.record(self._copy_stream)
        block.slot = slot
        self._resident.add(index)
        self.statistics.blocks_loaded += 1
        self.statistics.bytes_loaded += sum(item.host.numel() * item.host.element_size() for item in block.tensors)

    def _make_resident(self, index: int) -> None:
        self._prefetch(index)
        block = self._blocks[index]
        assert block.slot is not None
        if block.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(block.ready)
            block.ready = None
        # `.data`: the views get a version counter of their own, so the next copy into the slot (after this
        # block has left it) is not an in-place change of tensors autograd may have saved.
        views = _views_into(self._slots[block.slot].data, block)
        for item, view in zip(block.tensors, views, strict=True):
            _point(item, view)

    def _evict(self, index: int) -> None:
        block = self._blocks[index]
        if block.stepped and block.slot is not None:
            self._write_back(block)
        for item in block.tensors:
            _point(item, item.host)
        block.slot = None
        block.ready = None
        block.stepped = False
        self._resident.discard(index)

    def _write_back(self, block: _Block) -> None:
        """Copy the block's trained parameters (their current device tensors) into their host copies."""
        trained = [(item, item.trained.data) for item in block.tensors if item.trained is not None]
        if not trained:
            return
        self.statistics.blocks_written_back += 1
        if self._copy_stream is None:
            for item, current in trained:
                item.host.copy_(current)
            return
        # After the compute stream's last use of the weights (the block's backward and its fused steps); a
        # later copy into the same slot is queued behind it on the copy stream.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for item, current in trained:
                item.host.copy_(current, non_blocking=True)


def _point(item: _SwappedTensor, tensor: torch.Tensor) -> None:
    if item.trained is not None:
        item.trained.data = tensor
    else:
        object.__setattr__(item.module, item.name, tensor)


def _views_into(buffer: torch.Tensor, block: _Block) -> list[torch.Tensor]:
    """The block's tensors as views into `buffer` (a slot), at their offsets."""
    return [_view_at(buffer, offset, item.host) for item, offset in zip(block.tensors, block.offsets, strict=True)]


def _view_at(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    size = like.numel() * like.element_size()
    return buffer[offset : offset + size].view(like.dtype).view(like.shape)


def _tensors_to_swap(block: torch.nn.Module, *, trainable: bool) -> list[tuple[torch.nn.Module, str, str, bool]]:
    """(module, name, registry, trained) of every tensor the swapper takes from `block`, in the order it stores
    them: per module, with `trainable` its trained parameters, then its frozen parameters, then its buffers."""
    found = []
    for module in block.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None and parameter.requires_grad and trainable:
                found.append((module, name, "parameter", True))
        for name, parameter in module._parameters.items():
            if parameter is not None and not parameter.requires_grad:
                found.append((module, name, "parameter", False))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                found.append((module, name, "buffer" if persistent else "non_persistent_buffer", False))
    return found


def swapped_tensor_bytes(block: torch.nn.Module, *, trainable: bool = False) -> list[int]:
    """The bytes of every tensor a BlockSwapper would take from `block` (touching nothing: a model on the meta
    device will do); `fluxbooth.host.pinned.block_store_pinned_bytes` of it is what the block pins."""
    sizes = []
    for module, name, registry, _ in _tensors_to_swap(block, trainable=trainable):
        tensor = module._parameters[name] if registry == "parameter" else module._buffers[name]
        sizes.append(tensor.numel() * tensor.element_size())
    return sizes


def _take_block_tensors(block: torch.nn.Module, *, trainable: bool) -> list[_SwappedTensor]:
    """Unregister every frozen tensor of `block` (parameters that do not train, buffers) and keep it as a plain
    attribute (holding, for now, the tensor itself; `_stored_block` copies it to its own memory); with `trainable`,
    also take every trained parameter, which stays registered."""
    taken = []
    for module, name, registry, trained in _tensors_to_swap(block, trainable=trainable):
        if trained:
            parameter = module._parameters[name]
            taken.append(_SwappedTensor(module, name, parameter.detach(), "parameter", trained=parameter))
        elif registry == "parameter":
            taken.append(_SwappedTensor(module, name, module._parameters.pop(name).detach(), "parameter"))
        else:
            module._non_persistent_buffers_set.discard(name)
            taken.append(_SwappedTensor(module, name, module._buffers.pop(name), registry))
    return taken


def _stored_block(taken: list[_SwappedTensor], *, pin: bool) -> _Block:
    """Copy each taken tensor into host memory of its own, one at a time (each original is let go as soon as it
    is copied), point the tensor at its copy, and page-lock the copy in place when `pin`."""
    offsets, size = block_store_layout([item.host.numel() * item.host.element_size() for item in taken])
    memories = []
    for item in taken:
        nbytes = item.host.numel() * item.host.element_size()
        if not nbytes:
            copy = torch.empty_like(item.host, device="cpu")
        else:
            memory = _HostStore(-1, nbytes)
            copy = torch.frombuffer(memory, dtype=torch.uint8).view(item.host.dtype).view(item.host.shape)
            copy.copy_(item.host)
            if pin:
                memory.lock(copy.data_ptr(), nbytes)
            memories.append(memory)
        item.host = copy
        _point(item, copy)
    return _Block(taken, offsets, size, memories)


class _HostStore(mmap.mmap):
    """Anonymous, page-aligned host memory behind one swapped tensor (`torch.frombuffer` keeps it alive for as
    long as any tensor views it). `lock` page-locks it in place with cudaHostRegister (exactly its pages,
    outside PyTorch's caching host allocator and its power-of-two rounding); it is unregistered when the last
    view is freed, before its pages are unmapped."""

    registered_address: int | None = None

    def lock(self, address: int, size: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, size, 0)))
        self.registered_address = address

    def __del__(self) -> None:
        if self.registered_address is not None:
            torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(self.registered_address)))
            self.registered_address = None


@contextmanager
def swapping_blocks(
    transformer: torch.nn.Module, device: torch.device, *, keep_log: bool = False
) -> Iterator[BlockSwapper]:
    """A BlockSwapper over FLUX's blocks for the duration of the block (tests, one-off passes)."""
    swapper = BlockSwapper(flux_blocks(transformer), device, keep_log=keep_log)
    try:
        yield swapper
    finally:
        swapper.detach()


def check_block_swap(
    training_type: str, gradient_checkpointing: bool, zero_stage: int, fused_backward_pass: bool = False
) -> None:
    """The trainer's own check of what the planner only ever plans (a hand-written train.json too)."""
    if training_type == "full" and not fused_backward_pass:
        raise TrainerFailure(
            "invalid_config",
            "block_swap with training_type 'full' needs fused_backward_pass: each block's weights are stepped during "
            "its backward, before the block leaves the device; a full fine-tune without it keeps every weight's "
            "gradient until the optimizer step after the backward",
        )
    if training_type not in ("lora", "full"):
        raise TrainerFailure(
            "invalid_config", f"block_swap needs training_type 'lora' or 'full', not {training_type!r}"
        )
    if not gradient_checkpointing:
        raise TrainerFailure(
            "invalid_config",
            "block_swap needs gradient_checkpointing: without it the backward keeps every block's weights on the device",
        )
    if zero_stage == 3:
        raise TrainerFailure(
            "invalid_config", "block_swap keeps the blocks outside DeepSpeed: use zero_stage 2 or no DeepSpeed"
        )


def release_swapped_blocks(model: torch.nn.Module) -> None:
    """After an optimizer step: the trained blocks' values written back to their host copies (nothing when
    `model`'s blocks are not swapped, or only frozen ones are: those have nothing to write)."""
    swapper = getattr(model, SWAPPER_ATTRIBUTE, None)
    if swapper is not None and swapper.trains:
        swapper.release()


def attach_swapper(model: torch.nn.Module, swapper: BlockSwapper) -> None:
    """Keep `swapper` with the model whose blocks it swaps, for `release_swapped_blocks`."""
    object.__setattr__(model, SWAPPER_ATTRIBUTE, swapper)
