"""The doctor's checks of the container's limits (job/doctor/machine.py): the locked-memory limit and /dev/shm,
each with its numbers, and a warning where they are small for what this worker is set up to do."""

from __future__ import annotations

from dataclasses import replace

from fluxbooth.host.container_limits import ContainerLimits
from fluxbooth.host.hardware import GIB, MIB, Hardware, hypothetical_hardware
from fluxbooth.job.doctor import OK, WARN, check_locked_memory, check_shared_memory

KIB = 1024


def machine(limits: ContainerLimits, *, gpus: int = 1, nvme_path: str | None = None) -> Hardware:
    hardware = hypothetical_hardware(
        gpus=gpus, gpu_memory_bytes=80 * GIB, host_memory_bytes=256 * GIB, disk_bytes=500 * GIB, nvme_path=nvme_path
    )
    return replace(hardware, container=limits)


def test_a_small_locked_memory_limit_warns_where_nvme_offload_is_set_up() -> None:
    result = check_locked_memory(machine(ContainerLimits(64 * KIB, 64 * KIB, False, GIB, GIB), nvme_path="/nvme"))
    assert result.status == WARN
    assert result.detail == (
        "soft 64.0 KiB, hard 64.0 KiB; DeepSpeed's NVMe offload locks ≈953.7 MiB and more of swap buffers: NVMe "
        "plans are dropped; raise the container's locked-memory limit (docker run --ulimit memlock=-1)"
    )
    assert result.values == {
        "memlock_soft_bytes": 64 * KIB,
        "memlock_hard_bytes": 64 * KIB,
        "ipc_lock_capability": False,
    }


def test_a_small_locked_memory_limit_without_nvme_offload_is_only_noted() -> None:
    result = check_locked_memory(machine(ContainerLimits(8 * MIB, 8 * MIB, False, GIB, GIB)))
    assert result.status == OK
    assert result.detail.endswith("(no FLUXBOOTH_NVME_PATH: not used here)")


def test_an_unlimited_hard_limit_is_ok_and_reported_as_null() -> None:
    result = check_locked_memory(machine(ContainerLimits(8 * MIB, None, False, GIB, GIB), nvme_path="/nvme"))
    assert (result.status, result.detail) == (OK, "soft 8.0 MiB, hard unlimited")
    assert result.to_dict()["values"] == {
        "memlock_soft_bytes": 8 * MIB,
        "memlock_hard_bytes": None,
        "ipc_lock_capability": False,
    }


def test_cap_ipc_lock_makes_any_limit_ok() -> None:
    result = check_locked_memory(machine(ContainerLimits(64 * KIB, 64 * KIB, True, GIB, GIB), nvme_path="/nvme"))
    assert (result.status, result.detail) == (OK, "soft 64.0 KiB, hard 64.0 KiB (CAP_IPC_LOCK: not enforced)")


def test_a_small_shm_warns_with_several_gpus() -> None:
    result = check_shared_memory(machine(ContainerLimits(None, None, False, 64 * MIB, 60 * MIB), gpus=2))
    assert result.status == WARN
    assert result.detail == (
        "60.0 MiB free of 64.0 MiB; below the 1.0 GiB NCCL's shared-memory transport needs between GPUs: the "
        "trainer runs with NCCL_SHM_DISABLE=1; give the container a larger /dev/shm (docker run --shm-size=1g)"
    )
    assert result.values == {"shm_total_bytes": 64 * MIB, "shm_free_bytes": 60 * MIB}


def test_a_small_shm_with_one_gpu_is_only_noted() -> None:
    result = check_shared_memory(machine(ContainerLimits(None, None, False, 64 * MIB, 64 * MIB), gpus=1))
    assert result.status == OK
    assert result.detail.endswith("(one GPU: not used here)")


def test_a_large_shm_is_ok() -> None:
    result = check_shared_memory(machine(ContainerLimits(None, None, False, 16 * GIB, 16 * GIB), gpus=8))
    assert (result.status, result.detail) == (OK, "16.0 GiB free of 16.0 GiB")
