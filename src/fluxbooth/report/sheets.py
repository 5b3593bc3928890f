"""report/samples.png (the validation renders: a row per round, a column per prompt position) and report/dataset.png
(a contact sheet of the training images as trained, with captions and the dataset check's flags), composed
with Pillow in matplotlib's bundled DejaVu Sans.

Both stay small at any run size: at most SHEET_PIXELS pixels, the rounds TrainingHistory.shown_rounds
picks, and MAX_SHEET_IMAGES images (flagged ones first)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont, ImageOps

from fluxbooth.contract.budgets import MAX_SHEET_IMAGES
from fluxbooth.contract.scoring import BASE_STEP
from fluxbooth.dataset.images import read_image
from fluxbooth.report.history import TrainingHistory

SHEET_PIXELS = 1_500_000  # photo-like PNGs take about 2 bytes a pixel: a sheet stays near 3 MB
MIN_TILE, MAX_TILE = 128, 256
MARGIN = 8
TEXT_SIZE = 13
TITLE_SIZE = 16
LINE = TEXT_SIZE + 4
LABEL_WIDTH = 96
BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
FLAG_INK = (200, 0, 0)
CHOSEN_INK = (230, 120, 0)  # the chosen step: its row's frame here, its mark on report/likeness.png
CHOSEN_FRAME = 3  # pixels, drawn in the margin around the row's tiles

TrainingShape = Callable[[int, int], tuple[int, int]]


def _font(size: int) -> ImageFont.FreeTypeFont:
    from matplotlib import font_manager  # deferred: heavy to import, needed only to draw a sheet

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)


def _tile_side(count: int, extra_height: int) -> int:
    """The largest tile side within MIN_TILE..MAX_TILE that keeps `count` tiles (each with `extra_height`
    pixels of text under or over it) within SHEET_PIXELS."""
    side = int(math.sqrt(SHEET_PIXELS / max(1, count)))
    while side > MIN_TILE and count * (side + MARGIN) * (side + extra_height + MARGIN) > SHEET_PIXELS:
        side -= 8
    return max(MIN_TILE, min(MAX_TILE, side))


def _fitted(image: Image.Image, side: int) -> Image.Image:
    """Scaled to fit a side x side box, pixels kept crisp when enlarged a whole number of times."""
    scale = side / max(image.size)
    resample = Image.Resampling.NEAREST if scale >= 2 and scale.is_integer() else Image.Resampling.LANCZOS
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, resample)


def _lines(text: str, width_chars: int, count: int) -> list[str]:
    wrapped = textwrap.wrap(text, width=max(8, width_chars)) or [""]
    if len(wrapped) > count:
        wrapped = wrapped[:count]
        wrapped[-1] = wrapped[-1][: max(1, width_chars - 1)].rstrip() + "…"
    return wrapped


def _chars(width: int) -> int:
    return int(width / (TEXT_SIZE * 0.6))


SAMPLES_HEADER = 3 * LINE + MARGIN  # three lines of prompt over each column


def samples_size(rows: int, columns: int) -> tuple[int, int, int]:
    """(width, height, tile side) of a samples grid."""
    tile = _tile_side(rows * columns, 0)
    width = LABEL_WIDTH + columns * (tile + MARGIN) + MARGIN
    return width, TITLE_SIZE + 2 * MARGIN + SAMPLES_HEADER + rows * (tile + MARGIN), tile


def read_render(path: Path, side: int) -> Image.Image:
    """A validation render as the dataset stage reads a photo (upright, 8-bit RGB, the pixel cap), shrunk to at
    most `side` as it is read; a ValueError naming it (its folder and name) when it cannot be read."""
    return read_image(path, name=f"{path.parent.name}/{path.name}", max_side=side, error=ValueError)


def draw_samples(history: TrainingHistory, path: Path, title: str, chosen_step: int | None = None) -> None:
    """One row per validation round (and the final render), one column per prompt, prompts and steps written;
    the row of `chosen_step` (the step the likeness scores chose) framed and labelled "chosen"."""
    rows, prompts = history.shown_rounds(keep=chosen_step), history.prompts
    width, height, tile = samples_size(len(rows), len(prompts))
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    text, title_font = _font(TEXT_SIZE), _font(TITLE_SIZE)
    thinned = len({(image.training_step, image.final) for image in history.validation}) > len(rows)
    draw.text(
        (MARGIN, MARGIN), title + (f" (showing {len(rows)} rounds)" if thinned else ""), font=title_font, fill=INK
    )
    top = TITLE_SIZE + 2 * MARGIN
    for column, prompt in enumerate(prompts):
        left = LABEL_WIDTH + column * (tile + MARGIN)
        draw.multiline_text((left, top), "\n".join(_lines(prompt, _chars(tile), 3)), font=text, fill=INK, spacing=4)
    by_place = {(image.training_step, image.final, image.prompt_index): image for image in history.validation}
    for row, (step, final) in enumerate(rows):
        y = top + SAMPLES_HEADER + row * (tile + MARGIN)
        label = f"final\nstep {step}" if final else f"step {step}" + ("\nbase model" if step == BASE_STEP else "")
        chosen = step == chosen_step
        if chosen:
            label += "\nchosen"
            right = LABEL_WIDTH + len(prompts) * (tile + MARGIN) - MARGIN
            inset = MARGIN // 2 + CHOSEN_FRAME // 2
            draw.rectangle(
                (LABEL_WIDTH - inset, y - inset, right + inset - 1, y + tile + inset - 1),
                outline=CHOSEN_INK,
                width=CHOSEN_FRAME,
            )
        draw.multiline_text(
            (MARGIN, y + tile // 2 - LINE), label, font=text, fill=CHOSEN_INK if chosen else INK, spacing=4
        )
        for column in range(len(prompts)):
            image = by_place.get((step, final, column))
            if image is not None:
                fitted = _fitted(read_render(image.path, tile), tile)
                sheet.paste(fitted, (LABEL_WIDTH + column * (tile + MARGIN), y))
    sheet.save(path, format="PNG", compress_level=6)


@dataclass(frozen=True)
class SheetImage:
    """One training image for the contact sheet."""

    name: str  # as uploaded
    path: Path  # the prepared file the trainer reads
    caption: str  # the prompt it trains with
    flags: tuple[str, ...] = ()
    source: str = "instance_prompt"  # where the caption came from: one of contract.captioning.CAPTION_SOURCES


def as_trained(image: Image.Image, training_shape: TrainingShape) -> Image.Image:
    """What the trainer takes of `image`: scaled to cover its training shape, then the middle cropped out
    (the trainer's resize-and-crop; with aspect buckets only the rounding to the bucket is lost)."""
    return ImageOps.fit(image, training_shape(image.width, image.height), Image.Resampling.BICUBIC)


def sheet_selection(images: Sequence[SheetImage]) -> list[SheetImage]:
    """All images up to MAX_SHEET_IMAGES; beyond, the flagged ones first, then the others in order."""
    if len(images) <= MAX_SHEET_IMAGES:
        return list(images)
    flagged = [image for image in images if image.flags]
    return (flagged + [image for image in images if not image.flags])[:MAX_SHEET_IMAGES]


CELL_TEXT = 4 * LINE  # under each image: its name, two lines of caption, its flags


def dataset_size(count: int) -> tuple[int, int, int, int]:
    """(width, height, tile side, columns) of a contact sheet of `count` images (a landscape grid)."""
    tile = _tile_side(count, CELL_TEXT)
    columns = max(1, min(count, math.ceil(math.sqrt(count * 1.6))))
    rows = math.ceil(count / columns)
    return (
        MARGIN + columns * (tile + MARGIN),
        TITLE_SIZE + 3 * MARGIN + rows * (tile + CELL_TEXT + MARGIN),
        tile,
        columns,
    )


def draw_dataset(images: Sequence[SheetImage], training_shape: TrainingShape, path: Path, title: str) -> None:
    """A contact sheet: each image as trained, its uploaded name, its caption (shortened) and its flags."""
    shown = sheet_selection(images)
    if not shown:
        raise ValueError("the dataset holds no instance image")
    width, height, tile, columns = dataset_size(len(shown))
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    text, title_font = _font(TEXT_SIZE), _font(TITLE_SIZE)
    flagged = sum(1 for image in images if image.flags)
    count = (
        f"{len(images)} images" if len(shown) == len(images) else f"{len(shown)} of {len(images)} images, flagged first"
    )
    draw.text((MARGIN, MARGIN), f"{title}: {count}, {flagged} flagged", font=title_font, fill=INK)
    for index, item in enumerate(shown):
        left = MARGIN + (index % columns) * (tile + MARGIN)
        top = TITLE_SIZE + 3 * MARGIN + (index // columns) * (tile + CELL_TEXT + MARGIN)
        with Image.open(item.path) as opened:
            thumbnail = _fitted(as_trained(opened.convert("RGB"), training_shape), tile)
        sheet.paste(thumbnail, (left + (tile - thumbnail.width) // 2, top + (tile - thumbnail.height) // 2))
        y = top + tile + 2
        draw.text((left, y), _lines(item.name, _chars(tile), 1)[0], font=text, fill=INK)
        for line in _lines(item.caption, _chars(tile), 2):
            y += LINE
            draw.text((left, y), line, font=text, fill=(90, 90, 90))
        if item.flags:
            draw.text((left, y + LINE), _lines(", ".join(item.flags), _chars(tile), 1)[0], font=text, fill=FLAG_INK)
    sheet.save(path, format="PNG", compress_level=6)
