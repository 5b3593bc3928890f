"""Fetch a result's artifacts into a folder, each checked against the size and sha256 the worker reported:
from its presigned `url` (a bucket), or from its `file://` uri (a local worker without a bucket).

The result comes from a server, so it is read as untrusted: every artifact must state its name, size and
sha256; a name must land strictly inside the folder and must not be one of the client's own files there; no
download writes more than the size it states, nor through a link left where its partial file goes; and a
`file://` uri is read only from a worker on this machine, and only when it is a regular file."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

import requests

from fluxbooth.client.errors import ClientError, ExitCode

CHUNK_BYTES = 1024 * 1024
DOWNLOAD_TIMEOUT_SECONDS = (15.0, 120.0)
PART_SUFFIX = ".part"
# The files the client itself writes in --out, beside the artifacts (fluxbooth.client.submission writes them).
RESULT_FILE = "result.json"
RESUME_REQUEST_FILE = "resume-request.json"
CLIENT_FILES = {
    RESULT_FILE: "the file the client writes the result into",
    RESUME_REQUEST_FILE: "the file the client writes a timed-out job's resubmission into",
}
# Where the platform has it: a partial file is never opened through a link.
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Linux's limits, used when the file system does not say its own (os.pathconf).
DEFAULT_NAME_MAX = 255
DEFAULT_PATH_MAX = 4096
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _refuse(message: str) -> ClientError:
    return ClientError(message, ExitCode.DOWNLOAD)


def checked_artifacts(value: Any, where: str) -> list[dict[str, Any]]:
    """The result's `artifacts` list, each entry an object with a name, a size in bytes and a sha256; anything
    else is refused naming the entry, before any download starts."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _refuse(f"the result's {where} is {type(value).__name__}, not a list; the worker's answer is malformed")
    for index, artifact in enumerate(value):
        entry = f"{where}[{index}]"
        if not isinstance(artifact, dict):
            raise _refuse(
                f"the result's {entry} is {type(artifact).__name__}, not an object with name, bytes and "
                "sha256; the worker's answer is malformed"
            )
        size, digest = artifact.get("bytes"), artifact.get("sha256")
        if not isinstance(artifact.get("name"), str):
            raise _refuse(f"the result's {entry} has no name; the worker's answer is malformed")
        clash = _client_file(artifact["name"])
        if clash is not None:
            raise _refuse(
                f"the result's {entry} is named {artifact['name']!r}, {clash} in the output folder; not downloaded "
                "(the worker's answer is malformed)"
            )
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _refuse(f"the result's {entry} ({artifact['name']!r}) states no size in bytes; not downloaded")
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
            raise _refuse(f"the result's {entry} ({artifact['name']!r}) states no sha256; not downloaded")
    return value


def _client_file(name: str) -> str | None:
    """What of the client's own an artifact named `name` would overwrite, or None. Compared without case, since
    the output folder may be on a file system that ignores it."""
    written = "/".join(PurePosixPath(name).parts).casefold()
    for own, what in CLIENT_FILES.items():
        if written == own.casefold():
            return what
    if written.endswith(PART_SUFFIX):
        return f"a name ending in {PART_SUFFIX}, which the client downloads each artifact into before checking it"
    return None


def _limit(folder: Path, name: str, default: int) -> int:
    """The file system's limit `name` where `folder` (or its nearest existing parent) lives."""
    for place in (folder, *folder.parents):
        try:
            return int(os.pathconf(place, name))
        except (OSError, ValueError):
            continue
    return default


def _target(out_dir: Path, name: str) -> Path:
    """Where an artifact goes: a file strictly inside out_dir whose name (and its .part) the file system takes."""
    shown = repr(name) if len(name) <= 120 else repr(name[:120]) + f"... ({len(name)} characters)"
    relative = PurePosixPath(name)
    if "\0" in name:
        raise _refuse(f"the result names an artifact {shown} with a NUL character; not downloaded")
    if not relative.parts or relative.is_absolute() or ".." in relative.parts:
        raise _refuse(f"the result names an artifact {shown} outside the output folder; not downloaded")
    target = out_dir.absolute().joinpath(*relative.parts)
    try:
        components = [os.fsencode(part) for part in relative.parts]
        full = os.fsencode(str(target) + PART_SUFFIX)
    except UnicodeError:
        raise _refuse(f"the result names an artifact {shown} that is not a valid file name; not downloaded") from None
    name_max = _limit(out_dir.absolute(), "PC_NAME_MAX", DEFAULT_NAME_MAX)
    if max(map(len, components[:-1]), default=0) > name_max or len(components[-1] + PART_SUFFIX.encode()) > name_max:
        raise _refuse(
            f"the result names an artifact {shown} with a name longer than the file system's "
            f"{name_max} bytes; not downloaded"
        )
    if len(full) >= _limit(out_dir.absolute(), "PC_PATH_MAX", DEFAULT_PATH_MAX):
        raise _refuse(
            f"the result names an artifact {shown} whose path is longer than the file system takes; "
            "not downloaded (choose a shorter --out)"
        )
    return target


