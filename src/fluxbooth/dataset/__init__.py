"""From the request's zip (base64 or URL) to clean per-job image folders the trainer can trust.

Layout inside the job directory:

    job_dir/dataset.zip         the archive as received (removed once prepared)
    job_dir/raw/                extraction scratch, one file per accepted member (removed once prepared)
    job_dir/data/instance/      normalised 8-bit RGB PNGs, plus `<stem>.txt` captions
    job_dir/data/class/         the same for the zip's top-level `class/` folder, if any
    job_dir/data/control/       the same for its `control/` folder: each instance image's input image, same file
                                stem (FLUX.1 Kontext's image pairs), if any

The stages: `fetch` (base64 or an SSRF-safe download), `archive` (zip hardening and total-work budgets),
`images` (decode, orientation, RGB, stored at the size training needs). This module only runs them in
order. Everything treats the upload as hostile.

Error codes: problems with the request's fields themselves (bad base64, a forbidden URL) are
`invalid_input`; problems with what the archive or the download holds are `invalid_dataset`; too little free
disk is `does_not_fit`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fluxbooth.addresses import forbidden_address_reason
from fluxbooth.clock import JobClock
from fluxbooth.contract.buckets import Resolution, Shape, mix_to_json
from fluxbooth.contract.captions import MAX_CAPTION_CHARS
from fluxbooth.contract.pairing import normalised_stem, pair_key
from fluxbooth.dataset.archive import ExtractedArchive, ExtractedImage, extract_archive
from fluxbooth.dataset.fetch import decode_base64_dataset, download_dataset, fetch_archive
from fluxbooth.dataset.guards import (
    DISK_RESERVE_BYTES,
    Role,
    dataset_error,
    disk_full_is_does_not_fit,
    disk_stage,
    ensure_inside,
    quoted,
    unquoted,
)
from fluxbooth.dataset.images import (
    NormalisedImage,
    check_image_budgets,
    normalise_image,
    read_caption,
)
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.dataset_spec import DatasetSpec
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

# Letters and digits of any script stay in stored names (\w is Unicode-aware); anything else becomes `_`.
_UNSAFE_STEM_CHARACTERS = re.compile(r"[^\w.-]+")
# A stored stem's UTF-8 bound: with a `-NN` suffix and `.png` it stays well under a file system's 255 bytes.
MAX_STEM_BYTES = 160
# A caption is stored as at most this many UTF-8 bytes (and a newline).
_CAPTION_BYTES_BOUND = 4 * MAX_CAPTION_CHARS + 1


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
    cropped: int = 0  # images longer than the aspect cap, of which only the middle was kept
    pixels: int = 0  # pixels decoded, each distinct file once (as its header declares)
    notes: tuple[str, ...] = ()
    trigger_word: str | None = None  # put into every caption and the instance prompt by the trainer
    # Instance samples (an image at one size) per training shape: the buckets training uses, and what the
    # planner's re-plan with the real images reads (plan.choose_plan's bucket_mix).
    bucket_mix: dict[Shape, int] = field(default_factory=dict)
    # Each prepared instance file's name → the archive member it came from, for messages that name files.
    uploaded_names: dict[str, str] = field(default_factory=dict)
    control_dir: Path | None = None  # from the zip's `control/` folder: image pairs (FLUX.1 Kontext), if any
    control_images: int = 0

    def summary(self) -> dict[str, object]:
        return {
            "instance_images": self.instance_images,
            "class_images": self.class_images,
            "control_images": self.control_images,
            "captions": self.captions,
            "skipped": dict(sorted(self.skipped.items())),
            "smaller_than_resolution": self.smaller_than_resolution,
            "downscaled": self.downscaled,
            "cropped": self.cropped,
            "pixels": self.pixels,
            "notes": list(self.notes),
            "trigger_word": self.trigger_word,
            "buckets": mix_to_json(self.bucket_mix),
        }


def _safe_stem(member: str) -> str:
    """The uploaded file's stem as a file name: its letters and digits in any script (NFC), other runs of
    characters as `_`, at most MAX_STEM_BYTES of UTF-8."""
    stem = _UNSAFE_STEM_CHARACTERS.sub("_", normalised_stem(member)).strip("._")
    return stem.encode("utf-8")[:MAX_STEM_BYTES].decode("utf-8", errors="ignore").strip("._") or "image"


def _output_stem(member: str, taken: set[str]) -> str:
    """A readable, unique file stem: `photo1`, and `photo1-2` for a second `photo1` in another folder."""
    stem = _safe_stem(member)
    candidate = stem
    suffix = 2
    while candidate.casefold() in taken:
        candidate = f"{stem}-{suffix}"
        suffix += 1
    taken.add(candidate.casefold())
    return candidate


def _output_stems(images: Sequence[ExtractedImage]) -> list[str]:
    """Each image's stored stem, in order; a control image gets its training image's, so the trainer pairs the
    stored files by the same rule (fluxbooth.contract.pairing) the upload was checked by."""
    taken: dict[Role, set[str]] = {"instance": set(), "class": set(), "control": set()}
    stems = [_output_stem(item.member, taken[item.role]) if item.role != "control" else "" for item in images]
    by_key = {pair_key(item.member): stem for item, stem in zip(images, stems, strict=True) if item.role == "instance"}
    for index, item in enumerate(images):
        if item.role == "control":
            stems[index] = by_key.get(pair_key(item.member)) or _output_stem(item.member, taken["control"])
    return stems


def _stems_of(extracted: ExtractedArchive, role: Role) -> dict[str, str]:
    """Each image of a role by its pairing key (fluxbooth.contract.pairing); two sharing one cannot be paired."""
    stems: dict[str, str] = {}
    for item in extracted.images:
        if item.role != role:
            continue
        key = pair_key(item.member)
        if key in stems:
            raise dataset_error(
                f"{quoted(item.member)} and {quoted(stems[key])} share the file stem {quoted(key)} (stems are compared "
                "ignoring case); image pairs are matched by file stem, so give each pair a stem of its own"
            )
        stems[key] = item.member
    return stems


def _check_pairs(extracted: ExtractedArchive, with_prior_preservation: bool) -> None:
    """With a `control/` folder, every instance image has the control image of its file stem and every control
    image its instance image, and prior preservation is off (the trainer's rules), before any image is decoded."""
    if not extracted.count("control"):
        return
    if with_prior_preservation:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            "input.with_prior_preservation: the zip has a control/ folder (image pairs), and image-pair training has "
            "no class images with control images; turn with_prior_preservation off, or remove the control/ folder",
        )
    instance, control = _stems_of(extracted, "instance"), _stems_of(extracted, "control")
    for key, member in sorted(instance.items()):
        if key not in control:
            stem = unquoted(normalised_stem(member))
            raise dataset_error(
                f"{quoted(member)} has no control image: put its input image at control/{stem}.<ext> (the same file "
                "stem); with a control/ folder every training image needs one"
            )
    for key, member in sorted(control.items()):
        if key not in instance:
            stem = unquoted(normalised_stem(member))
            raise dataset_error(
                f"{quoted(member)} has no training image {stem}.<ext> at the zip's root; remove it or add its pair"
            )


