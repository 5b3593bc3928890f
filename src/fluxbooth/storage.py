"""Where trained artifacts go: an S3-compatible bucket, or a local directory when no bucket is set.

Both stores verify what they wrote (size and sha256) before reporting an artifact, and turn every
storage fault into `FluxboothError(ErrorCode.UPLOAD_FAILED, ...)` with a message that says what
to fix and never contains a credential.

boto3 is imported inside `S3Store` only: it costs a few hundred milliseconds to import, and the
handler's cold start should not pay for it when artifacts stay on local disk.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import os_reason
from fluxbooth.s3_failures import (
    describe_s3_failure, is_connection_error, is_missing_object, public_endpoint, without_secrets,
)
from fluxbooth.settings import ALLOW_LOCAL_OUTPUT_VARIABLE, BucketSettings, WorkerSettings

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 8 * 1024 * 1024
MULTIPART_PART_BYTES = 64 * 1024 * 1024
MULTIPART_CONCURRENCY = 4
DEFAULT_TOTAL_ATTEMPTS = 6
DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
DEFAULT_READ_TIMEOUT_SECONDS = 120.0
# SigV4 presigned URLs are refused by S3 beyond seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
# S3's DeleteObjects takes at most this many keys per request.
MAX_KEYS_PER_DELETE = 1000


@dataclass(frozen=True)
class StoredArtifact:
    """One artifact as the result reports it."""

    name: str
    uri: str  # "s3://bucket/key" or "file:///abs/path"
    url: str | None  # presigned GET URL for S3, None for local files
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "uri": self.uri, "url": self.url, "bytes": self.bytes, "sha256": self.sha256}


@runtime_checkable
class ArtifactStore(Protocol):
    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact: ...

    def describe(self) -> str: ...


@runtime_checkable
class ReadableStore(ArtifactStore, Protocol):
    """A store that can also be read back and pruned (checkpoints: list, check, download, delete)."""

    def list_folders(self) -> list[str]: ...

    def exists(self, name: str) -> bool: ...

    def download(self, name: str, target: Path) -> None: ...

    def delete_folder(self, name: str) -> int:
        """Remove the folder `name` (one path segment) and everything in it; return how many objects
        or files went. A folder that does not exist removes nothing."""
        ...


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


class S3Store:
    """Uploads to `s3://<bucket>/<key_prefix>/<name>` on AWS S3 or any S3-compatible service.

    Checksum headers are sent only where an operation requires them: boto3 >= 1.36 adds CRC32
    headers to every upload by default, which Cloudflare R2, Backblaze B2 and older MinIO refuse.
    Integrity comes instead from SigV4 payload signing (every request carries the SHA-256 of its body
    in `x-amz-content-sha256`, which every S3-compatible service checks) and from reading the object
    back afterwards (its size and the sha256 kept in its metadata).
    """

    def __init__(
        self,
        bucket: BucketSettings,
        key_prefix: str,
        *,
        transfer_config: TransferConfig | None = None,
        total_attempts: int = DEFAULT_TOTAL_ATTEMPTS,
        connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
        read_timeout_seconds: float = DEFAULT_READ_TIMEOUT_SECONDS,
    ) -> None:
        # boto3 only once a bucket is used: see the module docstring.
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self._bucket_settings = bucket
        self._key_prefix = key_prefix.strip("/")
        self._total_attempts = total_attempts
        self._transfer_config = transfer_config or TransferConfig(
            multipart_threshold=MULTIPART_PART_BYTES,
            multipart_chunksize=MULTIPART_PART_BYTES,
            max_concurrency=MULTIPART_CONCURRENCY,
            use_threads=True,
            # The CRT transfer client ignores the checksum policy below and always sends CRC32.
            preferred_transfer_client="classic",
        )
        config = Config(
            signature_version="s3v4",
            region_name=bucket.region or None,
            # botocore's `max_attempts` counts retries only; `total_max_attempts` includes the first try.
            retries={"mode": "standard", "total_max_attempts": total_attempts},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            connect_timeout=connect_timeout_seconds,
            read_timeout=read_timeout_seconds,
            max_pool_connections=max(10, self._transfer_config.max_request_concurrency),
            s3={
                # S3-compatible services rarely have per-bucket DNS names.
                "addressing_style": "path" if bucket.endpoint_url else "auto",
                # Without checksum headers, the signed body hash is what guards each part in transit.
                "payload_signing_enabled": True,
            },
        )
        try:
            # A private session: the worker's settings decide the credentials, not a host profile.
            session = boto3.session.Session(
                aws_access_key_id=bucket.access_key_id or None,
                aws_secret_access_key=bucket.secret_access_key or None,
                region_name=bucket.region or None,
            )
            self._client: BaseClient = session.client("s3", endpoint_url=bucket.endpoint_url or None, config=config)
            self._client.meta.events.register("before-call.s3.DeleteObjects", _add_content_md5)
        except ValueError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"BUCKET_ENDPOINT_URL {public_endpoint(bucket.endpoint_url)!r} is not a usable URL "
                f"({type(error).__name__}); set it to the service's https:// address",
            ) from error

    @property
    def client(self) -> BaseClient:
        """The boto3 S3 client, for benchmarks and for tests that hook its events."""
        return self._client

    @property
    def transfer_config(self) -> TransferConfig:
        return self._transfer_config

    def key_for(self, name: str) -> str:
        _check_artifact_name(name)
        return f"{self._key_prefix}/{name}" if self._key_prefix else name

    def describe(self) -> str:
        return f"s3://{self._bucket_settings.bucket}/{self._key_prefix}".rstrip("/")

    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact:
        key = self.key_for(name)
        size = _existing_file_size(local_path, name)
        _check_sha256(sha256)
        bucket = self._bucket_settings.bucket
        uri = f"s3://{bucket}/{key}"
        try:
            self._transfer(local_path, key, {"Metadata": {"sha256": sha256}})
        except Exception as error:
            if size >= self._transfer_config.multipart_threshold and not is_connection_error(error):
                self._abort_unfinished_multipart_uploads(key)
            raise self._upload_error(error, uri) from error
        try:
            head = self._client.head_object(Bucket=bucket, Key=key)
        except Exception as error:
            raise self._upload_error(error, uri, doing="checking the uploaded object") from error
        _verify_stored_object(uri, head, size, sha256)
        logger.info("uploaded %s (%d bytes)", uri, size)
        return StoredArtifact(name=name, uri=uri, url=self._presigned_url(key), bytes=size, sha256=sha256)

    def list_folders(self) -> list[str]:
        """Names of the "folders" (common prefixes) directly under this store's prefix."""
        bucket = self._bucket_settings.bucket
        prefix = f"{self._key_prefix}/" if self._key_prefix else ""
        folders: list[str] = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, Delimiter="/"
            ):
                folders.extend(
                    entry["Prefix"][len(prefix) :].rstrip("/") for entry in page.get("CommonPrefixes", [])
                )
        except Exception as error:
            raise self._upload_error(error, self.describe(), doing="listing") from error
        return folders

    def exists(self, name: str) -> bool:
        key = self.key_for(name)
        try:
            self._client.head_object(Bucket=self._bucket_settings.bucket, Key=key)
        except Exception as error:
            if is_missing_object(error):
                return False
            uri = f"s3://{self._bucket_settings.bucket}/{key}"
            raise self._upload_error(error, uri, doing="checking") from error
        return True

    def download(self, name: str, target: Path) -> None:
        """Fetch `name` to `target` through a temporary name, so `target` is whole or absent."""
        key = self.key_for(name)
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(
                self._bucket_settings.bucket, key, str(temporary), Config=self._transfer_config
            )
            os.replace(temporary, target)
        except Exception as error:
            temporary.unlink(missing_ok=True)
            uri = f"s3://{self._bucket_settings.bucket}/{key}"
            raise self._upload_error(error, uri, doing="downloading") from error

    def delete_folder(self, name: str) -> int:
        """Delete every object under `<key_prefix>/<name>/`, listed first and then removed in batches."""
        check_path_segment(name, "folder name")
        bucket = self._bucket_settings.bucket
        prefix = f"{self.key_for(name)}/"
        uri = f"s3://{bucket}/{prefix}"
        try:
            # The whole listing first: deleting while paginating would move the pages under the cursor.
            keys = [
                item["Key"]
                for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                for item in page.get("Contents", [])
            ]
            deleted = 0
            for start in range(0, len(keys), MAX_KEYS_PER_DELETE):
                batch = keys[start : start + MAX_KEYS_PER_DELETE]
                response = self._client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True}
                )
                # DeleteObjects answers 200 even when some keys were refused; those are listed in Errors.
                refused = response.get("Errors") or []
                if refused:
                    first = refused[0]
                    message = (
                        f"deleting {uri} failed: the service refused {len(refused)} of its {len(keys)} objects "
                        f"({first.get('Code', 'unknown')} on {first.get('Key', '?')}: {first.get('Message', '')}); "
                        "give the key in BUCKET_ACCESS_KEY_ID permission to delete objects, or remove them by hand"
                    )
                    raise FluxboothError(ErrorCode.UPLOAD_FAILED, without_secrets(message, self._bucket_settings))
                deleted += len(batch)
        except FluxboothError:
            raise
        except Exception as error:
            raise self._upload_error(error, uri, doing="deleting") from error
        logger.info("deleted %s (%d objects)", uri, deleted)
        return deleted

    def _transfer(self, local_path: Path, key: str, extra_args: dict[str, object]) -> None:
        # The transfer manager, unlike client.upload_file, raises the original botocore error
        # (with its error code and retry count) instead of a flattened S3UploadFailedError.
        from boto3.s3.transfer import create_transfer_manager  # on use only, as in __init__

        with create_transfer_manager(self._client, self._transfer_config) as manager:
            future = manager.upload(str(local_path), self._bucket_settings.bucket, key, extra_args=extra_args)
            future.result()

    def _abort_unfinished_multipart_uploads(self, key: str) -> None:
        """Second chance at removing parts: s3transfer aborts a failed upload, but that abort can fail too."""
        bucket = self._bucket_settings.bucket
        try:
            listing = self._client.list_multipart_uploads(Bucket=bucket, Prefix=key)
            for unfinished in listing.get("Uploads", []):
                if unfinished.get("Key") == key:
                    self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=unfinished["UploadId"])
                    logger.warning("aborted unfinished multipart upload of s3://%s/%s", bucket, key)
        except Exception as error:  # best effort: the upload error itself is what the caller needs
            logger.warning(
                "could not check s3://%s/%s for unfinished multipart uploads (%s); a bucket lifecycle rule "
                "'AbortIncompleteMultipartUpload' removes leftover parts",
                bucket,
                key,
                type(error).__name__,
            )

    def _presigned_url(self, key: str) -> str | None:
        seconds = self._bucket_settings.presign_seconds
        if seconds <= 0:
            return None
        return self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self._bucket_settings.bucket, "Key": key},
            ExpiresIn=min(seconds, MAX_PRESIGN_SECONDS),
        )

    def _upload_error(self, error: Exception, uri: str, *, doing: str = "uploading") -> FluxboothError:
        reason = describe_s3_failure(error, self._bucket_settings, self._total_attempts)
        message = f"{doing} {uri} failed: {reason}"
        return FluxboothError(ErrorCode.UPLOAD_FAILED, without_secrets(message, self._bucket_settings))


