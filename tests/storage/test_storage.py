"""Artifact storage: S3 against moto's server over real HTTP, and the local output directory."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.client import BaseClient

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.settings import WorkerSettings, locate_bucket
from fluxbooth.storage import stores as storage
from fluxbooth.storage.artifacts import sha256_file
from fluxbooth.storage.local import LocalStore
from fluxbooth.storage.protocol import StoredArtifact
from fluxbooth.storage.s3 import S3Store
from fluxbooth.storage.stores import open_store
from fluxbooth.storage.upload import preserve_on_volume
from tests.support.s3server import (
    AuthenticatingS3Server,
    InjectedFault,
    RecordedRequest,
    S3FaultProxy,
    free_tcp_port,
    make_s3_client,
)

MiB = 1024 * 1024
# S3's smallest allowed part, so a 12 MiB file takes three parts.
SMALL_PARTS = TransferConfig(
    multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2, preferred_transfer_client="classic"
)
MODEL = "my-model"
JOB = "job-123"


@dataclass(frozen=True)
class BuiltFile:
    path: Path
    content: bytes
    sha256: str


def build_file(directory: Path, relative_name: str, size: int, seed: int = 0) -> BuiltFile:
    content = random.Random(seed).randbytes(size)
    path = directory / relative_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return BuiltFile(path=path, content=content, sha256=hashlib.sha256(content).hexdigest())


def s3_store(env: dict[str, str], *, total_attempts: int = 3, key_prefix: str | None = None) -> S3Store:
    bucket = WorkerSettings.from_environ(env).bucket
    assert bucket is not None
    prefix = key_prefix if key_prefix is not None else f"{bucket.prefix}/{MODEL}/{JOB}"
    return S3Store(bucket, prefix, transfer_config=SMALL_PARTS, total_attempts=total_attempts)


def via_proxy(env: dict[str, str], proxy: S3FaultProxy) -> dict[str, str]:
    return {**env, "BUCKET_ENDPOINT_URL": proxy.url}


def key_of(env: dict[str, str], name: str) -> str:
    return f"{env['BUCKET_PREFIX']}/{MODEL}/{JOB}/{name}"


def checksum_headers_in(request: RecordedRequest) -> list[str]:
    """Headers that R2, B2 and MinIO refuse: flexible checksums and aws-chunked trailers."""
    found = [
        name
        for name in request.headers
        if name.startswith("x-amz-checksum-") or name in {"x-amz-sdk-checksum-algorithm", "x-amz-trailer"}
    ]
    if "aws-chunked" in request.headers.get("content-encoding", ""):
        found.append("content-encoding: aws-chunked")
    return found


def is_operation(name: str) -> Callable[[RecordedRequest], bool]:
    return lambda request: request.operation == name


def upload_error(store: S3Store | LocalStore, file: BuiltFile, name: str = "model.safetensors") -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        store.upload(file.path, name, sha256=file.sha256)
    return caught.value


# --- where artifacts land, and what the result says --------------------------------------------


def test_s3_upload_puts_the_object_at_prefix_model_job_name(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "weights.safetensors", 1000)
    store = open_store(WorkerSettings.from_environ(s3_bucket_env), MODEL, JOB)

    stored = store.upload(file.path, "weights.safetensors", sha256=file.sha256)

    key = f"fluxbooth-test/{MODEL}/{JOB}/weights.safetensors"
    assert stored.uri == f"s3://{s3_bucket_env['BUCKET_NAME']}/{key}"
    assert (stored.name, stored.bytes, stored.sha256) == ("weights.safetensors", 1000, file.sha256)
    assert s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key)["Body"].read() == file.content


def test_s3_upload_keeps_sharded_folder_names_in_the_key(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    name = "transformer/diffusion_pytorch_model-00001-of-00002.safetensors"
    file = build_file(tmp_path, name, 2000)

    stored = s3_store(s3_bucket_env).upload(file.path, name, sha256=file.sha256)

    assert stored.uri.endswith(f"/{MODEL}/{JOB}/{name}")
    listed = s3_client.list_objects_v2(Bucket=s3_bucket_env["BUCKET_NAME"])["Contents"]
    assert [item["Key"] for item in listed] == [key_of(s3_bucket_env, name)]


def test_s3_upload_stores_the_sha256_in_object_metadata(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 300)

    s3_store(s3_bucket_env).upload(file.path, "a.bin", sha256=file.sha256)

    head = s3_client.head_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key_of(s3_bucket_env, "a.bin"))
    assert head["Metadata"] == {"sha256": file.sha256}


def test_empty_bucket_prefix_puts_keys_at_model_job_name(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 10)
    env = {**s3_bucket_env, "BUCKET_PREFIX": ""}

    stored = open_store(WorkerSettings.from_environ(env), MODEL, JOB).upload(file.path, "a.bin", sha256=file.sha256)

    assert stored.uri == f"s3://{env['BUCKET_NAME']}/{MODEL}/{JOB}/a.bin"


def test_presigned_url_downloads_the_uploaded_bytes_over_http(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    file = build_file(tmp_path, "weights.safetensors", 4096)

    stored = s3_store(s3_bucket_env).upload(file.path, "weights.safetensors", sha256=file.sha256)

    assert stored.url is not None
    with urllib.request.urlopen(stored.url, timeout=30) as response:
        assert response.read() == file.content


@pytest.mark.parametrize(("configured_seconds", "expected_seconds"), [(3600, "3600"), (30 * 24 * 3600, "604800")])
def test_presigned_url_lifetime_comes_from_settings_capped_at_seven_days(
    s3_bucket_env: dict[str, str], tmp_path: Path, configured_seconds: int, expected_seconds: str
) -> None:
    file = build_file(tmp_path, "a.bin", 10)
    env = {**s3_bucket_env, "BUCKET_PRESIGN_SECONDS": str(configured_seconds)}

    stored = s3_store(env).upload(file.path, "a.bin", sha256=file.sha256)

    assert stored.url is not None
    assert parse_qs(urlsplit(stored.url).query)["X-Amz-Expires"] == [expected_seconds]


def test_presign_seconds_of_zero_gives_no_url(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    file = build_file(tmp_path, "a.bin", 10)
    env = {**s3_bucket_env, "BUCKET_PRESIGN_SECONDS": "0"}

    stored = s3_store(env).upload(file.path, "a.bin", sha256=file.sha256)

    assert stored.url is None


def test_describe_names_bucket_and_key_prefix_without_credentials(s3_bucket_env: dict[str, str]) -> None:
    store = open_store(WorkerSettings.from_environ(s3_bucket_env), MODEL, JOB)

    description = store.describe()

    assert description == f"s3://{s3_bucket_env['BUCKET_NAME']}/fluxbooth-test/{MODEL}/{JOB}"
    assert s3_bucket_env["BUCKET_ACCESS_KEY_ID"] not in description
    assert s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"] not in description


def test_open_store_without_a_bucket_writes_under_output_dir_model_job(tmp_path: Path) -> None:
    settings = WorkerSettings.from_environ({"FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs")})

    store = open_store(settings, MODEL, JOB)

    assert isinstance(store, LocalStore)
    assert store.directory == (tmp_path / "outputs" / MODEL / JOB).resolve()


def test_stored_artifact_to_dict_has_exactly_the_result_fields() -> None:
    artifact = StoredArtifact(name="a.bin", uri="s3://b/k/a.bin", url="http://x/a", bytes=3, sha256="0" * 64)

    assert artifact.to_dict() == {
        "name": "a.bin",
        "uri": "s3://b/k/a.bin",
        "url": "http://x/a",
        "bytes": 3,
        "sha256": "0" * 64,
    }


def test_sha256_file_is_the_hex_digest_of_its_bytes(tmp_path: Path) -> None:
    file = build_file(tmp_path, "big.bin", 9 * MiB + 7)

    assert sha256_file(file.path) == hashlib.sha256(file.content).hexdigest()


# --- multipart --------------------------------------------------------------------------------


def test_default_transfer_config_uses_64_mib_parts_for_multi_gb_files(s3_bucket_env: dict[str, str]) -> None:
    bucket = WorkerSettings.from_environ(s3_bucket_env).bucket
    assert bucket is not None

    config = S3Store(bucket, "prefix").transfer_config

    assert (config.multipart_threshold, config.multipart_chunksize) == (64 * MiB, 64 * MiB)
    assert config.max_request_concurrency > 1


def test_file_above_the_threshold_is_uploaded_in_parts_and_round_trips(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.safetensors", 12 * MiB)

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "big.safetensors", sha256=file.sha256)

    operations = s3_fault_proxy.operations()
    assert operations.count("CreateMultipartUpload") == 1
    assert operations.count("UploadPart") == 3
    assert operations.count("CompleteMultipartUpload") == 1
    key = key_of(s3_bucket_env, "big.safetensors")
    assert s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key)["Body"].read() == file.content
    head = s3_client.head_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key)
    assert head["Metadata"] == {"sha256": file.sha256}


# --- checksum headers that S3-compatible services refuse --------------------------------------


def test_single_part_upload_sends_no_checksum_headers(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 1000)

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "a.bin", sha256=file.sha256)

    assert "PutObject" in s3_fault_proxy.operations()
    assert {request.operation: checksum_headers_in(request) for request in s3_fault_proxy.requests} == {
        "PutObject": [],
        "HeadObject": [],
    }


def test_multipart_upload_sends_no_checksum_headers(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.bin", 11 * MiB)

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "big.bin", sha256=file.sha256)

    assert s3_fault_proxy.operations().count("UploadPart") == 3
    offending = {
        f"{request.operation} {request.target}": checksum_headers_in(request)
        for request in s3_fault_proxy.requests
        if checksum_headers_in(request)
    }
    assert offending == {}


def test_single_part_upload_body_is_signed_with_its_sha256(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 1000)

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "a.bin", sha256=file.sha256)

    (put,) = [request for request in s3_fault_proxy.requests if request.operation == "PutObject"]
    assert put.headers["x-amz-content-sha256"] == file.sha256


def test_every_multipart_part_is_signed_with_its_own_sha256(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.bin", 11 * MiB)
    part_bytes = SMALL_PARTS.multipart_chunksize

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "big.bin", sha256=file.sha256)

    signed = {
        int(request.query["partNumber"][0]): request.headers["x-amz-content-sha256"]
        for request in s3_fault_proxy.requests
        if request.operation == "UploadPart"
    }
    expected = {
        number: hashlib.sha256(file.content[(number - 1) * part_bytes : number * part_bytes]).hexdigest()
        for number in (1, 2, 3)
    }
    assert signed == expected


def test_plain_boto3_sends_the_checksum_headers_the_store_avoids(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    """The control for the two tests above: the proxy does see boto3's default CRC32 headers."""
    file = build_file(tmp_path, "a.bin", 1000)
    default_client = make_s3_client(
        s3_fault_proxy.url, s3_bucket_env["BUCKET_ACCESS_KEY_ID"], s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"]
    )

    default_client.upload_file(str(file.path), s3_bucket_env["BUCKET_NAME"], "plain/a.bin")

    (put,) = [request for request in s3_fault_proxy.requests if request.operation == "PutObject"]
    assert checksum_headers_in(put) != []


