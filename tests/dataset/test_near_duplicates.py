"""The dataset check's near-duplicate rule: the same photo re-encoded, resized or cropped is named with its
original; other photos of one subject, on other backgrounds or in other places, are not (issue 43, item 5)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fluxbooth.dataset.checks import DatasetChecks, check_dataset
from fluxbooth.dataset.near_duplicates import (
    CROP_WINDOWS,
    NEAR_DUPLICATE_DISTANCE,
    THUMBNAIL_SIDE,
    crop_thumbnails,
    near_duplicate_distances,
)
from tests.support.photos import SUBJECT_PLACES, encoded, portrait, subject_photo, textured_photo

PLACES = range(len(SUBJECT_PLACES))


def checked(tmp_path: Path, photos: dict[str, bytes]) -> DatasetChecks:
    """The check over these files as uploaded, each trained at its own size (so only duplicates are at stake)."""
    files = []
    for name, data in photos.items():
        path = tmp_path / f"{len(files)}-{name}"
        path.write_bytes(data)
        files.append((name, path))
    return check_dataset(files, lambda width, height: (width, height), "warn")


def near_duplicates(checks: DatasetChecks) -> list[tuple[str, ...]]:
    return [finding.files for finding in checks.findings if finding.check == "near_duplicate"]


def png(image: Image.Image) -> bytes:
    return encoded(image, "PNG")


def test_one_subject_on_six_backgrounds_in_six_places_is_six_photos(tmp_path: Path) -> None:
    photos = {f"toy{index}.png": png(subject_photo(index, index)) for index in PLACES}
    assert near_duplicates(checked(tmp_path, photos)) == []


def test_one_subject_in_six_places_on_one_background_is_six_photos(tmp_path: Path) -> None:
    photos = {f"toy{place}.png": png(subject_photo(0, place)) for place in PLACES}
    assert near_duplicates(checked(tmp_path, photos)) == []


def test_one_subject_in_one_place_on_six_backgrounds_is_six_photos(tmp_path: Path) -> None:
    photos = {f"toy{background}.png": png(subject_photo(background, 5)) for background in PLACES}
    assert near_duplicates(checked(tmp_path, photos)) == []


def test_a_small_subject_on_other_backgrounds_and_places_is_not_a_near_duplicate(tmp_path: Path) -> None:
    photos = {f"toy{index}.png": png(subject_photo(index, index, share=0.15)) for index in PLACES}
    assert near_duplicates(checked(tmp_path, photos)) == []


def cropped(left: float, top: float, right: float, bottom: float) -> Callable[[Image.Image], bytes]:
    """Cut these shares off the photo's edges."""

    def cut(photo: Image.Image) -> bytes:
        width, height = photo.size
        box = (round(left * width), round(top * height), round((1 - right) * width), round((1 - bottom) * height))
        return encoded(photo.crop(box), quality=90)

    return cut


COPIES: dict[str, Callable[[Image.Image], bytes]] = {
    "re-encoded at JPEG quality 40": lambda photo: encoded(photo, quality=40),
    "re-encoded at JPEG quality 10": lambda photo: encoded(photo, quality=10),
    "halved": lambda photo: png(photo.resize((photo.width // 2, photo.height // 2))),
    "enlarged by half": lambda photo: encoded(photo.resize((photo.width * 3 // 2, photo.height * 3 // 2))),
    "squeezed to 4:3": lambda photo: png(photo.resize((photo.width, photo.height * 3 // 4))),
    "cropped 10 % off the left": cropped(0.1, 0, 0, 0),
    "cropped 10 % off the bottom": cropped(0, 0, 0, 0.1),
    "cropped 7 % off the right and 3 % off the top": cropped(0, 0.03, 0.07, 0),
    "cropped 5 % off every edge": cropped(0.05, 0.05, 0.05, 0.05),
    "cropped 4 % off the left and halved": lambda photo: png(
        photo.crop((round(0.04 * photo.width), 0, photo.width, photo.height)).resize(
            (photo.width // 2, photo.height // 2)
        )
    ),
}


@pytest.mark.parametrize("copy", COPIES, ids=list(COPIES))
def test_a_copy_of_a_studio_photo_is_named_with_its_original(tmp_path: Path, copy: str) -> None:
    original = subject_photo(0, 0)
    photos = {"toy.png": png(original), "copy.jpg": COPIES[copy](original)}
    photos |= {f"other{index}.png": png(subject_photo(index, index)) for index in (1, 2, 3)}
    assert near_duplicates(checked(tmp_path, photos)) == [("toy.png", "copy.jpg")]


@pytest.mark.parametrize("copy", COPIES, ids=list(COPIES))
def test_a_copy_of_a_detailed_photo_is_named_with_its_original(tmp_path: Path, copy: str) -> None:
    original = textured_photo(0)
    photos = {"scene.png": png(original), "copy.jpg": COPIES[copy](original)}
    photos |= {f"other{seed}.png": png(textured_photo(seed)) for seed in (1, 2, 3)}
    assert near_duplicates(checked(tmp_path, photos)) == [("scene.png", "copy.jpg")]


def test_the_finding_says_how_close_the_copies_are_against_the_limit(tmp_path: Path) -> None:
    original = subject_photo(0, 0)
    checks = checked(tmp_path, {"toy.png": png(original), "copy.jpg": encoded(original, quality=40)})
    [finding] = checks.findings
    assert finding.check == "near_duplicate"
    assert finding.message.startswith("toy.png, copy.jpg: each matches another's pixels or a crop of them within 0.0")
    assert finding.message.endswith(" (the limit is 0.2)")


def test_every_copy_of_one_photo_is_named_in_one_finding(tmp_path: Path) -> None:
    original = textured_photo(4)
    photos = {"scene.png": png(original)} | {f"{name}.jpg": make(original) for name, make in COPIES.items()}
    assert near_duplicates(checked(tmp_path, photos)) == [tuple(photos)]


def test_a_crop_of_a_fifth_of_the_width_is_another_framing(tmp_path: Path) -> None:
    original = textured_photo(0)
    photos = {"scene.png": png(original), "reframed.jpg": cropped(0.2, 0, 0, 0)(original)}
    assert near_duplicates(checked(tmp_path, photos)) == []


def test_other_framings_of_one_portrait_are_not_near_duplicates() -> None:
    distances = near_duplicate_distances([crop_thumbnails(portrait(index)) for index in range(3)])
    assert (distances[~np.eye(3, dtype=bool)] > NEAR_DUPLICATE_DISTANCE).all()


def test_each_image_costs_the_same_few_thumbnails_whatever_its_size() -> None:
    small, large = crop_thumbnails(textured_photo(0, (64, 48))), crop_thumbnails(textured_photo(0, (2048, 1536)))
    assert small.shape == large.shape == (len(CROP_WINDOWS), THUMBNAIL_SIDE * THUMBNAIL_SIDE * 3)
    assert len(CROP_WINDOWS) == 225  # 15 spans a side: up to 10 % off it in steps of 2.5 %, from either edge