def _chunks_from_url(url: str, limit: int) -> Iterator[bytes]:
    try:
        with requests.get(url, stream=True, timeout=DOWNLOAD_TIMEOUT_SECONDS) as response:
            if response.status_code != 200:
                raise _refuse(f"HTTP {response.status_code} from {urlsplit(url).netloc}")
            yield from response.iter_content(min(CHUNK_BYTES, limit + 1))
    except requests.RequestException as error:
        raise _refuse(f"{type(error).__name__}: {error}") from error


def _chunks_from_file(uri: str, limit: int) -> Iterator[bytes]:
    path = Path(unquote(urlsplit(uri).path))
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on what was opened.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise _refuse(
            f"cannot read {path}: {error.strerror or error} (a file:// artifact is readable only on the worker's "
            "machine; give the worker a bucket to download from anywhere)"
        ) from error
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise _refuse(f"{path} is not a regular file; a file:// artifact must be one")
        while chunk := handle.read(min(CHUNK_BYTES, limit + 1)):
            yield chunk


def _source(artifact: Mapping[str, Any], allow_files: bool) -> Callable[[int], Iterable[bytes]]:
    url, uri = artifact.get("url"), str(artifact.get("uri") or "")
    if isinstance(url, str) and url:
        if urlsplit(url).scheme not in {"http", "https"}:
            raise _refuse(f"its url {url[:200]!r} is not http(s)")
        return lambda limit: _chunks_from_url(url, limit)
    if uri.startswith("file://"):
        if not allow_files:
            raise _refuse(
                "it is a file:// uri, read only from a worker on this machine (--url to localhost); "
                "give the endpoint a bucket so its artifacts have a url"
            )
        return lambda limit: _chunks_from_file(uri, limit)
    raise _refuse(f"no presigned url and no file:// uri to fetch it from ({uri[:200] or 'none'})")


def _open_partial(partial: Path) -> BinaryIO:
    """A new, empty partial file. Whatever was left at its place (a partial from an earlier run, or a link to a
    file outside the folder) is removed, never written through; the new one is created exclusively and not
    through a link, so a link put there meanwhile makes the download fail instead of redirecting it."""
    partial.unlink(missing_ok=True)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o666)
    return os.fdopen(descriptor, "wb")


def _discard(partial: Path) -> None:
    """Remove a partial file that will not be kept; one that cannot be removed is left, not raised over the
    error that ended its download."""
    try:
        partial.unlink(missing_ok=True)
    except OSError:
        pass


def _fetch(artifact: Mapping[str, Any], partial: Path, allow_files: bool) -> tuple[str, int]:
    """Write the artifact's bytes to `partial`, never more than it states; its sha256 and size."""
    expected = int(artifact["bytes"])
    digest, size = hashlib.sha256(), 0
    with _open_partial(partial) as handle:
        for chunk in _source(artifact, allow_files)(expected):
            size += len(chunk)
            if size > expected:
                raise _refuse(f"the source sent more than the {expected} bytes the result states; stopped there")
            handle.write(chunk)
            digest.update(chunk)
    return digest.hexdigest(), size


def download_artifact(artifact: Mapping[str, Any], out_dir: Path, allow_files: bool = False) -> Path:
    """Write one checked artifact under out_dir (through a .part file), or raise naming it and what did not match.
    `allow_files`: read `file://` uris (only for a worker on this machine)."""
    name = str(artifact["name"])
    target = _target(out_dir, name)
    partial = target.with_name(target.name + PART_SUFFIX)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.parent.resolve().is_relative_to(out_dir.resolve()):
            raise _refuse(f"the result names an artifact {name!r} that leads out of the output folder through a link")
        got_sha, size = _fetch(artifact, partial, allow_files)
    except (ClientError, OSError) as error:
        _discard(partial)
        reason = error.message if isinstance(error, ClientError) else f"{error.strerror or error}"
        raise _refuse(f"downloading {name} failed: {reason}") from error
    if got_sha != artifact["sha256"] or size != artifact["bytes"]:
        _discard(partial)
        raise _refuse(
            f"{name}: got {size} bytes with sha256 {got_sha}, the result says {artifact['bytes']} bytes with "
            f"sha256 {artifact['sha256']}; the file was not kept"
        )
    try:
        os.replace(partial, target)
    except OSError as error:
        _discard(partial)
        raise _refuse(f"downloading {name} failed: cannot write {target}: {error.strerror or error}") from error
    return target


def download_all(
    artifacts: Iterable[Mapping[str, Any]], out_dir: Path, say: Callable[[str], None], allow_files: bool = False
) -> list[Path]:
    """Every artifact (as checked_artifacts returns them), in the result's order; the first failure stops the rest."""
    written = []
    for artifact in artifacts:
        path = download_artifact(artifact, out_dir, allow_files)
        say(f"  {artifact['name']}  {artifact['bytes']} bytes  sha256 ok")
        written.append(path)
    return written
