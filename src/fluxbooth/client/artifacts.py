"""Fetch a result's artifacts into a folder, each checked against the size and sha256 the worker reported:
from its presigned `url` (a bucket), or from its `file://` uri (a local worker without a bucket)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

import requests

from fluxbooth.client.errors import ClientError, ExitCode

CHUNK_BYTES = 1024 * 1024
DOWNLOAD_TIMEOUT_SECONDS = (15.0, 120.0)


def _target(out_dir: Path, name: str) -> Path:
    """Where an artifact goes; a name that would leave the folder is refused."""
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise ClientError(f"the result names an artifact {name!r} outside the output folder; not downloaded", ExitCode.DOWNLOAD)
    return out_dir.joinpath(*relative.parts)


def _chunks_from_url(url: str) -> Iterator[bytes]:
    try:
        with requests.get(url, stream=True, timeout=DOWNLOAD_TIMEOUT_SECONDS) as response:
            if response.status_code != 200:
                raise ClientError(f"HTTP {response.status_code} from {urlsplit(url).netloc}", ExitCode.DOWNLOAD)
            yield from response.iter_content(CHUNK_BYTES)
    except requests.RequestException as error:
        raise ClientError(f"{type(error).__name__}: {error}", ExitCode.DOWNLOAD) from error


def _chunks_from_file(uri: str) -> Iterator[bytes]:
    path = Path(unquote(urlsplit(uri).path))
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                yield chunk
    except OSError as error:
        raise ClientError(
            f"cannot read {path}: {error.strerror or error} (a file:// artifact is readable only on the worker's "
            "machine; give the worker a bucket to download from anywhere)", ExitCode.DOWNLOAD,
        ) from error


def _source(artifact: Mapping[str, Any]) -> Callable[[], Iterable[bytes]]:
    url, uri = artifact.get("url"), str(artifact.get("uri") or "")
    if isinstance(url, str) and url:
        return lambda: _chunks_from_url(url)
    if uri.startswith("file://"):
        return lambda: _chunks_from_file(uri)
    raise ClientError(f"{artifact.get('name')}: no presigned url and no file:// uri to fetch it from ({uri or 'none'})", ExitCode.DOWNLOAD)


def download_artifact(artifact: Mapping[str, Any], out_dir: Path) -> Path:
    """Write one artifact under out_dir (through a .part file), or raise naming it and what did not match."""
    name = str(artifact.get("name", ""))
    target = _target(out_dir, name)
    partial = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as handle:
            for chunk in _source(artifact)():
                handle.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except ClientError as error:
        partial.unlink(missing_ok=True)
        raise ClientError(f"downloading {name} failed: {error.message}", ExitCode.DOWNLOAD) from error
    expected_sha, expected_bytes = artifact.get("sha256"), artifact.get("bytes")
    if digest.hexdigest() != expected_sha or (expected_bytes is not None and size != expected_bytes):
        partial.unlink(missing_ok=True)
        raise ClientError(
            f"{name}: got {size} bytes with sha256 {digest.hexdigest()}, the result says {expected_bytes} bytes with "
            f"sha256 {expected_sha}; the file was not kept", ExitCode.DOWNLOAD,
        )
    os.replace(partial, target)
    return target


def download_all(artifacts: Iterable[Mapping[str, Any]], out_dir: Path, say: Callable[[str], None]) -> list[Path]:
    """Every artifact, in the result's order; the first one that fails stops the rest."""
    written = []
    for artifact in artifacts:
        path = download_artifact(artifact, out_dir)
        say(f"  {artifact.get('name')}  {artifact.get('bytes')} bytes  sha256 ok")
        written.append(path)
    return written

