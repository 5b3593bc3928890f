"""What every artifact store offers (`ArtifactStore`, `ReadableStore`) and reports (`StoredArtifact`), and the
checks of the names and digests handed to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import os_reason


@dataclass(frozen=True)
class StoredArtifact:
    """One artifact as the result reports it."""

    name: str
    uri: str  # "s3://bucket/key" or "file:///abs/path"
    url: str | None  # presigned GET URL for S3, None for local files
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "uri": self.uri, "url": self.url, "bytes": self.bytes, "sha256": self.sha256}


@runtime_checkable
class ArtifactStore(Protocol):
    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact: ...

    def describe(self) -> str: ...


@runtime_checkable
class ReadableStore(ArtifactStore, Protocol):
    """A store that can also be read back and pruned (checkpoints: list, check, download, delete)."""

    def list_folders(self) -> list[str]: ...

    def exists(self, name: str) -> bool: ...

    def download(self, name: str, target: Path) -> None: ...

    def delete_folder(self, name: str) -> int:
        """Remove the folder `name` (one path segment) and everything in it; return how many objects
        or files went. A folder that does not exist removes nothing."""
        ...


def check_artifact_name(name: str) -> None:
    segments = name.split("/")
    if not name or "\\" in name or "\x00" in name or any(segment in {"", ".", ".."} for segment in segments):
        raise FluxboothError(
            ErrorCode.INTERNAL,
            f"artifact name {name[:200]!r} is not a relative path of plain segments "
            "(like 'transformer/config.json'); fix the exporter that produced it",
        )


def check_path_segment(value: str, what: str) -> None:
    if not value or value in {".", ".."} or "/" in value or "\\" in value or "\x00" in value:
        raise FluxboothError(ErrorCode.INTERNAL, f"{what} {value[:200]!r} cannot be used as a folder or key segment")


def check_sha256(value: str) -> None:
    if len(value) != 64 or any(character not in "0123456789abcdef" for character in value):
        raise FluxboothError(
            ErrorCode.INTERNAL, f"sha256 {value[:80]!r} is not 64 lowercase hex digits; pass hashlib's hexdigest()"
        )


def existing_file_size(local_path: Path, name: str) -> int:
    try:
        if not local_path.is_file():
            raise FileNotFoundError(f"{local_path} is not a file")
        return local_path.stat().st_size
    except OSError as error:
        raise FluxboothError(
            ErrorCode.INTERNAL, f"artifact {name} cannot be read from {local_path}: {os_reason(error)}"
        ) from error
