"""The local output directory as a store: artifacts copied in atomically and checked against their sha256."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import os_reason
from fluxbooth.storage.protocol import (
    StoredArtifact,
    check_artifact_name,
    check_path_segment,
    check_sha256,
    existing_file_size,
)

logger = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 8 * 1024 * 1024


class LocalStore:
    """Copies artifacts into a directory (the default when no bucket is configured)."""

    def __init__(self, directory: Path) -> None:
        self._directory = Path(directory).resolve()

    @property
    def directory(self) -> Path:
        return self._directory

    def describe(self) -> str:
        return self._directory.as_uri()

    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact:
        check_artifact_name(name)
        existing_file_size(local_path, name)
        check_sha256(sha256)
        target = self._directory / name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # `name` has no ".." segments, but a symlinked folder inside the directory could still lead out.
            if not target.parent.resolve().is_relative_to(self._directory):
                raise OSError(f"{target.parent} leads outside {self._directory}")
            copied_bytes, copied_sha256 = copy_atomically(source=local_path, target=target, expected_sha256=sha256)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"writing artifact {name} to {self._directory} failed: {os_reason(error)}; "
                "check that FLUXBOOTH_OUTPUT_DIR is writable and has free space",
            ) from error
        except _ContentMismatch as mismatch:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"artifact {name} changed while it was being stored: {mismatch}; nothing was written",
            ) from mismatch
        return StoredArtifact(name=name, uri=target.as_uri(), url=None, bytes=copied_bytes, sha256=copied_sha256)

    def list_folders(self) -> list[str]:
        if not self._directory.is_dir():
            return []
        return sorted(entry.name for entry in self._directory.iterdir() if entry.is_dir() and not entry.is_symlink())

    def exists(self, name: str) -> bool:
        check_artifact_name(name)
        return (self._directory / name).is_file()

    def delete_folder(self, name: str) -> int:
        check_path_segment(name, "folder name")
        folder = self._directory / name
        try:
            # Exactly a folder of this directory: a symlink (even to a sibling) or a way out is refused.
            if folder.resolve() != folder:
                raise OSError(f"{folder} is a link or leads outside {self._directory}")
            if not folder.exists():
                return 0
            if not folder.is_dir():
                raise NotADirectoryError(f"{folder} is not a folder")
            removed = sum(len(files) for _, _, files in os.walk(folder))
            shutil.rmtree(folder)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED, f"deleting {name} from {self._directory} failed: {os_reason(error)}"
            ) from error
        logger.info("deleted %s (%d files)", folder, removed)
        return removed

    def download(self, name: str, target: Path) -> None:
        check_artifact_name(name)
        source = self._directory / name
        try:
            if not source.resolve().is_relative_to(self._directory):
                raise OSError(f"{source} leads outside {self._directory}")
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_atomically(source=source, target=target)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED, f"reading {name} from {self._directory} failed: {os_reason(error)}"
            ) from error


class _ContentMismatch(Exception):
    pass


def copy_atomically(source: Path, target: Path, expected_sha256: str | None = None) -> tuple[int, str]:
    """Copy through a temporary name in the target's folder, then rename, so readers never see half a file.

    Hashing happens on the bytes as they are copied, so verification costs no second read.
    """
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    digest = hashlib.sha256()
    copied = 0
    try:
        with source.open("rb") as reader, temporary.open("xb") as writer:
            while chunk := reader.read(COPY_CHUNK_BYTES):
                digest.update(chunk)
                writer.write(chunk)
                copied += len(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        actual_sha256 = digest.hexdigest()
        if expected_sha256 is not None and actual_sha256 != expected_sha256:
            raise _ContentMismatch(f"sha256 of the copied bytes is {actual_sha256}, expected {expected_sha256}")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return copied, actual_sha256
