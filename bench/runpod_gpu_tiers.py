"""The README's GPU-tier tables, from the planner: `python bench/runpod_gpu_tiers.py [--guide] > tiers.md`.

Default: the README's "default request" table. For each card (GPU memory, the host RAM such workers have,
its NVML name for the time model) the request without training_type (FLUX.1-dev, rank-16 LoRA, 1000 steps)
at the card's resolution goes through `python -m fluxbooth plan --request … --json`; one Markdown row says
what the job would run (base, ZeRO stage, offload, GPU and host peaks, s/step, whole job) or why it is
refused and what to change. `--guide`: the guide's two example requests and the default one on the
24/48/80 GiB tiers, against the default 55-minute deadline. Predictions from docs/memory.md, not
measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GIB = 1024**3
DEFAULT_DEADLINE_SECONDS = 3300  # FLUXBOOTH_JOB_DEADLINE_SECONDS's default
TIERS = (
    ("24 GB: RTX 4090, L4, A5000", "24GiB", "62GiB", "RTX 4090"),
    ("48 GB: L40S, RTX A6000, A40", "48GiB", "94GiB", "L40S"),
    ("80 GB: A100, H100", "80GiB", "188GiB", "H100"),
)
GUIDE_BASIC = {
    "model_name": "my_dreambooth_model", "dataset": "base64_encoded_dataset_zip",
    "instance_prompt": "a photo of sks person", "class_prompt": "a photo of a person",
    "steps": 2000, "learning_rate": 2e-6, "batch_size": 1, "use_deepspeed": True,
}
GUIDE_ADVANCED = {
    **GUIDE_BASIC, "gradient_accumulation_steps": 2, "resolution": "1024x1024", "with_prior_preservation": True,
    "prior_loss_weight": 1.0, "num_class_images": 50, "mixed_precision": "fp16", "gradient_checkpointing": True,
}
NO_TRAINING_TYPE = {
    "model_name": "my-flux", "dataset_url": "https://example.com/photos.zip",
    "instance_prompt": "a photo of sks person", "steps": 1000, "resolution": 1024,
}
REQUESTS = (
    ("the guide's basic request", GUIDE_BASIC),
    ("the guide's advanced request", GUIDE_ADVANCED),
    ("no training_type, 1000 steps at 1024²", NO_TRAINING_TYPE),
)


# (row label, GPU memory, host RAM, NVML name for the time model, resolution) for the default request.
CARDS = (
    ("any 8 GiB card (timed as an A4000)", "8GiB", "32GiB", "NVIDIA RTX A4000", 512),
    ("any 8 GiB card (timed as an A4000)", "8GiB", "62GiB", "NVIDIA RTX A4000", 512),
    ("any 8 GiB card (timed as an A4000)", "8GiB", "62GiB", "NVIDIA RTX A4000", 1024),
    ("RTX A4000", "16GiB", "62GiB", "NVIDIA RTX A4000", 1024),
    ("L4", "24GiB", "62GiB", "NVIDIA L4", 1024),
    ("RTX 4090", "24GiB", "62GiB", "NVIDIA GeForce RTX 4090", 1024),
    ("RTX A6000", "48GiB", "94GiB", "NVIDIA RTX A6000", 1024),
    ("L40S", "48GiB", "94GiB", "NVIDIA L40S", 1024),
    ("A100 SXM 80GB", "80GiB", "188GiB", "NVIDIA A100-SXM4-80GB", 1024),
    ("H100 80GB HBM3", "80GiB", "188GiB", "NVIDIA H100 80GB HBM3", 1024),
)


def plan(tier: tuple[str, str, str, str], request: dict[str, Any], folder: Path) -> dict[str, Any]:
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    _, gpu_memory, host_memory, gpu_name = tier
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth", "plan", "--gpu-memory", gpu_memory, "--host-memory", host_memory,
         "--gpus", "1", "--disk", "200GiB", "--gpu-name", gpu_name, "--request", str(path), "--json"],
        capture_output=True, text=True, check=False,
    )
    try:
        return json.loads(completed.stdout)
    except ValueError:
        return {"error": {"message": (completed.stderr or completed.stdout).strip().splitlines()[-1]}}


def describe(chosen: dict[str, Any]) -> str:
    kind = f"LoRA r{chosen['lora_rank']}" if chosen["training_type"] == "lora" else "full fine-tune"
    offload = "/".join(value for value in (chosen["offload_optimizer"], chosen["offload_param"]))
    return (
        f"{kind}, {chosen['base_precision']} base, ZeRO-{chosen['zero_stage']}, offload {offload}: "
        f"GPU ≈{chosen['gpu_bytes'] / GIB:.1f} GiB, host ≈{chosen['host_bytes'] / GIB:.1f} GiB, "
        f"≈{chosen['total_seconds'] / 60:.0f} min"
    )


def outcome(result: dict[str, Any]) -> str:
    chosen = result.get("chosen")
    if chosen:
        return describe(chosen)
    error = result.get("error") or {}
    message = error.get("message", "?") if isinstance(error, dict) else str(error)
    return f"refused ({error.get('code', 'error') if isinstance(error, dict) else 'error'}): {message}"


def deadline_note(result: dict[str, Any]) -> str:
    """Whether the run fits the default deadline, and if not, the deadline it needs."""
    chosen = result.get("chosen")
    if not chosen:
        return "–"
    if chosen["total_seconds"] <= DEFAULT_DEADLINE_SECONDS:
        return "yes"
    needed_minutes = -(-chosen["total_seconds"] * 1.1 // 60)
    return f"no: set the deadline and the execution timeout to ≈{needed_minutes:.0f} min, or fewer steps"


def where(chosen: dict[str, Any]) -> str:
    base = f"{chosen['base_precision']} base"
    if chosen["offload_param"] != "none":
        placed = f"{base} offloaded to the {chosen['offload_param'].upper()}"
    else:
        placed = f"{base} on the GPU"
    optimizer = f", optimizer on the {chosen['offload_optimizer'].upper()}" if chosen["offload_optimizer"] != "none" else ""
    return f"{placed}, ZeRO-{chosen['zero_stage']}{optimizer}"


def card_row(card: tuple[str, str, str, str, int], folder: Path) -> str:
    label, gpu_memory, host_memory, gpu_name, resolution = card
    result = plan((label, gpu_memory, host_memory, gpu_name), {**NO_TRAINING_TYPE, "resolution": resolution}, folder)
    memory = f"{gpu_memory.replace('GiB', ' GiB')} / {host_memory.replace('GiB', ' GiB')}"
    chosen = result.get("chosen")
    if not chosen:
        refusal = outcome(result).replace("|", "\\|")
        return f"| {label} | {memory} | {resolution}² | {refusal} | – | – | – | – |"
    return (
        f"| {label} | {memory} | {resolution}² | {where(chosen)} | {chosen['gpu_bytes'] / GIB:.1f} GiB | "
        f"{chosen['host_bytes'] / GIB:.1f} GiB | {chosen['seconds_per_step']:.1f} | {chosen['total_seconds'] / 60:.0f} min |"
    )


def default_request_table() -> None:
    print("| GPU | GPU / host RAM | resolution | chosen | GPU peak | host peak | s/step | whole job |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as temporary:
        for card in CARDS:
            print(card_row(card, Path(temporary)))


def guide_table() -> None:
    print("| GPU (host RAM) | request | the planner's answer | within the default 55-min deadline |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as temporary:
        for tier in TIERS:
            for label, request in REQUESTS:
                result = plan(tier, request, Path(temporary))
                answer = outcome(result).replace("|", "\\|")
                print(f"| {tier[0]} ({tier[2].replace('GiB', ' GiB')}) | {label} | {answer} | {deadline_note(result)} |")


if __name__ == "__main__":
    guide_table() if "--guide" in sys.argv[1:] else default_request_table()
