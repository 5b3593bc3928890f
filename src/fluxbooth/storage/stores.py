"""Where trained artifacts go: an S3-compatible bucket, or a local directory when no bucket is set.

Both stores verify what they wrote (size and sha256) before reporting an artifact, and turn every
storage fault into `FluxboothError(ErrorCode.UPLOAD_FAILED, ...)` with a message that says what
to fix and never contains a credential.

The stores themselves are `fluxbooth.storage.s3` and `fluxbooth.storage.local` (what both offer:
`fluxbooth.storage.protocol`); here, which one a worker's settings open.
"""

from __future__ import annotations

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.settings import ALLOW_LOCAL_OUTPUT_VARIABLE, WorkerSettings
from fluxbooth.storage.local import LocalStore
from fluxbooth.storage.protocol import ArtifactStore, ReadableStore, check_path_segment
from fluxbooth.storage.s3 import S3Store


def storage_problem(settings: WorkerSettings) -> str | None:
    """Why this worker has nowhere lasting to put weights, or None. On RunPod a worker's disk goes with the
    worker, so without a bucket the weights are lost unless the operator chose local output on purpose."""
    if settings.bucket is not None or not settings.on_runpod or settings.allow_local_output:
        return None
    return (
        "no bucket is configured, and this worker runs on RunPod, whose container disk is deleted with the worker: "
        "set BUCKET_ENDPOINT_URL (https://<bucket>.s3.<region>.amazonaws.com or https://<host>/<bucket>), "
        f"BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY on the endpoint, or set {ALLOW_LOCAL_OUTPUT_VARIABLE}=1 "
        "to keep the weights in FLUXBOOTH_OUTPUT_DIR (a network volume path) on purpose"
    )


def require_usable_storage(settings: WorkerSettings) -> None:
    """Refuse a job before any work when its weights would have nowhere to go (see `storage_problem`)."""
    problem = storage_problem(settings)
    if problem is not None:
        # The same environment on a fresh worker has the same problem: no refresh.
        raise FluxboothError(ErrorCode.INTERNAL, f"worker configuration: {problem}", refresh_worker=False)


def local_output_warning(settings: WorkerSettings) -> str | None:
    """The result's warning when weights stay on a RunPod worker's own disk (outside the network volume)."""
    if settings.bucket is not None or not settings.on_runpod:
        return None
    output_dir = settings.output_dir.resolve()
    if settings.volume_dir is not None and output_dir.is_relative_to(settings.volume_dir.resolve()):
        return None
    return (
        f"the weights were written to {output_dir} on this worker's own disk, which RunPod deletes with the "
        "worker: fetch them before it scales down, or configure a bucket (BUCKET_ENDPOINT_URL) or a "
        "FLUXBOOTH_OUTPUT_DIR on the network volume"
    )


def open_store(settings: WorkerSettings, model_name: str, job_id: str) -> ArtifactStore:
    """The bucket when one is configured, else `<output_dir>/<model_name>/<job_id>/`."""
    check_path_segment(model_name, "model_name")
    check_path_segment(job_id, "job id")
    if settings.bucket is not None:
        key_prefix = "/".join(part for part in (settings.bucket.prefix.strip("/"), model_name, job_id) if part)
        return S3Store(settings.bucket, key_prefix)
    return LocalStore(settings.output_dir / model_name / job_id)


CHECKPOINTS_FOLDER = "checkpoints"


def open_checkpoint_store(settings: WorkerSettings, model_name: str) -> ReadableStore:
    """`<prefix>/<model_name>/checkpoints/` in the bucket, else `<output_dir>/<model_name>/checkpoints/`:
    per model, not per job, so a resubmitted job finds the checkpoints of the one that timed out."""
    check_path_segment(model_name, "model_name")
    if settings.bucket is not None:
        key_prefix = "/".join(
            part for part in (settings.bucket.prefix.strip("/"), model_name, CHECKPOINTS_FOLDER) if part
        )
        return S3Store(settings.bucket, key_prefix)
    return LocalStore(settings.output_dir / model_name / CHECKPOINTS_FOLDER)


def open_bucket_store(settings: WorkerSettings, key_prefix: str) -> S3Store:
    """The configured bucket under any key prefix (for a checkpoint named by its s3:// URI)."""
    if settings.bucket is None:
        raise FluxboothError(ErrorCode.INTERNAL, "open_bucket_store needs a configured bucket (BUCKET_ENDPOINT_URL)")
    return S3Store(settings.bucket, key_prefix)