# --- retries and faults -----------------------------------------------------------------------


def test_transient_503_responses_are_retried_until_the_upload_succeeds(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 2000)
    s3_fault_proxy.fail_first(2, matching=is_operation("PutObject"))

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy), total_attempts=3).upload(file.path, "a.bin", sha256=file.sha256)

    assert len(s3_fault_proxy.faults_answered) == 2
    assert s3_fault_proxy.operations().count("PutObject") == 3
    body = s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key_of(s3_bucket_env, "a.bin"))["Body"]
    assert body.read() == file.content


def test_transient_503_on_one_part_is_retried_and_the_multipart_upload_completes(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.bin", 12 * MiB)
    s3_fault_proxy.fail_first(1, InjectedFault(503, "SlowDown"), matching=is_operation("UploadPart"))

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).upload(file.path, "big.bin", sha256=file.sha256)

    assert s3_fault_proxy.operations().count("UploadPart") == 4
    body = s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key_of(s3_bucket_env, "big.bin"))["Body"]
    assert body.read() == file.content


def test_503_on_every_attempt_fails_with_upload_failed_after_all_attempts(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 2000)
    s3_fault_proxy.fail_always(is_operation("PutObject"))

    error = upload_error(s3_store(via_proxy(s3_bucket_env, s3_fault_proxy), total_attempts=2), file)

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert "HTTP 503 (ServiceUnavailable) after 2 attempts" in error.message
    assert "retry the job later" in error.message
    assert s3_fault_proxy.operations().count("PutObject") == 2


