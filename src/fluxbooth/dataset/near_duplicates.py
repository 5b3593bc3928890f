"""Near duplicates: the same photo re-encoded, resized or cropped, told apart from another photo of the subject.

A 64-bit difference hash could not tell them apart: it keeps only which of two neighbouring cells is brighter,
so a small subject on a plain background hashes to nearly the background's bits wherever the subject stands
and whatever the background's colour (six photos of one subject on six backgrounds all matched), while a
crop of 10 % moved enough cells to miss its original.

Each image is instead reduced to small colour thumbnails: one of the whole image, and one of each crop a
near duplicate may have been cut to (up to MAX_CROP of each side, split between its two edges in steps of
CROP_STEP). Two images are near duplicates when the whole of one matches some crop of the other (or the
whole of it) within NEAR_DUPLICATE_DISTANCE: the RMS difference of their thumbnails over their contrast.
Colour and position count, so another background or another place in the frame does not match.

The work per image is fixed (one reduction to WORKING_SIDE, then len(CROP_WINDOWS) tiny thumbnails); the
comparison is one matrix product per crop window over the whole set. bench/dataset_checks.py measures both
and the distances the threshold is set between.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

THUMBNAIL_SIDE = 8  # 8x8 RGB: small enough that a crop off the window grid by half a step still lines up
WORKING_SIDE = 96  # every window is cut from the image reduced once to this, so its size does not matter
MAX_CROP = 0.1  # of each side, taken from either edge or split between them
CROP_STEP = 0.025
# bench/dataset_checks.py, at 512²: re-encodes down to JPEG quality 10, halvings, blurs and crops of up to 12 % measure
# 0.13 or less; distinct photos (other framings of one portrait, a toy on other backgrounds or in other places) 0.31
# or more, a crop of 20 % 0.48 or more.
NEAR_DUPLICATE_DISTANCE = 0.2
# Grey levels: how far a thumbnail's pixels stray from its mean colour (its contrast) is what a difference is
# measured against; nearly plain images are measured against this instead, not their own near-zero contrast.
CONTRAST_FLOOR = 10.0
# Grey levels per channel of the whole images' mean colours: JPEG at quality 10 moved a plain background's by up to
# 6.5, a crop of 10 % (off an edge, or 5 % off every edge) the portrait's and 30 textured scenes' by up to 7.7
COLOUR_SHIFT_FREE = 12.0


def _spans() -> list[tuple[float, float]]:
    steps = round(MAX_CROP / CROP_STEP)
    return [(start * CROP_STEP, 1 - end * CROP_STEP) for start in range(steps + 1) for end in range(steps + 1 - start)]


# (left, top, right, bottom) as fractions of the image; the first is the whole image.
CROP_WINDOWS: tuple[tuple[float, float, float, float], ...] = tuple(
    (left, top, right, bottom) for left, right in _spans() for top, bottom in _spans()
)


def crop_thumbnails(image: Image.Image) -> np.ndarray:
    """The image's thumbnails, one row per CROP_WINDOWS entry (uint8, THUMBNAIL_SIDE² RGB values each)."""
    small = image.convert("RGB").resize((WORKING_SIDE, WORKING_SIDE), Image.Resampling.BOX)
    side = (THUMBNAIL_SIDE, THUMBNAIL_SIDE)
    rows = [
        np.asarray(
            small.resize(
                side,
                Image.Resampling.BOX,
                box=(left * WORKING_SIDE, top * WORKING_SIDE, right * WORKING_SIDE, bottom * WORKING_SIDE),
            ),
            dtype=np.uint8,
        ).ravel()
        for left, top, right, bottom in CROP_WINDOWS
    ]
    return np.stack(rows)


def _centred(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each thumbnail less its mean colour, and that colour (per channel)."""
    pixels = rows.reshape(len(rows), -1, 3)
    means = pixels.mean(axis=1)
    return (pixels - means[:, None, :]).reshape(len(rows), -1), means


def near_duplicate_distances(thumbnails: Sequence[np.ndarray]) -> np.ndarray:
    """For every two images, how far the whole of one is from the closest crop of the other (a square matrix,
    symmetric; 0 for the same pixels, about 1 or more for unrelated photos).

    The pattern is compared less each thumbnail's mean colour, over the images' contrast; their mean colours
    then count where they differ by more than COLOUR_SHIFT_FREE. One matrix product per window, each folding in
    both thumbnails' squared norms, so a window costs one pass over the pairs."""
    count = len(thumbnails)
    if count == 0:
        return np.zeros((0, 0))
    stacked = np.stack(thumbnails)  # images x windows x values, uint8
    whole, means = _centred(stacked[:, 0, :].astype(np.float32))
    values = whole.shape[1]
    squares = np.einsum("ij,ij->i", whole, whole)
    # [w, |w|², 1] · [-2c, 1, |c|²] = |w - c|²
    left = np.hstack([whole, squares[:, None], np.ones((count, 1), np.float32)])
    best = np.full((count, count), np.inf, dtype=np.float32)
    for window in range(stacked.shape[1]):
        crops, _ = _centred(stacked[:, window, :].astype(np.float32))
        crop_squares = np.einsum("ij,ij->i", crops, crops)
        right = np.hstack([-2 * crops, np.ones((count, 1), np.float32), crop_squares[:, None]])
        np.minimum(best, left @ right.T, out=best)
    shift = np.maximum(np.abs(means[:, None, :] - means[None, :, :]) - COLOUR_SHIFT_FREE, 0)
    mean_square = np.maximum(np.minimum(best, best.T), 0) / values + (shift**2).mean(axis=2)
    contrast = np.sqrt(squares / values)
    distances: np.ndarray = np.sqrt(mean_square) / np.maximum(
        CONTRAST_FLOOR, (contrast[:, None] + contrast[None, :]) / 2
    )
    return distances
