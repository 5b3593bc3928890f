"""The container's limits that kill GPU jobs without looking like a limit: the locked-memory limit and /dev/shm.

- DeepSpeed's NVMe offload allocates its swap buffers with `new_cpu_locked_tensor` (csrc/pin_memory/page_alloc.cpp:
  posix_memalign, then mlock), which RLIMIT_MEMLOCK caps unless the process holds CAP_IPC_LOCK. Containers start
  with 64 KiB to 8 MiB, and the failure reads "Cannot allocate memory", like the host running out of RAM.
- NCCL's shared-memory transport (several GPUs on one machine) creates its buffers in /dev/shm; Docker's
  default 64 MiB fails with "failed to extend /dev/shm/nccl-...".

`read_container_limits` is the thin reader (the paths are arguments so tests point them at a tmp dir); the rest
is pure. No torch here.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# CAP_IPC_LOCK's bit in /proc/self/status's CapEff (linux/capability.h): mlock ignores RLIMIT_MEMLOCK with it.
CAP_IPC_LOCK_BIT = 14
# /dev/shm below this is too small for NCCL's shared-memory transport between GPUs: NCCL's troubleshooting guide
# asks containers for `--shm-size=1g`, and each pair of GPUs takes several of its 4 MiB buffers per channel
# (NCCL_BUFFSIZE), so 8 GPUs reach hundreds of MiB. Below it the trainer runs with NCCL_SHM_DISABLE=1 (P2P or
# sockets between the GPUs instead).
NCCL_SHM_MIN_BYTES = 1024**3
# The smallest swap buffers DeepSpeed's NVMe offload locks for a FLUX transformer: offload_param's 5 buffers of
# 100M 16-bit elements (contract/deepspeed_numbers.py), ≈0.93 GiB. A limit below it is "small" for the doctor.
NVME_LOCKED_MEMORY_HINT_BYTES = 1_000_000_000
# What the docs and refusals tell a person to do about each.
MEMLOCK_FIX = "raise the container's locked-memory limit (docker run --ulimit memlock=-1)"
SHM_FIX = "give the container a larger /dev/shm (docker run --shm-size=1g)"


@dataclass(frozen=True)
class ContainerLimits:
    """RLIMIT_MEMLOCK (None: unlimited), whether CAP_IPC_LOCK exempts this process from it, and /dev/shm's
    size and free space (None: no /dev/shm to read)."""

    memlock_soft_bytes: int | None
    memlock_hard_bytes: int | None
    ipc_lock_capability: bool
    shm_total_bytes: int | None
    shm_free_bytes: int | None

    @property
    def lockable_bytes(self) -> int | None:
        """What one process may lock once the trainer has raised its soft limit to the hard one (None: no limit)."""
        return None if self.ipc_lock_capability else self.memlock_hard_bytes

    def needs_raised_soft_limit(self, locked_bytes: int) -> bool:
        """Whether locking `locked_bytes` needs the soft limit raised (the hard limit allowing it)."""
        if self.ipc_lock_capability or self.memlock_soft_bytes is None:
            return False
        return locked_bytes > self.memlock_soft_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# A hypothetical machine (`plan --runpod-gpu ...`) is planned as a normal RunPod container: RunPod sets neither a
# memlock ulimit nor CAP_IPC_LOCK, so the kernel's default RLIMIT_MEMLOCK applies (8 MiB since Linux 5.16,
# 64 KiB before: 8 MiB is the generous end, and either stops NVMe swap buffers), and /dev/shm is Docker's
# default 64 MiB. A real worker reads its own (`probe_hardware`).
ASSUMED_CONTAINER_LIMITS = ContainerLimits(
    memlock_soft_bytes=8 * 1024**2,
    memlock_hard_bytes=8 * 1024**2,
    ipc_lock_capability=False,
    shm_total_bytes=64 * 1024**2,
    shm_free_bytes=64 * 1024**2,
)


def limit_bytes(value: int) -> int | None:
    """A resource limit as getrlimit gives it, in bytes; None for RLIM_INFINITY."""
    return None if value == resource.RLIM_INFINITY or value < 0 else value


def parse_ipc_lock_capability(status_text: str) -> bool:
    """Whether /proc/self/status's CapEff holds CAP_IPC_LOCK."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split(":", 1)[1].strip(), 16) >> CAP_IPC_LOCK_BIT & 1)
            except ValueError:
                return False
    return False


def read_container_limits(root: Path = Path("/"), shm: Path = Path("/dev/shm")) -> ContainerLimits:
    """This process's RLIMIT_MEMLOCK and CAP_IPC_LOCK (from `root`/proc/self/status), and `shm`'s size."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        status = (root / "proc" / "self" / "status").read_text()
    except OSError:
        status = ""
    try:
        stats = os.statvfs(shm)
        total: int | None = stats.f_blocks * stats.f_frsize
        free: int | None = stats.f_bavail * stats.f_frsize
    except OSError:
        total = free = None
    return ContainerLimits(limit_bytes(soft), limit_bytes(hard), parse_ipc_lock_capability(status), total, free)


def raised_soft_limit(soft: int, hard: int) -> tuple[int, int] | None:
    """The (soft, hard) RLIMIT_MEMLOCK to set so this process may lock up to its hard limit; None: already so."""
    return None if soft == hard else (hard, hard)


def raise_locked_memory_limit() -> tuple[int, int] | None:
    """Raise this process's soft RLIMIT_MEMLOCK to its hard limit (the trainer, before DeepSpeed locks its NVMe
    swap buffers); what was set, or None when nothing changed or the kernel refused."""
    wanted = raised_soft_limit(*resource.getrlimit(resource.RLIMIT_MEMLOCK))
    if wanted is None:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, wanted)
    except (ValueError, OSError):
        return None  # the planner checked the hard limit; DeepSpeed's own error says the rest
    return wanted
