"""The dataset stage under aspect buckets: each photo stored whole (no crop), just large enough to cover its
bucket at the largest size, and the summary listing the buckets with their image counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from fluxbooth.contract.buckets import bucket_for
from fluxbooth.dataset import PreparedDataset, prepare_dataset
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import DatasetLimits
from tests.support.factories import make_image, make_zip, to_base64

PHOTOS = {"landscape.jpg": (400, 300), "portrait.jpg": (300, 400), "wide.jpg": (480, 270)}


def prepare(job_dir: Path, members: list[tuple[str, bytes]], **fields: Any) -> PreparedDataset:
    raw = {"model_name": "sks-dog", "dataset": to_base64(make_zip(members)), "instance_prompt": "a photo of sks dog"}
    return prepare_dataset(dataset_spec(parse_request({**raw, **fields})), job_dir, DatasetLimits())


def photos() -> list[tuple[str, bytes]]:
    return [(name, make_image(name, size=size)) for name, size in PHOTOS.items()]


def stored_sizes(prepared: PreparedDataset) -> dict[str, tuple[int, int]]:
    sizes = {}
    for path in sorted(prepared.instance_dir.glob("*.png")):
        with Image.open(path) as stored:
            sizes[path.stem] = stored.size
    return sizes


def test_the_summary_lists_each_bucket_with_its_images(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", photos(), resolution=[128, 192])

    assert prepared.summary()["buckets"] == [
        {"width": 112, "height": 144, "images": 1},
        {"width": 144, "height": 112, "images": 1},
        {"width": 160, "height": 224, "images": 1},
        {"width": 176, "height": 96, "images": 1},
        {"width": 224, "height": 160, "images": 1},
        {"width": 256, "height": 144, "images": 1},
    ]


def test_photos_are_stored_whole_just_covering_their_bucket_at_the_largest_size(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", photos(), resolution=[128, 192])

    assert prepared.cropped == 0
    for name, (width, height) in stored_sizes(prepared).items():
        original_width, original_height = PHOTOS[f"{name}.jpg"]
        bucket_width, bucket_height = bucket_for(width, height, 192)
        assert width >= bucket_width and height >= bucket_height
        assert min(width - bucket_width, height - bucket_height) <= 1  # no larger than it needs to be
        assert abs(width / height - original_width / original_height) < 0.01  # the whole photo


def test_photos_turned_by_their_exif_orientation_train_in_the_turned_bucket(tmp_path: Path) -> None:
    sideways = [
        (f"turned{index}.jpg", make_image("JPEG", size=(400, 300), color=(40 * index, 90, 200), exif_orientation=6))
        for index in range(3)
    ]

    prepared = prepare(tmp_path / "job", sideways, resolution=192)

    assert prepared.bucket_mix == {bucket_for(300, 400, 192): 3}


def test_a_fixed_shape_keeps_the_guides_centre_crop_and_names_its_one_shape(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", photos(), resolution="192x192")

    assert prepared.summary()["buckets"] == [{"width": 192, "height": 192, "images": 3}]
    assert stored_sizes(prepared) == {"landscape": (256, 192), "portrait": (192, 256), "wide": (341, 192)}


def test_photos_smaller_than_their_bucket_are_counted_and_noted(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", photos(), resolution=[128, 512])

    assert prepared.smaller_than_resolution == 3
    assert (
        "3 image(s) are smaller than their aspect bucket at 512 px and will be upscaled; larger photos train sharper"
        in prepared.notes
    )
