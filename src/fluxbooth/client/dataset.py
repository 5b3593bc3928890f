"""The photos a client sends: a folder packed into a zip, a zip file, or a link, and how each travels to the
worker: inline as base64 when the /run body stays under RunPod's limit, otherwise uploaded to the bucket with a
presigned PUT and sent as `dataset_url` (a presigned GET).

Torch-free: only the zip module, boto3 (to sign URLs, offline) and requests (for the PUT).
"""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import uuid
import zipfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from fluxbooth.client.errors import ClientError, ExitCode
from fluxbooth.dataset.guards import ROLE_FOLDERS
from fluxbooth.dataset.members import CAPTION_EXTENSION, IMAGE_EXTENSIONS
from fluxbooth.messages import format_bytes
from fluxbooth.settings import BucketSettings, DatasetLimits, bucket_from_environ

# RunPod refuses a /run body over 10 MB; the margin keeps headers and JSON framing out of the question.
RUNPOD_RUN_BODY_LIMIT_BYTES = 10 * 1000 * 1000
UPLOAD_TIMEOUT_SECONDS = 600.0
UPLOADS_FOLDER = "uploads"
# The files left out of the zip named in the client's output, at most this many (then a count).
LEFT_OUT_NAMED = 10


@dataclass(frozen=True)
class DatasetSource:
    """What PHOTOS named: zip bytes to send (packed from a folder or read from a file), or a link to pass on."""

    zip_bytes: bytes | None
    url: str | None
    description: str
    # A folder's files that are not in the zip: not photos or captions (relative paths), and hidden ones (a count).
    left_out: tuple[str, ...] = ()
    hidden_left_out: int = 0


@dataclass(frozen=True)
class FolderFiles:
    """A photo folder sorted: what goes into the zip, and what is left out."""

    kept: list[Path]
    left_out: list[Path]
    hidden: int


def is_link(photos: str) -> bool:
    return urlsplit(photos).scheme in {"http", "https"}


def _walk(folder: Path) -> list[Path]:
    """Every file under folder; unlike Path.rglob, a folder that cannot be listed is an error, not skipped."""
    found: list[Path] = []
    for root, _, names in os.walk(folder, onerror=_raise):
        found.extend(Path(root) / name for name in names)
    return found


def _raise(error: OSError) -> None:
    raise error


def _dataset_files(folder: Path) -> FolderFiles:
    """Images and the captions beside them, in a stable order; hidden files and folders are skipped, and so is
    anything else (a .pdf, a .docx, a raw photo), which the output then names."""
    try:
        paths = sorted(_walk(folder))
    except OSError as error:
        raise ClientError(
            f"cannot read the photo folder {folder}: {error.strerror or error}", ExitCode.USAGE
        ) from error
    kept, left_out, hidden = [], [], 0
    for path in paths:
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            hidden += 1
        elif path.is_file() and (path.suffix.lower() in IMAGE_EXTENSIONS or path.suffix.lower() == CAPTION_EXTENSION):
            kept.append(path)
        else:
            left_out.append(path)
    return FolderFiles(kept, left_out, hidden)


def left_out_line(source: DatasetSource) -> str | None:
    """The line naming what the zip left out of the folder, or None when nothing was."""
    if not source.left_out and not source.hidden_left_out:
        return None
    named = list(source.left_out[:LEFT_OUT_NAMED])
    if len(source.left_out) > LEFT_OUT_NAMED:
        named.append(f"and {len(source.left_out) - LEFT_OUT_NAMED} more")
    if source.hidden_left_out:
        named.append(f"{source.hidden_left_out} hidden file(s)")
    return f"left out of the zip (only photos and .txt captions travel): {', '.join(named)}"


def _check_image_cap(folder: Path, images: list[Path], max_images: int) -> None:
    """Refuse a folder the worker would refuse for its image count (its cap per role: the photos, class/,
    control/), before anything is packed or uploaded."""
    counts = Counter(
        parts[0].lower() if len(parts) > 1 and parts[0].lower() in ROLE_FOLDERS else "instance"
        for parts in (path.relative_to(folder).parts for path in images)
    )
    for role, count in sorted(counts.items()):
        if count > max_images:
            where = folder if role == "instance" else folder / role
            raise ClientError(
                f"{where} holds {count} {'photos' if role == 'instance' else role + ' images'}; the worker accepts at "
                f"most {max_images} (FLUXBOOTH_MAX_IMAGES): choose your best {max_images}",
                ExitCode.USAGE,
            )


def pack_folder(folder: Path, max_images: int = DatasetLimits.max_images) -> bytes:
    """The folder's images and `<stem>.txt` captions (and its `class/`, `control/` subfolders) as a zip."""
    return _pack(folder, _dataset_files(folder).kept, max_images)