class LocalStore:
    """Copies artifacts into a directory (the default when no bucket is configured)."""

    def __init__(self, directory: Path) -> None:
        self._directory = Path(directory).resolve()

    @property
    def directory(self) -> Path:
        return self._directory

    def describe(self) -> str:
        return self._directory.as_uri()

    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact:
        _check_artifact_name(name)
        _existing_file_size(local_path, name)
        _check_sha256(sha256)
        target = self._directory / name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # `name` has no ".." segments, but a symlinked folder inside the directory could still lead out.
            if not target.parent.resolve().is_relative_to(self._directory):
                raise OSError(f"{target.parent} leads outside {self._directory}")
            copied_bytes, copied_sha256 = copy_atomically(source=local_path, target=target, expected_sha256=sha256)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"writing artifact {name} to {self._directory} failed: {os_reason(error)}; "
                "check that FLUXBOOTH_OUTPUT_DIR is writable and has free space",
            ) from error
        except _ContentMismatch as mismatch:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"artifact {name} changed while it was being stored: {mismatch}; nothing was written",
            ) from mismatch
        return StoredArtifact(name=name, uri=target.as_uri(), url=None, bytes=copied_bytes, sha256=copied_sha256)

    def list_folders(self) -> list[str]:
        if not self._directory.is_dir():
            return []
        return sorted(entry.name for entry in self._directory.iterdir() if entry.is_dir() and not entry.is_symlink())

    def exists(self, name: str) -> bool:
        _check_artifact_name(name)
        return (self._directory / name).is_file()

    def delete_folder(self, name: str) -> int:
        check_path_segment(name, "folder name")
        folder = self._directory / name
        try:
            # Exactly a folder of this directory: a symlink (even to a sibling) or a way out is refused.
            if folder.resolve() != folder:
                raise OSError(f"{folder} is a link or leads outside {self._directory}")
            if not folder.exists():
                return 0
            if not folder.is_dir():
                raise NotADirectoryError(f"{folder} is not a folder")
            removed = sum(len(files) for _, _, files in os.walk(folder))
            shutil.rmtree(folder)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED, f"deleting {name} from {self._directory} failed: {os_reason(error)}"
            ) from error
        logger.info("deleted %s (%d files)", folder, removed)
        return removed

    def download(self, name: str, target: Path) -> None:
        _check_artifact_name(name)
        source = self._directory / name
        try:
            if not source.resolve().is_relative_to(self._directory):
                raise OSError(f"{source} leads outside {self._directory}")
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_atomically(source=source, target=target)
        except OSError as error:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED, f"reading {name} from {self._directory} failed: {os_reason(error)}"
            ) from error


