"""Each job attempt's own folder under the work root, named by its safe job id, and the cleanup of what dead
attempts left behind.

A folder is held by a flock for as long as its run lives, so a folder is removed by someone else only once no
live process holds it; DeepSpeed's NVMe swap folders are named after their attempt and cleaned the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.storage.stores import CHECKPOINTS_FOLDER

ATTEMPT_PREFIX = "job-"
CLAIMING_PREFIX = ".claiming-"
# A folder still under its claiming name this long after creation belongs to a process that died mid-claim.
CLAIMING_GRACE_SECONDS = 60.0
# Names that live beside job folders under a model's prefix; a job must never write into them.
RESERVED_JOB_IDS = frozenset({CHECKPOINTS_FOLDER})
MAX_SAFE_ID_CHARS = 64


def safe_job_id(job_id: object) -> str:
    """A folder and key segment for any JSON value RunPod's `id` may hold (a string, number, list, null).

    Letters, digits, `_` and `-` pass through; anything else, or a cut to MAX_SAFE_ID_CHARS, also gets a short
    hash of the whole id, so two different ids never share a storage folder. No id gives a random one."""
    if job_id is None or job_id == "":
        return uuid.uuid4().hex
    text = job_id if isinstance(job_id, str) else json.dumps(job_id, sort_keys=True, default=str)
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", text[: MAX_SAFE_ID_CHARS * 4])[:MAX_SAFE_ID_CHARS].strip("-")
    if cleaned != text or not isinstance(job_id, str):
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        cleaned = f"{cleaned[: MAX_SAFE_ID_CHARS - 13]}-{digest}".strip("-")
    if cleaned in RESERVED_JOB_IDS:
        cleaned = f"job-{cleaned}"
    return cleaned


@dataclass
class JobAttempt:
    """`<work_root>/job-<safe id>-<attempt>`: one run's own folder, locked (flock) for as long as the run lives.

    Two runs with the same job id get different folders, and a folder is removed by someone else only once no
    live process holds its lock (the kernel releases it when the owner dies, however it dies)."""

    path: Path
    lock_fd: int

    @property
    def name(self) -> str:
        return self.path.name

    def remove(self, swap_root: Path | None = None) -> None:
        """Delete the run's DeepSpeed swap folder under `swap_root` (the NVMe offload path, when set) and the
        folder, then let go of it (in that order: nobody else may clean it while it goes)."""
        if swap_root is not None:
            shutil.rmtree(job_swap_dir(swap_root, self.name), ignore_errors=True)
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def _lock_folder(path: Path, *, wait: bool) -> int | None:
    """An exclusive flock on the folder itself; None when a live process holds it (or it is gone)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def claim_attempt_dir(work_root: Path, safe_id: str) -> JobAttempt:
    """Create and lock this run's folder. It is locked under a claiming name and only then renamed into
    place, so a folder named `job-*` is never seen unlocked while its run is alive."""
    try:
        work_root.mkdir(parents=True, exist_ok=True)
        claiming = Path(tempfile.mkdtemp(prefix=CLAIMING_PREFIX, dir=work_root))
        descriptor = _lock_folder(claiming, wait=True)
        if descriptor is None:
            raise OSError(f"cannot lock {claiming}")
        target = work_root / f"{ATTEMPT_PREFIX}{safe_id}-{uuid.uuid4().hex[:12]}"
        os.rename(claiming, target)
    except OSError as error:
        raise FluxboothError(
            ErrorCode.INTERNAL,
            f"the work directory {work_root} cannot be used ({error.strerror or error}); "
            "set FLUXBOOTH_WORK_DIR to a writable directory",
        ) from error
    return JobAttempt(target, descriptor)


def attempt_is_live(work_root: Path, attempt_name: str) -> bool:
    descriptor = _lock_folder(work_root / attempt_name, wait=False)
    if descriptor is None:
        return (work_root / attempt_name).is_dir()
    os.close(descriptor)
    return False


def remove_stale_attempt_dirs(work_root: Path) -> list[Path]:
    """Remove the folders of runs that are gone (crashed, killed, an older worker's): only folders whose lock
    no live process holds, and claiming folders left by a process that died within its claim."""
    removed: list[Path] = []
    if not work_root.is_dir():
        return removed
    for entry in sorted(work_root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name.startswith(ATTEMPT_PREFIX):
            descriptor = _lock_folder(entry, wait=False)
            if descriptor is None:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            os.close(descriptor)
            removed.append(entry)
        elif entry.name.startswith(CLAIMING_PREFIX) and _age_seconds(entry) > CLAIMING_GRACE_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _age_seconds(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


SWAP_FOLDER_PREFIX = "fluxbooth-swap-"


def job_swap_dir(nvme_root: Path, attempt_name: str) -> Path:
    """This run's own DeepSpeed swap folder under the NVMe offload path (named after its attempt folder)."""
    return nvme_root / f"{SWAP_FOLDER_PREFIX}{attempt_name}"


def remove_stale_swap_dirs(nvme_root: Path, is_live: Callable[[str], bool] = lambda attempt_name: False) -> list[Path]:
    """Remove swap folders that killed or crashed runs left behind (swap files of a dead run fill the disk and
    crash a resume that reads them); a folder whose run `is_live` (by its attempt name) is kept."""
    removed = []
    if nvme_root.is_dir():
        for folder in nvme_root.glob(f"{SWAP_FOLDER_PREFIX}*"):
            if is_live(folder.name[len(SWAP_FOLDER_PREFIX) :]):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
