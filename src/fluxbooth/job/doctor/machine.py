"""The checks of what this worker has: host RAM, disk, the base model on it, the bucket it uploads to."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from botocore.exceptions import BotoCoreError, ClientError

from fluxbooth.errors import FluxboothError
from fluxbooth.host.container_limits import (
    MEMLOCK_FIX,
    NCCL_SHM_MIN_BYTES,
    NVME_LOCKED_MEMORY_HINT_BYTES,
    SHM_FIX,
)
from fluxbooth.host.hardware import GIB, Hardware
from fluxbooth.job.doctor.results import FAIL, OK, SKIP, WARN, CheckResult
from fluxbooth.messages import format_bytes
from fluxbooth.models.source import ModelPlaces, how_to_provide, local_model_folder, locate_hub_model
from fluxbooth.redaction import Redactor
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from fluxbooth.storage.s3 import S3Store
from fluxbooth.storage.stores import storage_problem

MIN_HOST_BYTES = 2 * GIB
MIN_DISK_BYTES = 2 * GIB
BUCKET_TIMEOUT_SECONDS = 10.0


def resolved_base_model(settings: WorkerSettings) -> str | None:
    """A local folder for the configured base model, or None when it is not on this machine."""
    name = settings.default_base_model
    if name == TINY_MODEL_NAME:
        return None
    folder = local_model_folder(name, None, settings.environ)
    return str(folder) if folder is not None else None


def check_base_model(settings: WorkerSettings) -> CheckResult:
    name = settings.default_base_model
    if name == TINY_MODEL_NAME:
        return CheckResult("base model", OK, f"{name}: built on demand from code, nothing to download")
    folder = resolved_base_model(settings)
    if folder is None and name.startswith("/"):
        return CheckResult("base model", FAIL, f"{name} is not on this machine (no transformer/config.json there)")
    if folder is None:
        places = ModelPlaces.from_environ(settings.environ)
        looked = "; ".join(look.describe() for look in locate_hub_model(name, None, places)[1])
        if places.offline:
            return CheckResult(
                "base model",
                FAIL,
                f"{name} is not on this machine and HF_HUB_OFFLINE=1. Looked in: {looked}. {how_to_provide(name)}",
            )
        return CheckResult(
            "base model",
            WARN,
            f"{name} is not on this machine: the first job downloads it into "
            f"{places.hub_cache} (HF_TOKEN for gated models). Looked in: {looked}",
        )
    weights = list((Path(folder) / "transformer").glob("*.safetensors"))
    if not weights:
        return CheckResult("base model", FAIL, f"{folder}/transformer has config.json but no .safetensors weights")
    size = sum(path.stat().st_size for path in weights)
    return CheckResult("base model", OK, f"{folder}: transformer weights {format_bytes(size)}")


def check_host_memory(hardware: Hardware, plan: Any) -> CheckResult:
    limit = (
        f" (cgroup limit {format_bytes(hardware.cgroup_memory_limit_bytes)})"
        if hardware.cgroup_memory_limit_bytes
        else ""
    )
    detail = (
        f"{format_bytes(hardware.host_available_bytes)} available of {format_bytes(hardware.host_total_bytes)}{limit}"
    )
    if hardware.host_available_bytes < MIN_HOST_BYTES:
        return CheckResult("host RAM", FAIL, detail + f"; at least {format_bytes(MIN_HOST_BYTES)} is needed")
    if plan.predicted_host_bytes and plan.predicted_host_bytes > hardware.host_available_bytes:
        return CheckResult(
            "host RAM", WARN, detail + f"; the reference plan needs ≈{format_bytes(plan.predicted_host_bytes)}"
        )
    return CheckResult("host RAM", OK, detail)


def check_disk(hardware: Hardware) -> CheckResult:
    detail = f"{format_bytes(hardware.disk_free_bytes)} free at {hardware.work_dir}"
    if hardware.nvme_path:
        detail += f"; {format_bytes(hardware.nvme_free_bytes or 0)} free at the offload path {hardware.nvme_path}"
    if hardware.disk_free_bytes < MIN_DISK_BYTES:
        return CheckResult("disk", FAIL, detail + f"; at least {format_bytes(MIN_DISK_BYTES)} is needed")
    return CheckResult("disk", OK, detail)


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else format_bytes(value)


def check_locked_memory(hardware: Hardware) -> CheckResult:
    """RLIMIT_MEMLOCK: DeepSpeed's NVMe offload mlocks its swap buffers; a warning where NVMe offload is set up
    and the hard limit is below the smallest of them."""
    limits = hardware.container
    values: dict[str, int | bool | None] = {
        "memlock_soft_bytes": limits.memlock_soft_bytes,
        "memlock_hard_bytes": limits.memlock_hard_bytes,
        "ipc_lock_capability": limits.ipc_lock_capability,
    }
    detail = f"soft {_limit(limits.memlock_soft_bytes)}, hard {_limit(limits.memlock_hard_bytes)}"
    if limits.ipc_lock_capability:
        return CheckResult("locked memory", OK, detail + " (CAP_IPC_LOCK: not enforced)", values)
    allowed = limits.lockable_bytes
    if allowed is None or allowed >= NVME_LOCKED_MEMORY_HINT_BYTES:
        return CheckResult("locked memory", OK, detail, values)
    small = f"; DeepSpeed's NVMe offload locks ≈{format_bytes(NVME_LOCKED_MEMORY_HINT_BYTES)} and more of swap buffers"
    if not hardware.nvme_path:
        return CheckResult("locked memory", OK, detail + small + " (no FLUXBOOTH_NVME_PATH: not used here)", values)
    return CheckResult("locked memory", WARN, detail + small + f": NVMe plans are dropped; {MEMLOCK_FIX}", values)


def check_shared_memory(hardware: Hardware) -> CheckResult:
    """/dev/shm: NCCL's shared-memory transport between GPUs; a warning with several GPUs when it is small."""
    limits = hardware.container
    values: dict[str, int | bool | None] = {
        "shm_total_bytes": limits.shm_total_bytes,
        "shm_free_bytes": limits.shm_free_bytes,
    }
    if limits.shm_total_bytes is None or limits.shm_free_bytes is None:
        detail = "no /dev/shm"
    else:
        detail = f"{format_bytes(limits.shm_free_bytes)} free of {format_bytes(limits.shm_total_bytes)}"
    if limits.shm_free_bytes is not None and limits.shm_free_bytes >= NCCL_SHM_MIN_BYTES:
        return CheckResult("/dev/shm", OK, detail, values)
    small = f"; below the {format_bytes(NCCL_SHM_MIN_BYTES)} NCCL's shared-memory transport needs between GPUs"
    if hardware.gpu_count < 2:
        return CheckResult("/dev/shm", OK, detail + small + " (one GPU: not used here)", values)
    return CheckResult(
        "/dev/shm", WARN, detail + small + f": the trainer runs with NCCL_SHM_DISABLE=1; {SHM_FIX}", values
    )


