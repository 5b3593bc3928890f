"""Builders for test inputs: images, zips (well-formed and hostile) and base64 payloads.

Plain functions, importable from any test module (`from tests.support.factories import make_zip`).
Everything is built in memory and kept small.
"""

from __future__ import annotations

import base64
import io
import stat
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from PIL import Image

DEFAULT_COLOR = (200, 80, 40)
FRAME_COLORS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0))
ZIP_DATE = (2024, 1, 1, 0, 0, 0)

Color = int | tuple[int, ...]
Members = Mapping[str, bytes] | Sequence[tuple[str, bytes]]


def _format_for(path_or_format: str | Path) -> str:
    text = str(path_or_format)
    if "." not in text:
        return text.upper()
    suffix = "." + text.rsplit(".", 1)[-1].lower()
    known = Image.registered_extensions()
    if suffix not in known:
        raise ValueError(f"no image format for {suffix!r}")
    return known[suffix]


def _base_image(mode: str, size: tuple[int, int], color: Color | None) -> Image.Image:
    if mode in ("I;16", "I"):
        value = color if isinstance(color, int) else 40_000
        return Image.new(mode, size, value)
    if mode in ("RGBA", "LA"):
        rgba = color if isinstance(color, tuple) and len(color) == 4 else (*(color or DEFAULT_COLOR), 255)
        return Image.new("RGBA", size, rgba).convert(mode)
    if mode == "CMYK" and isinstance(color, tuple) and len(color) == 4:
        return Image.new("CMYK", size, color)
    rgb = Image.new("RGB", size, color if color is not None else DEFAULT_COLOR)
    if mode == "P":
        return rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return rgb.convert(mode)


def make_image(
    path_or_format: str | Path = "PNG",
    size: tuple[int, int] = (256, 256),
    mode: str = "RGB",
    color: Color | None = None,
    exif_orientation: int | None = None,
    frames: int = 1,
    *,
    transparent_index: int | None = None,
) -> bytes:
    """An encoded image. `path_or_format` is a format ("JPEG") or a file name ("x.jpg"); a Path is also
    written to disk. Extra frames (GIF, PNG, WEBP, TIFF) get FRAME_COLORS so the first is recognisable."""
    image_format = _format_for(path_or_format if not isinstance(path_or_format, Path) else path_or_format.name)
    image = _base_image(mode, size, color)
    options: dict[str, object] = {}
    if image_format == "JPEG":
        options["quality"] = 90
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        options["exif"] = exif.tobytes()
    if transparent_index is not None:
        options["transparency"] = transparent_index
    if frames > 1:
        extra = [_base_image(mode, size, FRAME_COLORS[index % len(FRAME_COLORS)]) for index in range(1, frames)]
        options.update(save_all=True, append_images=extra, duration=100, loop=0)
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    data = buffer.getvalue()
    if isinstance(path_or_format, Path):
        path_or_format.write_bytes(data)
    return data


