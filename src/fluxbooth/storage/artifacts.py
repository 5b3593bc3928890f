"""Checking what the trainer exported before anything is uploaded, without importing torch.

The trainer already reloads its weights with diffusers; this side checks, byte for byte, that the
files it announced exist inside the output directory, are well-formed safetensors, and gives each
its size and sha256 for the result.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError

# Bytes per element of each safetensors dtype.
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
HASH_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LocalArtifact:
    name: str  # the key under the job's prefix, e.g. "transformer/config.json"
    path: Path
    bytes: int
    sha256: str
    kind: str


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _invalid(path: Path, reason: str) -> FluxboothError:
    return FluxboothError(ErrorCode.TRAINER_FAILED, f"exported file {path.name} is not valid safetensors: {reason}")


def verify_safetensors(path: Path) -> int:
    """Check the header and that the tensors tile the data section exactly; return the tensor count."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise _invalid(path, "shorter than its 8-byte header length")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER_BYTES, size - 8):
            raise _invalid(path, f"header length {header_length} does not fit in a {size}-byte file")
        try:
            header = json.loads(handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _invalid(path, f"header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _invalid(path, "header is not a JSON object")
    data_bytes = size - 8 - header_length
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise _invalid(path, f"tensor {name!r} has a malformed entry") from error
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise _invalid(path, f"tensor {name!r} has unknown dtype {dtype}")
        elements = 1
        for dimension in shape:
            elements *= int(dimension)
        if end - start != elements * SAFETENSORS_DTYPE_BYTES[dtype]:
            raise _invalid(
                path,
                f"tensor {name!r} spans {end - start} bytes, its shape needs {elements * SAFETENSORS_DTYPE_BYTES[dtype]}",
            )
        spans.append((start, end))
    spans.sort()
    cursor = 0
    for start, end in spans:
        if start != cursor:
            raise _invalid(path, "tensor data overlaps or leaves gaps")
        cursor = end
    if cursor != data_bytes:
        raise _invalid(path, f"data section is {data_bytes} bytes but the tensors cover {cursor} (truncated?)")
    if not spans:
        raise _invalid(path, "it holds no tensors")
    return len(spans)


def _files_of(entry_path: Path) -> list[Path]:
    if entry_path.is_dir():
        return sorted(path for path in entry_path.rglob("*") if path.is_file())
    return [entry_path]


def collect_artifacts(output_dir: Path, announced: list[dict[str, Any]]) -> list[LocalArtifact]:
    """Resolve the trainer's announced artifacts (files or folders) into verified files."""
    root = output_dir.resolve()
    artifacts: list[LocalArtifact] = []
    for entry in announced:
        entry_path = (root / str(entry["path"])).resolve()
        if not entry_path.is_relative_to(root) or not entry_path.exists():
            raise FluxboothError(
                ErrorCode.TRAINER_FAILED,
                f"the trainer announced {entry['path']!r}, which is not in its output directory",
            )
        for file_path in _files_of(entry_path):
            if file_path.is_symlink():
                raise FluxboothError(ErrorCode.TRAINER_FAILED, f"exported file {file_path.name} is a symlink")
            if file_path.suffix == ".safetensors":
                verify_safetensors(file_path)
            artifacts.append(
                LocalArtifact(
                    name=file_path.relative_to(root).as_posix(),
                    path=file_path,
                    bytes=file_path.stat().st_size,
                    sha256=sha256_file(file_path),
                    kind=str(entry.get("kind", "file")),
                )
            )
    if not any(artifact.name.endswith(".safetensors") for artifact in artifacts):
        raise FluxboothError(ErrorCode.TRAINER_FAILED, "the trainer finished but exported no safetensors weights")
    return artifacts