def check_bucket(settings: WorkerSettings) -> CheckResult:
    """HEAD the bucket with the worker's credentials; the message never carries a credential."""
    bucket = settings.bucket
    if bucket is None:
        problem = storage_problem(settings)
        if problem is not None:
            return CheckResult("object storage", FAIL, problem)
        return CheckResult(
            "object storage", SKIP, f"no bucket (BUCKET_ENDPOINT_URL): artifacts go to {settings.output_dir}"
        )

    host = urlsplit(bucket.endpoint_url).hostname if bucket.endpoint_url else "AWS S3"
    where = f"s3://{bucket.bucket} at {host}"
    redact = Redactor(settings.secret_values)
    try:
        store = S3Store(
            bucket,
            "",
            total_attempts=2,
            connect_timeout_seconds=BUCKET_TIMEOUT_SECONDS,
            read_timeout_seconds=BUCKET_TIMEOUT_SECONDS,
        )
        store.client.head_bucket(Bucket=bucket.bucket)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "?")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        hint = {
            "403": "the key cannot access this bucket; check BUCKET_ACCESS_KEY_ID/BUCKET_SECRET_ACCESS_KEY",
            "404": "no such bucket; check the bucket named in BUCKET_ENDPOINT_URL (or BUCKET_NAME)",
        }.get(str(status), "check BUCKET_ENDPOINT_URL and the bucket settings")
        return CheckResult("object storage", FAIL, redact(f"HEAD {where} failed: {status} {code}; {hint}"))
    except (BotoCoreError, FluxboothError, ValueError) as error:
        return CheckResult(
            "object storage", FAIL, redact(f"HEAD {where} failed: {type(error).__name__}; check BUCKET_ENDPOINT_URL")
        )
    return CheckResult("object storage", OK, f"HEAD {where}: reachable")
