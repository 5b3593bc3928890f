"""Free disk where a job writes: the filesystem a path lives on (or would live on, once made), and the check
right before training that what the trainer will write still fits."""

from __future__ import annotations

import os
from pathlib import Path

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import free_disk_bytes
from fluxbooth.messages import format_bytes


def _nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a folder not made yet lands on its parent's filesystem)."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def device_of(path: Path) -> int:
    """The filesystem (device number) holding `path` or its nearest existing parent."""
    return os.stat(_nearest_existing(path)).st_dev


def filesystem_free_bytes(paths: list[Path]) -> int:
    """Free bytes summed over the distinct filesystems holding `paths` (or their nearest existing parents)."""
    free_by_device: dict[int, int] = {}
    for path in paths:
        existing = _nearest_existing(path)
        free_by_device[os.stat(existing).st_dev] = free_disk_bytes(existing)
    return sum(free_by_device.values())


def ensure_disk_for_training(needed_bytes: int, nvme_path: str | None, work_root: Path) -> None:
    """The planner checked the disk before the dataset was unpacked; the dataset now takes its share, so
    check again, right before training, against what the trainer will write (`needed_bytes`: the plan's
    caches, checkpoints, exported weights and offload swap, under `work_root` and the plan's `nvme_path`)."""
    places = [work_root] + ([Path(nvme_path)] if nvme_path else [])
    free = filesystem_free_bytes(places)
    if needed_bytes > free:
        where = " and ".join(str(place) for place in places)
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: training needs about {format_bytes(needed_bytes)} (caches, checkpoints and the "
            f"exported weights) but only {format_bytes(free)} are free under {where}; free disk space or "
            "give the worker a bigger volume (FLUXBOOTH_WORK_DIR)",
            details={"needed_bytes": needed_bytes, "free_bytes": free},
        )
