"""Zips no standard tool writes, built byte by byte: the archives of the measured attacks on the worker
(repeated and overlapping central-directory entries) and the members they are made of."""

from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib
from dataclasses import dataclass

from PIL import Image

MiB = 1024**2


def sparse_block(size: int, spacing: int, seed: int) -> bytes:
    """Zeros with a random byte every `spacing`: deflates about 186x at spacing 700, under the 200x
    per-member cap, so only the repetition gives it away."""
    rng = random.Random(seed)
    block = bytearray(size)
    for index in range(0, size, spacing):
        block[index] = rng.randrange(1, 256)
    return bytes(block)


@dataclass(frozen=True)
class RawMember:
    """One member's bytes as a zip stores them: raw deflate data and the sizes and CRC of what it expands to."""

    compressed: bytes
    file_size: int
    crc: int


def deflated(data: bytes) -> RawMember:
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    return RawMember(compressor.compress(data) + compressor.flush(), len(data), zlib.crc32(data))


def repeated_deflate(block: bytes, repeats: int) -> RawMember:
    """`block` repeated `repeats` times, deflated without materialising the whole: each full flush starts
    a fresh byte-aligned block sequence, so one compressed piece can be concatenated with itself."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(repeats):
        crc = zlib.crc32(block, crc)
    return RawMember(piece * repeats + b"\x03\x00", len(block) * repeats, crc)


def local_header(name: bytes, member: RawMember) -> bytes:
    return (
        struct.pack(
            "<4sHHHHHIIIHH",
            b"PK\x03\x04",
            20,
            0,
            zipfile.ZIP_DEFLATED,
            0,
            33,
            member.crc,
            len(member.compressed),
            member.file_size,
            len(name),
            0,
        )
        + name
    )


def central_entry(name: bytes, member: RawMember, offset: int, compress_size: int | None = None) -> bytes:
    return (
        struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            (3 << 8) | 20,
            20,
            0,
            zipfile.ZIP_DEFLATED,
            0,
            33,
            member.crc,
            len(member.compressed) if compress_size is None else compress_size,
            member.file_size,
            len(name),
            0,
            0,
            0,
            0,
            0o100644 << 16,
            offset,
        )
        + name
    )


def end_of_directory(entries: int, directory: bytes, directory_offset: int) -> bytes:
    return struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, entries, entries, len(directory), directory_offset, 0)


def zip_listing_one_member_many_times(member: RawMember, names: list[str]) -> bytes:
    """One local header and its data, and a central directory whose every entry points at them (under the
    header's own name, as zipfile insists, so a reader without the overlap check extracts every entry)."""
    body = local_header(names[0].encode(), member) + member.compressed
    directory = b"".join(central_entry(name.encode(), member, 0) for name in names)
    return body + directory + end_of_directory(len(names), directory, len(body))


def zip_with_overlapping_members(member: RawMember, names: tuple[str, str, str]) -> bytes:
    """The overlapping-files bomb: the first member's data spans the second's local header and data."""
    first, second, third = (name.encode() for name in names)
    inner = local_header(second, member) + member.compressed
    body = local_header(first, member) + inner
    tail_offset = len(body)
    body += local_header(third, member) + member.compressed
    directory = (
        central_entry(first, member, 0, compress_size=len(inner))
        + central_entry(second, member, len(local_header(first, member)))
        + central_entry(third, member, tail_offset)
    )
    return body + directory + end_of_directory(3, directory, len(body))


def flat_png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
