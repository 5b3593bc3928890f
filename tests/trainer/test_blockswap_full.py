"""Block swapping of trained weights (fluxbooth.train.blockswap with `swap_trainable`) under the fused Adafactor
full fine-tune (fluxbooth.train.fused_adafactor), on the CPU, the accelerator being the CPU: the same weights and
optimizer state as without swapping, bit for bit, at most two blocks resident, every fused step taken while its
block is resident, the host copies holding the trained values after `release()`, and the trainer's check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
from fluxbooth.train.blockswap import BlockSwapper, check_block_swap, flux_blocks
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.fused_adafactor import FusedBackwardAdafactor
from tests.support.quantize_probe import forward_inputs

CPU = torch.device("cpu")
STEPS = 3


def full_transformer(base: Path) -> torch.nn.Module:
    """The tiny base in bf16, every weight trained, with gradient checkpointing (as the fused trainer holds it)."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(str(base), subfolder="transformer", torch_dtype=torch.bfloat16)
    model.requires_grad_(True)
    model.enable_gradient_checkpointing()
    return model.train()


def fused_optimizer(model: torch.nn.Module) -> FusedBackwardAdafactor:
    return FusedBackwardAdafactor(
        model.parameters(), lr=1e-2, seed=7, max_grad_norm=1.0, **OPTIMIZER_HYPERPARAMETERS["adafactor"]
    )


def train_steps(model: torch.nn.Module, optimizer: FusedBackwardAdafactor, swapper: BlockSwapper | None = None) -> None:
    """The trainer's loop: backward (each weight stepped inside it), step, and the swapper released after it."""
    inputs = forward_inputs(model.config)
    for _ in range(STEPS):
        model(**inputs).sample.float().square().mean().backward()
        optimizer.step()
        if swapper is not None:
            swapper.release()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def optimizer_state(model: torch.nn.Module, optimizer: FusedBackwardAdafactor) -> dict[str, dict[str, object]]:
    return {name: dict(optimizer.state[parameter]) for name, parameter in model.named_parameters()}


def trained_with_swapping(base: Path) -> tuple[torch.nn.Module, FusedBackwardAdafactor]:
    model = full_transformer(base)
    optimizer = fused_optimizer(model)
    train_steps(model, optimizer, BlockSwapper(flux_blocks(model), CPU, swap_trainable=True))
    return model, optimizer


@pytest.fixture(scope="module")
def unswapped(tiny_base: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, object]]]:
    model = full_transformer(tiny_base)
    optimizer = fused_optimizer(model)
    train_steps(model, optimizer)
    return weights(model), optimizer_state(model, optimizer)


def test_fused_steps_with_swapped_trained_blocks_give_the_unswapped_weights_bit_for_bit(
    tiny_base: Path, unswapped: tuple[dict[str, torch.Tensor], dict[str, dict[str, object]]]
) -> None:
    model, optimizer = trained_with_swapping(tiny_base)
    expected, _ = unswapped
    trained = weights(model)
    assert trained.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(trained[name], expected[name])] == []
    base = weights(full_transformer(tiny_base))
    assert sum(not torch.equal(trained[name], base[name]) for name in base) > len(base) // 2


def test_fused_steps_with_swapped_trained_blocks_give_the_unswapped_optimizer_state_bit_for_bit(
    tiny_base: Path, unswapped: tuple[dict[str, torch.Tensor], dict[str, dict[str, object]]]
) -> None:
    model, optimizer = trained_with_swapping(tiny_base)
    _, expected = unswapped
    state = optimizer_state(model, optimizer)
    assert state.keys() == expected.keys()
    for name, entries in expected.items():
        assert state[name].keys() == entries.keys(), name
        for key, value in entries.items():
            if torch.is_tensor(value):
                assert torch.equal(state[name][key], value), (name, key)
            else:
                assert state[name][key] == value, (name, key)


