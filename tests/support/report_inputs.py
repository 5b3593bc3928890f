"""A report's inputs built as the trainer and the dataset leave them, without training: step events, the validation
renders with their index, and the dataset sheet's photos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from fluxbooth.contract.events import StepEvent, TrainerEvent
from fluxbooth.contract.layout import VALIDATION_FOLDER, VALIDATION_INDEX_NAME
from fluxbooth.report import SheetImage
from tests.support.photos import textured_photo

PROMPTS = ("a photo of sks dog", "a sks dog in the snow")


def step_events(steps: int, *, first: int = 1) -> list[TrainerEvent]:
    return [
        StepEvent(step=step, total=steps, loss=1.0 / step, lr=1e-4 * min(1.0, step / 3), seconds_per_step=0.5)
        for step in range(first, steps + 1)
    ]


def write_renders(
    output_dir: Path,
    rounds: list[int],
    final_step: int,
    *,
    side: int = 64,
    noise: bool = False,
    prompts: tuple[str, ...] = PROMPTS,
) -> None:
    """validation/ as train/validation.py writes it: step-NNNNNN/ folders, the final renders, the index."""
    folder = output_dir / VALIDATION_FOLDER
    records = []
    generator = np.random.default_rng(0)
    for step in [*rounds, final_step]:
        subfolder = f"step-{step:06d}/" if step in rounds else ""
        (folder / subfolder).mkdir(parents=True, exist_ok=True)
        for index, prompt in enumerate(prompts):
            file = f"{subfolder}validation_{index:02d}.png"
            pixels = generator.integers(0, 256, (side, side, 3), dtype=np.uint8) if noise else None
            image = Image.fromarray(pixels) if noise else textured_photo(step * 10 + index, (side, side))
            image.save(folder / file)
            records.append({"file": file, "prompt": prompt, "seed": index, "steps": 2, "training_step": step})
    (folder / VALIDATION_INDEX_NAME).write_text(json.dumps({"images": records, "guidance_scale": 3.5}))


def sheet_of(folder: Path, count: int, *, side: int = 96, noise: bool = False) -> list[SheetImage]:
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(1)
    images = []
    for index in range(count):
        path = folder / f"photo{index}.png"
        pixels = generator.integers(0, 256, (side, side, 3), dtype=np.uint8) if noise else None
        (Image.fromarray(pixels) if noise else textured_photo(index, (side, side))).save(path)
        images.append(SheetImage(f"photo{index}.jpg", path, "a photo of sks dog", ("blurry",) if index == 1 else ()))
    return images
