"""Zip hardening and the archive's total-work budgets: every member is checked before anything is
decompressed (names, types, no two members sharing compressed data, sizes summed over the whole archive
against a cap and a ratio to the upload), then streamed through byte counters into files with generated
names (member names are inspected, never used as paths).

Which members are read, and as what, is `fluxbooth.dataset.members`; here, the limits checked before
anything is written and the extraction itself.
"""

from __future__ import annotations

import hashlib
import lzma
import re
import struct
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fluxbooth.contract.captions import MAX_CAPTION_CHARS
from fluxbooth.dataset.guards import (
    CHUNK_BYTES,
    DISK_RESERVE_BYTES,
    Role,
    dataset_error,
    disk_stage,
    ensure_inside,
    quoted,
)
from fluxbooth.dataset.images import ALLOWED_IMAGE_FORMATS
from fluxbooth.dataset.members import MAX_CAPTION_BYTES, PlannedMember, plan_extraction
from fluxbooth.messages import format_bytes
from fluxbooth.settings import DatasetLimits

# Small members may legitimately compress very well (a flat-colour PNG, an empty caption); only big
# members with huge ratios look like bombs.
RATIO_CHECK_MIN_BYTES = 1024 * 1024
# Below this many expanded bytes the whole archive's ratio is not checked: a handful of flat BMPs may
# compress 1000x, and this much work is bounded whatever the upload.
ARCHIVE_RATIO_FLOOR_BYTES = 64 * 1024 * 1024
# A local file header: signature, 22 bytes of fields the central directory repeats, name and extra lengths.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class ExtractedImage:
    member: str  # its name inside the archive, for messages
    role: Role
    path: Path  # the extracted bytes, under raw/ with a generated name
    caption_member: str | None = None
    caption_path: Path | None = None
    digest: str = ""  # sha256 of the extracted bytes: identical files are decoded once


@dataclass(frozen=True)
class ExtractedArchive:
    images: tuple[ExtractedImage, ...]
    skipped: dict[str, int] = field(default_factory=dict)

    def count(self, role: Role) -> int:
        return sum(1 for image in self.images if image.role == role)


def describe_non_zip(head: bytes) -> str:
    """Why a file whose first 512 bytes are `head` is no zip, in the user's terms."""
    if not head:
        return "the archive is empty"
    if head.startswith(b"PK\x03\x04"):
        return "the zip is truncated or damaged (no central directory found); re-create and re-upload it"
    kinds = {
        b"\x1f\x8b": "a gzip file",
        b"BZh": "a bzip2 file",
        b"\xfd7zXZ": "an xz file",
        b"7z\xbc\xaf": "a 7-Zip archive",
        b"Rar!": "a RAR archive",
        b"\x89PNG": "a single PNG image",
        b"\xff\xd8\xff": "a single JPEG image",
        b"%PDF": "a PDF",
    }
    for magic, kind in kinds.items():
        if head.startswith(magic):
            return f"the upload is {kind}, not a zip archive; put the images in a .zip"
    if head[257:262] == b"ustar":
        return "the upload is a tar archive, not a zip archive; put the images in a .zip"
    return "the upload is not a zip archive; put the images in a .zip"


def _check_declared_sizes(planned: list[PlannedMember], limits: DatasetLimits, archive_bytes: int) -> int:
    """Refuse on what the headers declare, before anything is decompressed; returns the declared total.

    The totals are summed over every member that will be extracted, so many modest members cannot add
    up to what one big member may not be."""
    total = 0
    for member in planned:
        for info in (member.info, member.caption):
            if info is None:
                continue
            shown = quoted(info.filename)
            if info is member.caption and info.file_size > MAX_CAPTION_BYTES:
                raise dataset_error(
                    f"caption {shown} is {info.file_size:,} bytes; captions are at most {MAX_CAPTION_CHARS} characters"
                )
            if info.file_size > limits.max_member_bytes:
                raise dataset_error(
                    f"member {shown} declares {format_bytes(info.file_size)}, over the "
                    f"{format_bytes(limits.max_member_bytes)} per-file cap; use smaller images"
                )
            ratio = info.file_size / max(info.compress_size, 1)
            if info.file_size > RATIO_CHECK_MIN_BYTES and ratio > limits.max_compression_ratio:
                raise dataset_error(
                    f"member {shown} expands {ratio:,.0f}x (the cap is {limits.max_compression_ratio}x), "
                    "which looks like a zip bomb; images do not compress like that"
                )
            total += info.file_size
    if total > limits.max_expanded_bytes:
        raise dataset_error(
            f"the archive declares {format_bytes(total)} of files, over the {format_bytes(limits.max_expanded_bytes)} "
            "cap (FLUXBOOTH_MAX_EXPANDED_BYTES); use fewer or smaller images"
        )
    ratio = total / max(archive_bytes, 1)
    if total > ARCHIVE_RATIO_FLOOR_BYTES and ratio > limits.max_archive_expansion_ratio:
        raise dataset_error(
            f"the archive's {format_bytes(archive_bytes)} expand to {format_bytes(total)}, {ratio:,.0f}x, over the "
            f"{limits.max_archive_expansion_ratio}x cap (FLUXBOOTH_MAX_ARCHIVE_EXPANSION_RATIO); images do not "
            "compress like that, so re-create the zip from the photos themselves"
        )
    return total


