"""The README's GPU tables, from the planner: `python bench/runpod_gpu_tiers.py [--guide] > tiers.md`.

One row per card: each card's request goes through `python -m fluxbooth plan --request … --json` on a
hypothetical machine with that card's memory and its datasheet row (`--gpu-name`), at the worker's own
deadline (plan's default: FLUXBOOTH_JOB_DEADLINE_SECONDS, 540 s unless the environment sets it). A row says
what the job would run (base, ZeRO stage, offload, GPU and host peaks, s/step, the whole job) or why it is
refused and what to change.

Default: the request without training_type (FLUX.1-dev, rank-16 LoRA, 1000 steps at 1024²) on every card.
`--guide`: the guide's Basic and Advanced requests, as written, on every card.

RunPod does not publish the host RAM and CPUs a serverless worker gets with each card: the values assumed here,
by GPU memory, are the `plan --runpod-gpu` presets' (fluxbooth.plan.runpod_gpus.ASSUMED_HOSTS). The host RAM decides only the offloading rows; the CPU count only the time of
an offloaded optimizer. Predictions from docs/memory.md, not measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fluxbooth.plan.runpod_gpus import assumed_host

GIB = 1024**3
# (the card as RunPod lists it, its memory in GiB, the name NVML reports), slowest tier first.
CARDS = (
    ("RTX A4000", 16, "NVIDIA RTX A4000"),
    ("RTX A4500", 20, "NVIDIA RTX A4500"),
    ("RTX A5000", 24, "NVIDIA RTX A5000"),
    ("L4", 24, "NVIDIA L4"),
    ("RTX 3090", 24, "NVIDIA GeForce RTX 3090"),
    ("RTX 4090", 24, "NVIDIA GeForce RTX 4090"),
    ("RTX 5090", 32, "NVIDIA GeForce RTX 5090"),
    ("A40", 48, "NVIDIA A40"),
    ("RTX A6000", 48, "NVIDIA RTX A6000"),
    ("L40", 48, "NVIDIA L40"),
    ("L40S", 48, "NVIDIA L40S"),
    ("RTX 6000 Ada", 48, "NVIDIA RTX 6000 Ada Generation"),
    ("A100 PCIe", 80, "NVIDIA A100 80GB PCIe"),
    ("A100 SXM", 80, "NVIDIA A100-SXM4-80GB"),
    ("H100 SXM", 80, "NVIDIA H100 80GB HBM3"),
    ("H200", 141, "NVIDIA H200"),
)
GUIDE_BASIC = {
    "model_name": "my_dreambooth_model",
    "dataset": "base64_encoded_dataset_zip",
    "instance_prompt": "a photo of sks person",
    "class_prompt": "a photo of a person",
    "steps": 2000,
    "learning_rate": 2e-6,
    "batch_size": 1,
    "use_deepspeed": True,
}
GUIDE_ADVANCED = {
    **GUIDE_BASIC,
    "gradient_accumulation_steps": 2,
    "resolution": "1024x1024",
    "with_prior_preservation": True,
    "prior_loss_weight": 1.0,
    "num_class_images": 50,
    "mixed_precision": "fp16",
    "gradient_checkpointing": True,
}
NO_TRAINING_TYPE = {
    "model_name": "my-flux",
    "dataset_url": "https://example.com/photos.zip",
    "instance_prompt": "a photo of sks person",
    "steps": 1000,
    "resolution": 1024,
}
# The deadline refusal's own words (plan/checks.py), and the changes it names after "; use ".
_BEYOND_DEADLINE = "beyond the job deadline"


def host_for(gpu_gib: int) -> tuple[str, int]:
    host_gib, cpus = assumed_host(gpu_gib)
    return f"{host_gib}GiB", cpus


def plan(card: tuple[str, int, str], request: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`plan --json` for the request on the card, at the worker's default deadline, its base model cached on the
    worker (`--cached`: the endpoint's cached model or a volume; a first download is not in the whole job)."""
    _, gpu_gib, nvml_name = card
    host_memory, cpus = host_for(gpu_gib)
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fluxbooth",
            "plan",
            "--gpus",
            "1",
            "--gpu-memory",
            f"{gpu_gib}GiB",
            "--host-memory",
            host_memory,
            "--cpus",
            str(cpus),
            "--disk",
            "200GiB",
            "--gpu-name",
            nvml_name,
            "--request",
            str(path),
            "--cached",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return json.loads(completed.stdout)
    except ValueError:
        return {"error": {"message": (completed.stderr or completed.stdout).strip().splitlines()[-1]}}