def test_failed_multipart_upload_is_aborted_leaving_no_parts(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.bin", 12 * MiB)
    s3_fault_proxy.fail_always(
        lambda request: request.operation == "UploadPart" and request.query["partNumber"] == ["2"]
    )

    error = upload_error(s3_store(via_proxy(s3_bucket_env, s3_fault_proxy), total_attempts=2), file, "big.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    operations = s3_fault_proxy.operations()
    assert operations.count("CreateMultipartUpload") == 1
    assert "AbortMultipartUpload" in operations
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket_env["BUCKET_NAME"]).get("Uploads", []) == []
    assert s3_client.list_objects_v2(Bucket=s3_bucket_env["BUCKET_NAME"]).get("Contents", []) == []


def test_unfinished_multipart_upload_is_aborted_even_when_the_first_abort_fails(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "big.bin", 12 * MiB)
    aborts_refused = [0]

    def fail_parts_and_the_first_abort(request: RecordedRequest) -> InjectedFault | None:
        if request.operation == "UploadPart":
            return InjectedFault(500, "InternalError")
        if request.operation == "AbortMultipartUpload" and aborts_refused[0] < 2:
            aborts_refused[0] += 1
            return InjectedFault(500, "InternalError")
        return None

    s3_fault_proxy.rule = fail_parts_and_the_first_abort

    error = upload_error(s3_store(via_proxy(s3_bucket_env, s3_fault_proxy), total_attempts=2), file, "big.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert aborts_refused[0] == 2
    assert s3_fault_proxy.operations().count("AbortMultipartUpload") == 3
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket_env["BUCKET_NAME"]).get("Uploads", []) == []


def test_unreachable_endpoint_fails_with_upload_failed_naming_the_endpoint(
    s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 100)
    down_endpoint = f"http://127.0.0.1:{free_tcp_port()}"
    env = {**s3_bucket_env, "BUCKET_ENDPOINT_URL": down_endpoint}

    error = upload_error(s3_store(env, total_attempts=2), file)

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert f"cannot connect to the storage endpoint {down_endpoint}" in error.message
    assert "check BUCKET_ENDPOINT_URL" in error.message


def test_missing_bucket_fails_with_upload_failed_naming_the_bucket(
    s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 100)
    env = {**s3_bucket_env, "BUCKET_NAME": "fluxbooth-test-no-such-bucket"}

    error = upload_error(s3_store(env), file)

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert "bucket 'fluxbooth-test-no-such-bucket' does not exist" in error.message
    assert "fix BUCKET_NAME" in error.message


def test_endpoint_url_that_is_not_a_url_is_a_worker_setting_error(s3_bucket_env: dict[str, str]) -> None:
    env = {**s3_bucket_env, "BUCKET_ENDPOINT_URL": "storage.example.com:9000"}

    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ(env)

    assert str(caught.value) == "BUCKET_ENDPOINT_URL 'storage.example.com:9000' is not an http(s) URL"


def test_valid_credentials_upload_to_the_authenticating_server(
    s3_auth_server: AuthenticatingS3Server, isolated_aws_environment: None, tmp_path: Path
) -> None:
    """The control for the credential tests below: the server accepts a right key."""
    file = build_file(tmp_path, "a.bin", 100)

    stored = s3_store(s3_auth_server.env(*s3_auth_server.allowed_key)).upload(file.path, "a.bin", sha256=file.sha256)

    assert stored.bytes == 100


@pytest.mark.parametrize("wrong_part", ["unknown key id", "wrong secret"])
def test_rejected_credentials_fail_with_upload_failed_without_echoing_them(
    s3_auth_server: AuthenticatingS3Server, isolated_aws_environment: None, tmp_path: Path, wrong_part: str
) -> None:
    file = build_file(tmp_path, "a.bin", 100)
    key_id, secret = s3_auth_server.allowed_key
    if wrong_part == "unknown key id":
        key_id = "AKIAFLUXBOOTHUNKNOWN"
    else:
        secret = "fluxbooth-wrong-secret-canary"

    error = upload_error(s3_store(s3_auth_server.env(key_id, secret)), file)

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert "rejected the credentials" in error.message
    assert "check BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY" in error.message
    shown = error.message + repr(error) + json.dumps(error.to_result())
    assert key_id not in shown
    assert secret not in shown


def test_key_without_permission_fails_with_upload_failed_access_denied(
    s3_auth_server: AuthenticatingS3Server, isolated_aws_environment: None, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 100)

    error = upload_error(s3_store(s3_auth_server.env(*s3_auth_server.powerless_key)), file)

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert f"access denied to bucket {s3_auth_server.bucket!r} (AccessDenied)" in error.message
    assert s3_auth_server.powerless_key[0] not in error.message


# --- verification after upload ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("replacement", "metadata", "expected_problem"),
    [
        (b"shorter", {"sha256": "0" * 64}, "the stored object has 7 bytes, the local file 1000"),
        (b"x" * 1000, {}, "has no sha256 metadata"),
        (b"x" * 1000, {"sha256": "f" * 64}, f"sha256 metadata is {'f' * 64}"),
    ],
    ids=["size differs", "metadata missing", "sha256 differs"],
)
def test_upload_fails_when_the_stored_object_does_not_match_the_file(
    s3_bucket_env: dict[str, str],
    s3_client: BaseClient,
    tmp_path: Path,
    replacement: bytes,
    metadata: dict[str, str],
    expected_problem: str,
) -> None:
    file = build_file(tmp_path, "a.bin", 1000)
    store = s3_store(s3_bucket_env)
    key = key_of(s3_bucket_env, "a.bin")

    def another_writer_replaces_the_object(**_: object) -> None:
        s3_client.put_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key, Body=replacement, Metadata=metadata)

    store.client.meta.events.register("before-call.s3.HeadObject", another_writer_replaces_the_object)

    error = upload_error(store, file, "a.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert f"verifying s3://{s3_bucket_env['BUCKET_NAME']}/{key} after upload failed" in error.message
    assert expected_problem in error.message


def test_upload_fails_when_the_object_vanishes_before_verification(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    file = build_file(tmp_path, "a.bin", 1000)
    store = s3_store(s3_bucket_env)

    def another_writer_deletes_the_object(**_: object) -> None:
        s3_client.delete_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key_of(s3_bucket_env, "a.bin"))

    store.client.meta.events.register("before-call.s3.HeadObject", another_writer_deletes_the_object)

    error = upload_error(store, file, "a.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert "the object is missing right after the upload" in error.message


# --- inputs the stores refuse -----------------------------------------------------------------

UNSAFE_NAMES = ["../escape.bin", "/abs.bin", "a/../../b.bin", "", "a\\b.bin", "a//b.bin", "./a.bin"]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_s3_store_refuses_artifact_names_that_are_not_plain_relative_paths(
    s3_bucket_env: dict[str, str], tmp_path: Path, name: str
) -> None:
    file = build_file(tmp_path, "a.bin", 10)

    error = upload_error(s3_store(s3_bucket_env), file, name)

    assert error.code is ErrorCode.INTERNAL
    assert "is not a relative path of plain segments" in error.message


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_local_store_refuses_artifact_names_that_are_not_plain_relative_paths(tmp_path: Path, name: str) -> None:
    file = build_file(tmp_path / "export", "a.bin", 10)

    error = upload_error(LocalStore(tmp_path / "out"), file, name)

    assert error.code is ErrorCode.INTERNAL
    assert not (tmp_path / "escape.bin").exists()


def test_open_store_refuses_a_job_id_with_a_slash(tmp_path: Path) -> None:
    settings = WorkerSettings.from_environ({"FLUXBOOTH_OUTPUT_DIR": str(tmp_path)})

    with pytest.raises(FluxboothError) as caught:
        open_store(settings, MODEL, "../other-job")

    assert caught.value.code is ErrorCode.INTERNAL
    assert "job id" in caught.value.message


# --- the local directory store ----------------------------------------------------------------


def test_local_upload_copies_the_bytes_and_returns_a_file_uri(tmp_path: Path) -> None:
    file = build_file(tmp_path / "export", "weights.safetensors", 5000)
    store = LocalStore(tmp_path / "out")

    stored = store.upload(file.path, "weights.safetensors", sha256=file.sha256)

    target = (tmp_path / "out" / "weights.safetensors").resolve()
    assert target.read_bytes() == file.content
    assert stored == StoredArtifact(
        name="weights.safetensors", uri=target.as_uri(), url=None, bytes=5000, sha256=file.sha256
    )


def test_local_upload_creates_sharded_subfolders_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    name = "transformer/diffusion_pytorch_model-00002-of-00002.safetensors"
    file = build_file(tmp_path / "export", name, 3000)
    store = LocalStore(tmp_path / "out")

    store.upload(file.path, name, sha256=file.sha256)

    written = sorted(path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").rglob("*"))
    assert written == ["transformer", name]


def test_local_upload_with_a_wrong_sha256_fails_and_keeps_the_previous_file(tmp_path: Path) -> None:
    file = build_file(tmp_path / "export", "a.bin", 3000)
    previous = tmp_path / "out" / "a.bin"
    previous.parent.mkdir(parents=True)
    previous.write_bytes(b"previous artifact")

    with pytest.raises(FluxboothError) as caught:
        LocalStore(tmp_path / "out").upload(file.path, "a.bin", sha256="0" * 64)

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    assert "artifact a.bin changed while it was being stored" in caught.value.message
    assert previous.read_bytes() == b"previous artifact"
    assert sorted(path.name for path in previous.parent.iterdir()) == ["a.bin"]


def test_local_upload_replaces_an_existing_artifact(tmp_path: Path) -> None:
    first = build_file(tmp_path / "first", "a.bin", 100, seed=1)
    second = build_file(tmp_path / "second", "a.bin", 200, seed=2)
    store = LocalStore(tmp_path / "out")

    store.upload(first.path, "a.bin", sha256=first.sha256)
    store.upload(second.path, "a.bin", sha256=second.sha256)

    assert (tmp_path / "out" / "a.bin").read_bytes() == second.content


def test_local_upload_into_an_unwritable_place_fails_with_upload_failed(tmp_path: Path) -> None:
    file = build_file(tmp_path / "export", "a.bin", 100)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the output folder should be")

    error = upload_error(LocalStore(blocker / MODEL / JOB), file, "a.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert "check that FLUXBOOTH_OUTPUT_DIR is writable" in error.message


def test_local_upload_refuses_to_follow_a_symlinked_folder_out_of_the_directory(tmp_path: Path) -> None:
    file = build_file(tmp_path / "export", "a.bin", 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "transformer").symlink_to(outside, target_is_directory=True)

    error = upload_error(LocalStore(tmp_path / "out"), file, "transformer/a.bin")

    assert error.code is ErrorCode.UPLOAD_FAILED
    assert list(outside.iterdir()) == []


# --- keeping weights on the volume when the upload finally fails ------------------------------


def test_preserve_on_volume_copies_files_keeping_their_layout(tmp_path: Path) -> None:
    export = tmp_path / "job" / "export"
    files = [
        build_file(export, "model_index.json", 50, seed=1),
        build_file(export, "transformer/diffusion_pytorch_model-00001-of-00002.safetensors", 3000, seed=2),
        build_file(export, "transformer/diffusion_pytorch_model-00002-of-00002.safetensors", 2000, seed=3),
    ]
    volume = tmp_path / "runpod-volume"
    volume.mkdir()

    kept = preserve_on_volume([file.path for file in files], volume, MODEL, JOB)

    assert kept == volume / "fluxbooth-unuploaded" / MODEL / JOB
    for file in files:
        assert (kept / file.path.relative_to(export)).read_bytes() == file.content
    assert len([path for path in kept.rglob("*") if path.is_file()]) == 3


def test_preserve_on_volume_copies_whole_folders(tmp_path: Path) -> None:
    export = tmp_path / "export"
    weights = build_file(export, "lora/pytorch_lora_weights.safetensors", 1000)
    volume = tmp_path / "volume"
    volume.mkdir()

    kept = preserve_on_volume([export / "lora"], volume, MODEL, JOB)

    assert (kept / "lora" / "pytorch_lora_weights.safetensors").read_bytes() == weights.content


def test_preserve_on_volume_without_enough_space_fails_naming_the_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = build_file(tmp_path / "export", "model.safetensors", 1000)
    volume = tmp_path / "volume"
    volume.mkdir()
    # A full disk cannot be produced on demand; report no free bytes instead.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))

    with pytest.raises(FluxboothError) as caught:
        preserve_on_volume([weights.path], volume, MODEL, JOB)

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    assert f"keeping the trained weights on the persistent volume at {volume}" in caught.value.message
    assert "free space on the volume" in caught.value.message


# --- the fixtures themselves ------------------------------------------------------------------


def test_bucket_env_reaches_the_server_from_a_subprocess(s3_bucket_env: dict[str, str], s3_client: BaseClient) -> None:
    script = (
        "import os, boto3\n"
        "client = boto3.client('s3', endpoint_url=os.environ['BUCKET_ENDPOINT_URL'],"
        " aws_access_key_id=os.environ['BUCKET_ACCESS_KEY_ID'],"
        " aws_secret_access_key=os.environ['BUCKET_SECRET_ACCESS_KEY'],"
        " region_name=os.environ['BUCKET_REGION'])\n"
        "client.put_object(Bucket=os.environ['BUCKET_NAME'], Key='from-subprocess', Body=b'hello')\n"
    )

    subprocess.run([sys.executable, "-c", script], env={**os.environ, **s3_bucket_env}, check=True, timeout=60)

    body = s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key="from-subprocess")["Body"].read()
    assert body == b"hello"


@pytest.fixture
def host_aws_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a developer's shell might export; requested before s3_bucket_env in the test below."""
    monkeypatch.setenv("AWS_PROFILE", "fluxbooth-no-such-profile")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "host-key-id")
    monkeypatch.setenv("BUCKET_NAME", "host-bucket")


def test_bucket_env_hides_host_aws_configuration(
    host_aws_configuration: None, s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:

    file = build_file(tmp_path, "a.bin", 10)

    stored = s3_store(s3_bucket_env).upload(file.path, "a.bin", sha256=file.sha256)

    assert stored.bytes == 10
    assert "AWS_PROFILE" not in os.environ
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    assert os.environ.get("BUCKET_NAME") is None


# --- deleting a folder (checkpoint pruning) -----------------------------------------------------


def is_delete_objects(request: RecordedRequest) -> bool:
    return request.method == "POST" and "delete" in request.query


def put_tiny_objects(client: BaseClient, env: dict[str, str], names: list[str]) -> None:
    for name in names:
        client.put_object(Bucket=env["BUCKET_NAME"], Key=key_of(env, name), Body=b"x")


def keys_under_job(client: BaseClient, env: dict[str, str]) -> list[str]:
    prefix = key_of(env, "")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=env["BUCKET_NAME"], Prefix=prefix)
    return sorted(item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", []))


def test_s3_delete_folder_removes_more_than_1000_objects_in_batches_of_at_most_1000(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient
) -> None:
    put_tiny_objects(s3_client, s3_bucket_env, [f"checkpoint-2/file-{index:04d}" for index in range(1001)])

    removed = s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).delete_folder("checkpoint-2")

    assert removed == 1001
    assert keys_under_job(s3_client, s3_bucket_env) == []
    assert len([request for request in s3_fault_proxy.requests if is_delete_objects(request)]) == 2


def test_s3_delete_folder_leaves_a_sibling_whose_name_starts_the_same(
    s3_bucket_env: dict[str, str], s3_client: BaseClient
) -> None:
    put_tiny_objects(s3_client, s3_bucket_env, ["checkpoint-1/a", "checkpoint-1/nested/b", "checkpoint-10/a"])

    removed = s3_store(s3_bucket_env).delete_folder("checkpoint-1")

    assert removed == 2
    assert keys_under_job(s3_client, s3_bucket_env) == ["checkpoint-10/a"]


def test_s3_delete_folder_of_a_missing_folder_removes_nothing(s3_bucket_env: dict[str, str]) -> None:
    assert s3_store(s3_bucket_env).delete_folder("checkpoint-404") == 0


def test_s3_delete_folder_sends_content_md5_for_services_that_refuse_crc32_only(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient
) -> None:
    put_tiny_objects(s3_client, s3_bucket_env, ["checkpoint-2/a"])

    s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).delete_folder("checkpoint-2")

    (delete,) = [request for request in s3_fault_proxy.requests if is_delete_objects(request)]
    assert len(base64.b64decode(delete.headers["content-md5"])) == 16


def test_s3_delete_folder_refused_by_the_service_fails_with_upload_failed_naming_the_folder(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, s3_client: BaseClient
) -> None:
    put_tiny_objects(s3_client, s3_bucket_env, ["checkpoint-2/a"])
    s3_fault_proxy.fail_always(is_delete_objects, InjectedFault(status=403, code="AccessDenied"))

    with pytest.raises(FluxboothError) as caught:
        s3_store(via_proxy(s3_bucket_env, s3_fault_proxy)).delete_folder("checkpoint-2")

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    folder_uri = f"s3://{s3_bucket_env['BUCKET_NAME']}/{key_of(s3_bucket_env, 'checkpoint-2/')}"
    assert caught.value.message.startswith(f"deleting {folder_uri} failed: access denied")
    assert keys_under_job(s3_client, s3_bucket_env) == ["checkpoint-2/a"]


def test_s3_delete_folder_with_keys_refused_in_the_response_fails_without_echoing_credentials(
    s3_bucket_env: dict[str, str], s3_client: BaseClient
) -> None:
    put_tiny_objects(s3_client, s3_bucket_env, ["checkpoint-2/a", "checkpoint-2/b"])
    store = s3_store(s3_bucket_env)
    access_key = s3_bucket_env["BUCKET_ACCESS_KEY_ID"]

    # A test double on the real client: DeleteObjects answers 200 and lists refused keys in `Errors`,
    # which moto does only for object-locked versions (never for the plain keys delete_folder sends).
    def refuse_one_key(parsed: dict[str, object], **_: object) -> None:
        refused = {"Key": key_of(s3_bucket_env, "checkpoint-2/b"), "Code": "AccessDenied"}
        parsed["Errors"] = [{**refused, "Message": f"Access Denied for {access_key}"}]

    store.client.meta.events.register("after-call.s3.DeleteObjects", refuse_one_key)

    with pytest.raises(FluxboothError) as caught:
        store.delete_folder("checkpoint-2")

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    folder_uri = f"s3://{s3_bucket_env['BUCKET_NAME']}/{key_of(s3_bucket_env, 'checkpoint-2/')}"
    assert caught.value.message == (
        f"deleting {folder_uri} failed: the service refused 1 of its 2 objects (AccessDenied on "
        f"{key_of(s3_bucket_env, 'checkpoint-2/b')}: Access Denied for [REDACTED]); give the key in "
        "BUCKET_ACCESS_KEY_ID permission to delete objects, or remove them by hand"
    )


def test_s3_delete_folder_refuses_a_name_that_is_not_one_path_segment(s3_bucket_env: dict[str, str]) -> None:
    with pytest.raises(FluxboothError) as caught:
        s3_store(s3_bucket_env).delete_folder("checkpoint-2/..")

    assert caught.value.code is ErrorCode.INTERNAL
    assert "cannot be used as a folder or key segment" in caught.value.message


def test_local_delete_folder_removes_the_folder_and_counts_its_files(tmp_path: Path) -> None:
    for name in ("checkpoint-1/a", "checkpoint-1/nested/b", "checkpoint-10/a"):
        build_file(tmp_path / "out", name, 10)

    removed = LocalStore(tmp_path / "out").delete_folder("checkpoint-1")

    assert removed == 2
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checkpoint-10"]


def test_local_delete_folder_of_a_missing_folder_removes_nothing(tmp_path: Path) -> None:
    assert LocalStore(tmp_path / "out").delete_folder("checkpoint-404") == 0


def test_local_delete_folder_refuses_a_symlinked_folder_and_keeps_what_it_points_to(tmp_path: Path) -> None:
    kept = build_file(tmp_path / "out", "checkpoint-8/a", 10)
    (tmp_path / "out" / "checkpoint-2").symlink_to(tmp_path / "out" / "checkpoint-8")

    with pytest.raises(FluxboothError) as caught:
        LocalStore(tmp_path / "out").delete_folder("checkpoint-2")

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    assert "is a link or leads outside" in caught.value.message
    assert kept.path.read_bytes() == kept.content


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "a\\b"])
def test_local_delete_folder_refuses_a_name_that_is_not_one_path_segment(tmp_path: Path, name: str) -> None:
    outside = build_file(tmp_path, "precious/a", 10)

    with pytest.raises(FluxboothError) as caught:
        LocalStore(tmp_path / "out").delete_folder(name)

    assert caught.value.code is ErrorCode.INTERNAL
    assert outside.path.is_file()


