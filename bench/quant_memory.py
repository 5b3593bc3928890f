"""Host-memory peaks of a LoRA over a bf16, fp8 and nf4 FLUX base on the CPU, against the planner.

The model: the `scaled` FLUX-architecture transformer of bench/memory.py (about 70 M parameters, random
weights, stored in bf16 like FLUX.1's checkpoints), built here offline.

Each precision runs in a fresh process, which measures its own resident memory (RSS) above a baseline
taken after a warm-up: the same load and training step on the tiny FLUX model (fluxbooth.synthetic.tiny). The first
training step of a process leaves 30-40 MiB resident that no model term owns and that does not grow with the
model: libtorch's backward and optimizer code paged in (file-backed, about 23 MiB) and runtime state
allocated once (autograd's and oneDNN's, about 15-20 MiB anonymous). Without the warm-up that constant was
counted as training memory (train peaks 18-28 % above the prediction, for bf16 as for fp8 and nf4); the
planner counts it once per process, in TRAINER_PROCESS_BASELINE_BYTES, which bench/memory.py read off whole
tiny-model training runs. Linux's peak counter (VmHWM) is reset (`/proc/self/clear_refs` = 5) before each
phase, so each phase's high-water mark is its own:
- `stored`: resident after loading, the frozen base as stored;
- `load peak`: the high-water mark while loading (bf16: diffusers' from_pretrained, what the trainer does
  for a bf16 base; fp8/nf4: fluxbooth.train.quantize's layer-by-layer loader);
- `train peak`: LoRA (the planner's default targets, rank 16) with gradient checkpointing, AdamW on the
  fp32 adapter, one step at 256² with a 64-token prompt: the base, the adapter's states, the activations,
  and (quantised) the dequantised layer in flight.

Predicted (fluxbooth.plan.memory): `stored` = frozen_base_bytes; `load peak` = stored plus the layer being
quantised (quantised: its bf16 weight and the quantiser's working copies, `layer_being_quantised`; a bf16 base
is read once, in place); `train peak` = every device (`gpu.`) term of
`estimate_memory` for Strategy("lora", no DeepSpeed, base_precision): what the model states and activations
occupy, which on the CPU accelerator is host memory. The children run with MALLOC_MMAP_THRESHOLD_=131072 so
glibc returns freed buffers (its retention is a host term of its own, measured by bench/memory.py).

Usage: python bench/quant_memory.py [--write bench/RESULTS.md] [--repeat 2]
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
PHASES_SHOWN = ("stored", "load_peak", "train_peak")
# The pass condition: the base as stored and the training peak. The load peak is shown beside the planner's
# bound for it (the whole base stored plus the largest layer being quantised), which it stays under.
PHASES_CHECKED = ("stored", "train_peak")


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


def load_base(model_dir: Path, precision: str) -> Any:
    """The frozen base as the trainer loads it: diffusers' from_pretrained (bf16) or the quantising loader."""
    import torch
    from diffusers import FluxTransformer2DModel

    from fluxbooth.train.quantize import load_quantised_base

    if precision != "bf16":
        return load_quantised_base(str(model_dir), precision, torch.device("cpu"), torch.bfloat16)
    model = FluxTransformer2DModel.from_pretrained(str(model_dir / "transformer"), torch_dtype=torch.bfloat16)
    # diffusers maps bf16 safetensors without copying: the pages become resident as they are read, which
    # training does at its first step. Reading them now counts them where they belong.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.float().sum()
    return model


def train_lora(model: Any, before_first_step: Any = None) -> int:
    """LoRA (rank 16, the planner's default targets, fp32 adapter) with gradient checkpointing and AdamW,
    STEPS steps; returns the adapter's parameter count."""
    import torch
    from peft import LoraConfig

    from fluxbooth.contract.names import DEFAULT_LORA_TARGET_MODULES

    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            init_lora_weights="gaussian",
            target_modules=list(DEFAULT_LORA_TARGET_MODULES),
        )
    )
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.data = parameter.data.float()
    model.enable_gradient_checkpointing()
    model.train()
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    inputs = training_inputs(model.config)
    if before_first_step is not None:
        before_first_step()
    for _ in range(STEPS):
        loss = model(**inputs).sample.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sum(parameter.numel() for parameter in trainable)


def measure(model_dir: Path, warm_up_dir: Path, precision: str) -> dict[str, int]:
    """In the child process: the three phases, as bytes above the baseline after the warm-up."""
    import torch

    torch.manual_seed(0)
    # Warm-up outside the measurement: the same load and training step on the tiny model, so what a
    # process's first step leaves resident whatever the model (code pages, runtime state) is in the baseline.
    train_lora(load_base(warm_up_dir, precision))
    gc.collect()
    baseline = rss_bytes()
    reset_peak()
    model = load_base(model_dir, precision)
    gc.collect()
    result = {"stored": rss_bytes() - baseline, "load_peak": peak_rss_bytes() - baseline}
    result["trainable_params"] = train_lora(model, before_first_step=reset_peak)
    result["train_peak"] = peak_rss_bytes() - baseline
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
    from fluxbooth.host.hardware import probe_hardware
    from fluxbooth.plan.memory import estimate_memory, frozen_base_bytes, layer_being_quantised
    from fluxbooth.plan.types import JobShape, Strategy
    from fluxbooth.sizing import model_size

    size = model_size(str(model_dir))
    stored = sum(frozen_base_bytes(size, precision, 2).values())
    # Loading a quantised base holds the layer being quantised beside it; a bf16 base is read once, in place.
    in_flight = layer_being_quantised(size, precision, 2) if precision != "bf16" else 0
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