class _ContentMismatch(Exception):
    pass


def copy_atomically(source: Path, target: Path, expected_sha256: str | None = None) -> tuple[int, str]:
    """Copy through a temporary name in the target's folder, then rename, so readers never see half a file.

    Hashing happens on the bytes as they are copied, so verification costs no second read.
    """
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    digest = hashlib.sha256()
    copied = 0
    try:
        with source.open("rb") as reader, temporary.open("xb") as writer:
            while chunk := reader.read(COPY_CHUNK_BYTES):
                digest.update(chunk)
                writer.write(chunk)
                copied += len(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        actual_sha256 = digest.hexdigest()
        if expected_sha256 is not None and actual_sha256 != expected_sha256:
            raise _ContentMismatch(f"sha256 of the copied bytes is {actual_sha256}, expected {expected_sha256}")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return copied, actual_sha256


def _check_artifact_name(name: str) -> None:
    segments = name.split("/")
    if not name or "\\" in name or "\x00" in name or any(segment in {"", ".", ".."} for segment in segments):
        raise FluxboothError(
            ErrorCode.INTERNAL,
            f"artifact name {name[:200]!r} is not a relative path of plain segments "
            "(like 'transformer/config.json'); fix the exporter that produced it",
        )


def check_path_segment(value: str, what: str) -> None:
    if not value or value in {".", ".."} or "/" in value or "\\" in value or "\x00" in value:
        raise FluxboothError(
            ErrorCode.INTERNAL, f"{what} {value[:200]!r} cannot be used as a folder or key segment"
        )


def _check_sha256(value: str) -> None:
    if len(value) != 64 or any(character not in "0123456789abcdef" for character in value):
        raise FluxboothError(
            ErrorCode.INTERNAL, f"sha256 {value[:80]!r} is not 64 lowercase hex digits; pass hashlib's hexdigest()"
        )


def _existing_file_size(local_path: Path, name: str) -> int:
    try:
        if not local_path.is_file():
            raise FileNotFoundError(f"{local_path} is not a file")
        return local_path.stat().st_size
    except OSError as error:
        raise FluxboothError(
            ErrorCode.INTERNAL, f"artifact {name} cannot be read from {local_path}: {os_reason(error)}"
        ) from error


def _verify_stored_object(uri: str, head: dict[str, object], expected_bytes: int, expected_sha256: str) -> None:
    stored_bytes = head.get("ContentLength")
    metadata = head.get("Metadata") or {}
    stored_sha256 = metadata.get("sha256") if isinstance(metadata, dict) else None
    if stored_bytes != expected_bytes:
        problem = f"the stored object has {stored_bytes} bytes, the local file {expected_bytes}"
    elif stored_sha256 is None:
        problem = "the stored object has no sha256 metadata (x-amz-meta-sha256); the service dropped it"
    elif stored_sha256 != expected_sha256:
        problem = f"the stored object's sha256 metadata is {stored_sha256}, the local file's {expected_sha256}"
    else:
        return
    raise FluxboothError(
        ErrorCode.UPLOAD_FAILED,
        f"verifying {uri} after upload failed: {problem}. Another writer may have replaced it, or the "
        "service altered it; run the job again, with a BUCKET_PREFIX of its own",
    )


def _add_content_md5(params: dict[str, Any], **_: object) -> None:
    """DeleteObjects must carry a body checksum. botocore >= 1.36 sends only CRC32, which older MinIO,
    Ceph and other S3-compatible services refuse (MissingContentMD5); Content-MD5 as well satisfies both."""
    body = params.get("body")
    if isinstance(body, str):
        body = body.encode()
    if isinstance(body, bytes) and "Content-MD5" not in params["headers"]:
        digest = hashlib.md5(body, usedforsecurity=False).digest()
        params["headers"]["Content-MD5"] = base64.b64encode(digest).decode("ascii")
