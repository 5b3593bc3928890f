"""`python -m fluxbooth doctor`: is this machine ready to train?

Everything the reference guide's test_deepspeed.py checked (DeepSpeed installed with compatible
ops, accelerate's DeepSpeed support, CUDA and bf16, config files written and re-read, the
environment the plan sets), plus host RAM, disk, the base model's presence and the bucket.

torch, DeepSpeed and accelerate are only ever imported in a child process (`python -m
fluxbooth.job.doctor --runtime-probe ...`), run with the environment the plan gives the trainer: a
broken CUDA install cannot take the doctor down with it, and the probe sees what the trainer
will see.

- `results`: what a check finds; `checkup`: every check in order (`run_doctor`, `worker_start_checks`);
- `runtime`: the probe's child process (`__main__`) and what it says of CUDA, DeepSpeed and accelerate;
- `machine`: host RAM, disk, locked memory and /dev/shm, the base model, the bucket; `configs`: the files and
  environment the plan writes.
"""

from fluxbooth.job.doctor.checkup import (
    NOT_CHECKED_AT_WORKER_START,
    DoctorOptions,
    doctor_passed,
    run_doctor,
    worker_start_checks,
)
from fluxbooth.job.doctor.configs import (
    check_environment,
    write_and_reread_configs,
)
from fluxbooth.job.doctor.machine import (
    BUCKET_TIMEOUT_SECONDS,
    MIN_DISK_BYTES,
    MIN_HOST_BYTES,
    check_base_model,
    check_bucket,
    check_disk,
    check_host_memory,
    check_locked_memory,
    check_shared_memory,
    resolved_base_model,
)
from fluxbooth.job.doctor.results import (
    FAIL,
    OK,
    SKIP,
    WARN,
    CheckResult,
)
from fluxbooth.job.doctor.runtime import (
    RUNTIME_PROBE_TIMEOUT_SECONDS,
    STALE_OP_LOCK_SECONDS,
    check_accelerate,
    check_deepspeed,
    check_gpu,
    clear_stale_op_locks,
    run_runtime_probe,
)

__all__ = [
    "BUCKET_TIMEOUT_SECONDS",
    "CheckResult",
    "DoctorOptions",
    "FAIL",
    "MIN_DISK_BYTES",
    "MIN_HOST_BYTES",
    "NOT_CHECKED_AT_WORKER_START",
    "OK",
    "RUNTIME_PROBE_TIMEOUT_SECONDS",
    "SKIP",
    "STALE_OP_LOCK_SECONDS",
    "WARN",
    "check_accelerate",
    "check_base_model",
    "check_bucket",
    "check_deepspeed",
    "check_disk",
    "check_locked_memory",
    "check_shared_memory",
    "check_environment",
    "check_gpu",
    "check_host_memory",
    "clear_stale_op_locks",
    "doctor_passed",
    "resolved_base_model",
    "run_doctor",
    "run_runtime_probe",
    "worker_start_checks",
    "write_and_reread_configs",
]
