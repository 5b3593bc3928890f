"""The request's validation control images (FLUX.1 Kontext edits): each fetched like the dataset (base64, or an
SSRF-safe download within the same byte caps), decoded within the per-image pixel budget and stored as an 8-bit
sRGB PNG that covers the training shapes, as `job_dir/validation-images/NN.png`. Every refusal names the image's
field (`input.validation_images[N]`)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from fluxbooth.clock import JobClock
from fluxbooth.dataset.fetch import decode_base64_dataset, download_dataset
from fluxbooth.dataset.guards import ensure_inside
from fluxbooth.dataset.images import normalise_image
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.families import Family
from fluxbooth.request.dataset_spec import DatasetSpec
from fluxbooth.settings import DatasetLimits

FOLDER = "validation-images"
# The field the dataset's fetch stage names in its messages ("input.dataset: …", "dataset_url: …").
_DATASET_FIELD = re.compile(r"^(input\.)?(dataset_url|dataset)\b")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@contextlib.contextmanager
def _named(field: str) -> Iterator[None]:
    """The dataset fetch stage's refusals, naming this field instead of the dataset's."""
    try:
        yield
    except FluxboothError as error:
        message = _DATASET_FIELD.sub(f"input.{field}", error.message, count=1)
        raise FluxboothError(error.code, message, refresh_worker=error.refresh_worker, details=error.details) from error


def check_validation_images_used(spec: DatasetSpec, family: Family) -> None:
    """Control images are for a family that edits an input image (FLUX.1 Kontext); for another they would be
    fetched and then never used, so they are refused before anything is fetched."""
    if spec.validation_images and not family.control_images:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input.validation_images: {family.title} renders validation prompts from text alone and does not use "
            "control images (FLUX.1 Kontext does); remove validation_images",
        )


def fetch_validation_images(
    spec: DatasetSpec, job_dir: Path, limits: DatasetLimits, clock: JobClock | None = None
) -> tuple[Path, ...]:
    """The stored control image of each validation prompt that has one, in prompt order; every download within
    the job's `clock`, shared with the dataset's."""
    if not spec.validation_images:
        return ()
    folder = ensure_inside(job_dir / FOLDER, job_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stored = []
    for index, value in enumerate(spec.validation_images):
        field = f"validation_images[{index}]"
        upload = ensure_inside(folder / f"{index:02d}.upload", job_dir)
        with _named(field):
            if _URL.match(value):  # any scheme, any case: `ftp://` is refused as a URL, not decoded as base64
                download_dataset(value, upload, limits, clock=clock, stage=f"downloading input.{field}")
            else:
                upload.write_bytes(decode_base64_dataset(value, limits, content="the image", link="an http(s) URL"))
        destination = ensure_inside(folder / f"{index:02d}.png", job_dir)
        normalise_image(upload, destination, member=f"input.{field}", limits=limits, resolution=spec.resolution)
        upload.unlink()
        stored.append(destination)
    return tuple(stored)