# --- RunPod's bucket conventions: the bucket named by BUCKET_ENDPOINT_URL ----------------------------


@pytest.mark.parametrize(
    ("url", "service_url", "bucket", "region", "prefix"),
    [
        (
            "https://my-loras.s3.us-west-2.amazonaws.com",
            "https://s3.us-west-2.amazonaws.com",
            "my-loras",
            "us-west-2",
            "",
        ),
        ("https://my-loras.s3.amazonaws.com", "https://s3.amazonaws.com", "my-loras", None, ""),
        (
            "https://my.dotted.bucket.s3-eu-west-1.amazonaws.com",
            "https://s3-eu-west-1.amazonaws.com",
            "my.dotted.bucket",
            "eu-west-1",
            "",
        ),
        ("https://my-loras.nyc3.digitaloceanspaces.com", "https://nyc3.digitaloceanspaces.com", "my-loras", "nyc3", ""),
        (
            "https://my-loras.s3.us-west-004.backblazeb2.com",
            "https://s3.us-west-004.backblazeb2.com",
            "my-loras",
            "us-west-004",
            "",
        ),
        (
            "https://acct.r2.cloudflarestorage.com/my-loras",
            "https://acct.r2.cloudflarestorage.com",
            "my-loras",
            None,
            "",
        ),
        ("http://127.0.0.1:9000/my-loras/team-a/", "http://127.0.0.1:9000", "my-loras", None, "team-a"),
        (
            "https://s3.us-east-2.amazonaws.com/my-loras",
            "https://s3.us-east-2.amazonaws.com",
            "my-loras",
            "us-east-2",
            "",
        ),
        ("https://acct.r2.cloudflarestorage.com", "https://acct.r2.cloudflarestorage.com", None, None, ""),
    ],
    ids=[
        "aws-regional",
        "aws-global",
        "aws-dash-region",
        "spaces",
        "backblaze",
        "r2-path",
        "minio-path-prefix",
        "aws-path",
        "no-bucket",
    ],
)
def test_the_bucket_is_read_from_the_endpoint_url_as_runpod_writes_it(
    url: str, service_url: str, bucket: str | None, region: str | None, prefix: str
) -> None:
    location = locate_bucket(url)
    assert (location.service_url, location.bucket, location.region, location.prefix) == (
        service_url,
        bucket,
        region,
        prefix,
    )