def build_models(root: Path) -> dict[str, Path]:
    """bench/memory.py's models: `scaled` (measured) and `tiny` (the warm-up)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import build_models as build_memory_models

    return build_memory_models(root)


def run_child(model_dir: Path, warm_up_dir: Path, precision: str) -> dict[str, int]:
    # glibc's default mmap threshold rises after large frees and then keeps freed buffers in the heap
    # (bench/memory.py measures that retention separately); fixed, the peaks are what is really in use.
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    completed = subprocess.run(
        [sys.executable, __file__, "--child", precision, str(model_dir), str(warm_up_dir)],
        capture_output=True, text=True, timeout=1800, check=False, env=environment,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"{precision} run failed:\n{completed.stderr[-4000:]}")
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def error(measured: int, expected: int) -> float:
    return (expected - measured) / measured


def section(rows: list[tuple[str, list[dict[str, int]], dict[str, int]]], parameters: int) -> str:
    import torch

    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    )
    runs = len(rows[0][1])
    lines = [
        SECTION_BEGIN,
        "## LoRA over a bf16, fp8 and nf4 base: host memory on the CPU (`bench/quant_memory.py`)",
        "",
        f"Machine: {machine}, shared with other engineers' jobs while it ran (memory is far less sensitive "
        f"to that than time). Scaled FLUX transformer ({parameters / 1e6:.1f} M parameters, bf16 checkpoint), "
        f"LoRA rank {LORA_RANK} on the planner's default targets, {RESOLUTION}², {TEXT_TOKENS} text tokens, "
        "gradient checkpointing, AdamW, no DeepSpeed. Bytes above each process's RSS after a warm-up (the same "
        "load and training step on the tiny model, so the first step's code pages and runtime state, which the "
        "planner counts in the process baseline, are not counted again); MALLOC_MMAP_THRESHOLD_=131072; "
        f"predicted = fluxbooth.plan.memory (frozen_base_bytes, layer_being_quantised; estimate_memory's device "
        f"terms). {runs} fresh process{'es' if runs > 1 else ''} per base.",
        "",
        "| base | phase | measured MiB (each run) | predicted MiB | error (each run) |",
        "|---|---|---:|---:|---:|",
    ]
    for precision, measured_runs, expected in rows:
        for phase in PHASES_SHOWN:
            measured = " / ".join(mib(run[phase]) for run in measured_runs)
            errors = " / ".join(f"{error(run[phase], expected[phase]):+.1%}" for run in measured_runs)
            lines.append(
                f"| {precision} | {phase.replace('_', ' ')} | {measured} | {mib(expected[phase])} | {errors} |"
            )
    lines += [
        "",
        f"Pass condition: stored and training peaks within {AGREEMENT:.0%} of the prediction in every run. The load "
        "peak is shown against the planner's bound for it (the whole base stored plus the largest layer's bf16 "
        "weight and the quantiser's working copies of it, `layer_being_quantised`), which it stays under.",
        "",
        SECTION_END,
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("PRECISION", "MODEL_DIR", "WARM_UP_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, help="replace this benchmark's section in a RESULTS.md")
    parser.add_argument("--work", type=Path, help="where to build the scaled model (default: a temporary folder)")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per base precision")
    arguments = parser.parse_args()
    if arguments.child:
        precision, model_dir, warm_up_dir = arguments.child
        print(json.dumps(measure(Path(model_dir), Path(warm_up_dir), precision)))
        return 0
    work = arguments.work or Path(tempfile.mkdtemp(prefix="quant-memory-"))
    try:
        models = build_models(work)
        rows = []
        for precision in PRECISIONS:
            expected = predicted(models["scaled"], precision, work)
            measured_runs = [run_child(models["scaled"], models["tiny"], precision) for _ in range(arguments.repeat)]
            rows.append((precision, measured_runs, expected))
            for measured in measured_runs:
                print(
                    precision,
                    {phase: (mib(measured[phase]), mib(expected[phase])) for phase in PHASES_SHOWN},
                    flush=True,
                )
        from fluxbooth.sizing import model_size

        text = section(rows, model_size(str(models["scaled"])).transformer_params)
        print(text)
        if arguments.write:
            from activations import replace_section  # bench/activations.py (build_models put bench/ on the path)

            replace_section(arguments.write, SECTION_BEGIN, SECTION_END, text)
        worst = max(
            abs(error(measured[phase], expected[phase]))
            for _, measured_runs, expected in rows
            for measured in measured_runs
            for phase in PHASES_CHECKED
        )
        print(f"worst disagreement {worst:.1%} (pass: within {AGREEMENT:.0%})")
        return 0 if worst <= AGREEMENT else 1
    finally:
        if arguments.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