def _check_no_shared_data(archive_path: Path, infos: list[zipfile.ZipInfo], directory_offset: int) -> None:
    """Each member's bytes (local header and compressed data) must be its own and lie before the central
    directory. A directory listing the same or overlapping data many times passes every per-member check
    while multiplying the work: the overlapping-files zip bomb."""
    spans: list[tuple[int, int, zipfile.ZipInfo]] = []
    with archive_path.open("rb") as source:
        for info in infos:
            source.seek(info.header_offset)
            header = source.read(_LOCAL_HEADER.size)
            if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_HEADER_SIGNATURE:
                raise dataset_error(
                    f"member {quoted(info.filename)} points at no file header; the zip is damaged, re-create it"
                )
            _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
            end = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length + info.compress_size
            spans.append((info.header_offset, end, info))
    spans.sort(key=lambda span: span[:2])
    for (start, end, info), (next_start, _, next_info) in zip(spans, spans[1:], strict=False):
        if next_start < end:
            how = "the same" if next_start == start else "overlapping"
            raise dataset_error(
                f"members {quoted(info.filename)} and {quoted(next_info.filename)} point at {how} compressed data, "
                "a zip-bomb trick that repeats the work; re-create the zip with a standard tool"
            )
    if spans and spans[-1][1] > directory_offset:
        raise dataset_error(
            f"member {quoted(spans[-1][2].filename)} runs into the archive's directory; the zip is damaged, "
            "re-create it"
        )


def _check_counts(planned: list[PlannedMember], skipped: Counter[str], limits: DatasetLimits) -> None:
    instance = sum(1 for member in planned if member.role == "instance")
    class_count = sum(1 for member in planned if member.role == "class")
    if sum(1 for member in planned if member.role == "control") > limits.max_images:
        raise dataset_error(
            f"found more than {limits.max_images} control images; at most {limits.max_images} are accepted"
        )
    if instance == 0:
        found = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())) or "nothing"
        held = f" (class/ holds {class_count})" if class_count else ""
        raise dataset_error(
            f"no usable instance images in the archive{held}; skipped: {found}. "
            f"Put {', '.join(ALLOWED_IMAGE_FORMATS)} files in the zip"
        )
    if instance < limits.min_images:
        raise dataset_error(
            f"found {instance} instance image(s); at least {limits.min_images} are needed. Add more photos"
        )
    if instance > limits.max_images:
        raise dataset_error(f"found {instance} instance images; at most {limits.max_images} are accepted")
    if class_count > limits.max_images:
        raise dataset_error(f"found {class_count} class images; at most {limits.max_images} are accepted")


def _check_member_count(infos: list[zipfile.ZipInfo], limits: DatasetLimits) -> None:
    if len(infos) > limits.max_members:
        raise dataset_error(
            f"the archive has {len(infos):,} members, over the {limits.max_members:,} cap; use fewer files"
        )


def count_instance_images(infos: list[zipfile.ZipInfo], limits: DatasetLimits, archive_bytes: int) -> int:
    """The instance images this stage would extract from a zip of `archive_bytes` whose central directory lists
    `infos`, by the same rules (names, types, skipped files, the wrapper folder, the image counts, the sizes the
    members declare), without a byte of member data: what a dry run plans for. A directory the stage would
    refuse is refused the same way."""
    _check_member_count(infos, limits)
    planned, skipped = plan_extraction(infos)
    _check_counts(planned, skipped, limits)
    _check_declared_sizes(planned, limits, archive_bytes)
    return sum(1 for member in planned if member.role == "instance")


