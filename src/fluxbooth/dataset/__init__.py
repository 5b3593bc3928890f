"""From the request's zip (base64 or URL) to clean per-job image folders the trainer can trust.

Layout inside the job directory:

    job_dir/dataset.zip         the archive as received (removed once prepared)
    job_dir/raw/                extraction scratch, one file per accepted member (removed once prepared)
    job_dir/data/instance/      normalised 8-bit RGB PNGs, plus `<stem>.txt` captions
    job_dir/data/class/         the same for the zip's top-level `class/` folder, if any

The stages: `fetch` (base64 or an SSRF-safe download), `archive` (zip hardening and total-work budgets),
`images` (decode, orientation, RGB, stored at the size training needs). This module only runs them in
order. Everything treats the upload as hostile.

Error codes: problems with the request's fields themselves (bad base64, a forbidden URL) are
`invalid_input`; problems with what the archive or the download holds are `invalid_dataset`; too little free
disk is `does_not_fit`.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fluxbooth.dataset.archive import ExtractedArchive, ExtractedImage, extract_archive
from fluxbooth.dataset.fetch import decode_base64_dataset, download_dataset, forbidden_address_reason
from fluxbooth.dataset.guards import DISK_RESERVE_BYTES, Role, ensure_free_disk, ensure_inside, input_error
from fluxbooth.dataset.images import NormalisedImage, normalise_image, read_caption
from fluxbooth.request import TrainingRequest
from fluxbooth.settings import DatasetLimits

__all__ = [
    "ExtractedArchive",
    "ExtractedImage",
    "NormalisedImage",
    "PreparedDataset",
    "decode_base64_dataset",
    "download_dataset",
    "extract_archive",
    "forbidden_address_reason",
    "normalise_image",
    "prepare_dataset",
    "read_caption",
]

_UNSAFE_STEM_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class PreparedDataset:
    instance_dir: Path  # normalised RGB PNGs (+ optional caption .txt with the same stem)
    class_dir: Path | None  # from the zip's top-level `class/` folder, if any
    instance_images: int
    class_images: int
    captions: int
    skipped: dict[str, int]  # e.g. {"macos_metadata": 2, "hidden": 1, "not_image": 3}
    smaller_than_resolution: int  # images the trainer will upscale
    downscaled: int = 0  # images reduced here to the smallest size that still covers the resolution
    notes: tuple[str, ...] = ()

    def summary(self) -> dict[str, object]:
        return {
            "instance_images": self.instance_images,
            "class_images": self.class_images,
            "captions": self.captions,
            "skipped": dict(sorted(self.skipped.items())),
            "smaller_than_resolution": self.smaller_than_resolution,
            "downscaled": self.downscaled,
            "notes": list(self.notes),
        }


def _output_stem(member: str, taken: set[str]) -> str:
    """A readable, unique file stem: `photo1`, and `photo1-2` for a second `photo1` in another folder."""
    stem = _UNSAFE_STEM_CHARACTERS.sub("_", PurePosixPath(member).stem).strip("._")[:80] or "image"
    candidate = stem
    suffix = 2
    while candidate.casefold() in taken:
        candidate = f"{stem}-{suffix}"
        suffix += 1
    taken.add(candidate.casefold())
    return candidate


# ------------------------------------------------------------------------------------------- the whole


def _fetch_archive(request: TrainingRequest, archive_path: Path, limits: DatasetLimits) -> None:
    if request.dataset is not None:
        data = decode_base64_dataset(request.dataset, limits)
        ensure_free_disk(archive_path.parent, len(data) + DISK_RESERVE_BYTES, purpose="storing the dataset")
        archive_path.write_bytes(data)
    elif request.dataset_url is not None:
        download_dataset(request.dataset_url, archive_path, limits)
    else:
        raise input_error("dataset", "give the dataset zip as base64 in dataset, or a link in dataset_url")


def prepare_dataset(
    request: TrainingRequest,
    job_dir: Path,
    limits: DatasetLimits,
    *,
    on_image: Callable[[int, int], None] | None = None,
) -> PreparedDataset:
    """Fetch, check, extract and normalise the request's dataset inside `job_dir`.

    `on_image(done, total)` is called after each image, for progress reporting.
    """
    job_dir = job_dir.resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    archive_path = ensure_inside(job_dir / "dataset.zip", job_dir)
    raw_dir = ensure_inside(job_dir / "raw", job_dir)
    data_dir = ensure_inside(job_dir / "data", job_dir)

    _fetch_archive(request, archive_path, limits)
    extracted = extract_archive(archive_path, raw_dir, limits)
    archive_path.unlink()

    output_dirs: dict[Role, Path] = {"instance": data_dir / "instance"}
    if extracted.count("class"):
        output_dirs["class"] = data_dir / "class"
    for directory in output_dirs.values():
        directory.mkdir(parents=True, exist_ok=True)

    taken: dict[Role, set[str]] = {"instance": set(), "class": set()}
    counts: Counter[str] = Counter()
    for done, item in enumerate(extracted.images, start=1):
        directory = output_dirs[item.role]
        stem = _output_stem(item.member, taken[item.role])
        result = normalise_image(
            item.path,
            ensure_inside(directory / f"{stem}.png", job_dir),
            member=item.member,
            limits=limits,
            resolution=request.resolution,
        )
        item.path.unlink()
        counts[f"{item.role}_images"] += 1
        counts["downscaled"] += result.downscaled
        width, height = request.resolution
        counts["smaller"] += result.width < width or result.height < height
        if item.caption_path is not None:
            caption = read_caption(item.caption_path, member=item.caption_member or item.member)
            item.caption_path.unlink()
            if caption:
                ensure_inside(directory / f"{stem}.txt", job_dir).write_text(caption + "\n", encoding="utf-8")
                counts["captions"] += 1
        if on_image is not None:
            on_image(done, len(extracted.images))
    shutil.rmtree(raw_dir, ignore_errors=True)

    notes: list[str] = []
    width, height = request.resolution
    if counts["smaller"]:
        notes.append(
            f"{counts['smaller']} image(s) are smaller than {width}x{height} and will be upscaled; "
            "larger photos train sharper"
        )
    if counts["class_images"] and not request.with_prior_preservation:
        notes.append("the archive's class/ images are unused because with_prior_preservation is false")
    return PreparedDataset(
        instance_dir=output_dirs["instance"],
        class_dir=output_dirs.get("class"),
        instance_images=counts["instance_images"],
        class_images=counts["class_images"],
        captions=counts["captions"],
        skipped=dict(extracted.skipped),
        smaller_than_resolution=counts["smaller"],
        downscaled=counts["downscaled"],
        notes=tuple(notes),
    )
