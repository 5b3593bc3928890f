"""Zip hardening and the archive's total-work budgets: every member is checked before anything is
decompressed (names, types, no two members sharing compressed data, sizes summed over the whole archive
against a cap and a ratio to the upload), then streamed through byte counters into files with generated
names (member names are inspected, never used as paths)."""

from __future__ import annotations

import hashlib
import lzma
import re
import stat
import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fluxbooth.dataset.guards import (
    CHUNK_BYTES,
    DISK_RESERVE_BYTES,
    ROLE_FOLDERS,
    Role,
    dataset_error,
    disk_stage,
    ensure_inside,
    quoted,
)
from fluxbooth.dataset.images import ALLOWED_IMAGE_FORMATS, MAX_CAPTION_CHARS
from fluxbooth.hardware import format_bytes
from fluxbooth.settings import DatasetLimits
from fluxbooth.contract.pairing import pair_key

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".heic", ".heif", ".hif", ".avif"}
)
UNSUPPORTED_IMAGE_EXTENSIONS = frozenset(
    {".jxl", ".svg", ".psd", ".raw", ".dng", ".cr2", ".cr3", ".nef", ".arw",
     ".orf", ".rw2", ".ico", ".tga", ".jp2", ".exr", ".hdr"}
)
ARCHIVE_EXTENSIONS = frozenset(
    {".zip", ".tar", ".gz", ".tgz", ".bz2", ".tbz", ".tbz2", ".xz", ".txz", ".zst", ".7z", ".rar", ".lz",
     ".lzma", ".cab", ".jar", ".cbz", ".cbr"}
)
CAPTION_EXTENSION = ".txt"
MAX_CAPTION_BYTES = 64 * 1024
SUPPORTED_COMPRESSION = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA})
COMPRESSION_NAMES = {1: "Shrink", 6: "Implode", 9: "Deflate64", 93: "Zstandard", 95: "XZ", 98: "PPMd",
                     99: "AES encryption"}
# Small members may legitimately compress very well (a flat-colour PNG, an empty caption); only big
# members with huge ratios look like bombs.
RATIO_CHECK_MIN_BYTES = 1024 * 1024
# Below this many expanded bytes the whole archive's ratio is not checked: a handful of flat BMPs may
# compress 1000x, and this much work is bounded whatever the upload.
ARCHIVE_RATIO_FLOOR_BYTES = 64 * 1024 * 1024
# A local file header: signature, 22 bytes of fields the central directory repeats, name and extra lengths.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"

_DRIVE_LETTER = re.compile(r"^[A-Za-z]:")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


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


def _member_parts(info: zipfile.ZipInfo) -> tuple[str, ...]:
    """The member's path components, or an invalid_dataset error for a hostile or unsafe name."""
    name = info.filename
    shown = quoted(name)
    if _CONTROL_CHARACTERS.search(name):
        raise dataset_error(f"member {shown} has control characters in its name; rename it and re-zip")
    if "\\" in name:
        raise dataset_error(
            f"member {shown} uses backslashes in its path (a non-standard zip); re-zip with a standard tool"
        )
    if name.startswith("/"):
        raise dataset_error(f"member {shown} has an absolute path; re-zip with relative paths")
    if _DRIVE_LETTER.match(name):
        raise dataset_error(f"member {shown} starts with a drive letter; re-zip with relative paths")
    parts = name.split("/")
    if ".." in parts:
        raise dataset_error(f"member {shown} escapes the archive root; remove it and re-zip")
    return tuple(part for part in parts if part not in ("", "."))


def _check_member_type(info: zipfile.ZipInfo) -> bool:
    """True for a regular file, False for a directory; refuses links and special files."""
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    shown = quoted(info.filename)
    if kind == stat.S_IFLNK:
        raise dataset_error(f"member {shown} is a symbolic link; zip the real files instead")
    if info.is_dir() or kind == stat.S_IFDIR:
        return False
    if kind not in (0, stat.S_IFREG):
        raise dataset_error(f"member {shown} is not a regular file (a device, pipe or socket); remove it")
    if info.flag_bits & 0x1:
        raise dataset_error(f"member {shown} is encrypted; re-zip without a password")
    if info.compress_type not in SUPPORTED_COMPRESSION:
        method = COMPRESSION_NAMES.get(info.compress_type, f"method {info.compress_type}")
        raise dataset_error(
            f"member {shown} uses unsupported compression ({method}); re-zip with standard Deflate"
        )
    return True


