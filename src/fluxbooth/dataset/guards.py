"""What every dataset stage shares: its error shapes, bounded names in messages, and the disk and
containment checks that keep a job's files inside its own directory."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import MAX_NAME_CHARS, format_bytes, short_name

DISK_RESERVE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
# Out of space, or out of the user's quota: either way the job needs more disk than it has.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# The zip's top-level folders: instance images at its root, `class/` (prior preservation), `control/` (the input
# image of each instance image's pair, same file stem: FLUX.1 Kontext).
Role = Literal["instance", "class", "control"]
ROLE_FOLDERS: tuple[Role, ...] = ("class", "control")


def dataset_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset: {message}")


def url_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset_url: {message}")


def input_error(field_name: str, message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_INPUT, f"input.{field_name}: {message}")


def quoted(name: str, limit: int = MAX_NAME_CHARS) -> str:
    """A member name safe to put in a message, in quotes: control characters escaped, a long one shortened in
    its middle (fluxbooth.messages.short_name)."""
    return f"'{short_name(name, limit)}'"


def unquoted(name: str, limit: int = MAX_NAME_CHARS) -> str:
    """`quoted` without the quotes, for a name inside a path the message suggests."""
    return short_name(name, limit)


def _does_not_fit(what: str, needed_bytes: int, free_bytes: int, path: Path) -> FluxboothError:
    return FluxboothError(
        ErrorCode.DOES_NOT_FIT,
        f"disk: {what} needs about {format_bytes(needed_bytes)} but only {format_bytes(free_bytes)} "
        f"are free under {path}; free disk space, use a bigger volume or a smaller dataset",
        details={"needed_bytes": needed_bytes, "free_bytes": free_bytes},
    )


def ensure_free_disk(path: Path, needed_bytes: int, *, purpose: str) -> None:
    """Refuse early, saying how much is needed, rather than fail half-way with ENOSPC."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise _does_not_fit(purpose, needed_bytes, free, path)


@dataclass
class DiskNeed:
    """What a stage needs on disk; a stage that learns more as it writes (a download without a length)
    raises `bytes`, so a disk that fills up is reported with the real number."""

    bytes: int


@contextmanager
def disk_stage(path: Path, needed_bytes: int, *, purpose: str) -> Iterator[DiskNeed]:
    """Check the free disk before a stage writes, and turn the disk filling up during it anyway (another
    writer, an estimate that was short) into `does_not_fit` with the numbers, never `internal`."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise _does_not_fit(purpose, needed_bytes, free, path)
    need = DiskNeed(needed_bytes)
    try:
        yield need
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: the disk filled up while {purpose}, which needs about {format_bytes(need.bytes)}; "
            f"{format_bytes(free)} were free under {path} when it began. Free disk space or use a bigger volume",
            details={"needed_bytes": need.bytes, "free_bytes": free},
        ) from None


@contextmanager
def disk_full_is_does_not_fit(path: Path, *, purpose: str) -> Iterator[None]:
    """The last word on a full disk anywhere in a stage that has no better numbers: what is free now."""
    try:
        yield
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        free = shutil.disk_usage(path).free
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: the disk filled up while {purpose}; {format_bytes(free)} are free under {path}. "
            "Free disk space or use a bigger volume",
            details={"free_bytes": free},
        ) from None


def ensure_inside(path: Path, root: Path) -> Path:
    """Resolved-path containment (a string prefix test would accept /job-evil for /job)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise dataset_error(f"refusing to write {path.name!r} outside the job directory")
    return resolved