def _pack(folder: Path, files: list[Path], max_images: int) -> bytes:
    images = [path for path in files if path.suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        known = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise ClientError(
            f"no photos in {folder}: put the images ({known}) there, captions beside them as .txt", ExitCode.USAGE
        )
    _check_image_cap(folder, images, max_images)
    buffer = io.BytesIO()
    # Photos are compressed already; storing them keeps packing fast and the zip the same size.
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for path in files:
            try:
                archive.writestr(path.relative_to(folder).as_posix(), path.read_bytes())
            except OSError as error:
                raise ClientError(f"cannot read {path}: {error.strerror or error}", ExitCode.USAGE) from error
    return buffer.getvalue()


def read_photos(photos: str) -> DatasetSource:
    """PHOTOS as given on the command line: a folder, a .zip file, or an http(s) link to a zip."""
    if is_link(photos):
        return DatasetSource(None, photos, f"the link {photos}")
    path = Path(photos).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ClientError(
            f"{photos} does not exist: give a folder of photos, a .zip, or an https:// link", ExitCode.USAGE
        ) from None
    except OSError as error:
        raise ClientError(f"cannot read {path}: {error.strerror or error}", ExitCode.USAGE) from error
    if stat.S_ISDIR(mode):
        sorted_files = _dataset_files(path)
        packed = _pack(path, sorted_files.kept, DatasetLimits.max_images)
        return DatasetSource(
            packed,
            None,
            f"{path} packed into a zip of {format_bytes(len(packed))}",
            tuple(item.relative_to(path).as_posix() for item in sorted_files.left_out),
            sorted_files.hidden,
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ClientError(f"cannot read {path}: {error.strerror or error}", ExitCode.USAGE) from error
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise ClientError(
            f"{path} is not a zip file: give a folder of photos, a .zip, or an https:// link", ExitCode.USAGE
        )
    return DatasetSource(data, None, f"{path} ({format_bytes(len(data))})")


def run_body(job_input: Mapping[str, Any], policy: Mapping[str, Any] | None, webhook: str | None) -> bytes:
    """The exact JSON body POSTed to /run."""
    body: dict[str, Any] = {"input": dict(job_input)}
    if policy:
        body["policy"] = dict(policy)
    if webhook:
        body["webhook"] = webhook
    return json.dumps(body).encode()


def fits_inline(job_input: Mapping[str, Any], zip_bytes: bytes, extra: Mapping[str, Any]) -> bool:
    """True when the /run body carrying the zip as base64 stays within RunPod's limit."""
    encoded_chars = 4 * ((len(zip_bytes) + 2) // 3)
    rest = len(run_body({**job_input, "dataset": ""}, extra.get("policy"), extra.get("webhook")))
    return rest + encoded_chars <= RUNPOD_RUN_BODY_LIMIT_BYTES


def _s3_client(bucket: BucketSettings) -> Any:
    # deferred: boto3 is slow to import, and only a dataset too large to send inline is uploaded
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=bucket.access_key_id or None,
        aws_secret_access_key=bucket.secret_access_key or None,
        region_name=bucket.region or None,
    )
    config = Config(signature_version="s3v4", s3={"addressing_style": "path" if bucket.endpoint_url else "auto"})
    return session.client("s3", endpoint_url=bucket.endpoint_url or None, config=config)


def bucket_for_upload(environ: Mapping[str, str]) -> BucketSettings | None:
    try:
        return bucket_from_environ(environ)
    except ValueError as error:
        raise ClientError(f"the bucket settings are unusable: {error}", ExitCode.USAGE) from error


def upload_zip(zip_bytes: bytes, bucket: BucketSettings) -> str:
    """PUT the zip to the bucket through a presigned URL; return a presigned GET link the worker can fetch."""
    key = "/".join(part for part in (bucket.prefix, UPLOADS_FOLDER, uuid.uuid4().hex, "dataset.zip") if part)
    client = _s3_client(bucket)
    put_url = client.generate_presigned_url(
        "put_object", Params={"Bucket": bucket.bucket, "Key": key}, ExpiresIn=int(UPLOAD_TIMEOUT_SECONDS) * 2
    )
    try:
        response = requests.put(put_url, data=zip_bytes, timeout=UPLOAD_TIMEOUT_SECONDS)
    except requests.RequestException as error:
        raise ClientError(
            f"uploading the dataset to the bucket failed: {type(error).__name__}: {error}", ExitCode.API
        ) from error
    if response.status_code >= 300:
        raise ClientError(
            f"the bucket refused the dataset upload (HTTP {response.status_code}): {response.text[:300]}; "
            "check BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID and BUCKET_SECRET_ACCESS_KEY",
            ExitCode.API,
        )
    return str(
        client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket.bucket, "Key": key}, ExpiresIn=bucket.presign_seconds
        )
    )


def dataset_fields(
    source: DatasetSource, job_input: Mapping[str, Any], extra: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, str], str]:
    """The request's dataset field (`dataset` or `dataset_url`), and a line saying how the photos travel."""
    if source.url is not None:
        return {"dataset_url": source.url}, f"dataset: {source.description}, fetched by the worker"
    assert source.zip_bytes is not None
    if fits_inline(job_input, source.zip_bytes, extra):
        return {"dataset": base64.b64encode(source.zip_bytes).decode()}, f"dataset: {source.description}, sent inline"
    bucket = bucket_for_upload(environ)
    if bucket is None:
        raise ClientError(
            f"the dataset zip is {format_bytes(len(source.zip_bytes))}: too big for RunPod's 10 MB /run body once "
            "base64-encoded (about 7.4 MB of zip); set BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID and "
            "BUCKET_SECRET_ACCESS_KEY so the client uploads it, or host the zip and pass its https:// link",
            ExitCode.USAGE,
        )
    link = upload_zip(source.zip_bytes, bucket)
    return {"dataset_url": link}, f"dataset: {source.description}, uploaded to s3://{bucket.bucket}"
