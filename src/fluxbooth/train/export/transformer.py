"""The full transformer's files: the diffusers folder (config and shards, written from any ZeRO stage)
and the original-layout single file, each checked by reading it back.

Functions marked *collective* must be called by every rank (ZeRO-3 gathers partitioned parameters
with collectives); only the main process writes files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fluxbooth.train.export.key_layouts import FLUX1_TABLES, KeyTables, OriginalTensor, single_file_layout
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.family_ops import transformer_class_in
from fluxbooth.train.state import gathered

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SAMPLE_TENSORS_TO_COMPARE = 6
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """ "5GB" → 5 * 1000**3 (diffusers' and huggingface_hub's convention); ints pass through."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if match is None:
        raise TrainerFailure("invalid_config", f"max_shard_size {size!r} is not a size like '5GB'")
    return int(float(match.group(1)) * 1000 ** " KMGT".index((match.group(2) or " ").upper()))


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    current = 0
    for name, size in sizes:
        if shards[-1] and current + size > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += size
    return shards


def _shard_file_name(index: int, count: int) -> str:
    return (
        WEIGHTS_NAME
        if count == 1
        else WEIGHTS_NAME.replace(".safetensors", f"-{index + 1:05d}-of-{count:05d}.safetensors")
    )


def save_transformer(
    model: Any, out_dir: Path, *, is_main_process: bool, max_shard_size: str, metadata: dict[str, str]
) -> dict[str, torch.Tensor]:
    """*Collective under ZeRO-3.* Write `model` (a FluxTransformer2DModel, possibly ZeRO-3 partitioned) in the
    diffusers layout: config.json plus safetensors shards (each carrying `metadata`) and their index, as
    diffusers' `save_pretrained` writes them (which cannot add metadata). Returns, on the main process, a
    few of the written tensors (for the load-back check).

    Parameters are gathered one at a time and each shard is written as soon as it is full, so the
    peak extra memory is one shard on the host and one parameter on the GPU, whatever the model size.
    """
    named = list(model.named_parameters())
    persistent_buffers = [(name, buffer) for name, buffer in model.named_buffers() if name in model.state_dict()]
    sizes = [(name, int(getattr(p, "ds_numel", p.numel())) * p.element_size()) for name, p in named]
    sizes += [(name, buffer.numel() * buffer.element_size()) for name, buffer in persistent_buffers]
    tensors_by_name = dict(named) | dict(persistent_buffers)
    shards = _plan_shards(sizes, parse_size(max_shard_size))
    wanted_samples = set(sample_names([name for name, _ in sizes]))
    samples: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    if is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_config(out_dir)
    for index, names in enumerate(shards):
        file_name = _shard_file_name(index, len(shards))
        shard: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = tensors_by_name[name]
            with gathered([tensor] if isinstance(tensor, torch.nn.Parameter) else []):
                if is_main_process:
                    shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if is_main_process:
            save_file(shard, str(out_dir / file_name), metadata=metadata)
            weight_map.update(dict.fromkeys(names, file_name))
            samples.update({name: shard[name] for name in names if name in wanted_samples})
        del shard
    if is_main_process and len(shards) > 1:
        index_content = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
        (out_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index_content, indent=2, sort_keys=True) + "\n")
    return samples


def sample_names(names: list[str]) -> list[str]:
    if len(names) <= SAMPLE_TENSORS_TO_COMPARE:
        return names
    step = (len(names) - 1) / (SAMPLE_TENSORS_TO_COMPARE - 1)
    return [names[round(index * step)] for index in range(SAMPLE_TENSORS_TO_COMPARE)]


def verify_saved_transformer(folder: Path, samples: dict[str, torch.Tensor]) -> None:
    """Load `folder` with its class's from_pretrained (the class its config names: FLUX.1's or FLUX.2's)
    and compare the sampled tensors exactly."""
    try:
        reloaded = transformer_class_in(folder).from_pretrained(str(folder), torch_dtype=None)
    except Exception as error:  # any failure to load is an export failure, whatever diffusers raises
        raise TrainerFailure(
            "export_failed", f"the saved transformer in {folder.name}/ does not load in diffusers: {error}"
        ) from error
    state = reloaded.state_dict()
    for name, expected in samples.items():
        if name not in state or not torch.equal(state[name].cpu(), expected):
            raise TrainerFailure("export_failed", f"the saved transformer's {name} differs from the trained weights")


# safetensors' names for torch dtypes (the file header's "dtype").
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of a file written by `write_safetensors_streaming`: known by dtype and shape before it exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    build: Callable[[], torch.Tensor]

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors_streaming(path: Path, tensors: list[PlannedTensor], metadata: dict[str, str]) -> None:
    """A safetensors file written one tensor at a time: the header (every name, dtype, shape and offset)
    first, then each tensor's bytes as it is built, so at most one tensor is in memory."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.bytes],
        }
        offset += tensor.bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for planned in tensors:
            built = planned.build().contiguous()
            if built.dtype != planned.dtype or tuple(built.shape) != planned.shape:
                raise TrainerFailure(
                    "export_failed",
                    f"{planned.name} came out {built.dtype} {tuple(built.shape)}, planned {planned.dtype} {planned.shape}",
                )
            file.write(built.view(torch.uint8).numpy().data)


def export_single_file(
    transformer_folder: Path, out_file: Path, metadata: dict[str, str], tables: KeyTables = FLUX1_TABLES
) -> None:
    """The saved diffusers transformer → one safetensors file in the original FLUX layout (ComfyUI's
    diffusion_models folder, `FluxTransformer2DModel.from_single_file`). Streamed: each original tensor
    is read from the shards (memory-mapped), built, written and dropped, then checked the same way
    against the written file, so no state dict, fused copy or reload of the whole model is ever held."""
    files = sorted(transformer_folder.glob("diffusion_pytorch_model*.safetensors"))
    with ExitStack() as stack:
        shards = [stack.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in files]
        shard_of = {key: shard for shard in shards for key in shard.keys()}

        def read(key: str) -> torch.Tensor:
            return shard_of[key].get_tensor(key)

        planned = []
        for entry in single_file_layout(shard_of, tables):
            slices = [shard_of[source].get_slice(source) for source in entry.sources]
            shape = (sum(piece.get_shape()[0] for piece in slices), *slices[0].get_shape()[1:])
            dtype = _TORCH_DTYPES[slices[0].get_dtype()]
            planned.append(PlannedTensor(entry.name, dtype, shape, partial(_build_original, entry, read)))
        write_safetensors_streaming(out_file, planned, metadata)
        written = stack.enter_context(safe_open(str(out_file), framework="pt", device="cpu"))
        if set(written.keys()) != {tensor.name for tensor in planned}:
            raise TrainerFailure(
                "export_failed", f"{out_file.name} does not hold every tensor of the trained transformer"
            )
        for tensor in planned:
            if not torch.equal(written.get_tensor(tensor.name), tensor.build()):
                raise TrainerFailure(
                    "export_failed", f"{out_file.name} does not hold the trained weights in {tensor.name}"
                )


def _build_original(entry: OriginalTensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    return entry.build([read(source) for source in entry.sources])