def make_oversized_png(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels but that holds almost no data: what a
    decompression-bomb image looks like to anything that only reads the header."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def _central_directory_entries(data: bytes) -> list[tuple[int, str]]:
    """(offset of the central directory record, member name) for each member."""
    end = data.rfind(b"PK\x05\x06")
    count, _, offset = struct.unpack("<HII", data[end + 10 : end + 20])
    entries = []
    for _ in range(count):
        name_length, extra_length, comment_length = struct.unpack("<HHH", data[offset + 28 : offset + 34])
        name = data[offset + 46 : offset + 46 + name_length].decode("utf-8", "replace")
        entries.append((offset, name))
        offset += 46 + name_length + extra_length + comment_length
    return entries


def _patch_members(
    data: bytes,
    names: Iterable[str],
    *,
    set_flags: int = 0,
    compress_type: int | None = None,
    file_size: int | None = None,
) -> bytes:
    """Rewrite header fields that zipfile will not write for us, in both the local header and the
    central directory (readers disagree on which one they trust)."""
    wanted = set(names)
    patched = bytearray(data)
    for central, name in _central_directory_entries(data):
        if name not in wanted:
            continue
        (local,) = struct.unpack("<I", data[central + 42 : central + 46])
        header_fields = ((central + 8, central + 10, central + 24), (local + 6, local + 8, local + 22))
        for flags_at, method_at, size_at in header_fields:
            flags = struct.unpack("<H", patched[flags_at : flags_at + 2])[0] | set_flags
            patched[flags_at : flags_at + 2] = struct.pack("<H", flags)
            if compress_type is not None:
                patched[method_at : method_at + 2] = struct.pack("<H", compress_type)
            if file_size is not None:
                patched[size_at : size_at + 4] = struct.pack("<I", file_size)
    return bytes(patched)


def make_zip(
    members: Members,
    *,
    compression: int = zipfile.ZIP_DEFLATED,
    symlinks: Mapping[str, str] | None = None,
    encrypt_flag: Iterable[str] = (),
    compress_type_override: Mapping[str, int] | None = None,
    declared_sizes: Mapping[str, int] | None = None,
    special_files: Mapping[str, int] | None = None,
) -> bytes:
    """A zip holding `members` (names used verbatim, duplicates allowed, `name/` for a directory).

    Hostile variants: `symlinks` {name: target} adds symbolic-link members; `encrypt_flag` marks members
    as encrypted; `compress_type_override` {name: method} claims another compression method;
    `declared_sizes` {name: bytes} makes the headers lie about the expanded size; `special_files`
    {name: stat.S_IFIFO...} adds device/pipe members.
    """
    items = list(members.items()) if isinstance(members, Mapping) else list(members)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name" is the point of some tests
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, payload in items:
                info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
                info.compress_type = zipfile.ZIP_STORED if name.endswith("/") else compression
                info.create_system = 3
                info.external_attr = ((stat.S_IFDIR | 0o755) if name.endswith("/") else (stat.S_IFREG | 0o644)) << 16
                archive.writestr(info, b"" if name.endswith("/") else payload)
            for name, target in (symlinks or {}).items():
                info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
                info.create_system = 3
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                archive.writestr(info, target)
            for name, kind in (special_files or {}).items():
                info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
                info.create_system = 3
                info.external_attr = (kind | 0o644) << 16
                archive.writestr(info, b"")
    data = buffer.getvalue()
    if encrypt_flag:
        data = _patch_members(data, encrypt_flag, set_flags=0x1)
    for name, method in (compress_type_override or {}).items():
        data = _patch_members(data, [name], compress_type=method)
    for name, size in (declared_sizes or {}).items():
        data = _patch_members(data, [name], file_size=size)
    return data


def dataset_members(
    count: int = 4,
    size: tuple[int, int] = (96, 96),
    captions: bool = False,
    class_images: int = 0,
    image_format: str = "PNG",
) -> list[tuple[str, bytes]]:
    """The members of a small, valid DreamBooth dataset: photo0..N, optional captions, class/ images."""
    extension = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}[image_format]
    members: list[tuple[str, bytes]] = []
    for index in range(count):
        color = ((index * 60) % 256, (index * 110 + 40) % 256, (index * 30 + 90) % 256)
        members.append((f"photo{index}.{extension}", make_image(image_format, size=size, color=color)))
        if captions:
            members.append((f"photo{index}.txt", f"a photo of sks dog, pose {index}\n".encode()))
    for index in range(class_images):
        members.append((f"class/dog{index}.{extension}", make_image(image_format, size=size, color=(90, 90, 90))))
    return members


def make_dataset_zip(
    count: int = 4,
    size: tuple[int, int] = (96, 96),
    captions: bool = False,
    class_images: int = 0,
    image_format: str = "PNG",
) -> bytes:
    return make_zip(dataset_members(count, size, captions, class_images, image_format))


def to_base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