def _extracted_name(index: int, member_name: str) -> str:
    suffix = PurePosixPath(member_name).suffix.lower()
    if not re.fullmatch(r"\.[a-z0-9]{1,8}", suffix):
        suffix = ""
    return f"{index:05d}{suffix}"


_ARCHIVE_READ_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


class _ExpansionCounter:
    """Counts decompressed bytes across the whole archive; headers can lie, this cannot."""

    def __init__(self, limits: DatasetLimits) -> None:
        self.limits = limits
        self.total = 0

    def add(self, info: zipfile.ZipInfo, member_bytes: int, chunk_bytes: int) -> None:
        self.total += chunk_bytes
        shown = quoted(info.filename)
        if member_bytes > info.file_size or member_bytes > self.limits.max_member_bytes:
            raise dataset_error(
                f"member {shown} expands beyond its declared size ({format_bytes(info.file_size)}); "
                "the archive is damaged or hostile, re-create it"
            )
        if self.total > self.limits.max_expanded_bytes:
            raise dataset_error(
                f"the archive expands beyond the {format_bytes(self.limits.max_expanded_bytes)} cap "
                f"(FLUXBOOTH_MAX_EXPANDED_BYTES, reached while extracting {shown}); use fewer or smaller images"
            )


def _extract_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, counter: _ExpansionCounter) -> str:
    """Stream one member into `target` through the counter; returns the sha256 of its bytes."""
    member_bytes = 0
    digest = hashlib.sha256()
    shown = quoted(info.filename)
    try:
        source = archive.open(info)
    except (*_ARCHIVE_READ_ERRORS, NotImplementedError, RuntimeError) as error:
        raise dataset_error(f"member {shown} is corrupt ({error}); re-create the zip") from None
    with target.open("xb") as sink, source:
        while True:
            try:
                chunk = source.read(CHUNK_BYTES)
            except _ARCHIVE_READ_ERRORS as error:
                raise dataset_error(f"member {shown} is corrupt ({error}); re-create the zip") from None
            if not chunk:
                break
            member_bytes += len(chunk)
            counter.add(info, member_bytes, len(chunk))
            digest.update(chunk)
            sink.write(chunk)
    return digest.hexdigest()


def extract_archive(archive_path: Path, destination: Path, limits: DatasetLimits) -> ExtractedArchive:
    """Check every member, then stream the images (and their captions) into `destination`.

    Member names are only inspected, never used as paths: extracted files are `destination/00000.jpg`,
    ... so no name can place a file elsewhere.
    """
    try:
        archive = zipfile.ZipFile(archive_path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError):
        with archive_path.open("rb") as source:
            raise dataset_error(describe_non_zip(source.read(512))) from None
    with archive:
        infos = archive.infolist()
        _check_member_count(infos, limits)
        _check_no_shared_data(archive_path, infos, archive.start_dir)
        planned, skipped = plan_extraction(infos)
        _check_counts(planned, skipped, limits)
        declared_total = _check_declared_sizes(planned, limits, archive_path.stat().st_size)
        destination.mkdir(parents=True, exist_ok=True)
        root = destination.resolve()
        with disk_stage(root, declared_total + DISK_RESERVE_BYTES, purpose="extracting the dataset"):
            images = _extract_planned(archive, planned, root, limits)
    return ExtractedArchive(images=tuple(images), skipped=dict(skipped))


def _extract_planned(
    archive: zipfile.ZipFile, planned: list[PlannedMember], root: Path, limits: DatasetLimits
) -> list[ExtractedImage]:
    counter = _ExpansionCounter(limits)
    images: list[ExtractedImage] = []
    written = 0
    for member in planned:
        image_path = ensure_inside(root / _extracted_name(written, member.name), root)
        digest = _extract_member(archive, member.info, image_path, counter)
        written += 1
        caption_path = None
        if member.caption is not None:
            caption_path = ensure_inside(root / _extracted_name(written, member.caption.filename), root)
            _extract_member(archive, member.caption, caption_path, counter)
            written += 1
        images.append(
            ExtractedImage(
                member=member.name,
                role=member.role,
                path=image_path,
                caption_member=member.caption.filename if member.caption else None,
                caption_path=caption_path,
                digest=digest,
            )
        )
    return images
