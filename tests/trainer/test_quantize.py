"""The frozen base stored as fp8 or nf4 under LoRA (fluxbooth.train.quantize): the layers, the loader
from safetensors, peft on top, and DeepSpeed leaving the quantised storage alone."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.quantize import (
    NF4_VALUES,
    Float8Linear,
    Nf4Linear,
    QuantisedLinear,
    check_base_precision,
    load_quantised_base,
    quantised_linear,
    residency,
)

PRECISIONS = ["fp8", "nf4"]
# The top-level layers kept in bf16: input embedders and the output projection.
FULL_PRECISION_LINEARS = {
    "x_embedder", "context_embedder", "norm_out.linear", "proj_out",
    "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
}  # fmt: skip
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out"]


def gaussian_weight(rows: int = 96, columns: int = 160, seed: int = 0) -> torch.Tensor:
    return (torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fluxbooth.synthetic.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "tiny-flux")


def load(base: Path, precision: str) -> torch.nn.Module:
    return load_quantised_base(str(base), precision, torch.device("cpu"), torch.bfloat16)


def load_bf16(base: Path) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(str(base), subfolder="transformer", torch_dtype=torch.bfloat16).eval()


def relative_error(approximation: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approximation.float() - exact.float()).abs().mean() / exact.float().abs().mean())


def test_fp8_layer_stores_one_byte_per_weight_and_an_fp32_scale_per_output_channel() -> None:
    layer = Float8Linear(gaussian_weight(96, 160), None)
    assert layer.stored_bytes() == 96 * 160 + 4 * 96
    assert {buffer.dtype for buffer in layer.buffers()} == {torch.uint8}


def test_nf4_layer_stores_half_a_byte_per_weight_plus_double_quantised_absmax() -> None:
    weights = 96 * 160
    layer = Nf4Linear(gaussian_weight(96, 160), None)
    blocks = weights // 64
    absmax_bytes = blocks  # one 8-bit dynamic-map code per block of 64
    second_level_bytes = 4 * (1 + math.ceil(blocks / 256))  # fp32 mean, one fp32 scale per 256 blocks
    table_bytes = 4 * 16 + 4 * 256  # the NF4 values and the dynamic map, fp32
    assert layer.stored_bytes() == weights // 2 + absmax_bytes + second_level_bytes + table_bytes
    assert layer.absmax_codes.dtype == torch.uint8


@pytest.mark.parametrize(("precision", "bound"), [("fp8", 0.03), ("nf4", 0.10)])
def test_dequantised_gaussian_weight_is_within_the_format_error(precision: str, bound: float) -> None:
    weight = gaussian_weight(256, 512)
    error = relative_error(quantised_linear(precision, weight, None).dequantise(torch.float32), weight)
    assert 0 < error < bound


def test_nf4_stores_a_block_of_exact_nf4_values_as_those_values() -> None:
    scale = 0.037
    values = torch.tensor(NF4_VALUES * 4) * scale  # one 64-element block, each code four times
    layer = Nf4Linear(values.reshape(1, 64), None)
    # The codes are exact; only the block's absmax passes through its 8-bit double quantisation.
    torch.testing.assert_close(layer.dequantise(torch.float32).reshape(-1), values, rtol=1e-2, atol=0)


def test_fp8_keeps_each_rows_largest_weight_exactly() -> None:
    weight = gaussian_weight(8, 64).float()
    layer = Float8Linear(weight, None)
    rows = torch.arange(8)
    largest = weight.abs().argmax(dim=1)
    torch.testing.assert_close(layer.dequantise(torch.float32)[rows, largest], weight[rows, largest], rtol=1e-6, atol=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_and_input_gradient_use_the_dequantised_weight(precision: str) -> None:
    weight, bias = gaussian_weight(64, 128), torch.randn(64).bfloat16()
    layer = quantised_linear(precision, weight, bias)
    inputs = torch.randn(5, 128).bfloat16().requires_grad_()
    reference_inputs = inputs.detach().clone().requires_grad_()
    layer(inputs).float().square().sum().backward()
    reference = torch.nn.functional.linear(reference_inputs, layer.dequantise(torch.bfloat16), bias)
    reference.float().square().sum().backward()
    torch.testing.assert_close(layer(inputs.detach()), reference.detach())
    torch.testing.assert_close(inputs.grad, reference_inputs.grad)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_autograd_saves_no_full_precision_copy_of_the_frozen_weight(precision: str) -> None:
    layer = quantised_linear(precision, gaussian_weight(64, 128), None)
    saved_shapes = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda tensor: saved_shapes.append(tuple(tensor.shape)) or tensor, lambda tensor: tensor
    ):
        output = layer(torch.randn(3, 128).bfloat16().requires_grad_())
    output.sum().backward()
    assert (64, 128) not in saved_shapes and (128, 64) not in saved_shapes


class WeightShapedTensors(TorchDispatchMode):
    """Records the dtype of every tensor wider than a byte (not the stored codes, nor views of them) that an
    op produces with a weight's shape or its transpose's."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shapes = {shape, shape[::-1]}
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) in self.shapes and tensor.element_size() > 1:
                self.dtypes.add(tensor.dtype)
        return output