def runpod_bucket_env(s3_bucket_env: dict[str, str]) -> dict[str, str]:
    """Only RunPod's three variables, the bucket inside the URL (path style: moto has no per-bucket DNS)."""
    return {
        "BUCKET_ENDPOINT_URL": f"{s3_bucket_env['BUCKET_ENDPOINT_URL']}/{s3_bucket_env['BUCKET_NAME']}",
        "BUCKET_ACCESS_KEY_ID": s3_bucket_env["BUCKET_ACCESS_KEY_ID"],
        "BUCKET_SECRET_ACCESS_KEY": s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"],
    }


def test_runpods_three_variables_alone_upload_to_the_bucket_in_the_url(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    settings = WorkerSettings.from_environ(runpod_bucket_env(s3_bucket_env))
    file = build_file(tmp_path, "weights.safetensors", 1000)

    stored = open_store(settings, MODEL, JOB).upload(file.path, "weights.safetensors", sha256=file.sha256)

    key = f"fluxbooth/{MODEL}/{JOB}/weights.safetensors"
    assert stored.uri == f"s3://{s3_bucket_env['BUCKET_NAME']}/{key}"
    assert s3_client.get_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=key)["Body"].read() == file.content


def test_a_bucket_url_naming_no_bucket_is_a_setting_error_not_the_local_disk(s3_bucket_env: dict[str, str]) -> None:
    env = {**runpod_bucket_env(s3_bucket_env), "BUCKET_ENDPOINT_URL": s3_bucket_env["BUCKET_ENDPOINT_URL"]}
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ(env)
    assert str(caught.value) == (
        "BUCKET_ENDPOINT_URL names no bucket: write it as https://<bucket>.s3.<region>.amazonaws.com or "
        "https://<host>/<bucket> (R2, MinIO, other S3-compatible stores), or set BUCKET_NAME"
    )


