"""Measure FLUX activation memory on the CPU and compare it with the planner's activation model.

Two measurements on FluxTransformer2DModel built from config (random weights, no download),
with FLUX.1's head dimension (128) and 2 or 4 heads — the real model has 24; activations are
linear in the number of heads, which the two widths check:

1. saved-tensor bytes per block: every tensor autograd saves for backward, seen through
   `torch.autograd.graph.saved_tensors_hooks`, deduplicated by storage, parameters excluded.
   These give the coefficients in `fluxbooth.plan.SAVED_BYTES_PER_TOKEN_HIDDEN`.
2. the allocator's peak over one forward and backward (torch.profiler with profile_memory) of a
   model with 2 double and 2 single blocks, with and without gradient checkpointing, at 512^2
   and 1024^2, compared with `fluxbooth.plan.activation_bytes`.

Usage: python bench/activations.py [--quick] [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxTransformer2DModel

from fluxbooth.plan import JobShape, activation_bytes, image_tokens
from fluxbooth.sizing import model_size_from_configs

HEAD_DIM = 128
TEXT_TOKENS = 512
JOINT_DIM = 4096
SECTION_BEGIN = "<!-- activations:begin -->"
SECTION_END = "<!-- activations:end -->"


@dataclass(frozen=True)
class Shape:
    heads: int
    resolution: int
    double: int
    single: int

    def config(self) -> dict[str, Any]:
        return {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": self.double,
            "num_single_layers": self.single,
            "attention_head_dim": HEAD_DIM,
            "num_attention_heads": self.heads,
            "joint_attention_dim": JOINT_DIM,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        }


def build(shape: Shape, dtype: torch.dtype, checkpointing: bool) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**shape.config()).to(dtype).train()
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model


def inputs(shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    image = image_tokens((shape.resolution, shape.resolution))
    return {
        "hidden_states": torch.randn(1, image, 64, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, JOINT_DIM, dtype=dtype),
        "pooled_projections": torch.randn(1, 768, dtype=dtype),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "guidance": torch.tensor([1.0], dtype=dtype),
        "img_ids": torch.zeros(image, 3),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
        "return_dict": False,
    }


def saved_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Bytes autograd saves for backward in one forward (no checkpointing), parameters excluded."""
    model = build(shape, dtype, checkpointing=False)
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs(shape, dtype))
    return sum(seen.values())


