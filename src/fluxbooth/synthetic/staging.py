"""Synthetic model folders written under a temporary name beside their final one and renamed into place: a reader
never sees half a folder, and concurrent builders do not corrupt each other. No torch here."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def staging_folder(out_dir: Path) -> Path:
    """A fresh temporary name beside `out_dir`, naming this process (remove_abandoned_staging reads it back)."""
    return out_dir.parent / f".{out_dir.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_abandoned_staging(out_dir: Path) -> list[Path]:
    """Staging folders of builders that were killed (a full-size one holds up to 33 GB): removed when the
    process named in the folder's name is gone; a live builder's folder is left alone."""
    removed = []
    for folder in out_dir.parent.glob(f".{out_dir.name}.building-*"):
        pid_text = folder.name.rsplit(".building-", 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def build_in_place(out_dir: Path, write: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """`write` a folder into a staging folder and rename it to `out_dir`. A complete folder another builder put
    there first is kept; an incomplete one (a hand-made folder: a crash before the rename leaves none) is replaced,
    since only a complete folder may live under this name."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    try:
        write(staging)
        if out_dir.exists():
            if is_complete(out_dir):
                return out_dir
            shutil.rmtree(out_dir)
        try:
            os.rename(staging, out_dir)
        except OSError:
            # Another builder won the race between the check above and the rename; its folder is complete.
            if is_complete(out_dir):
                return out_dir
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
