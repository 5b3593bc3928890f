"""What every dataset stage shares: its error shapes, bounded names in messages, and the disk and
containment checks that keep a job's files inside its own directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from fluxbooth.errors import ErrorCode, FluxboothError

DISK_RESERVE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024

Role = Literal["instance", "class"]


def dataset_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset: {message}")


def url_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset_url: {message}")


def input_error(field_name: str, message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_INPUT, f"input.{field_name}: {message}")


def quoted(name: str, limit: int = 120) -> str:
    """A member name safe to put in a message: bounded, control characters escaped."""
    shown = name if len(name) <= limit else name[:limit] + "..."
    return repr(shown)


def megabytes(count: int) -> str:
    if count < 1024**2:
        return f"{count:,} bytes"
    return f"{count / 1024**2:.1f} MB"


def ensure_free_disk(path: Path, needed_bytes: int, *, purpose: str) -> None:
    """Refuse early, saying how much is needed, rather than fail half-way with ENOSPC."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: {purpose} needs about {megabytes(needed_bytes)} but only {megabytes(free)} "
            f"are free under {path}; free disk space, use a bigger volume or a smaller dataset",
        )


def ensure_inside(path: Path, root: Path) -> Path:
    """Resolved-path containment (a string prefix test would accept /job-evil for /job)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise dataset_error(f"refusing to write {path.name!r} outside the job directory")
    return resolved

