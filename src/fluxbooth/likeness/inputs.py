"""What gets scored, read from disk: the training photos, and the renders grouped by step (validation.json under
the trainer's validation folder, or plain folders for the `score` command). Every image is read through the
dataset stage's reader (fluxbooth.dataset.images.read_image: EXIF orientation, 16-bit and palette modes to 8-bit
RGB, colour profiles, the pixel cap), shrunk to SCORED_SIDE as it is read, so memory is bounded per photo."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from fluxbooth.contract.layout import VALIDATION_INDEX_NAME, render_index
from fluxbooth.dataset.images import read_image
from fluxbooth.dataset.members import IMAGE_EXTENSIONS

# The largest side any scorer looks at: dlib's detector shrinks to it (faces.py); DINOv2 and SigLIP take 224 px.
SCORED_SIDE = 1600
# At most this many files not scored are named in the `score` command's output; the rest are counted.
MAX_NAMED_UNSCORED = 20


class NothingToScore(Exception):
    """The inputs hold nothing scorable; the message says what is missing."""


class UnreadableImage(NothingToScore):
    """A photo or render that cannot be read (empty, not an image, truncated, over the pixel cap); the message
    names the file."""


@dataclass(frozen=True)
class RenderSet:
    """One step's renders, each with the prompt fidelity reads (None: not measured)."""

    step: int
    images: tuple[Path, ...]
    prompts: tuple[str | None, ...]


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise NothingToScore(f"{folder} is not a folder")
    return sorted(path for path in folder.iterdir() if path.is_file())


def image_files(folder: Path) -> list[Path]:
    """The images directly in `folder` (the suffixes the dataset stage reads), by name."""
    return [path for path in _files(folder) if path.suffix.lower() in IMAGE_EXTENSIONS]


def unscored_files(folder: Path) -> list[Path]:
    """The other files directly in `folder`: what scoring leaves out, to be named."""
    return [path for path in _files(folder) if path.suffix.lower() not in IMAGE_EXTENSIONS]


def load_image(path: Path) -> Image.Image:
    """8-bit RGB, upright, at most SCORED_SIDE on its longer side; UnreadableImage naming `path` otherwise."""
    return read_image(path, name=str(path), max_side=SCORED_SIDE, error=UnreadableImage)


def folder_set(step: int, folder: Path, prompt: str | None) -> RenderSet:
    """Every image in a folder as one set (the `score` command), all with the same prompt."""
    files = image_files(folder)
    if not files:
        raise NothingToScore(f"{folder} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    return RenderSet(step, tuple(files), tuple(prompt for _ in files))


def _prompt_index(record: dict[str, Any], first_seen: list[str]) -> int:
    """The render's prompt index: from the trainer's file name, else the prompt's order of first appearance."""
    named = render_index(str(record["file"]))
    if named is not None:
        return named
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
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    first_seen: list[str] = []
    for record in records:
        by_step.setdefault(int(record["training_step"]), {})[_prompt_index(record, first_seen)] = record
    sets = []
    for step in sorted(by_step):
        chosen = [by_step[step][number] for number in sorted(by_step[step])]
        prompts = tuple(
            fidelity_prompts[number] if number < len(fidelity_prompts) else record["prompt"]
            for number, record in zip(sorted(by_step[step]), chosen, strict=True)
        )
        sets.append(RenderSet(step, tuple(validation_dir / record["file"] for record in chosen), prompts))
    if not sets:
        raise NothingToScore(f"{index} lists no renders")
    return sets
