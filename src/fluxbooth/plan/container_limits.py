"""The container's limits as the planner weighs them (fluxbooth.host.container_limits reads them): an NVMe plan
whose locked swap buffers exceed what RLIMIT_MEMLOCK lets a process lock is dropped, one the soft limit alone
stops runs with the soft limit raised by the trainer; several GPUs on a small /dev/shm run without NCCL's
shared-memory transport. No torch here.
"""

from __future__ import annotations

from fluxbooth.host.container_limits import MEMLOCK_FIX, NCCL_SHM_MIN_BYTES, SHM_FIX
from fluxbooth.host.hardware import Hardware
from fluxbooth.messages import format_bytes
from fluxbooth.plan.types import MemoryEstimate

# The breakdown's terms DeepSpeed allocates with mlock (new_cpu_locked_tensor), per process: the NVMe swap buffers
# (plan/memory/model_states.py).
LOCKED_TERMS = ("host.param_swap_buffers", "host.optimizer_swap_buffers")


def locked_bytes(estimate: MemoryEstimate) -> int:
    """The bytes one process locks with mlock for its NVMe swap buffers (0 without NVMe offload)."""
    return int(sum(estimate.breakdown.get(term, 0) for term in LOCKED_TERMS))


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else format_bytes(value)


def memlock_problem(estimate: MemoryEstimate, hardware: Hardware) -> str:
    """Why an NVMe plan cannot lock its swap buffers in this container; empty when it can (the hard limit
    allows them: the trainer raises the soft one)."""
    locked = locked_bytes(estimate)
    allowed = hardware.container.lockable_bytes
    if not locked or allowed is None or locked <= allowed:
        return ""
    limits = hardware.container
    return (
        f"its NVMe swap buffers lock ≈{format_bytes(locked)} of host memory per process (mlock), above the "
        f"container's locked-memory limit ({_limit(limits.memlock_soft_bytes)} soft, "
        f"{_limit(limits.memlock_hard_bytes)} hard); {MEMLOCK_FIX}, or use offload 'cpu'"
    )


def memlock_ratio(estimate: MemoryEstimate, hardware: Hardware) -> float | None:
    """Locked bytes over what a process may lock (above 1 is short); None when nothing is locked or no limit applies."""
    locked = locked_bytes(estimate)
    allowed = hardware.container.lockable_bytes
    if not locked or allowed is None:
        return None
    return locked / max(1, allowed)


def nccl_shm_disabled(hardware: Hardware, processes: int) -> bool:
    """Several processes on a /dev/shm below NCCL_SHM_MIN_BYTES (or none): NCCL must not use shared memory."""
    free = hardware.container.shm_free_bytes
    return processes > 1 and (free is None or free < NCCL_SHM_MIN_BYTES)


def container_notes(estimate: MemoryEstimate, hardware: Hardware, processes: int) -> list[str]:
    """The plan's lines about the container's limits: the soft limit the trainer raises, NCCL without /dev/shm."""
    notes = []
    locked = locked_bytes(estimate)
    limits = hardware.container
    if locked and limits.needs_raised_soft_limit(locked):
        notes.append(
            f"locked memory: the NVMe swap buffers lock ≈{format_bytes(locked)} per process, above the soft "
            f"RLIMIT_MEMLOCK ({_limit(limits.memlock_soft_bytes)}); the trainer raises it to the hard limit "
            f"({_limit(limits.memlock_hard_bytes)}) at start"
        )
    if nccl_shm_disabled(hardware, processes):
        shm = (
            "no /dev/shm"
            if limits.shm_free_bytes is None
            else f"{format_bytes(limits.shm_free_bytes)} free in /dev/shm"
        )
        notes.append(
            f"NCCL: {shm}, below the {format_bytes(NCCL_SHM_MIN_BYTES)} its shared-memory transport needs between "
            f"{processes} GPUs; the trainer runs with NCCL_SHM_DISABLE=1 (P2P or sockets instead); {SHM_FIX}"
        )
    return notes