def where(chosen: dict[str, Any]) -> str:
    base = f"{chosen['base_precision']} base"
    if chosen["block_swap"]:
        placed = f"{base}'s blocks streamed from host RAM"
    elif chosen["offload_param"] != "none":
        placed = f"{base} offloaded to the {chosen['offload_param'].upper()}"
    else:
        placed = f"{base} on the GPU"
    optimizer = (
        f", optimizer on the {chosen['offload_optimizer'].upper()}" if chosen["offload_optimizer"] != "none" else ""
    )
    return f"{placed}, ZeRO-{chosen['zero_stage']}{optimizer}"


def answer(result: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(what the worker answers, the strategy whose numbers the row shows): the chosen plan; or, refused for
    the deadline, the fastest strategy that fits memory and the change that would let it run."""
    if result.get("chosen"):
        close = any("the run may time out" in warning for warning in result.get("warnings", []))
        verdict = (
            f"starts, warned it is close to the {result['deadline_seconds'] / 60:.0f}-min deadline"
            if close
            else "trains"
        )
        return verdict, result["chosen"]
    error = result.get("error") or {}
    message = str(error.get("message", "?"))
    fitting = [c for c in result.get("candidates", []) if c["fits"] and c["honours_request"]]
    if _BEYOND_DEADLINE in message and fitting:
        remedy = message.split("; use ", 1)[-1].replace(" (and an endpoint execution timeout above it)", "")
        fastest = max(fitting, key=lambda candidate: candidate["relative_speed"])
        return f"refused at the {result['deadline_seconds'] / 60:.0f}-min deadline; use {remedy}", fastest
    return f"refused ({error.get('code', 'error')}): {message}".replace("|", "\\|"), None


def row(card: tuple[str, int, str], request: dict[str, Any], folder: Path) -> str:
    label, gpu_gib, _ = card
    host_memory, cpus = host_for(gpu_gib)
    verdict, shown = answer(plan(card, request, folder))
    machine = f"{label} | {gpu_gib} GiB | {host_memory.replace('GiB', ' GiB')}, {cpus} CPUs"
    if shown is None:
        return f"| {machine} | {verdict} | – | – | – | – | – |"
    return (
        f"| {machine} | {verdict} | {where(shown)} | {shown['gpu_bytes'] / GIB:.1f} GiB | "
        f"{shown['host_bytes'] / GIB:.1f} GiB | {shown['seconds_per_step']:.1f} | {shown['total_seconds'] / 60:.0f} min |"
    )


HEADER = (
    "| GPU | GPU memory | host (assumed) | the worker's answer | strategy | GPU peak | host peak | s/step | whole job |\n"
    "|---|---:|---|---|---|---:|---:|---:|---:|"
)


def table(request: dict[str, Any]) -> None:
    print(HEADER)
    with tempfile.TemporaryDirectory() as temporary:
        for card in CARDS:
            print(row(card, request, Path(temporary)))


if __name__ == "__main__":
    if "--guide" in sys.argv[1:]:
        for title, request in (
            ("The guide's basic request", GUIDE_BASIC),
            ("The guide's advanced request", GUIDE_ADVANCED),
        ):
            print(f"{title}:\n")
            table(request)
            print()
    else:
        table(NO_TRAINING_TYPE)
