"""Aspect-ratio buckets (fluxbooth.contract.buckets): which shape each image trains at, at each size."""

from __future__ import annotations

import pytest

from fluxbooth.contract.buckets import Resolution, bucket_for, bucket_mix, mix_to_json

# Landscape aspect ratios from 1:1 to 4:1 (the dataset's default cap), log-spaced.
ASPECTS = [4 ** (step / 400) for step in range(401)]


def test_a_square_image_trains_at_the_size_itself() -> None:
    assert bucket_for(3000, 3000, 1024) == (1024, 1024)


def test_a_phone_photo_trains_at_its_own_aspect_ratio_at_about_the_size_squared() -> None:
    assert bucket_for(4032, 3024, 1024) == (1184, 896)


def test_a_portrait_photo_gets_the_turned_shape_of_its_landscape_twin() -> None:
    assert bucket_for(3024, 4032, 1024) == (896, 1184)


@pytest.mark.parametrize("size", [64, 256, 512, 1024, 2048])
def test_bucket_sides_are_multiples_of_16(size: int) -> None:
    shapes = {bucket_for(round(aspect * 1000), 1000, size) for aspect in ASPECTS}

    assert all(width % 16 == 0 and height % 16 == 0 for width, height in shapes)


@pytest.mark.parametrize("size", [256, 512, 1024, 2048])
def test_an_image_is_cropped_by_no_more_than_rounding_its_short_side_to_16(size: int) -> None:
    for aspect in ASPECTS:
        width, height = bucket_for(round(aspect * 100_000), 100_000, size)
        # Scaled to cover the bucket, the image overhangs it by the short side's rounding, seen from the long side.
        exact_short = width / aspect
        assert abs(exact_short - height) <= 8, (aspect, width, height)


@pytest.mark.parametrize(("size", "tolerance"), [(256, 0.10), (512, 0.05), (1024, 0.025), (2048, 0.0125)])
def test_buckets_hold_about_the_size_squared(size: int, tolerance: float) -> None:
    for aspect in ASPECTS:
        width, height = bucket_for(round(aspect * 1000), 1000, size)
        assert abs(width * height / size**2 - 1) <= tolerance, (aspect, width, height)


def test_a_list_of_sizes_gives_each_image_one_bucket_per_size() -> None:
    assert Resolution(sizes=(256, 384)).shapes_for(4032, 3024) == ((288, 224), (448, 336))


def test_a_fixed_shape_gives_every_image_that_shape() -> None:
    assert Resolution(fixed=(768, 1024)).shapes_for(4032, 3024) == ((768, 1024),)


def test_validation_and_class_images_render_at_the_largest_size_square_or_the_fixed_shape() -> None:
    assert (Resolution(sizes=(512, 1024)).render_shape, Resolution(fixed=(768, 1024)).render_shape) == (
        (1024, 1024),
        (768, 1024),
    )


def test_the_mix_counts_every_image_at_every_size() -> None:
    mix = bucket_mix(Resolution(sizes=(256, 384)), [(4032, 3024), (3024, 4032), (4000, 3000), (1000, 1000)])

    assert mix_to_json(mix) == [
        {"width": 224, "height": 288, "images": 1},
        {"width": 256, "height": 256, "images": 1},
        {"width": 288, "height": 224, "images": 2},
        {"width": 336, "height": 448, "images": 1},
        {"width": 384, "height": 384, "images": 1},
        {"width": 448, "height": 336, "images": 2},
    ]


def test_a_resolution_reads_back_as_a_request_spells_it() -> None:
    assert (Resolution(sizes=(512, 1024)).to_json(), Resolution(fixed=(768, 1024)).to_json()) == (
        [512, 1024],
        "768x1024",
    )
