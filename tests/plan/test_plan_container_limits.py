"""The container's limits in the plan (plan/container_limits.py): an NVMe plan whose locked swap buffers exceed
RLIMIT_MEMLOCK is dropped, naming the numbers and the fix, or kept when the hard limit allows them (the trainer
raises the soft one); several GPUs on a small /dev/shm run with NCCL_SHM_DISABLE=1.

The limits are set on hypothetical hardware, but for the last test, which lowers this process's real limit in a
child process and plans there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli.exits import EXIT_FAILED
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.container_limits import ContainerLimits
from fluxbooth.host.hardware import GIB, MIB, Hardware
from fluxbooth.job.launch_files import child_environment
from fluxbooth.plan import choose_plan, evaluate_candidates, model_size
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec
from fluxbooth.sizing import FLUX_DEV_NAME
from tests.support.specs import gpu_machine, job_spec

KIB = 1024
# DeepSpeed's offload_optimizer swap buffers for FLUX.1-dev: 4 fp32 buffers of one 1e9-element sub-group.
FLUX_OPTIMIZER_SWAP_BUFFERS = "≈14.9 GiB"


def request_spec(**fields: Any) -> JobSpec:
    """A FLUX.1-dev full fine-tune at 1024x1024 (AdamW) with request `fields`, resolved as the worker resolves it."""
    request = {
        "model_name": "m",
        "dataset_url": "https://example.com/d.zip",
        "instance_prompt": "a photo of sks person",
        "training_type": "full",
        "optimizer": "adamw",
        **fields,
    }
    return job_spec(parse_request(request), model_size(FLUX_DEV_NAME))


def limited(hardware: Hardware, soft: int | None, hard: int | None, *, shm: int = 64 * MIB) -> Hardware:
    """`hardware` in a container with this RLIMIT_MEMLOCK (None: unlimited), without CAP_IPC_LOCK."""
    return replace(hardware, container=ContainerLimits(soft, hard, False, shm, shm))


@pytest.fixture
def nvme_machine() -> Hardware:
    """An 80 GiB card with 256 GiB host RAM and an NVMe offload path."""
    return replace(gpu_machine(80, 256, disk_gib=2000), nvme_path="/nvme", nvme_free_bytes=2000 * GIB)


def nvme_candidate_reason(hardware: Hardware) -> str:
    candidates = evaluate_candidates(request_spec(offload="nvme", zero_stage=3), hardware, model_size(FLUX_DEV_NAME))
    nvme = next(
        c
        for c in candidates
        if c.honours_request and (c.strategy.offload_optimizer, c.strategy.offload_param) == ("nvme", "none")
    )
    return nvme.reason


def test_an_nvme_plan_above_the_locked_memory_limit_is_dropped_naming_the_numbers_and_the_fix(
    nvme_machine: Hardware,
) -> None:
    assert nvme_candidate_reason(limited(nvme_machine, 64 * KIB, 64 * KIB)) == (
        f"its NVMe swap buffers lock {FLUX_OPTIMIZER_SWAP_BUFFERS} of host memory per process (mlock), above the "
        "container's locked-memory limit (64.0 KiB soft, 64.0 KiB hard); raise the container's locked-memory limit "
        "(docker run --ulimit memlock=-1), or use offload 'cpu'"
    )


def test_a_requested_nvme_offload_above_the_limit_is_refused_with_that_reason(nvme_machine: Hardware) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(
            request_spec(offload="nvme", zero_stage=3),
            limited(nvme_machine, 8 * MIB, 8 * MIB),
            model_size(FLUX_DEV_NAME),
        )
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "above the container's locked-memory limit (8.0 MiB soft, 8.0 MiB hard)" in caught.value.message


def test_an_nvme_plan_the_hard_limit_allows_is_kept_and_the_trainer_raises_the_soft_limit(
    nvme_machine: Hardware,
) -> None:
    plan = choose_plan(
        request_spec(offload="nvme", zero_stage=3), limited(nvme_machine, 64 * KIB, None), model_size(FLUX_DEV_NAME)
    )
    assert plan.offload_optimizer == "nvme"
    assert plan.warnings == (
        f"locked memory: the NVMe swap buffers lock {FLUX_OPTIMIZER_SWAP_BUFFERS} per process, above the soft "
        "RLIMIT_MEMLOCK (64.0 KiB); the trainer raises it to the hard limit (unlimited) at start",
    )


def test_cap_ipc_lock_keeps_an_nvme_plan_whatever_the_limit(nvme_machine: Hardware) -> None:
    exempt = replace(nvme_machine, container=ContainerLimits(64 * KIB, 64 * KIB, True, GIB, GIB))
    plan = choose_plan(request_spec(offload="nvme", zero_stage=3), exempt, model_size(FLUX_DEV_NAME))
    assert (plan.offload_optimizer, plan.warnings) == ("nvme", ())


def test_an_unlimited_container_keeps_an_nvme_plan_without_a_note(nvme_machine: Hardware) -> None:
    plan = choose_plan(
        request_spec(offload="nvme", zero_stage=3), limited(nvme_machine, None, None), model_size(FLUX_DEV_NAME)
    )
    assert (plan.offload_optimizer, plan.warnings) == ("nvme", ())


def lora_plan_environment(hardware: Hardware) -> tuple[tuple[str, ...], dict[str, str]]:
    plan = choose_plan(request_spec(training_type="lora"), hardware, model_size(FLUX_DEV_NAME))
    env = child_environment(plan, {}, cpu_count=16, torch_extensions_dir=Path("/ops"))
    return plan.warnings, env


def test_two_gpus_on_a_small_shm_run_without_nccls_shared_memory_transport() -> None:
    warnings, env = lora_plan_environment(limited(gpu_machine(80, 256, gpus=2), None, None, shm=64 * MIB))
    assert env["NCCL_SHM_DISABLE"] == "1"
    assert warnings == (
        "NCCL: 64.0 MiB free in /dev/shm, below the 1.0 GiB its shared-memory transport needs between 2 GPUs; the "
        "trainer runs with NCCL_SHM_DISABLE=1 (P2P or sockets instead); give the container a larger /dev/shm "
        "(docker run --shm-size=1g)",
    )


def test_one_gpu_on_a_small_shm_keeps_nccls_defaults() -> None:
    warnings, env = lora_plan_environment(limited(gpu_machine(80, 256, gpus=1), None, None, shm=64 * MIB))
    assert "NCCL_SHM_DISABLE" not in env
    assert warnings == ()


def test_two_gpus_on_a_large_shm_keep_nccls_defaults() -> None:
    warnings, env = lora_plan_environment(limited(gpu_machine(80, 256, gpus=2), None, None, shm=2 * GIB))
    assert "NCCL_SHM_DISABLE" not in env
    assert warnings == ()


# Lowers RLIMIT_MEMLOCK to 64 KiB, drops CAP_IPC_LOCK (which lifts the limit for root) from the bounding set so
# the exec'd planner starts without it, as in a normal container, then plans an NVMe job for this machine.
LOWERED_LIMIT_CHILD = textwrap.dedent(
    """
    import ctypes, os, resource, sys
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
    PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
        sys.exit(77)
    os.execv(sys.executable, [sys.executable, "-m", "fluxbooth", "plan", *sys.argv[1:]])
    """
)


def test_a_process_with_a_lowered_locked_memory_limit_is_refused_its_nvme_job(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    arguments = ["--base-model", "fluxbooth/tiny-flux", "--training-type", "full", "--offload", "nvme"]
    arguments += ["--zero-stage", "3", "--nvme-path", str(nvme), "--resolution", "64x64", "--json"]
    completed = subprocess.run(
        [sys.executable, "-c", LOWERED_LIMIT_CHILD, *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"), "HF_HUB_OFFLINE": "1"},
        timeout=300,
        check=False,
    )
    if completed.returncode == 77:
        pytest.skip("this root process cannot drop CAP_IPC_LOCK (no CAP_SETPCAP)")
    error = json.loads(completed.stdout)["error"]
    assert completed.returncode == EXIT_FAILED
    assert error["code"] == "does_not_fit"
    assert "above the container's locked-memory limit (64.0 KiB soft, 64.0 KiB hard)" in error["message"]
