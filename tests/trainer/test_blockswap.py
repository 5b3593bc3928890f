"""Block swapping (fluxbooth.train.blockswap) on the CPU, the accelerator being the CPU: the same loss and LoRA
gradients as without swapping, at most two blocks resident at any time and the right ones, the frozen tensors
out of reach of `module.to`, and everything given back on detach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fluxbooth.train.blockswap import BlockSwapper, flux_blocks, swapping_blocks
from tests.support.quantize_probe import forward_inputs

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out"]
CPU = torch.device("cpu")


def lora_transformer(base: Path, precision: str) -> torch.nn.Module:
    """The tiny base (bf16, or quantised as the trainer loads it) with a LoRA (seeded) and checkpointing."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from fluxbooth.train.quantize import load_quantised_base

    if precision == "bf16":
        model = FluxTransformer2DModel.from_pretrained(str(base), subfolder="transformer", torch_dtype=torch.bfloat16)
    else:
        model = load_quantised_base(str(base), precision, CPU, torch.bfloat16)
    model.requires_grad_(False)
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    model.enable_gradient_checkpointing()
    return model.train()


def loss_and_lora_gradients(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**forward_inputs(model.config)).sample.float().square().mean()
    loss.backward()
    gradients = {
        name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.requires_grad
    }
    return loss.detach(), gradients


@pytest.mark.parametrize("precision", ["bf16", "nf4"])
def test_swapped_blocks_give_the_same_loss_and_lora_gradients(tiny_base: Path, precision: str) -> None:
    expected_loss, expected_gradients = loss_and_lora_gradients(lora_transformer(tiny_base, precision))
    model = lora_transformer(tiny_base, precision)
    with swapping_blocks(model, CPU):
        loss, gradients = loss_and_lora_gradients(model)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert gradients.keys() == expected_gradients.keys() and gradients
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=1e-6, atol=0)


def test_forward_holds_the_block_computing_and_prefetches_the_next(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "nf4")
    with swapping_blocks(model, CPU, keep_log=True) as swapper:
        model(**forward_inputs(model.config)).sample.float().square().mean().backward()
    last = len(flux_blocks(model)) - 1
    forward = [(event.block, event.resident) for event in swapper.statistics.events if not event.backward]
    assert forward == [(index, (index, index + 1) if index < last else (last,)) for index in range(last + 1)]


def test_backward_recomputes_from_the_last_block_and_prefetches_the_previous(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "nf4")
    with swapping_blocks(model, CPU, keep_log=True) as swapper:
        model(**forward_inputs(model.config)).sample.float().square().mean().backward()
    last = len(flux_blocks(model)) - 1
    backward = [(event.block, event.resident) for event in swapper.statistics.events if event.backward]
    assert backward == [(index, (index - 1, index) if index else (0,)) for index in range(last, -1, -1)]
    assert swapper.statistics.most_resident == 2


def test_each_block_is_copied_once_in_forward_and_once_in_backward_but_the_last_stays(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "fp8")
    blocks = flux_blocks(model)
    with swapping_blocks(model, CPU) as swapper:
        model(**forward_inputs(model.config)).sample.float().square().mean().backward()
        last_block = sum(item.host.numel() * item.host.element_size() for item in swapper._blocks[-1].tensors)
        every_block = swapper.host_bytes()
    assert swapper.statistics.blocks_loaded == 2 * len(blocks) - 1
    assert swapper.statistics.bytes_loaded == 2 * every_block - last_block


def test_only_the_block_computing_points_at_device_copies(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "bf16")
    blocks = flux_blocks(model)
    seen: list[tuple[int, list[bool], tuple[int, ...]]] = []
    with swapping_blocks(model, CPU) as swapper:
        hosts = [[item.host for item in block.tensors] for block in swapper._blocks]

        def record(index: int):  # type: ignore[no-untyped-def]
            def hook(module: torch.nn.Module, inputs: object) -> None:
                on_host = [
                    all(
                        getattr(item.module, item.name) is host
                        for item, host in zip(block.tensors, hosts[other], strict=True)
                    )
                    for other, block in enumerate(swapper._blocks)
                ]
                seen.append((index, on_host, swapper.resident))

            return hook

        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(record(index))
        with torch.no_grad():
            model(**forward_inputs(model.config))
    # The block computing points at its device copies; the next one has its copy made (prefetched) but its
    # module still points at the host until it runs; every other block points at its host copies.
    assert [
        (index, [other for other, host in enumerate(on_host) if not host], resident)
        for index, on_host, resident in seen
    ] == [(index, [index], (index, index + 1) if index + 1 < len(blocks) else (index,)) for index in range(len(blocks))]


def test_module_to_moves_only_what_is_not_swapped(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "nf4")
    swapper = BlockSwapper(flux_blocks(model), CPU)
    frozen_in_blocks = [
        name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if name.startswith(("transformer_blocks.", "single_transformer_blocks.")) and not tensor.requires_grad
    ]  # fmt: skip
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert frozen_in_blocks == [] and trainable
    assert swapper.host_bytes() > 0
    swapper.detach()


def test_detach_gives_every_tensor_back_registered_as_it_was(tiny_base: Path) -> None:
    model = lora_transformer(tiny_base, "nf4")
    before = {
        name: (tensor.dtype, tensor.requires_grad)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    persistent = set(model.state_dict())
    swapper = BlockSwapper(flux_blocks(model), CPU)
    with torch.no_grad():
        model(**forward_inputs(model.config))
    swapper.detach()
    after = {
        name: (tensor.dtype, tensor.requires_grad)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    assert after == before
    assert set(model.state_dict()) == persistent


def test_every_resident_block_lives_in_one_of_the_planned_device_slots(tiny_base: Path) -> None:
    """At every block's start, forward and backward, each tensor a module points at is its host copy or a
    view into one of the swapper's device slots, and no more blocks than the plan's slots are held."""
    from fluxbooth.host.pinned import BLOCK_SWAP_DEVICE_SLOTS

    model = lora_transformer(tiny_base, "bf16")
    held: list[int] = []
    with swapping_blocks(model, CPU) as swapper:
        slots = [(slot.data_ptr(), slot.data_ptr() + slot.numel()) for slot in swapper.device_slots]

        def in_slot(tensor: torch.Tensor) -> bool:
            return any(start <= tensor.data_ptr() < end for start, end in slots)

        def count(module: torch.nn.Module, inputs: object) -> None:
            on_device = set()
            for index, block in enumerate(swapper._blocks):
                for item in block.tensors:
                    current = getattr(item.module, item.name)
                    assert in_slot(current) or current.data_ptr() == item.host.data_ptr()
                    if in_slot(current) or block.slot is not None:
                        on_device.add(index)
            held.append(len(on_device))

        for block in flux_blocks(model):
            block.register_forward_pre_hook(count)
        model(**forward_inputs(model.config)).sample.float().square().mean().backward()
    assert len(slots) == BLOCK_SWAP_DEVICE_SLOTS
    assert len(held) == 2 * len(flux_blocks(model)) and max(held) == BLOCK_SWAP_DEVICE_SLOTS
