"""What gets scored, read from disk: the training photos, and the renders grouped by step (validation.json under
the trainer's validation folder, or plain folders for the `score` command). Standard library and PIL only."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from fluxbooth.contract.layout import VALIDATION_INDEX_NAME

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# The trainer names each render after its prompt's index (train/validation.py: validation_NN.png).
RENDER_INDEX = re.compile(r"_(\d+)\.[a-z]+$")


class NothingToScore(Exception):
    """The inputs hold nothing scorable; the message says what is missing."""


@dataclass(frozen=True)
class RenderSet:
    """One step's renders, each with the prompt fidelity reads (None: not measured)."""

    step: int
    images: tuple[Path, ...]
    prompts: tuple[str | None, ...]


def image_files(folder: Path) -> list[Path]:
    """The images directly in `folder`, by name."""
    if not folder.is_dir():
        raise NothingToScore(f"{folder} is not a folder")
    return sorted(path for path in folder.iterdir() if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES)


def load_image(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def folder_set(step: int, folder: Path, prompt: str | None) -> RenderSet:
    """Every image in a folder as one set (the `score` command), all with the same prompt."""
    files = image_files(folder)
    if not files:
        raise NothingToScore(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return RenderSet(step, tuple(files), tuple(prompt for _ in files))


def _prompt_index(record: dict, first_seen: list[str]) -> int:
    """The render's prompt index: from the trainer's file name, else the prompt's order of first appearance."""
    match = RENDER_INDEX.search(str(record["file"]))
    if match:
        return int(match.group(1))
    if record["prompt"] not in first_seen:
        first_seen.append(record["prompt"])
    return first_seen.index(record["prompt"])


def validation_sets(validation_dir: Path, fidelity_prompts: Sequence[str]) -> list[RenderSet]:
    """validation.json's renders grouped by training step, one per prompt (a step rendered twice, during training
    and by the exported weights at the end, keeps the later record: the exported weights')."""
    index = validation_dir / VALIDATION_INDEX_NAME
    try:
        records = json.loads(index.read_text())["images"]
    except FileNotFoundError as error:
        raise NothingToScore(f"{index} is missing: the run rendered no validation prompts") from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NothingToScore(f"{index} cannot be read ({type(error).__name__}: {error})") from error
    by_step: dict[int, dict[int, dict]] = {}
    first_seen: list[str] = []
    for record in records:
        by_step.setdefault(int(record["training_step"]), {})[_prompt_index(record, first_seen)] = record
    sets = []
    for step in sorted(by_step):
        chosen = [by_step[step][number] for number in sorted(by_step[step])]
        prompts = tuple(fidelity_prompts[number] if number < len(fidelity_prompts) else record["prompt"]
                        for number, record in zip(sorted(by_step[step]), chosen))
        sets.append(RenderSet(step, tuple(validation_dir / record["file"] for record in chosen), prompts))
    if not sets:
        raise NothingToScore(f"{index} lists no renders")
    return sets
