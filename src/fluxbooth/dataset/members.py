"""The members of a dataset zip read from its central directory alone: which are images, captions or refused,
their names made safe, the wrapper folder dropped, the role and pairing key told from each path.
"""

from __future__ import annotations

import re
import stat
import zipfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from fluxbooth.contract.pairing import pair_key
from fluxbooth.dataset.guards import (
    ROLE_FOLDERS,
    Role,
    dataset_error,
    quoted,
)

IMAGE_EXTENSIONS = frozenset(
    {
        ".jpg",
        ".jpeg",
        ".jpe",
        ".jfif",
        ".png",
        ".webp",
        ".bmp",
        ".gif",
        ".tif",
        ".tiff",
        ".heic",
        ".heif",
        ".hif",
        ".avif",
    }
)
UNSUPPORTED_IMAGE_EXTENSIONS = frozenset(
    {
        ".jxl",
        ".svg",
        ".psd",
        ".raw",
        ".dng",
        ".cr2",
        ".cr3",
        ".nef",
        ".arw",
        ".orf",
        ".rw2",
        ".ico",
        ".tga",
        ".jp2",
        ".exr",
        ".hdr",
    }
)
ARCHIVE_EXTENSIONS = frozenset(
    {
        ".zip",
        ".tar",
        ".gz",
        ".tgz",
        ".bz2",
        ".tbz",
        ".tbz2",
        ".xz",
        ".txz",
        ".zst",
        ".7z",
        ".rar",
        ".lz",
        ".lzma",
        ".cab",
        ".jar",
        ".cbz",
        ".cbr",
    }
)
CAPTION_EXTENSION = ".txt"
MAX_CAPTION_BYTES = 64 * 1024
SUPPORTED_COMPRESSION = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA})
COMPRESSION_NAMES = {
    1: "Shrink",
    6: "Implode",
    9: "Deflate64",
    93: "Zstandard",
    95: "XZ",
    98: "PPMd",
    99: "AES encryption",
}

_DRIVE_LETTER = re.compile(r"^[A-Za-z]:")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


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
        raise dataset_error(f"member {shown} uses unsupported compression ({method}); re-zip with standard Deflate")
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
class PlannedMember:
    info: zipfile.ZipInfo
    name: str
    role: Role
    caption: zipfile.ZipInfo | None = None


def plan_extraction(infos: Iterable[zipfile.ZipInfo]) -> tuple[list[PlannedMember], Counter[str]]:
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

    planned: list[PlannedMember] = []
    used_captions: set[tuple[str, ...]] = set()
    for parts, info in sorted(images, key=lambda item: item[1].filename):
        role = _role(parts)
        key = (role, *_pairing_key(parts))
        caption = captions.get(key) if role == "instance" else None
        if caption is not None:
            used_captions.add(key)
        planned.append(PlannedMember(info, info.filename, role, caption[1] if caption else None))
    for key in captions.keys() - used_captions:
        skipped[f"{key[0]}_caption" if key[0] in ROLE_FOLDERS else "unpaired_caption"] += 1
    return planned, skipped
