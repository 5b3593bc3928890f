"""What an S3 failure tells the caller: the cause and what to change, in words, never the service's raw response
nor a credential.

botocore is imported inside the functions, as boto3 is inside `storage.S3Store`: the handler's cold start should
not pay for it when artifacts stay on local disk.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fluxbooth.messages import os_reason
from fluxbooth.redaction import Redactor
from fluxbooth.settings import BucketSettings

_CREDENTIAL_ERROR_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"}
)
_PERMISSION_ERROR_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem"})
_MISSING_BUCKET_ERROR_CODES = frozenset({"NoSuchBucket"})


def is_missing_object(error: BaseException) -> bool:
    from botocore.exceptions import ClientError  # botocore only once an S3 store is used (cold start)

    return isinstance(error, ClientError) and str(error.response.get("Error", {}).get("Code")) in {"404", "NoSuchKey"}


def is_connection_error(error: BaseException) -> bool:
    from botocore.exceptions import ConnectionError as BotocoreConnectionError  # as above: only with a bucket

    return isinstance(error, BotocoreConnectionError)


def describe_s3_failure(error: BaseException, bucket: BucketSettings, total_attempts: int) -> str:
    """Why the storage service failed, and what to change; never the service's raw response."""
    # botocore only once an S3 store is used: the handler's cold start does not pay for it.
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as BotocoreConnectionError

    endpoint = public_endpoint(bucket.endpoint_url)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return "no credentials were found; set BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY"
    if isinstance(error, ConnectTimeoutError):
        return (
            f"connecting to {endpoint} timed out after {total_attempts} attempts; check BUCKET_ENDPOINT_URL "
            "and that the storage service is reachable from the worker"
        )
    if isinstance(error, ReadTimeoutError):
        return (
            f"{endpoint} stopped answering (read timeout) after {total_attempts} attempts; "
            "the storage service is overloaded or down, retry the job later"
        )
    if isinstance(error, (EndpointConnectionError, BotocoreConnectionError)):
        return (
            f"cannot connect to the storage endpoint {endpoint} (connection refused or dropped) after "
            f"{total_attempts} attempts; check BUCKET_ENDPOINT_URL and that the service is up"
        )
    if isinstance(error, ClientError):
        details = error.response.get("Error", {})
        code = str(details.get("Code", "unknown"))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        attempts = error.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
        if code in _CREDENTIAL_ERROR_CODES:
            return (
                f"the storage service rejected the credentials ({code}); check BUCKET_ACCESS_KEY_ID and "
                "BUCKET_SECRET_ACCESS_KEY"
            )
        if code in _PERMISSION_ERROR_CODES or status == 403:
            return (
                f"access denied to bucket {bucket.bucket!r} ({code}); give the key in BUCKET_ACCESS_KEY_ID "
                "permission to put, get, list and delete objects and multipart uploads in it"
            )
        if code in _MISSING_BUCKET_ERROR_CODES:
            return f"bucket {bucket.bucket!r} does not exist at {endpoint}; create it, or fix BUCKET_NAME"
        if code in {"NoSuchKey", "404"}:
            return "the object is missing right after the upload; another writer may have deleted it, run the job again"
        if isinstance(status, int) and (status >= 500 or status == 429 or code in {"SlowDown", "Throttling"}):
            return (
                f"the storage service kept answering HTTP {status} ({code}) after {attempts} attempts; "
                "it is overloaded or down, retry the job later"
            )
        return f"the storage service refused the request: HTTP {status} ({code})"
    if isinstance(error, OSError):
        return f"reading the local file failed: {os_reason(error)}"
    return f"{type(error).__name__}: {error}"


def public_endpoint(endpoint_url: str | None) -> str:
    """The endpoint without any user:password part, for messages."""
    if not endpoint_url:
        return "AWS S3"
    parts = urlsplit(endpoint_url)
    # netloc may carry "user:password@"; keep only what follows it.
    host_and_port = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host_and_port}{parts.path}" if parts.scheme else endpoint_url.rpartition("@")[2]


def without_secrets(message: str, bucket: BucketSettings) -> str:
    return Redactor((bucket.secret_access_key, bucket.access_key_id))(message)
