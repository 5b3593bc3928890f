"""Photos as people take them: an iPhone's HEIC, AVIF, and wide-gamut (Display P3) colour, each decoded to the
sRGB the trainer expects, turned upright once, and counted against the same budgets as any other image."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pillow_heif
import pytest
from PIL import Image

from fluxbooth.dataset import PreparedDataset, normalise_image, prepare_dataset
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import DatasetLimits
from tests.support.colour_profiles import display_p3_as_srgb, display_p3_profile
from tests.support.factories import dataset_members, make_zip, to_base64

LIMITS = DatasetLimits()
ORANGE = (200, 120, 80)
# Lossy codecs on a flat colour: a step or two of rounding, far less than P3's shift of this orange (13 steps).
CODEC_TOLERANCE = 3
ROTATE_CLOCKWISE = 6  # EXIF orientation: the stored picture is turned 90 degrees clockwise to show it


def photo(size: tuple[int, int] = (96, 80), color: tuple[int, int, int] = ORANGE) -> Image.Image:
    """A flat colour with a blue square in its top-left corner, so orientation shows."""
    image = Image.new("RGB", size, color)
    image.paste((0, 0, 255), (0, 0, 16, 16))
    return image


def exif_turned(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def heic(image: Image.Image, *, icc_profile: bytes | None = None, orientation: int | None = None) -> bytes:
    """HEIC as an iPhone writes it (HEVC in HEIF), through libheif, without registering any Pillow plugin."""
    if icc_profile is not None:
        image.info["icc_profile"] = icc_profile
    options: dict[str, Any] = {"quality": 95}
    if orientation is not None:
        options["exif"] = exif_turned(orientation)
    buffer = io.BytesIO()
    pillow_heif.from_pillow(image).save(buffer, **options)
    return buffer.getvalue()


def encoded(
    image: Image.Image, image_format: str, *, icc_profile: bytes | None = None, orientation: int | None = None
) -> bytes:
    """`image` in a format Pillow writes itself (AVIF, JPEG, PNG)."""
    options: dict[str, Any] = {"quality": 95} if image_format in ("AVIF", "JPEG") else {}
    if icc_profile is not None:
        options["icc_profile"] = icc_profile
    if orientation is not None:
        options["exif"] = exif_turned(orientation)
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def photo_file(image_format: str, **options: Any) -> bytes:
    return heic(photo(), **options) if image_format == "HEIF" else encoded(photo(), image_format, **options)


def normalised(tmp_path: Path, name: str, data: bytes) -> Image.Image:
    source = tmp_path / name
    source.write_bytes(data)
    destination = tmp_path / "stored.png"
    normalise_image(source, destination, member=name, limits=LIMITS, resolution=(512, 512))
    with Image.open(destination) as stored:
        stored.load()
        return stored.copy()


def prepare(job_dir: Path, archive: bytes, limits: DatasetLimits = LIMITS) -> PreparedDataset:
    raw = {"model_name": "sks-dog", "dataset": to_base64(archive), "instance_prompt": "a photo of sks dog"}
    return prepare_dataset(dataset_spec(parse_request(raw)), job_dir, limits)


def dataset_refusal(job_dir: Path, archive: bytes, limits: DatasetLimits) -> str:
    with pytest.raises(FluxboothError) as caught:
        prepare(job_dir, archive, limits)
    assert caught.value.code is ErrorCode.INVALID_DATASET, caught.value.message
    return caught.value.message


def centre(image: Image.Image) -> tuple[int, int, int]:
    red, green, blue = image.getpixel((image.width // 2, image.height // 2))
    return red, green, blue


def assert_close(pixel: tuple[int, int, int], expected: tuple[float, float, float], tolerance: float) -> None:
    assert np.abs(np.array(pixel) - np.array(expected)).max() <= tolerance, (pixel, expected)


# --- formats ---------------------------------------------------------------------------------------


def test_heic_and_avif_photos_are_prepared_beside_the_other_formats(tmp_path: Path) -> None:
    archive = make_zip(
        [
            *dataset_members(1),
            ("IMG_0001.HEIC", heic(photo())),
            ("IMG_0002.heif", heic(photo(color=(40, 90, 200)))),
            ("IMG_0003.avif", encoded(photo(color=(90, 200, 40)), "AVIF")),
        ]
    )

    prepared = prepare(tmp_path / "job", archive)

    assert (prepared.instance_images, prepared.skipped) == (4, {})


@pytest.mark.parametrize(("name", "image_format"), [("IMG_0001.HEIC", "HEIF"), ("photo.avif", "AVIF")])
def test_heic_and_avif_keep_their_colours(tmp_path: Path, name: str, image_format: str) -> None:
    stored = normalised(tmp_path, name, photo_file(image_format))

    assert (stored.mode, stored.size) == ("RGB", (96, 80))
    assert_close(centre(stored), ORANGE, CODEC_TOLERANCE)


@pytest.mark.parametrize(
    ("name", "image_format"), [("IMG_0001.HEIC", "HEIF"), ("photo.avif", "AVIF"), ("photo.jpg", "JPEG")]
)
def test_a_photo_taken_turned_is_stored_upright_once(tmp_path: Path, name: str, image_format: str) -> None:
    stored = normalised(tmp_path, name, photo_file(image_format, orientation=ROTATE_CLOCKWISE))

    assert stored.size == (80, 96)
    # The blue square of the stored picture's top-left corner shows at the top right.
    assert_close(stored.getpixel((stored.width - 4, 4)), (0, 0, 255), CODEC_TOLERANCE)


# --- colour ----------------------------------------------------------------------------------------


def test_the_test_profile_is_display_p3() -> None:
    # The oracle the colour tests compare with: P3's orange is a more saturated orange in sRGB numbers.
    assert_close(tuple(round(value) for value in display_p3_as_srgb(ORANGE)), (213, 115, 70), 0)


@pytest.mark.parametrize(
    ("name", "image_format", "tolerance"),
    [
        ("photo.png", "PNG", 1),
        ("photo.jpg", "JPEG", CODEC_TOLERANCE),
        ("IMG_0001.HEIC", "HEIF", CODEC_TOLERANCE),
        ("photo.avif", "AVIF", CODEC_TOLERANCE),
    ],
)
def test_a_display_p3_photo_is_converted_to_srgb(tmp_path: Path, name: str, image_format: str, tolerance: int) -> None:
    stored = normalised(tmp_path, name, photo_file(image_format, icc_profile=display_p3_profile()))

    assert_close(centre(stored), display_p3_as_srgb(ORANGE), tolerance)


def test_the_stored_image_carries_no_colour_profile(tmp_path: Path) -> None:
    stored = normalised(tmp_path, "IMG_0001.HEIC", heic(photo(), icc_profile=display_p3_profile()))

    assert "icc_profile" not in stored.info


# --- budgets ---------------------------------------------------------------------------------------


def test_a_heic_over_the_per_image_pixel_cap_is_refused_from_its_header(tmp_path: Path) -> None:
    archive = make_zip(
        [
            ("a.png", encoded(photo(), "PNG")),
            ("b.png", encoded(photo(), "PNG")),
            ("IMG_0001.HEIC", heic(photo((128, 96)))),
        ]
    )
    limits = DatasetLimits(max_image_pixels=10_000)

    assert dataset_refusal(tmp_path / "job", archive, limits) == (
        "dataset: image 'IMG_0001.HEIC' declares 128x96 pixels, over the 10,000-pixel cap; downscale it"
    )


def test_heic_and_avif_pixels_count_against_the_dataset_pixel_budget(tmp_path: Path) -> None:
    archive = make_zip(
        [
            ("IMG_0001.HEIC", heic(photo())),
            ("IMG_0002.HEIC", heic(photo((80, 96)))),
            ("c.avif", encoded(photo(), "AVIF")),
        ]
    )
    limits = DatasetLimits(max_dataset_pixels=20_000)

    assert dataset_refusal(tmp_path / "job", archive, limits) == (
        "dataset: the images hold 23,040 pixels in total, over the 20,000-pixel budget "
        "(FLUXBOOTH_MAX_DATASET_PIXELS); use fewer or smaller images"
    )


@pytest.mark.parametrize("kept", ["file type box only", "first half"])
def test_a_broken_heic_is_refused_naming_the_file(tmp_path: Path, kept: str) -> None:
    whole = heic(photo())
    file_type_box = int.from_bytes(whole[:4], "big")
    data = whole[:file_type_box] if kept == "file type box only" else whole[: len(whole) // 2]
    archive = make_zip([*dataset_members(3), ("IMG_0001.HEIC", data)])

    assert dataset_refusal(tmp_path / "job", archive, LIMITS) == (
        "dataset: image 'IMG_0001.HEIC' is not a readable JPEG/PNG/WEBP/BMP/GIF/TIFF/HEIF/AVIF file; "
        "re-export it as JPEG or PNG"
    )
