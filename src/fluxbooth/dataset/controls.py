"""The request's validation control images (FLUX.1 Kontext edits): each fetched like the dataset (base64, or an
SSRF-safe download within the same byte caps), decoded within the per-image pixel budget and stored as an 8-bit
sRGB PNG that covers the training shapes, as `job_dir/validation-images/NN.png`. Every refusal names the image's
field (`input.validation_images[N]`)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from fluxbooth.dataset.fetch import decode_base64_dataset, download_dataset
from fluxbooth.dataset.guards import ensure_inside
from fluxbooth.dataset.images import normalise_image
from fluxbooth.errors import FluxboothError
from fluxbooth.request import TrainingRequest
from fluxbooth.settings import DatasetLimits

FOLDER = "validation-images"
# The field the dataset's fetch stage names in its messages ("input.dataset: …", "dataset_url: …").
_DATASET_FIELD = re.compile(r"^(input\.)?(dataset_url|dataset)\b")


@contextlib.contextmanager
def _named(field: str) -> Iterator[None]:
    """The dataset fetch stage's refusals, naming this field instead of the dataset's."""
    try:
        yield
    except FluxboothError as error:
        message = _DATASET_FIELD.sub(f"input.{field}", error.message, count=1)
        raise FluxboothError(error.code, message, refresh_worker=error.refresh_worker, details=error.details) from error


def fetch_validation_images(request: TrainingRequest, job_dir: Path, limits: DatasetLimits) -> tuple[Path, ...]:
    """The stored control image of each validation prompt that has one, in prompt order."""
    if not request.validation_images:
        return ()
    folder = ensure_inside(job_dir / FOLDER, job_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stored = []
    for index, value in enumerate(request.validation_images):
        field = f"validation_images[{index}]"
        upload = ensure_inside(folder / f"{index:02d}.upload", job_dir)
        with _named(field):
            if value.startswith(("http://", "https://")):
                download_dataset(value, upload, limits)
            else:
                upload.write_bytes(decode_base64_dataset(value, limits, content="the image", link="an http(s) URL"))
        destination = ensure_inside(folder / f"{index:02d}.png", job_dir)
        normalise_image(upload, destination, member=f"input.{field}", limits=limits, resolution=request.resolution)
        upload.unlink()
        stored.append(destination)
    return tuple(stored)