def _distinct_label(member: str, labels: Iterable[str]) -> str:
    """The member's name, or for a zip holding two entries of one name, `dup.jpg (entry 2)`: per-file results
    (the dataset check's findings, the contact sheet) must not fold two uploads into one."""
    taken = set(labels)
    label, entry = member, 1
    while label in taken:
        entry += 1
        label = f"{member} (entry {entry})"
    return label


def _same_file_again(earlier: Path, destination: Path) -> None:
    """A second name for an identical upload's output: a hard link (no disk), or a copy where links fail."""
    try:
        os.link(earlier, destination)
    except OSError:
        shutil.copyfile(earlier, destination)


def _normalise_all(
    extracted: ExtractedArchive,
    output_dirs: dict[Role, Path],
    resolution: Resolution,
    limits: DatasetLimits,
    job_dir: Path,
    on_image: Callable[[int, int], None] | None,
    uploaded_names: dict[str, str],
    buckets: Counter[Shape],
) -> Counter[str]:
    """Each image into its role's folder, identical files decoded once; returns the counts for the summary
    and adds each instance image's training shapes to `buckets`."""
    stems = _output_stems(extracted.images)
    stored: dict[str, tuple[Path, NormalisedImage]] = {}
    counts: Counter[str] = Counter()
    for done, (item, stem) in enumerate(zip(extracted.images, stems, strict=True), start=1):
        directory = output_dirs[item.role]
        destination = ensure_inside(directory / f"{stem}.png", job_dir)
        if item.digest and item.digest in stored:
            earlier, result = stored[item.digest]
            _same_file_again(earlier, destination)
        else:
            result = normalise_image(item.path, destination, member=item.member, limits=limits, resolution=resolution)
            stored[item.digest or str(item.path)] = (destination, result)
        item.path.unlink()
        if item.role == "instance":
            uploaded_names[destination.name] = _distinct_label(item.member, uploaded_names.values())
        counts[f"{item.role}_images"] += 1
        counts["downscaled"] += result.downscaled
        counts["cropped"] += result.cropped
        shapes = resolution.shapes_for(result.width, result.height)
        counts["smaller"] += any(result.width < width or result.height < height for width, height in shapes)
        if item.role == "instance":
            buckets.update(shapes)
        if item.caption_path is not None:
            caption = read_caption(item.caption_path, member=item.caption_member or item.member)
            item.caption_path.unlink()
            if caption:
                ensure_inside(directory / f"{stem}.txt", job_dir).write_text(caption + "\n", encoding="utf-8")
                counts["captions"] += 1
        if on_image is not None:
            on_image(done, len(extracted.images))
    return counts


