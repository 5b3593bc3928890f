"""host/container_limits.py: the locked-memory limit and /dev/shm, read as the container has them.

/dev/shm is any directory here (its filesystem's numbers are what statvfs reports); /proc/self/status is built
under tmp_path for CAP_IPC_LOCK; RLIMIT_MEMLOCK is this process's own.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from fluxbooth.host.container_limits import (
    ASSUMED_CONTAINER_LIMITS,
    ContainerLimits,
    limit_bytes,
    parse_ipc_lock_capability,
    raised_soft_limit,
    read_container_limits,
)
from fluxbooth.host.hardware import GIB, MIB, hypothetical_hardware

# CapEff of a root process with every capability (CAP_IPC_LOCK, bit 14, among them) and of Docker's default set.
ALL_CAPABILITIES = "CapEff:\t000001ffffffffff\n"
DOCKER_DEFAULT_CAPABILITIES = "CapEff:\t00000000a80425fb\n"


def status_root(root: Path, status: str) -> Path:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "status").write_text(f"Name:\tpython\n{status}")
    return root


def test_the_size_of_shm_is_read_from_the_directory_given(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    limits = read_container_limits(tmp_path, shm)
    stats = os.statvfs(shm)
    assert limits.shm_total_bytes == stats.f_blocks * stats.f_frsize
    assert limits.shm_free_bytes == pytest.approx(stats.f_bavail * stats.f_frsize, rel=0.01)


def test_a_missing_shm_has_no_size(tmp_path: Path) -> None:
    limits = read_container_limits(tmp_path, tmp_path / "no-shm")
    assert (limits.shm_total_bytes, limits.shm_free_bytes) == (None, None)


def test_the_locked_memory_limit_is_this_processs_own(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limits = read_container_limits(tmp_path, tmp_path)
    assert (limits.memlock_soft_bytes, limits.memlock_hard_bytes) == (limit_bytes(soft), limit_bytes(hard))


def test_an_unlimited_limit_is_none() -> None:
    assert limit_bytes(resource.RLIM_INFINITY) is None
    assert limit_bytes(64 * 1024) == 64 * 1024


@pytest.mark.parametrize(
    ("status", "exempt"),
    [(ALL_CAPABILITIES, True), (DOCKER_DEFAULT_CAPABILITIES, False)],
    ids=["root with every capability", "docker default"],
)
def test_cap_ipc_lock_is_read_from_the_effective_capabilities(tmp_path: Path, status: str, exempt: bool) -> None:
    assert read_container_limits(status_root(tmp_path, status), tmp_path).ipc_lock_capability is exempt


def test_an_unreadable_status_grants_no_capability() -> None:
    assert parse_ipc_lock_capability("CapEff:\tnot-hex\n") is False
    assert parse_ipc_lock_capability("") is False


def test_cap_ipc_lock_lifts_the_limit_a_process_may_lock() -> None:
    exempt = ContainerLimits(64 * 1024, 64 * 1024, True, None, None)
    assert exempt.lockable_bytes is None
    assert not exempt.needs_raised_soft_limit(GIB)


def test_a_soft_limit_below_the_hard_one_is_raised_to_it() -> None:
    assert raised_soft_limit(64 * 1024, 8 * MIB) == (8 * MIB, 8 * MIB)
    assert raised_soft_limit(8 * MIB, 8 * MIB) is None


def test_hypothetical_hardware_assumes_a_normal_runpod_container() -> None:
    hardware = hypothetical_hardware(gpus=1, gpu_memory_bytes=80 * GIB, host_memory_bytes=256 * GIB, disk_bytes=GIB)
    assert hardware.container == ASSUMED_CONTAINER_LIMITS
    assert hardware.container == ContainerLimits(8 * MIB, 8 * MIB, False, 64 * MIB, 64 * MIB)
    assert hardware.to_dict()["container_limits"]["memlock_soft_bytes"] == 8 * MIB