def test_bucket_name_disagreeing_with_the_bucket_in_the_host_is_refused() -> None:
    env = {"BUCKET_ENDPOINT_URL": "https://my-loras.s3.us-west-2.amazonaws.com", "BUCKET_NAME": "other"}
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ(env)
    assert str(caught.value) == (
        "BUCKET_NAME='other' but BUCKET_ENDPOINT_URL names the bucket 'my-loras'; remove BUCKET_NAME or make them agree"
    )


def test_bucket_name_with_a_path_style_url_keeps_the_path_as_folders() -> None:
    bucket = WorkerSettings.from_environ(
        {"BUCKET_ENDPOINT_URL": "http://minio:9000/team-a", "BUCKET_NAME": "loras", "BUCKET_PREFIX": "runs"}
    ).bucket
    assert bucket is not None
    assert (bucket.endpoint_url, bucket.bucket, bucket.prefix) == ("http://minio:9000", "loras", "team-a/runs")


def test_the_region_comes_from_the_url_unless_bucket_region_says_otherwise() -> None:
    url = {"BUCKET_ENDPOINT_URL": "https://my-loras.s3.eu-central-1.amazonaws.com"}
    assert WorkerSettings.from_environ(url).bucket.region == "eu-central-1"  # type: ignore[union-attr]
    assert WorkerSettings.from_environ({**url, "BUCKET_REGION": "eu-west-3"}).bucket.region == "eu-west-3"  # type: ignore[union-attr]