def _notes(counts: Counter[str], spec: DatasetSpec, limits: DatasetLimits) -> tuple[str, ...]:
    notes: list[str] = []
    resolution = spec.resolution
    if counts["smaller"]:
        shape = resolution.describe() if resolution.fixed else f"their aspect bucket at {resolution.sizes[-1]} px"
        notes.append(
            f"{counts['smaller']} image(s) are smaller than {shape} and will be upscaled; larger photos train sharper"
        )
    if counts["cropped"]:
        notes.append(
            f"{counts['cropped']} image(s) are longer than {limits.max_image_aspect_ratio:g}:1 and were cropped to "
            "their middle, the part training uses"
        )
    if counts["class_images"] and not spec.with_prior_preservation:
        notes.append("the archive's class/ images are unused because with_prior_preservation is false")
    return tuple(notes)


def prepare_dataset(
    spec: DatasetSpec,
    job_dir: Path,
    limits: DatasetLimits,
    *,
    on_image: Callable[[int, int], None] | None = None,
    clock: JobClock | None = None,
) -> PreparedDataset:
    """Fetch, check, extract and normalise the job's dataset (`spec`) inside `job_dir`.

    Every budget (archive size and expansion, decoded pixels, stored bytes, free disk) is checked before
    the work it bounds. `on_image(done, total)` is called after each image, for progress reporting. A download
    runs within the job's `clock`.
    """
    job_dir = job_dir.resolve()
    with disk_full_is_does_not_fit(job_dir, purpose="preparing the dataset"):
        job_dir.mkdir(parents=True, exist_ok=True)
        archive_path = ensure_inside(job_dir / "dataset.zip", job_dir)
        raw_dir = ensure_inside(job_dir / "raw", job_dir)
        data_dir = ensure_inside(job_dir / "data", job_dir)

        fetch_archive(spec, archive_path, limits, clock)
        extracted = extract_archive(archive_path, raw_dir, limits)
        archive_path.unlink()
        _check_pairs(extracted, spec.with_prior_preservation)
        pixels, stored_bound = check_image_budgets(
            ((item.digest or str(item.path), item.path, item.member) for item in extracted.images),
            spec.resolution,
            limits,
        )
        captions_bound = _CAPTION_BYTES_BOUND * sum(item.caption_path is not None for item in extracted.images)

        output_dirs: dict[Role, Path] = {"instance": data_dir / "instance"}
        uploaded_names: dict[str, str] = {}
        buckets: Counter[Shape] = Counter()
        for role in ("class", "control"):
            if extracted.count(role):
                output_dirs[role] = data_dir / role
        for directory in output_dirs.values():
            directory.mkdir(parents=True, exist_ok=True)
        needed = stored_bound + captions_bound + DISK_RESERVE_BYTES
        with disk_stage(data_dir, needed, purpose="storing the normalised images"):
            counts = _normalise_all(
                extracted, output_dirs, spec.resolution, limits, job_dir, on_image, uploaded_names, buckets
            )
        shutil.rmtree(raw_dir, ignore_errors=True)

    return PreparedDataset(
        instance_dir=output_dirs["instance"],
        class_dir=output_dirs.get("class"),
        control_dir=output_dirs.get("control"),
        instance_images=counts["instance_images"],
        class_images=counts["class_images"],
        control_images=counts["control_images"],
        captions=counts["captions"],
        skipped=dict(extracted.skipped),
        smaller_than_resolution=counts["smaller"],
        downscaled=counts["downscaled"],
        cropped=counts["cropped"],
        pixels=pixels,
        notes=_notes(counts, spec, limits),
        trigger_word=spec.trigger_word,
        bucket_mix=dict(buckets),
        uploaded_names=uploaded_names,
    )
