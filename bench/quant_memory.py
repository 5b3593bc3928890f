"""Host-memory peaks of a LoRA over a bf16, fp8 and nf4 FLUX base on the CPU, against the planner.

The model: the `scaled` FLUX-architecture transformer of bench/memory.py (about 70 M parameters, random
weights, stored in bf16 like FLUX.1's checkpoints), built here offline.

Each precision runs in a fresh process, which measures its own resident memory (RSS) above a baseline
taken after its imports; Linux's peak counter (VmHWM) is reset (`/proc/self/clear_refs` = 5) before each
phase, so each phase's high-water mark is its own:
- `stored`: resident after loading, the frozen base as stored;
- `load peak`: the high-water mark while loading (bf16: diffusers' from_pretrained, what the trainer does
  for a bf16 base; fp8/nf4: fluxbooth.train.quantize's layer-by-layer loader);
- `train peak`: LoRA (the planner's default targets, rank 16) with gradient checkpointing, AdamW on the
  fp32 adapter, one step at 256² with a 64-token prompt: the base, the adapter's states, the activations,
  and (quantised) the dequantised layer in flight.

Predicted (fluxbooth.plan.memory): `stored` = frozen_base_bytes; `load peak` = stored plus one bf16 layer
in flight (quantised; a bf16 base is read once, in place); `train peak` = every device (`gpu.`) term of
`estimate_memory` for Strategy("lora", no DeepSpeed, base_precision): what the model states and activations
occupy, which on the CPU accelerator is host memory. The children run with MALLOC_MMAP_THRESHOLD_=131072 so
glibc returns freed buffers (its retention is a host term of its own, measured by bench/memory.py).

Usage: python bench/quant_memory.py [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SECTION_BEGIN = "<!-- quant_memory:begin -->"
SECTION_END = "<!-- quant_memory:end -->"
PRECISIONS = ("bf16", "fp8", "nf4")
RESOLUTION = 256
TEXT_TOKENS = 64
LORA_RANK = 16
STEPS = 1
AGREEMENT = 0.15


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure(model_dir: Path, precision: str) -> dict[str, int]:
    """In the child process: the three phases, as bytes above the post-import baseline."""
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from fluxbooth.plan.types import DEFAULT_LORA_TARGETS
    from fluxbooth.train.quantize import load_quantised_base, quantised_linear

    torch.manual_seed(0)
    folder = model_dir / "transformer"
    # Warm-up outside the measurement: diffusers' lazy modules and torch's first kernels load on first use.
    with torch.device("meta"):
        FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(str(folder)))
    if precision != "bf16":
        quantised_linear(precision, torch.randn(64, 64).bfloat16(), None)
    gc.collect()
    baseline = rss_bytes()
    reset_peak()
    if precision == "bf16":
        model = FluxTransformer2DModel.from_pretrained(str(folder), torch_dtype=torch.bfloat16)
        # diffusers maps bf16 safetensors without copying: the pages become resident as they are read,
        # which training does at its first step. Reading them now counts them where they belong.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.float().sum()
    else:
        model = load_quantised_base(str(model_dir), precision, torch.device("cpu"), torch.bfloat16)
    gc.collect()
    result = {"stored": rss_bytes() - baseline, "load_peak": peak_rss_bytes() - baseline}
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian", target_modules=list(DEFAULT_LORA_TARGETS)))
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.data = parameter.data.float()
    model.enable_gradient_checkpointing()
    model.train()
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    inputs = training_inputs(model.config)
    reset_peak()
    for _ in range(STEPS):
        loss = model(**inputs).sample.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["train_peak"] = peak_rss_bytes() - baseline
    result["trainable_params"] = sum(parameter.numel() for parameter in trainable)
    return result


def training_inputs(config: Any) -> dict[str, Any]:
    import torch

    tokens = (RESOLUTION // 16) ** 2
    return {
        "hidden_states": torch.randn(1, tokens, config.in_channels).bfloat16(),
        "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, config.joint_attention_dim).bfloat16(),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim).bfloat16(),
        "timestep": torch.tensor([0.5]).bfloat16(),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
        "guidance": torch.tensor([3.5]).bfloat16(),
    }


def predicted(model_dir: Path, precision: str, work: Path) -> dict[str, int]:
    from fluxbooth.hardware import probe_hardware
    from fluxbooth.modelsize import model_size
    from fluxbooth.plan.memory import estimate_memory, frozen_base_bytes
    from fluxbooth.plan.types import JobShape, Strategy

    size = model_size(str(model_dir))
    stored = sum(frozen_base_bytes(size, precision, 2).values())
    # Loading a quantised base holds one bf16 layer beside it; a bf16 base is read once, in place.
    in_flight = size.largest_layer_params * 2 if precision != "bf16" else 0
    job = JobShape(
        training_type="lora", lora_rank=LORA_RANK, base_precision=precision, use_deepspeed=False,
        resolution=(RESOLUTION, RESOLUTION), max_sequence_length=TEXT_TOKENS, steps=STEPS,
    )  # fmt: skip
    hardware = probe_hardware(work, {"PATH": os.environ.get("PATH", "")})
    estimate = estimate_memory(Strategy("lora", False, 0, "none", "none", precision), size, job, hardware, "bf16")
    device_terms = {key: value for key, value in estimate.breakdown.items() if key.startswith("gpu.")}
    return {
        "stored": stored,
        "load_peak": stored + in_flight,
        # What the planner puts on the device for this strategy (frozen base, adapter and its optimizer
        # state, activations, the dequantised layer in flight): on the CPU accelerator it is in host memory.
        "train_peak": sum(device_terms.values()),
        "trainable_params": int(estimate.breakdown["trainable_params"]),
    }


def build_scaled_model(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import build_models  # bench/memory.py: the scaled model of the memory benchmark

    return build_models(root)["scaled"]


def run_child(model_dir: Path, precision: str) -> dict[str, int]:
    # glibc's default mmap threshold rises after large frees and then keeps freed buffers in the heap
    # (bench/memory.py measures that retention separately); fixed, the peaks are what is really in use.
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    completed = subprocess.run(
        [sys.executable, __file__, "--child", precision, str(model_dir)],
        capture_output=True, text=True, timeout=1800, check=False, env=environment,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"{precision} run failed:\n{completed.stderr[-4000:]}")
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def section(rows: list[tuple[str, dict[str, int], dict[str, int]]], parameters: int) -> str:
    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    lines = [
        SECTION_BEGIN,
        "## LoRA over a bf16, fp8 and nf4 base: host memory on the CPU (`bench/quant_memory.py`)",
        "",
        f"Machine: {machine}. Scaled FLUX transformer ({parameters / 1e6:.1f} M parameters, bf16 checkpoint), "
        f"LoRA rank {LORA_RANK} on the planner's default targets, {RESOLUTION}², {TEXT_TOKENS} text tokens, "
        "gradient checkpointing, AdamW, no DeepSpeed. Bytes above each process's post-import RSS; "
        "MALLOC_MMAP_THRESHOLD_=131072; predicted = fluxbooth.plan.memory (frozen_base_bytes; estimate_memory's device terms).",
        "",
        "| base | phase | measured MiB | predicted MiB | error |",
        "|---|---|---:|---:|---:|",
    ]
    for precision, measured, expected in rows:
        for phase in ("stored", "load_peak", "train_peak"):
            error = (expected[phase] - measured[phase]) / measured[phase]
            lines.append(f"| {precision} | {phase.replace('_', ' ')} | {mib(measured[phase])} | {mib(expected[phase])} | {error:+.1%} |")
    lines += ["", SECTION_END]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    current = path.read_text() if path.is_file() else ""
    if SECTION_BEGIN in current:
        head, rest = current.split(SECTION_BEGIN, 1)
        current = head + text + rest.split(SECTION_END, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(current)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("PRECISION", "MODEL_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, help="replace this benchmark's section in a RESULTS.md")
    parser.add_argument("--work", type=Path, help="where to build the scaled model (default: a temporary folder)")
    arguments = parser.parse_args()
    if arguments.child:
        precision, model_dir = arguments.child
        print(json.dumps(measure(Path(model_dir), precision)))
        return 0
    work = arguments.work or Path(tempfile.mkdtemp(prefix="quant-memory-"))
    try:
        model_dir = build_scaled_model(work)
        rows = []
        for precision in PRECISIONS:
            measured, expected = run_child(model_dir, precision), predicted(model_dir, precision, work)
            rows.append((precision, measured, expected))
            print(precision, {phase: (mib(measured[phase]), mib(expected[phase])) for phase in ("stored", "load_peak", "train_peak")}, flush=True)
        from fluxbooth.modelsize import model_size

        text = section(rows, model_size(str(model_dir)).transformer_params)
        print(text)
        if arguments.write:
            write_section(arguments.write, text)
        worst = max(abs(expected[p] - measured[p]) / measured[p] for _, measured, expected in rows for p in ("stored", "train_peak"))
        return 0 if worst <= AGREEMENT else 1
    finally:
        if arguments.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
