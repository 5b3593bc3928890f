"""The frozen FLUX base under LoRA stored in 8 bits (`fp8`) or 4 bits (`nf4`), computed in bf16.

- `fp8`: each weight row divided by its own scale (row absmax / 448) and stored as float8 e4m3;
  4 bytes of scale per output channel.
- `nf4`: QLoRA's 4-bit NormalFloat. The flattened weight is cut into blocks of 64, each block divided by
  its absmax and rounded to the nearest of the 16 NF4 values (the table bitsandbytes uses), two codes a
  byte. Double quantisation as bitsandbytes does it: the per-block absmax values, less their mean, are cut
  into blocks of 256, each divided by its own absmax (kept in fp32) and rounded to the nearest value of the
  signed dynamic 8-bit map (`signed_dynamic_map`), one byte each. 0.5 + 1/64 + 4/(64*256) bytes per weight,
  plus the two lookup tables (16 and 256 fp32 values) per layer.

Our own layers, pure torch (the same code on the CPU and on CUDA), rather than bitsandbytes or torchao:
see docs/quantisation.md for what was tried. Every stored tensor is an integer tensor (the fp32 scales are
kept as uint8 views of their bytes) and a non-persistent buffer, so
- `module.bfloat16()` / `module.to(dtype)` (what DeepSpeed and accelerate do to the model) cannot cast them,
  as `_apply` converts only floating-point tensors (`float8_e4m3fn.is_floating_point()` is True, hence the
  uint8 view of the fp8 codes too);
- no checkpoint or state dict holds them (they are rebuilt from the base model at load).

Layers quantised: the Linear layers inside `transformer_blocks` and `single_transformer_blocks` (more than
99 % of FLUX's weights). Kept in bf16: the norms (tiny, and they scale every activation), the input
embedders (`x_embedder`, `context_embedder`, `time_text_embed`) and the output (`norm_out`, `proj_out`),
which are small (under 0.2 % of the weights) and where a quantisation error is not averaged out by later
layers.

The quantised Linear subclasses `torch.nn.Linear`, so peft's default dispatch wraps it in its ordinary
`lora.Linear`; the module names, and therefore the LoRA state-dict keys, are those of the bf16 model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as functional

from fluxbooth.contract.precision import BASE_PRECISIONS, QUANTISED_PRECISIONS, is_quantised_layer
from fluxbooth.train.base_model import TRANSFORMER_SUBFOLDER, resolve_model_folder, transformer_weight_files
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.family_ops import transformer_class_in

BF16 = BASE_PRECISIONS[0]
FP8, NF4 = QUANTISED_PRECISIONS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

NF4_BLOCK = 64
NF4_ABSMAX_BLOCK = 256
# bitsandbytes' dynamic map (Dettmers 2015, "8-Bit Approximations for Parallelism in Deep Learning"): a sign,
# then a decimal exponent of 10^-6 .. 10^0 written in unary, the remaining bits a linear fraction.
DYNAMIC_MAP_EXPONENTS = 7
# QLoRA's NormalFloat4 values (Dettmers et al. 2023, appendix E), as bitsandbytes stores them.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's bytes as uint8: `_apply`'s dtype casts skip it, the value survives exactly."""
    return tensor.contiguous().view(torch.uint8)


def _float32_from(stored: torch.Tensor) -> torch.Tensor:
    return stored.view(torch.float32)


