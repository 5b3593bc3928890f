"""The README's memory table by model family: `python bench/family_tiers.py > families.md`.

One row per family and RunPod tier (24, 48 and 80 GiB): the request without training_type (a rank-16 LoRA,
1000 steps at 1024²) with `base_model` set to each family's published model, through
`python -m fluxbooth plan --request … --json` on a hypothetical machine with that card (bench/runpod_gpu_tiers.py's
`plan`, at the worker's default deadline, the host RAM assumed there). Each model is sized from its published
configs (fluxbooth.sizing.PRESET_OF_MODEL), text encoders included: a text encoder that does not fit the
card beside the CUDA context is planned on the CPU while caching, in host RAM. Predictions from
docs/memory.md, not measurements; the FLUX.2 activation coefficients are FLUX.1's (not measured on FLUX.2 blocks).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runpod_gpu_tiers import GIB, NO_TRAINING_TYPE, answer, host_for, plan, where  # noqa: E402

FAMILY_MODELS = (
    ("FLUX.1 [dev] (and Krea [dev])", "black-forest-labs/FLUX.1-dev"),
    ("FLUX.1 Kontext [dev]", "black-forest-labs/FLUX.1-Kontext-dev"),
    ("FLUX.2 [klein] 4B", "black-forest-labs/FLUX.2-klein-4B"),
    ("FLUX.2 [klein] 9B", "black-forest-labs/FLUX.2-klein-9B"),
    ("FLUX.2 [dev]", "black-forest-labs/FLUX.2-dev"),
)
TIERS = (
    ("RTX 4090", 24, "NVIDIA GeForce RTX 4090"),
    ("L40S", 48, "NVIDIA L40S"),
    ("H100 SXM", 80, "NVIDIA H100 80GB HBM3"),
)
HEADER = (
    "| family | GPU (host assumed) | the worker's answer | strategy | GPU peak | host peak | whole job |\n"
    "|---|---|---|---|---:|---:|---:|"
)


def family_row(label: str, model: str, card: tuple[str, int, str], folder: Path) -> str:
    name, gpu_gib, _ = card
    host_memory, _ = host_for(gpu_gib)
    verdict, shown = answer(plan(card, {**NO_TRAINING_TYPE, "base_model": model}, folder))
    machine = f"{name}, {gpu_gib} GiB ({host_memory.replace('GiB', ' GiB')})"
    if shown is None:
        return f"| {label} | {machine} | {verdict} | – | – | – | – |"
    return (
        f"| {label} | {machine} | {verdict} | {where(shown)} | {shown['gpu_bytes'] / GIB:.1f} GiB | "
        f"{shown['host_bytes'] / GIB:.1f} GiB | {shown['total_seconds'] / 60:.0f} min |"
    )


def main() -> None:
    print(HEADER)
    with tempfile.TemporaryDirectory() as temporary:
        for label, model in FAMILY_MODELS:
            for card in TIERS:
                print(family_row(label, model, card, Path(temporary)))


if __name__ == "__main__":
    main()