# --- on RunPod, weights never silently land on the worker's disk --------------------------------------

ON_RUNPOD = {"RUNPOD_POD_ID": "abc123xyz", "RUNPOD_ENDPOINT_ID": "ep-42"}
NO_BUCKET_ON_RUNPOD = (
    "worker configuration: no bucket is configured, and this worker runs on RunPod, whose container disk is deleted "
    "with the worker: set BUCKET_ENDPOINT_URL (https://<bucket>.s3.<region>.amazonaws.com or https://<host>/<bucket>), "
    "BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY on the endpoint, or set FLUXBOOTH_ALLOW_LOCAL_OUTPUT=1 to keep "
    "the weights in FLUXBOOTH_OUTPUT_DIR (a network volume path) on purpose"
)


@pytest.mark.parametrize("marker", ["RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"])
def test_a_runpod_worker_without_a_bucket_is_refused(marker: str, tmp_path: Path) -> None:
    settings = WorkerSettings.from_environ({marker: ON_RUNPOD[marker], "FLUXBOOTH_OUTPUT_DIR": str(tmp_path)})
    with pytest.raises(FluxboothError) as caught:
        storage.require_usable_storage(settings)
    assert caught.value.code is ErrorCode.INTERNAL
    assert caught.value.message == NO_BUCKET_ON_RUNPOD
    assert caught.value.refresh_worker is False