def compute_dtype(inputs: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `inputs` runs in: autocast's for the inputs' device where autocast is on (the
    path without DeepSpeed: accelerate autocasts, and an input may arrive in fp32 after a layer norm autocast
    keeps in fp32), else the inputs' own."""
    device_type = inputs.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return inputs.dtype


class _FrozenQuantisedMatmul(torch.autograd.Function):
    """inputs @ W.T with W rebuilt from its quantised form in forward and again in backward, so autograd
    never keeps a full-precision copy of a frozen weight alive between the two. W is rebuilt directly in the
    compute dtype (`compute_dtype`): never a wider copy that autocast would cast again."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, layer: QuantisedLinear) -> torch.Tensor:
        dtype = compute_dtype(inputs)
        ctx.layer = layer
        ctx.input_dtype = inputs.dtype
        ctx.compute_dtype = dtype
        bias = None if layer.bias is None else layer.bias.to(dtype)
        return functional.linear(inputs.to(dtype), layer.dequantise(dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        weight = ctx.layer.dequantise(ctx.compute_dtype)
        return (grad_output.to(ctx.compute_dtype) @ weight).to(ctx.input_dtype), None


class QuantisedLinear(torch.nn.Linear):
    """A frozen Linear whose weight is stored quantised; the bias (if any) stays a bf16 parameter.

    `weight` is the stored codes (uint8), so peft finds the layer's device and, seeing an integer dtype,
    leaves the LoRA weights in their own dtype.
    """

    precision = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def stored_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers(recurse=False))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # The bias is frozen like the weight, so it goes inside the function (no gradient, fused add).
        return _FrozenQuantisedMatmul.apply(inputs, self)


class Float8Linear(QuantisedLinear):
    """float8 e4m3 weight, one fp32 scale per output channel, computed in the input's dtype (bf16).

    `native_fp8_matmul` (off by default) uses torch._scaled_mm on GPUs with fp8 tensor cores (compute
    capability 8.9+); it has not been measured on a GPU yet, so nothing turns it on.
    """

    precision = FP8
    native_fp8_matmul = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        full = weight.to(torch.float32)
        scale = full.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
        codes = (full / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.register_buffer("weight", _bytes_of(codes), persistent=False)
        self.register_buffer("weight_scale", _bytes_of(scale), persistent=False)

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        codes = self.weight.view(FP8_DTYPE)
        return codes.to(dtype) * _float32_from(self.weight_scale).to(dtype)[:, None]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.native_fp8_matmul and _has_fp8_tensor_cores(inputs.device) and not torch.is_grad_enabled():
            return self._scaled_mm_forward(inputs)
        return super().forward(inputs)

    def _scaled_mm_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # Row-wise scales on both sides (what _scaled_mm's row-wise mode takes): (M, 1) and (1, N), fp32.
        rows = inputs.reshape(-1, self.in_features)
        input_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
        input_codes = (rows.float() / input_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        output = torch._scaled_mm(
            input_codes,
            self.weight.view(FP8_DTYPE).t(),
            scale_a=input_scale,
            scale_b=_float32_from(self.weight_scale).reshape(1, -1),
            bias=None if self.bias is None else self.bias.to(inputs.dtype),
            out_dtype=inputs.dtype,
        )
        return output.reshape(*inputs.shape[:-1], self.out_features)


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Nf4Linear(QuantisedLinear):
    """4-bit NormalFloat weight with double-quantised block absmax (QLoRA), computed in the input's dtype."""

    precision = NF4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        codes, absmax = _nf4_quantise(weight)
        absmax_codes, absmax_scales = _dynamic_quantise(absmax - absmax.mean())
        self.register_buffer("weight", codes, persistent=False)
        self.register_buffer("absmax_codes", absmax_codes, persistent=False)
        # fp32 [absmax mean, one scale per 256 absmax values], as bytes.
        self.register_buffer(
            "absmax_scales", _bytes_of(torch.cat((absmax.mean().reshape(1), absmax_scales))), persistent=False
        )
        table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=weight.device)
        self.register_buffer("nf4_table", _bytes_of(table), persistent=False)
        self.register_buffer("absmax_map", _bytes_of(signed_dynamic_map(weight.device)), persistent=False)

    def block_absmax(self) -> torch.Tensor:
        """The per-64-weight block absmax values (fp32) as the double quantisation gives them back."""
        offset_and_scales = _float32_from(self.absmax_scales)
        centred = _float32_from(self.absmax_map)[self.absmax_codes.int()]
        scales = offset_and_scales[1:].repeat_interleave(NF4_ABSMAX_BLOCK)[: centred.numel()]
        return centred * scales + offset_and_scales[0]

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        numel = self.in_features * self.out_features
        table = _float32_from(self.nf4_table).to(dtype)
        every_byte = torch.arange(256, device=table.device)
        # One lookup per stored byte: byte -> (value of its high nibble, value of its low nibble).
        pairs = torch.stack((table[every_byte >> 4], table[every_byte & 0x0F]), dim=1)
        values = pairs[self.weight.int()].reshape(-1, NF4_BLOCK)
        absmax = self.block_absmax().to(dtype)
        return (values * absmax[:, None]).reshape(-1)[:numel].reshape(self.out_features, self.in_features)


