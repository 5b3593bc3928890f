"""The S3-compatible bucket store: multipart uploads checked by size and sha256 after writing, presigned
links, listing, download and deletion of folders, every fault a message without a credential.

boto3 is imported inside `S3Store` only: it costs a few hundred milliseconds to import, and the handler's
cold start should not pay for it when artifacts stay on local disk.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.settings import BucketSettings
from fluxbooth.storage.protocol import (
    StoredArtifact,
    check_artifact_name,
    check_path_segment,
    check_sha256,
    existing_file_size,
)
from fluxbooth.storage.s3_failures import (
    describe_s3_failure,
    is_connection_error,
    is_missing_object,
    public_endpoint,
    without_secrets,
)

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)
MULTIPART_PART_BYTES = 64 * 1024 * 1024
MULTIPART_CONCURRENCY = 4
DEFAULT_TOTAL_ATTEMPTS = 6
DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
DEFAULT_READ_TIMEOUT_SECONDS = 120.0
# SigV4 presigned URLs are refused by S3 beyond seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
# S3's DeleteObjects takes at most this many keys per request.
MAX_KEYS_PER_DELETE = 1000


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
        check_artifact_name(name)
        return f"{self._key_prefix}/{name}" if self._key_prefix else name

    def describe(self) -> str:
        return f"s3://{self._bucket_settings.bucket}/{self._key_prefix}".rstrip("/")

    def upload(self, local_path: Path, name: str, *, sha256: str) -> StoredArtifact:
        key = self.key_for(name)
        size = existing_file_size(local_path, name)
        check_sha256(sha256)
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
                folders.extend(entry["Prefix"][len(prefix) :].rstrip("/") for entry in page.get("CommonPrefixes", []))
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
            self._client.download_file(self._bucket_settings.bucket, key, str(temporary), Config=self._transfer_config)
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
        url: str = self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self._bucket_settings.bucket, "Key": key},
            ExpiresIn=min(seconds, MAX_PRESIGN_SECONDS),
        )
        return url

    def _upload_error(self, error: Exception, uri: str, *, doing: str = "uploading") -> FluxboothError:
        reason = describe_s3_failure(error, self._bucket_settings, self._total_attempts)
        message = f"{doing} {uri} failed: {reason}"
        return FluxboothError(ErrorCode.UPLOAD_FAILED, without_secrets(message, self._bucket_settings))


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
