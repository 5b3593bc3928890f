"""Training images on disk → prompts, sizes and pixel tensors at a training shape."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from fluxbooth.contract.captions import MAX_CAPTION_CHARS, with_trigger
from fluxbooth.contract.pairing import pair_key
from fluxbooth.train.failures import TrainerFailure

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
ORIENTATION_TAG = 0x0112
QUARTER_TURN_ORIENTATIONS = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class TrainingImage:
    path: Path
    prompt: str
    control: Path | None = None  # its control image (FLUX.1 Kontext pairs)


def list_image_files(folder: Path) -> list[Path]:
    """Image files directly in `folder` (hidden files skipped), in a stable order."""
    if not folder.is_dir():
        return []
    return sorted(
        path
        for path in folder.iterdir()
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")
    )


def read_caption(image_path: Path) -> str | None:
    """The caption in `<stem>.txt` beside the image, or None when there is none (or it is blank)."""
    caption_path = image_path.with_suffix(".txt")
    if not caption_path.is_file():
        return None
    try:
        caption = caption_path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as error:
        raise TrainerFailure(
            "invalid_dataset", f"caption {caption_path.name} is not UTF-8 text; save it as UTF-8"
        ) from error
    if len(caption) > MAX_CAPTION_CHARS:
        raise TrainerFailure(
            "invalid_dataset",
            f"caption {caption_path.name} has {len(caption)} characters; keep captions under {MAX_CAPTION_CHARS}",
        )
    return caption or None


def discover_images(
    folder: Path, default_prompt: str, *, use_captions: bool = True, trigger_word: str | None = None
) -> list[TrainingImage]:
    """Every image in `folder` with its prompt: its caption file (with the trigger word put in) when present,
    else `default_prompt`."""
    images = []
    for path in list_image_files(folder):
        caption = read_caption(path) if use_captions else None
        prompt = with_trigger(caption, trigger_word) if caption else default_prompt
        images.append(TrainingImage(path=path, prompt=prompt))
    return images


def with_controls(images: list[TrainingImage], control_dir: Path) -> list[TrainingImage]:
    """Each image paired with the control image of its stem in `control_dir`, by the pairing rule the worker
    checked the upload by (fluxbooth.contract.pairing); an image without one, or two control images one image
    could pair with, is an invalid dataset naming them."""
    by_key: dict[str, Path] = {}
    for path in list_image_files(control_dir):
        key = pair_key(path.name)
        if key in by_key:
            raise TrainerFailure(
                "invalid_dataset",
                f"{control_dir.name}/{by_key[key].name} and {control_dir.name}/{path.name} share the "
                "file stem (compared ignoring case); give each pair a stem of its own",
            )
        by_key[key] = path
    missing = [image.path.name for image in images if pair_key(image.path.name) not in by_key]
    if missing:
        raise TrainerFailure(
            "invalid_dataset",
            f"{missing[0]} has no control image in {control_dir.name}/ (same file stem); every training "
            f"image of an image-pair dataset needs one ({len(missing)} missing)",
        )
    return [replace(image, control=by_key[pair_key(image.path.name)]) for image in images]


def oriented_size(path: Path) -> tuple[int, int]:
    """(width, height) of the image as `load_image` turns it (EXIF orientation applied), from its header."""
    try:
        with Image.open(path) as opened:
            width, height = opened.size
            turned = opened.getexif().get(ORIENTATION_TAG) in QUARTER_TURN_ORIENTATIONS
    except (OSError, ValueError) as error:
        raise TrainerFailure(
            "invalid_dataset", f"image {path.name} cannot be read ({error}); remove or replace it"
        ) from error
    return (height, width) if turned else (width, height)


def load_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened)
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise TrainerFailure(
            "invalid_dataset", f"image {path.name} cannot be decoded ({error}); remove or replace it"
        ) from error


def resize_and_center_crop(image: Image.Image, resolution: tuple[int, int]) -> Image.Image:
    """Scale so the image covers `resolution` (width, height), then crop the middle."""
    target_width, target_height = resolution
    scale = max(target_width / image.width, target_height / image.height)
    resized_width = max(target_width, round(image.width * scale))
    resized_height = max(target_height, round(image.height * scale))
    image = image.resize((resized_width, resized_height), Image.Resampling.BICUBIC)
    left = (resized_width - target_width) // 2
    top = (resized_height - target_height) // 2
    return image.crop((left, top, left + target_width, top + target_height))


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB image → float tensor [3, H, W] in [-1, 1], the VAE's input range."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def pixel_batch(paths: list[Path], resolution: tuple[int, int]) -> torch.Tensor:
    return torch.stack([image_to_tensor(resize_and_center_crop(load_image(path), resolution)) for path in paths])