def peak_bytes(shape: Shape, dtype: torch.dtype, checkpointing: bool) -> tuple[int, int]:
    """(allocator peak over forward+backward, weight-gradient bytes).

    A first step allocates the weight gradients; the measured second step accumulates into them,
    as DeepSpeed's preallocated gradient buffers do, so the peak is the activations' own."""
    from torch.profiler import ProfilerActivity, profile

    model = build(shape, dtype, checkpointing)
    arguments = inputs(shape, dtype)
    model(**arguments)[0].float().square().mean().backward()
    grads = sum(
        parameter.grad.numel() * parameter.grad.element_size()
        for parameter in model.parameters()
        if parameter.grad is not None
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        output = model(**arguments)[0]
        output.float().square().mean().backward()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak, grads


def coefficients(dtype: torch.dtype, heads: int, resolution: int) -> dict[str, float]:
    base = saved_bytes(Shape(heads, resolution, 0, 0), dtype)
    double = saved_bytes(Shape(heads, resolution, 1, 0), dtype) - base
    single = saved_bytes(Shape(heads, resolution, 0, 1), dtype) - base
    tokens = image_tokens((resolution, resolution)) + TEXT_TOKENS
    token_hidden = tokens * heads * HEAD_DIM
    # A lone block also saves the shared rotary tables (cos and sin, fp32): count them once, apart.
    rotary = 2 * tokens * HEAD_DIM * 4
    return {
        "double": (double - rotary) / token_hidden,
        "single": (single - rotary) / token_hidden,
    }


def predicted_peak(shape: Shape, dtype: torch.dtype, checkpointing: bool) -> int:
    size = model_size_from_configs(
        "scaled",
        shape.config(),
        {
            "vocab_size": 1,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 0,
            "max_position_embeddings": 1,
        },
        {"vocab_size": 1, "d_model": JOINT_DIM, "d_kv": 1, "d_ff": 1, "num_layers": 0, "num_heads": 1},
        {"block_out_channels": [8], "layers_per_block": 1, "latent_channels": 16},
        source="config",
    )
    job = JobShape(resolution=(shape.resolution, shape.resolution), gradient_checkpointing=checkpointing)
    every = 1 if checkpointing else 0
    return sum(activation_bytes(size, job, "no" if dtype == torch.float32 else "bf16", every).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="512^2 only")
    parser.add_argument("--write", type=Path, help="replace the activations section of this markdown file")
    arguments = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    resolutions = (512,) if arguments.quick else (512, 1024)
    rows_coefficients = []
    for dtype in (torch.bfloat16, torch.float32):
        for heads in (2, 4):
            for resolution in resolutions:
                values = coefficients(dtype, heads, resolution)
                rows_coefficients.append((str(dtype).removeprefix("torch."), heads, resolution, values))
                print(json.dumps({"dtype": str(dtype), "heads": heads, "resolution": resolution, **values}), flush=True)
    rows_peak = []
    for heads in (2, 4):
        for resolution in resolutions:
            for checkpointing in (False, True):
                shape = Shape(heads, resolution, 2, 2)
                started = time.monotonic()
                peak, grads = peak_bytes(shape, torch.bfloat16, checkpointing)
                predicted = predicted_peak(shape, torch.bfloat16, checkpointing)
                rows_peak.append((heads, resolution, checkpointing, peak, grads, predicted))
                print(
                    json.dumps(
                        {
                            "heads": heads,
                            "resolution": resolution,
                            "checkpointing": checkpointing,
                            "measured_peak": peak,
                            "weight_grads": grads,
                            "predicted": predicted,
                            "seconds": round(time.monotonic() - started, 1),
                        }
                    ),
                    flush=True,
                )
    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    lines = [
        SECTION_BEGIN,
        "### Activations (bench/activations.py, CPU)",
        "",
        f"Machine: {machine}. FLUX blocks with head dim 128, text 512 tokens, batch 1, random weights.",
        "",
        "Saved-for-backward bytes per (token x hidden unit), one block, rotary tables excluded "
        "(`fluxbooth.plan.SAVED_BYTES_PER_TOKEN_HIDDEN`):",
        "",
        "| dtype | heads | resolution | double block | single block |",
        "|---|---|---|---|---|",
    ]
    for dtype_name, heads, resolution, values in rows_coefficients:
        lines.append(f"| {dtype_name} | {heads} | {resolution}² | {values['double']:.1f} | {values['single']:.1f} |")
    lines += [
        "",
        "Allocator peak over the second forward + backward (weight gradients already allocated, as in "
        "DeepSpeed's buffers; they are counted in the model states, not here), 2 double + 2 single blocks, bf16:",
        "",
        "| heads | resolution | checkpointing | measured peak | predicted | error | weight grads |",
        "|---|---|---|---|---|---|---|",
    ]
    for heads, resolution, checkpointing, peak, grads, predicted in rows_peak:
        error = (predicted - peak) / peak * 100
        lines.append(
            f"| {heads} | {resolution}² | {'on' if checkpointing else 'off'} | {peak / 2**20:.1f} MiB | "
            f"{predicted / 2**20:.1f} MiB | {error:+.1f} % | {grads / 2**20:.1f} MiB |"
        )
    lines.append(SECTION_END)
    section = "\n".join(lines) + "\n"
    print(section)
    if arguments.write:
        replace_section(arguments.write, SECTION_BEGIN, SECTION_END, section)


def replace_section(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text between `begin` and `end` (inclusive) or append it; the rest of the file is kept."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