def test_local_runs_keep_the_local_output_directory_default(tmp_path: Path) -> None:
    settings = WorkerSettings.from_environ({"FLUXBOOTH_OUTPUT_DIR": str(tmp_path)})
    storage.require_usable_storage(settings)
    assert storage.local_output_warning(settings) is None


def test_a_runpod_worker_with_a_bucket_is_fine(s3_bucket_env: dict[str, str]) -> None:
    settings = WorkerSettings.from_environ({**ON_RUNPOD, **runpod_bucket_env(s3_bucket_env)})
    storage.require_usable_storage(settings)
    assert storage.local_output_warning(settings) is None


def test_opting_into_local_output_on_runpod_is_allowed_with_a_warning(tmp_path: Path) -> None:
    env = {
        **ON_RUNPOD,
        "FLUXBOOTH_ALLOW_LOCAL_OUTPUT": "1",
        "FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
    }
    settings = WorkerSettings.from_environ(env)
    storage.require_usable_storage(settings)
    assert storage.local_output_warning(settings) == (
        f"the weights were written to {tmp_path / 'outputs'} on this worker's own disk, which RunPod deletes with the "
        "worker: fetch them before it scales down, or configure a bucket (BUCKET_ENDPOINT_URL) or a "
        "FLUXBOOTH_OUTPUT_DIR on the network volume"
    )


def test_local_output_on_the_network_volume_needs_no_warning(tmp_path: Path) -> None:
    volume = tmp_path / "runpod-volume"
    volume.mkdir()
    env = {
        **ON_RUNPOD,
        "FLUXBOOTH_ALLOW_LOCAL_OUTPUT": "1",
        "FLUXBOOTH_OUTPUT_DIR": str(volume / "loras"),
        "FLUXBOOTH_VOLUME_DIR": str(volume),
        "FLUXBOOTH_VOLUME_PERSISTENT": "1",
    }
    assert storage.local_output_warning(WorkerSettings.from_environ(env)) is None