def _nf4_quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, the fp32 absmax of each block of 64)."""
    flat = weight.reshape(-1).to(torch.float32)
    flat = functional.pad(flat, (0, (-flat.numel()) % NF4_BLOCK))
    blocks = flat.reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=weight.device)
    midpoints = (table[1:] + table[:-1]) / 2
    indices = torch.bucketize(blocks / absmax[:, None], midpoints).to(torch.uint8).reshape(-1, 2)
    return (indices[:, 0] << 4) | indices[:, 1], absmax


def signed_dynamic_map(device: torch.device | None = None) -> torch.Tensor:
    """The 256 sorted values of bitsandbytes' `create_dynamic_map(signed=True)`, built the same way (same
    float32 arithmetic, so the same bits): for each exponent i of 0..6, the midpoints of 2^i + 1 evenly spaced
    points in [0.1, 1] times 10^(i-6), with both signs; then 0 and 1."""
    values: list[float] = []
    for exponent in range(DYNAMIC_MAP_EXPONENTS):
        boundaries = torch.linspace(0.1, 1, 2**exponent + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        magnitude = 10 ** (exponent - (DYNAMIC_MAP_EXPONENTS - 1))
        values += (magnitude * means).tolist() + (-magnitude * means).tolist()
    return torch.tensor(sorted([*values, 0.0, 1.0]), dtype=torch.float32, device=device)


def _dynamic_quantise(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' `quantize_blockwise(values, blocksize=256)`: (uint8 index of the nearest dynamic-map value
    of each value over its block's absmax, the fp32 absmax of each block of 256)."""
    padded = functional.pad(values, (0, (-values.numel()) % NF4_ABSMAX_BLOCK)).reshape(-1, NF4_ABSMAX_BLOCK)
    scales = padded.abs().amax(dim=1)
    normalised = (padded / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-1, 1)
    dynamic_map = signed_dynamic_map(values.device)
    codes = torch.bucketize(normalised, (dynamic_map[1:] + dynamic_map[:-1]) / 2).to(torch.uint8)
    return codes.reshape(-1)[: values.numel()], scales


# Each subclass is built from (weight, bias), not nn.Linear's (in_features, out_features, bias): typed by that.
LAYER_CLASSES: dict[str, Callable[[torch.Tensor, torch.Tensor | None], QuantisedLinear]] = {
    FP8: Float8Linear,
    NF4: Nf4Linear,
}


def quantised_linear(precision: str, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantisedLinear:
    """A frozen quantised layer built from a full-precision weight on the weight's device."""
    return LAYER_CLASSES[precision](weight, bias)


def check_base_precision(base_precision: str, training_type: str, zero_stage: int) -> None:
    """The trainer's own check of what the planner already refused (a hand-written train.json too)."""
    if base_precision not in BASE_PRECISIONS:
        raise TrainerFailure(
            "invalid_config", f"base_precision {base_precision!r} is not one of {', '.join(BASE_PRECISIONS)}"
        )
    if base_precision == BF16:
        return
    if training_type != "lora":
        raise TrainerFailure(
            "invalid_config",
            f"base_precision {base_precision!r} stores a frozen base and only works with training_type 'lora'; "
            "a full fine-tune trains every weight: use base_precision 'bf16'",
        )
    if zero_stage == 3:
        raise TrainerFailure(
            "invalid_config",
            f"base_precision {base_precision!r} keeps the whole quantised base on each GPU; "
            "ZeRO-3 would partition it: use zero_stage 2 (or no DeepSpeed)",
        )


def load_quantised_transformer(
    transformer_folder: Path, weight_files: list[Path], precision: str, device: torch.device, dtype: torch.dtype
) -> Any:
    """The transformer (the class its config names: FLUX.1's or FLUX.2's) with its block Linears quantised
    (`precision` fp8 or nf4; bf16: as stored), built layer by layer on `device`.

    The skeleton is built on the meta device (no memory); the safetensors files are read one tensor at a
    time (memory-mapped), each moved to `device` and, for a block Linear, quantised there before the next
    is read. So the host holds at most one layer's bf16 weight beside the quantised model, and the device
    never holds more than one bf16 layer either. (A block-swapped base is built so on the host: bf16 too, as
    diffusers' loader would leave the whole checkpoint's pages resident beside it.)
    """
    if precision not in BASE_PRECISIONS:
        raise TrainerFailure(
            "invalid_config", f"base_precision {precision!r} is not one of {', '.join(BASE_PRECISIONS)}"
        )
    transformer_class = transformer_class_in(transformer_folder)
    config = transformer_class.load_config(str(transformer_folder))
    with torch.device("meta"):
        model = transformer_class.from_config(config)
    with _tensor_reader(weight_files) as read:
        for name, module in list(model.named_modules()):
            _fill_module(model, name, module, read, precision, device, dtype)
    leftovers = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if leftovers:
        raise TrainerFailure(
            "invalid_config", f"the base transformer's weights lack {len(leftovers)} tensors, e.g. {leftovers[:3]}"
        )
    return model.eval().requires_grad_(False)


def _return_freed_host_memory() -> None:
    """Hand the heap pages freed by one layer's quantisation back to the system. Each layer's transient
    copies (the bf16 tensor read, fp32 working copies) are freed between the quantised tensors that stay,
    so glibc cannot shrink its heap and the transients of every layer would stay resident (measured on the
    CPU: fp8 load peak 4.4x the stored base without this); malloc_trim releases free pages wherever they are."""
    library = ctypes.util.find_library("c")
    if library is None:
        return
    trim = getattr(ctypes.CDLL(library), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def _fill_module(
    model: torch.nn.Module,
    name: str,
    module: torch.nn.Module,
    read: Any,
    precision: str,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    prefix = f"{name}." if name else ""
    if type(module) is torch.nn.Linear and is_quantised_layer(name) and precision in QUANTISED_PRECISIONS:
        weight = read(prefix + "weight", module.weight.shape).to(device)
        bias = None if module.bias is None else read(prefix + "bias", module.bias.shape).to(device, dtype)
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, quantised_linear(precision, weight, bias))
        del weight
        _return_freed_host_memory()
        return
    for parameter_name, parameter in list(module.named_parameters(recurse=False)):
        tensor = read(prefix + parameter_name, parameter.shape).to(device, dtype)
        module._parameters[parameter_name] = torch.nn.Parameter(tensor, requires_grad=False)


# safetensors dtype names (the format's header) -> torch dtypes.
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip


@contextmanager
def _tensor_reader(files: list[Path]) -> Iterator[Any]:
    """`read(key, shape)`: one tensor copied out of its safetensors file with plain reads.

    Not memory-mapped on purpose: every page of a mapping that has been read counts in the process's
    resident memory until the file is closed, so reading a 22 GiB checkpoint through a mapping would
    show the whole bf16 base in host memory beside the quantised one. Here the host holds exactly the
    tensor being read."""
    with ExitStack() as stack:
        entries: dict[str, tuple[Any, int, dict[str, Any]]] = {}
        for path in files:
            handle = stack.enter_context(path.open("rb"))
            header_length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_length))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                entries[key] = (handle, 8 + header_length, entry)

        def read(key: str, shape: torch.Size) -> torch.Tensor:
            if key not in entries:
                raise TrainerFailure("invalid_config", f"the base transformer's weights lack {key!r}")
            handle, data_start, entry = entries[key]
            if tuple(entry["shape"]) != tuple(shape):
                raise TrainerFailure(
                    "invalid_config",
                    f"the base transformer's {key!r} has shape {tuple(entry['shape'])}, the model expects {tuple(shape)}",
                )
            begin, end = entry["data_offsets"]
            if end == begin:
                return torch.empty(tuple(entry["shape"]), dtype=SAFETENSORS_DTYPES[entry["dtype"]])
            data = bytearray(end - begin)
            handle.seek(data_start + begin)
            handle.readinto(data)
            return torch.frombuffer(data, dtype=SAFETENSORS_DTYPES[entry["dtype"]]).reshape(tuple(entry["shape"]))

        yield read