def test_at_most_two_blocks_are_resident_while_the_trained_blocks_swap(tiny_base: Path) -> None:
    model = full_transformer(tiny_base)
    optimizer = fused_optimizer(model)
    swapper = BlockSwapper(flux_blocks(model), CPU, swap_trainable=True, keep_log=True)
    train_steps(model, optimizer, swapper)
    assert swapper.statistics.most_resident == 2
    assert max(len(event.resident) for event in swapper.statistics.events) == 2


def test_every_fused_step_runs_while_its_block_is_resident(tiny_base: Path) -> None:
    model = full_transformer(tiny_base)
    optimizer = fused_optimizer(model)
    swapper = BlockSwapper(flux_blocks(model), CPU, swap_trainable=True)
    host_of = {id(item.trained): item.host for block in swapper._blocks for item in block.tensors}
    stepped_on_host: list[int] = []
    step_parameter = optimizer.step_parameter

    def recording(parameter: torch.nn.Parameter) -> None:
        host = host_of.get(id(parameter))
        if host is not None and parameter.data.data_ptr() == host.data_ptr():
            stepped_on_host.append(id(parameter))
        step_parameter(parameter)

    optimizer.step_parameter = recording  # type: ignore[method-assign]
    train_steps(model, optimizer, swapper)
    assert len(host_of) == sum(1 for block in flux_blocks(model) for _ in block.parameters())
    assert stepped_on_host == []


def test_after_release_the_host_copies_hold_the_trained_values_and_nothing_is_resident(tiny_base: Path) -> None:
    model = full_transformer(tiny_base)
    optimizer = fused_optimizer(model)
    swapper = BlockSwapper(flux_blocks(model), CPU, swap_trainable=True)
    inputs = forward_inputs(model.config)
    before = {id(item.trained): item.host.clone() for block in swapper._blocks for item in block.tensors}
    model(**inputs).sample.float().square().mean().backward()
    optimizer.step()
    resident_then = swapper.resident
    device_values = {
        id(parameter): parameter.detach().clone() for block in flux_blocks(model) for parameter in block.parameters()
    }
    swapper.release()
    items = [item for block in swapper._blocks for item in block.tensors]
    assert resident_then == (0,) and swapper.resident == ()
    assert all(item.trained.data.data_ptr() == item.host.data_ptr() for item in items)
    assert all(torch.equal(item.host, device_values[id(item.trained)]) for item in items)
    assert sum(not torch.equal(item.host, before[id(item.trained)]) for item in items) > len(items) // 2


def test_a_forward_alone_writes_nothing_back(tiny_base: Path) -> None:
    model = full_transformer(tiny_base)
    swapper = BlockSwapper(flux_blocks(model), CPU, swap_trainable=True)
    with torch.no_grad():
        model(**forward_inputs(model.config))
    swapper.release()
    assert swapper.statistics.blocks_written_back == 0
    assert swapper.statistics.blocks_loaded == len(flux_blocks(model))


def test_the_trained_parameters_stay_registered_and_the_state_dict_keeps_its_keys(tiny_base: Path) -> None:
    model = full_transformer(tiny_base)
    keys = list(model.state_dict())
    parameters = list(model.parameters())
    swapper = BlockSwapper(flux_blocks(model), CPU, swap_trainable=True)
    assert swapper.trains
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))


def test_block_swap_for_a_full_fine_tune_without_the_fused_pass_is_refused() -> None:
    with pytest.raises(TrainerFailure) as refused:
        check_block_swap("full", gradient_checkpointing=True, zero_stage=0, fused_backward_pass=False)
    assert refused.value.code == "invalid_config"
    assert refused.value.message == (
        "block_swap with training_type 'full' needs fused_backward_pass: each block's weights are stepped during its "
        "backward, before the block leaves the device; a full fine-tune without it keeps every weight's gradient "
        "until the optimizer step after the backward"
    )


def test_block_swap_for_the_fused_full_fine_tune_is_accepted() -> None:
    assert check_block_swap("full", gradient_checkpointing=True, zero_stage=0, fused_backward_pass=True) is None
