"""A DeepSpeed op build killed mid-way leaves `<TORCH_EXTENSIONS_DIR>/<op>/lock` (torch.utils.file_baton), and
every later load of that op waits on it forever: the worker's start check (the doctor) reports a lock older
than a build takes and removes it, before its probe loads any op."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fluxbooth.job.doctor import FAIL, OK, STALE_OP_LOCK_SECONDS, WARN, DoctorOptions, clear_stale_op_locks, run_doctor


def lock_file(extensions: Path, op: str, age_seconds: float) -> Path:
    """The lock torch's JIT build holds while it compiles `op`, last touched `age_seconds` ago."""
    lock = extensions / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_seconds
    os.utime(lock, (then, then))
    return lock


def test_a_lock_older_than_a_build_takes_is_reported_and_removed(tmp_path: Path) -> None:
    lock = lock_file(tmp_path, "cpu_adam", STALE_OP_LOCK_SECONDS + 60)

    result = clear_stale_op_locks(tmp_path, time.time())

    assert not lock.exists()
    assert (result.name, result.status) == ("op build locks", WARN)
    assert result.detail == f"removed 1 op-build lock(s) older than 30 min, left by a killed build: {lock}"


def test_a_lock_of_a_build_in_progress_is_left_alone(tmp_path: Path) -> None:
    lock = lock_file(tmp_path, "async_io", 60)

    result = clear_stale_op_locks(tmp_path, time.time())

    assert lock.exists()
    assert (result.status, result.detail) == (OK, f"no lock older than 30 min in {tmp_path}")


def test_a_stale_lock_that_cannot_be_removed_fails_the_check(tmp_path: Path) -> None:
    lock = lock_file(tmp_path, "cpu_lion", STALE_OP_LOCK_SECONDS + 60)
    lock.parent.chmod(0o500)
    try:
        result = clear_stale_op_locks(tmp_path, time.time())
    finally:
        lock.parent.chmod(0o700)

    if os.geteuid() == 0:  # root removes it regardless of the folder's mode
        assert result.status == WARN and not lock.exists()
    else:
        assert result.status == FAIL and lock.exists()
        assert result.detail.startswith(f"cannot remove the stale op-build lock {lock}: Permission denied")


def test_the_doctor_clears_a_stale_lock_before_its_probe_loads_the_ops(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    lock = lock_file(extensions, "cpu_adam", STALE_OP_LOCK_SECONDS + 60)
    seen_by_probe: list[bool] = []

    def probe(*_: object, **__: object) -> dict[str, str]:
        # Records what the real probe (a child process loading the ops) would have found.
        seen_by_probe.append(lock.exists())
        return {"torch_error": "not imported in this test"}

    environ = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "FLUXBOOTH_BASE_MODEL": "fluxbooth/tiny-flux",
        "HF_HUB_OFFLINE": "1",
    }
    results = run_doctor(environ, DoctorOptions(allow_cpu=True), probe=probe)

    locks = next(result for result in results if result.name == "op build locks")
    assert locks.status == WARN and str(lock) in locks.detail
    assert seen_by_probe == [False]