@pytest.mark.parametrize("precision", PRECISIONS)
def test_under_autocast_the_weight_is_dequantised_only_in_the_autocast_dtype(precision: str) -> None:
    # Without DeepSpeed accelerate runs the model under autocast, where an input can arrive in fp32 (after a
    # layer norm autocast keeps in fp32): no fp32 copy of the weight may appear, forward or backward.
    layer = quantised_linear(precision, gaussian_weight(64, 128), torch.zeros(64).bfloat16())
    inputs = torch.randn(3, 128, requires_grad=True)
    with WeightShapedTensors((64, 128)) as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = layer(inputs)
        output.float().square().sum().backward()
    assert seen.dtypes == {torch.bfloat16}
    assert (output.dtype, inputs.grad.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("cast", ["bfloat16", "half", "float", "to_bf16"])
def test_dtype_casts_of_the_module_leave_the_quantised_bytes_alone(precision: str, cast: str) -> None:
    layer = quantised_linear(precision, gaussian_weight(), torch.zeros(96).bfloat16())
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    layer.to(torch.bfloat16) if cast == "to_bf16" else getattr(layer, cast)()
    after = dict(layer.named_buffers())
    assert {name: after[name].dtype for name in after} == {name: before[name].dtype for name in before}
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_quantised_storage_is_not_part_of_the_state_dict(precision: str) -> None:
    layer = quantised_linear(precision, gaussian_weight(), torch.zeros(96).bfloat16())
    assert list(layer.state_dict()) == ["bias"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_loader_quantises_every_block_linear_and_keeps_embedders_and_output_in_bf16(
    tiny_base: Path, precision: str
) -> None:
    model = load(tiny_base, precision)
    plain = {name for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    quantised = [module for module in model.modules() if isinstance(module, QuantisedLinear)]
    assert plain == FULL_PRECISION_LINEARS
    assert len(quantised) == residency(model)["quantised_layers"][precision] == 40
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert not any(parameter.requires_grad for parameter in model.parameters())


@pytest.mark.parametrize(("precision", "bound"), [("fp8", 0.05), ("nf4", 0.25)])
def test_quantised_transformer_output_is_close_to_the_bf16_one(tiny_base: Path, precision: str, bound: float) -> None:
    from tests.support.quantize_probe import forward_inputs

    reference = load_bf16(tiny_base)
    inputs = forward_inputs(reference.config)
    with torch.no_grad():
        exact = reference(**inputs).sample
        approximate = load(tiny_base, precision)(**inputs).sample
    assert 0 < relative_error(approximate, exact) < bound


def test_loader_names_a_missing_tensor(tiny_base: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_base / "transformer" / "diffusion_pytorch_model.safetensors")
    del weights["single_transformer_blocks.1.proj_mlp.weight"]
    (tmp_path / "transformer").mkdir()
    save_file(weights, tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    (tmp_path / "transformer" / "config.json").write_text((tiny_base / "transformer" / "config.json").read_text())
    with pytest.raises(TrainerFailure) as failure:
        load_quantised_base(str(tmp_path), "nf4", torch.device("cpu"), torch.bfloat16)
    assert failure.value.code == "invalid_config"
    assert (
        str(failure.value.message)
        == "the base transformer's weights lack 'single_transformer_blocks.1.proj_mlp.weight'"
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_state_dict_keys_are_those_of_a_lora_on_the_bf16_base(tiny_base: Path, precision: str) -> None:
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    keys = {}
    for name, model in (("bf16", load_bf16(tiny_base)), (precision, load(tiny_base, precision))):
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
        keys[name] = set(get_peft_model_state_dict(model))
    assert keys[precision] == keys["bf16"]
    # A and B of: 4 attention targets in each of 2 double blocks, 5 in each of 2 single blocks, the top proj_out.
    assert len(keys["bf16"]) == 2 * (2 * 4 + 2 * 5 + 1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_on_a_quantised_base_trains_only_the_adapter(tiny_base: Path, precision: str) -> None:
    from peft import LoraConfig

    from tests.support.quantize_probe import forward_inputs

    model = load(tiny_base, precision)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    model(**forward_inputs(model.config)).sample.float().square().mean().backward()
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    with_gradients = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert with_gradients == trainable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepspeed_initialize_and_steps_keep_the_quantised_dtypes_and_bytes(tiny_base: Path, precision: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.quantize_probe", str(tiny_base), precision, str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(report["before"]) == 40 * (2 if precision == "fp8" else 5)
    assert report["after_initialize"] == report["before"]
    assert report["after_steps"] == report["before"]
    assert report["lora_changed"] is True
    assert report["residency"]["full_precision_block_linears"] == 0


def test_full_fine_tune_refuses_a_quantised_base() -> None:
    with pytest.raises(TrainerFailure) as failure:
        check_base_precision("nf4", "full", 2)
    assert failure.value.code == "invalid_config"
    assert failure.value.message == (
        "base_precision 'nf4' stores a frozen base and only works with training_type 'lora'; "
        "a full fine-tune trains every weight: use base_precision 'bf16'"
    )


def test_zero3_refuses_a_quantised_base() -> None:
    with pytest.raises(TrainerFailure) as failure:
        check_base_precision("fp8", "lora", 3)
    assert failure.value.message == (
        "base_precision 'fp8' keeps the whole quantised base on each GPU; ZeRO-3 would partition it: "
        "use zero_stage 2 (or no DeepSpeed)"
    )


def test_unknown_base_precision_is_refused() -> None:
    with pytest.raises(TrainerFailure) as failure:
        check_base_precision("int4", "lora", 2)
    assert failure.value.message == "base_precision 'int4' is not one of bf16, fp8, nf4"


@pytest.mark.parametrize("training_type", ["full", "lora"])
def test_bf16_base_is_accepted_for_every_training_type(training_type: str) -> None:
    check_base_precision("bf16", training_type, 3)