def _skip_reason(parts: tuple[str, ...]) -> str | None:
    basename = parts[-1]
    if parts[0] == "__MACOSX" or basename == ".DS_Store" or any(part.startswith("._") for part in parts):
        return "macos_metadata"
    if any(part.startswith(".") for part in parts):
        return "hidden"
    suffixes = [suffix.lower() for suffix in PurePosixPath(basename).suffixes]
    if suffixes and suffixes[-1] in ARCHIVE_EXTENSIONS:
        return "nested_archive"
    if suffixes and suffixes[-1] in UNSUPPORTED_IMAGE_EXTENSIONS:
        return "unsupported_image_format"
    if suffixes and suffixes[-1] in IMAGE_EXTENSIONS | {CAPTION_EXTENSION}:
        return None
    return "not_image"


_Candidate = tuple[tuple[str, ...], zipfile.ZipInfo]


def _strip_wrapper_folder(members: list[_Candidate]) -> list[_Candidate]:
    """Zipping a folder puts everything under `folder/`; treat that folder as the archive root."""
    if not members or any(len(parts) < 2 for parts, _ in members):
        return members
    roots = {parts[0] for parts, _ in members}
    if len(roots) != 1 or next(iter(roots)).lower() in ROLE_FOLDERS:
        return members
    return [(parts[1:], info) for parts, info in members]


def _role(parts: tuple[str, ...]) -> Role:
    folder = parts[0].lower() if len(parts) > 1 else ""
    return "class" if folder == "class" else "control" if folder == "control" else "instance"


def _pairing_key(parts: tuple[str, ...]) -> tuple[str, ...]:
    """A caption's and its image's shared key: their folder and file stem, by the pairing rule images use."""
    return tuple(part.casefold() for part in parts[:-1]) + (pair_key(parts[-1]),)


@dataclass(frozen=True)
class _PlannedMember:
    info: zipfile.ZipInfo
    name: str
    role: Role
    caption: zipfile.ZipInfo | None = None


def _plan_extraction(infos: Iterable[zipfile.ZipInfo]) -> tuple[list[_PlannedMember], Counter[str]]:
    skipped: Counter[str] = Counter()
    candidates: list[_Candidate] = []
    for info in infos:
        parts = _member_parts(info)
        if not _check_member_type(info) or not parts:
            continue
        reason = _skip_reason(parts)
        if reason is not None:
            skipped[reason] += 1
            continue
        candidates.append((parts, info))
    candidates = _strip_wrapper_folder(candidates)

    captions: dict[tuple[str, ...], _Candidate] = {}
    images: list[_Candidate] = []
    for parts, info in candidates:
        if parts[-1].lower().endswith(CAPTION_EXTENSION):
            key = (_role(parts), *_pairing_key(parts))
            if key in captions:  # `Photo.txt` beside `photo.txt`: one image, one caption; the second is counted
                skipped["duplicate_caption"] += 1
                continue
            captions[key] = (parts, info)
        else:
            images.append((parts, info))

    planned: list[_PlannedMember] = []
    used_captions: set[tuple[str, ...]] = set()
    for parts, info in sorted(images, key=lambda item: item[1].filename):
        role = _role(parts)
        key = (role, *_pairing_key(parts))
        caption = captions.get(key) if role == "instance" else None
        if caption is not None:
            used_captions.add(key)
        planned.append(_PlannedMember(info, info.filename, role, caption[1] if caption else None))
    for key in captions.keys() - used_captions:
        skipped[f"{key[0]}_caption" if key[0] in ROLE_FOLDERS else "unpaired_caption"] += 1
    return planned, skipped


def _check_declared_sizes(planned: list[_PlannedMember], limits: DatasetLimits, archive_bytes: int) -> int:
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


def _check_counts(planned: list[_PlannedMember], skipped: Counter[str], limits: DatasetLimits) -> None:
    instance = sum(1 for member in planned if member.role == "instance")
    class_count = sum(1 for member in planned if member.role == "class")
    if sum(1 for member in planned if member.role == "control") > limits.max_images:
        raise dataset_error(f"found more than {limits.max_images} control images; at most {limits.max_images} are accepted")
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
    planned, skipped = _plan_extraction(infos)
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


def _extract_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, counter: _ExpansionCounter
) -> str:
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
        planned, skipped = _plan_extraction(infos)
        _check_counts(planned, skipped, limits)
        declared_total = _check_declared_sizes(planned, limits, archive_path.stat().st_size)
        destination.mkdir(parents=True, exist_ok=True)
        root = destination.resolve()
        with disk_stage(root, declared_total + DISK_RESERVE_BYTES, purpose="extracting the dataset"):
            images = _extract_planned(archive, planned, root, limits)
    return ExtractedArchive(images=tuple(images), skipped=dict(skipped))


def _extract_planned(
    archive: zipfile.ZipFile, planned: list[_PlannedMember], root: Path, limits: DatasetLimits
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
