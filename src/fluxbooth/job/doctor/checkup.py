"""Every check of the doctor in the order a person reads them (`run_doctor`), and the subset a worker runs
before it takes a job (`worker_start_checks`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import Hardware, probe_hardware
from fluxbooth.job.doctor.configs import check_environment, write_and_reread_configs
from fluxbooth.job.doctor.machine import (
    check_base_model,
    check_bucket,
    check_disk,
    check_host_memory,
    check_locked_memory,
    check_shared_memory,
    resolved_base_model,
)
from fluxbooth.job.doctor.results import FAIL, OK, CheckResult
from fluxbooth.job.doctor.runtime import (
    RUNTIME_PROBE_TIMEOUT_SECONDS,
    check_accelerate,
    check_deepspeed,
    check_gpu,
    clear_stale_op_locks,
    run_runtime_probe,
)
from fluxbooth.job.launch_files import child_environment
from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.plan import JobShape, Plan, choose_plan, model_size
from fluxbooth.settings import WorkerSettings


@dataclass(frozen=True)
class DoctorOptions:
    allow_cpu: bool = False
    build_ops: bool = False
    probe_timeout_seconds: int = RUNTIME_PROBE_TIMEOUT_SECONDS


def _reference_plan(hardware: Hardware, settings: WorkerSettings) -> tuple[Any, str]:
    """The plan a default job would get here, else the guide's ZeRO-2 CPU-offload plan."""
    job = JobShape(resolution=(512, 512) if hardware.accelerator == "cpu" else (1024, 1024), steps=10)
    try:
        model = model_size(resolved_base_model(settings) or settings.default_base_model)
        return choose_plan(job, hardware, model), "the plan a default job gets on this machine"
    except FluxboothError as error:
        why = (
            "the default job does not fit here"
            if error.code is ErrorCode.DOES_NOT_FIT
            else "the base model cannot be sized here"
        )
        on_cpu = hardware.accelerator == "cpu"
        fallback = Plan(
            accelerator="cpu" if on_cpu else "cuda",
            num_processes=1 if on_cpu else max(1, hardware.gpu_count),
            training_type="full",
            use_deepspeed=True,
            zero_stage=2,
            offload_optimizer="cpu",
            offload_param="none",
            mixed_precision="bf16",
            gradient_checkpointing=True,
            optimizer="DeepSpeedCPUAdam",
            predicted_gpu_bytes=0,
            predicted_host_bytes=0,
            predicted_disk_bytes=0,
        )
        return fallback, f"the guide's ZeRO-2 CPU-offload plan ({why})"


def run_doctor(
    environ: Mapping[str, str],
    options: DoctorOptions,
    *,
    probe: Callable[..., dict[str, Any]] = run_runtime_probe,
) -> list[CheckResult]:
    """Every check, in the order a person reads them. `probe` is the child-process runner."""
    settings = WorkerSettings.from_environ(environ)
    work_dir = settings.work_root
    hardware = probe_hardware(work_dir, environ)
    plan, plan_source = _reference_plan(hardware, settings)
    extensions = extensions_dir(settings)
    child_env = child_environment(
        plan, environ, cpu_count=hardware.cpu_count, torch_extensions_dir=extensions, debug=False
    )
    results = [
        CheckResult(
            "plan",
            OK,
            f"{plan_source}: ZeRO-{plan.zero_stage}, offload optimizer {plan.offload_optimizer}, "
            f"parameters {plan.offload_param}, {plan.mixed_precision}, accelerator {plan.accelerator}",
        )
    ]
    # Before the probe, which loads the ops and would wait on a stale lock.
    results.append(clear_stale_op_locks(extensions, time.time()))
    with tempfile.TemporaryDirectory(prefix="fluxbooth-doctor-") as temporary:
        job_dir = Path(temporary)
        results.append(write_and_reread_configs(plan, job_dir, work_dir))
        results.append(check_environment(plan, child_env))
        report = probe(
            job_dir / "config",
            child_env,
            need_cpu_adam=plan.offload_optimizer != "none",
            need_aio="nvme" in (plan.offload_optimizer, plan.offload_param),
            build_ops=options.build_ops,
            timeout=options.probe_timeout_seconds,
        )
    results.extend(check_deepspeed(report, plan))
    results.append(
        check_accelerate(report, plan)
        if "deepspeed_error" not in report
        else CheckResult("accelerate", FAIL, "skipped: DeepSpeed did not import")
    )
    results.append(check_gpu(hardware, report, options.allow_cpu))
    results.append(check_host_memory(hardware, plan))
    results.append(check_disk(hardware))
    results.append(check_locked_memory(hardware))
    results.append(check_shared_memory(hardware))
    results.append(check_base_model(settings))
    results.append(check_bucket(settings))
    return results


def doctor_passed(results: list[CheckResult]) -> bool:
    return all(result.status != FAIL for result in results)


# Not a reason to stop a worker at start: a missing base model may still be downloaded by the first job
# (which refuses in seconds, naming where it looked, when it cannot be).
NOT_CHECKED_AT_WORKER_START = frozenset({"base model"})


def worker_start_checks(
    environ: Mapping[str, str], *, probe: Callable[..., dict[str, Any]] = run_runtime_probe
) -> list[CheckResult]:
    """The doctor's checks that show a broken worker before it takes a job: its settings and bucket, torch,
    CUDA when the machine has GPUs, DeepSpeed and its ops, accelerate, host RAM and disk. A machine without
    any GPU is not failed here (the planner refuses its jobs, naming why)."""
    try:
        WorkerSettings.from_environ(environ)
    except ValueError as error:
        return [CheckResult("worker settings", FAIL, f"{error}; fix the endpoint's environment variables")]
    results = run_doctor(environ, DoctorOptions(allow_cpu=True), probe=probe)
    return [result for result in results if result.name not in NOT_CHECKED_AT_WORKER_START]