def load_quantised_base(base_model: str | Path, precision: str, device: torch.device, dtype: torch.dtype) -> Any:
    """`base_model`'s transformer (a pipeline folder, as the trainer's session resolved it, or a cached hub id)
    with its block Linears quantised."""
    folder = resolve_model_folder(base_model) / TRANSFORMER_SUBFOLDER
    return load_quantised_transformer(folder, transformer_weight_files(base_model), precision, device, dtype)


def residency(model: torch.nn.Module) -> dict[str, Any]:
    """What a model holds and where: quantised layers by precision, stored bytes by dtype, devices.

    Recorded at training start and at each render, so a test (and a person) can see that the transformer
    rendering is the quantised training one and no bf16 copy of the block Linears was made."""
    layers: dict[str, int] = {}
    stored: dict[str, int] = {}
    full_block_linears = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantisedLinear):
            layers[module.precision] = layers.get(module.precision, 0) + 1
        elif type(module) is torch.nn.Linear and _block_linear_name(name):
            full_block_linears += 1
    for tensor in [*model.parameters(), *model.buffers()]:
        key = str(tensor.dtype).removeprefix("torch.")
        stored[key] = stored.get(key, 0) + tensor.numel() * tensor.element_size()
    devices = sorted({str(tensor.device) for tensor in [*model.parameters(), *model.buffers()]})
    lora_layers = [
        module for module in model.modules() if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)
    ]
    return {
        "quantised_layers": layers,
        "full_precision_block_linears": full_block_linears,
        "lora_layers": sum(1 for module in lora_layers if len(module.lora_A)),
        "stored_bytes_by_dtype": stored,
        "devices": devices,
    }


def _block_linear_name(name: str) -> bool:
    """A block Linear's name, also once peft has wrapped it (`...to_q.base_layer`); the LoRA A/B layers are not."""
    return is_quantised_layer(name) and ".lora_" not in name
