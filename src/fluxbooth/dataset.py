"""From the request's zip (base64 or URL) to clean per-job image folders the trainer can trust.

Layout inside the job directory:

    job_dir/dataset.zip         the archive as received (removed once prepared)
    job_dir/raw/                extraction scratch, one file per accepted member (removed once prepared)
    job_dir/data/instance/      normalised 8-bit RGB PNGs, plus `<stem>.txt` captions
    job_dir/data/class/         the same for the zip's top-level `class/` folder, if any

Everything here treats the upload as hostile: sizes are capped before decoding, member names are checked
but never used as paths (extracted files get generated names), decompression is streamed through byte
counters, and every image is fully decoded here so a bad file fails the job in seconds, naming the file,
instead of minutes later inside the trainer.

Error codes: problems with the request's fields themselves (bad base64, a forbidden URL) are
`invalid_input`; problems with what the archive or the download holds are `invalid_dataset`; too little free
disk is `does_not_fit`.
"""

from __future__ import annotations

import base64
import binascii
import errno
import http.client
import io
import ipaddress
import lzma
import re
import shutil
import socket
import ssl
import stat
import struct
import time
import warnings
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import quote, urljoin, urlsplit

from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request import TrainingRequest
from fluxbooth.settings import DatasetLimits

ALLOWED_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
)
UNSUPPORTED_IMAGE_EXTENSIONS = frozenset(
    {".heic", ".heif", ".avif", ".jxl", ".svg", ".psd", ".raw", ".dng", ".cr2", ".cr3", ".nef", ".arw",
     ".orf", ".rw2", ".ico", ".tga", ".jp2", ".exr", ".hdr"}
)
ARCHIVE_EXTENSIONS = frozenset(
    {".zip", ".tar", ".gz", ".tgz", ".bz2", ".tbz", ".tbz2", ".xz", ".txz", ".zst", ".7z", ".rar", ".lz",
     ".lzma", ".cab", ".jar", ".cbz", ".cbr"}
)
CAPTION_EXTENSION = ".txt"
MAX_CAPTION_CHARS = 2000
MAX_CAPTION_BYTES = 64 * 1024
SUPPORTED_COMPRESSION = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA})
COMPRESSION_NAMES = {1: "Shrink", 6: "Implode", 9: "Deflate64", 93: "Zstandard", 95: "XZ", 98: "PPMd",
                     99: "AES encryption"}
# Small members may legitimately compress very well (a flat-colour PNG, an empty caption); only big
# members with huge ratios look like bombs.
RATIO_CHECK_MIN_BYTES = 1024 * 1024
DISK_RESERVE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
MAX_REDIRECTS = 5
# A server that trickles bytes can stay under the idle timeout forever; the whole download gets this
# many idle timeouts in total unless the caller says otherwise.
TOTAL_TIMEOUT_FACTOR = 30
PNG_COMPRESS_LEVEL = 0  # stored, not deflated: the trainer reads each file once, and deflate was 80 % of preparation time (bench/overhead.py)
WHITE = (255, 255, 255)

_DATA_URI_PREFIX = re.compile(rb"^data:[^,]{0,200};base64,", re.IGNORECASE)
_BASE64_WHITESPACE = b" \t\r\n\v\f"
_DRIVE_LETTER = re.compile(r"^[A-Za-z]:")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
_UNSAFE_STEM_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]+")

Role = Literal["instance", "class"]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PreparedDataset:
    instance_dir: Path  # normalised RGB PNGs (+ optional caption .txt with the same stem)
    class_dir: Path | None  # from the zip's top-level `class/` folder, if any
    instance_images: int
    class_images: int
    captions: int
    skipped: dict[str, int]  # e.g. {"macos_metadata": 2, "hidden": 1, "not_image": 3}
    smaller_than_resolution: int  # images the trainer will upscale
    downscaled: int = 0  # images reduced here to the smallest size that still covers the resolution
    notes: tuple[str, ...] = ()

    def summary(self) -> dict[str, object]:
        return {
            "instance_images": self.instance_images,
            "class_images": self.class_images,
            "captions": self.captions,
            "skipped": dict(sorted(self.skipped.items())),
            "smaller_than_resolution": self.smaller_than_resolution,
            "downscaled": self.downscaled,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ExtractedImage:
    member: str  # its name inside the archive, for messages
    role: Role
    path: Path  # the extracted bytes, under raw/ with a generated name
    caption_member: str | None = None
    caption_path: Path | None = None


@dataclass(frozen=True)
class ExtractedArchive:
    images: tuple[ExtractedImage, ...]
    skipped: dict[str, int] = field(default_factory=dict)

    def count(self, role: Role) -> int:
        return sum(1 for image in self.images if image.role == role)


@dataclass(frozen=True)
class NormalisedImage:
    width: int
    height: int
    downscaled: bool


# ----------------------------------------------------------------------------------------------- errors


def _dataset_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset: {message}")


def _url_error(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_DATASET, f"dataset_url: {message}")


def _input_error(field_name: str, message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_INPUT, f"input.{field_name}: {message}")


def _quoted(name: str, limit: int = 120) -> str:
    """A member name safe to put in a message: bounded, control characters escaped."""
    shown = name if len(name) <= limit else name[:limit] + "..."
    return repr(shown)


def _megabytes(count: int) -> str:
    if count < 1024**2:
        return f"{count:,} bytes"
    return f"{count / 1024**2:.1f} MB"


def ensure_free_disk(path: Path, needed_bytes: int, *, purpose: str) -> None:
    """Refuse early, saying how much is needed, rather than fail half-way with ENOSPC."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: {purpose} needs about {_megabytes(needed_bytes)} but only {_megabytes(free)} "
            f"are free under {path}; free disk space, use a bigger volume or a smaller dataset",
        )


def ensure_inside(path: Path, root: Path) -> Path:
    """Resolved-path containment (a string prefix test would accept /job-evil for /job)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise _dataset_error(f"refusing to write {path.name!r} outside the job directory")
    return resolved


# ----------------------------------------------------------------------------------------------- base64


def decode_base64_dataset(text: str, limits: DatasetLimits) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, whitespace tolerated) → the zip's bytes."""
    if len(text) > limits.max_base64_chars:
        raise _input_error(
            "dataset",
            f"is {len(text):,} characters of base64, over the {limits.max_base64_chars:,} cap; "
            "send a link in dataset_url instead",
        )
    try:
        encoded = text.encode("ascii")
    except UnicodeEncodeError:
        raise _input_error("dataset", "contains non-base64 characters; send the zip as plain base64") from None
    encoded = _DATA_URI_PREFIX.sub(b"", encoded, count=1).translate(None, _BASE64_WHITESPACE)
    if not encoded:
        raise _input_error("dataset", "is empty; send the dataset zip as base64, or use dataset_url")
    if (b"-" in encoded or b"_" in encoded) and b"+" not in encoded and b"/" not in encoded:
        encoded = encoded.translate(bytes.maketrans(b"-_", b"+/"))
    try:
        data = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise _input_error(
            "dataset", f"is not valid base64 ({error}); send standard base64 of the zip, with '=' padding"
        ) from None
    if not data:
        raise _input_error("dataset", "decodes to zero bytes; send the dataset zip as base64")
    return data


# ------------------------------------------------------------------------------------------------- URLs


def forbidden_address_reason(address: Address, *, allow_private: bool) -> str | None:
    """Why the worker must not connect to `address`, or None.

    Link-local (cloud metadata), multicast and unspecified addresses are refused even when private
    addresses are allowed for local testing.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return forbidden_address_reason(embedded, allow_private=allow_private)
        if address.teredo is not None:
            return "a Teredo tunnel address"
    if address.is_link_local:
        return "link-local (the cloud metadata range)"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified:
        return "unspecified"
    if allow_private:
        return None
    if address.is_loopback:
        return "loopback"
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "not publicly routable"
    return None


def _resolve_allowed_addresses(host: str, port: int, limits: DatasetLimits) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise _url_error(f"cannot resolve host {host!r} ({error}); check the URL") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise _url_error(f"host {host!r} has no addresses; check the URL")
    for text in addresses:
        # Every address must pass: a DNS answer mixing a public and a private address must not let the
        # connection pick the private one.
        address = ipaddress.ip_address(text.split("%", 1)[0])
        reason = forbidden_address_reason(address, allow_private=limits.allow_private_urls)
        if reason is not None:
            raise _input_error(
                "dataset_url",
                f"host {host!r} resolves to {address}, a {reason} address; the worker only downloads from "
                "public addresses (set FLUXBOOTH_ALLOW_PRIVATE_URLS=1 for local testing)",
            )
    return addresses


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the address that was checked, not to whatever DNS answers a second time."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._pinned_address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._pinned_address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, *, address: str, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._pinned_address = address
        self._tls_context = context

    def connect(self) -> None:
        sock = socket.create_connection((self._pinned_address, self.port), self.timeout)
        self.sock = self._tls_context.wrap_socket(sock, server_hostname=self.host)


def display_url(url: str) -> str:
    """scheme://host/path without the query (presigned URLs carry signatures there)."""
    parts = urlsplit(url)
    path = parts.path if len(parts.path) <= 100 else parts.path[:100] + "..."
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{path}"


def _checked_url(url: str, *, redirected: bool) -> tuple[str, str, int, str]:
    """(scheme, host, port, request target) for an http(s) URL, or an invalid_input error."""
    where = "redirected to" if redirected else "is"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _input_error("dataset_url", f"{where} a malformed URL") from None
    scheme = parts.scheme.lower()
    if scheme not in {"http", "https"}:
        raise _input_error("dataset_url", f"{where} a {scheme or 'scheme-less'}: URL; only http and https are followed")
    if not parts.hostname:
        raise _input_error("dataset_url", f"{where} a URL without a host")
    if parts.username is not None or parts.password is not None:
        raise _input_error("dataset_url", "must not carry credentials (user:password@); use a presigned URL")
    target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80), target


def _connect(
    scheme: str, host: str, port: int, addresses: list[str], timeout: float, url: str
) -> http.client.HTTPConnection:
    """A connected HTTP(S) connection to the first checked address that answers."""
    failure: str = "no address answered"
    for address in addresses:
        connection: http.client.HTTPConnection
        if scheme == "https":
            connection = _PinnedHTTPSConnection(
                host, port, address=address, timeout=timeout, context=ssl.create_default_context()
            )
        else:
            connection = _PinnedHTTPConnection(host, port, address=address, timeout=timeout)
        try:
            connection.connect()
            return connection
        except ssl.SSLError as error:
            connection.close()
            raise _url_error(f"TLS failed for {display_url(url)} ({error.reason or error}); check the URL") from None
        except TimeoutError:
            connection.close()
            failure = f"timed out after {timeout:g} s"
        except OSError as error:
            connection.close()
            failure = str(error.strerror or error)
    raise _url_error(f"cannot connect to {host}:{port} ({failure}); check the URL or the server")


def _status_error(status: int, reason: str, url: str) -> FluxboothError:
    hints = {
        401: "the link needs credentials; use a presigned or public URL",
        403: "access denied; presigned URLs expire, so create a fresh one",
        404: "nothing at that address; check the URL (presigned URLs expire)",
        410: "the file is gone; upload it again",
    }
    hint = hints.get(status) or (
        "the server failed; try again later" if status >= 500 else "expected 200 OK with the zip"
    )
    return _url_error(f"the server answered {status} {reason} for {display_url(url)}: {hint}")


def download_dataset(
    url: str,
    destination: Path,
    limits: DatasetLimits,
    *,
    total_timeout_seconds: float | None = None,
) -> int:
    """GET `url` into `destination`, following up to MAX_REDIRECTS redirects; returns the byte count.

    Every hop is checked (scheme, resolved addresses) and the connection goes to the checked address.
    `limits.download_timeout_seconds` bounds connecting and every wait for data; the whole download is
    bounded by `total_timeout_seconds` (default TOTAL_TIMEOUT_FACTOR idle timeouts).
    """
    idle_timeout = float(limits.download_timeout_seconds)
    deadline = time.monotonic() + (total_timeout_seconds or idle_timeout * TOTAL_TIMEOUT_FACTOR)
    current = url.strip()
    for hop in range(MAX_REDIRECTS + 1):
        scheme, host, port, target = _checked_url(current, redirected=hop > 0)
        addresses = _resolve_allowed_addresses(host, port, limits)
        connection = _connect(scheme, host, port, addresses, idle_timeout, current)
        try:
            try:
                connection.request(
                    "GET",
                    target,
                    headers={"User-Agent": "fluxbooth-worker", "Accept-Encoding": "identity", "Accept": "*/*"},
                )
                response = connection.getresponse()
            except TimeoutError:
                raise _url_error(
                    f"{display_url(current)} did not answer within {idle_timeout:g} s; "
                    "check the server or host the file elsewhere"
                ) from None
            except (OSError, http.client.HTTPException) as error:
                raise _url_error(
                    f"{display_url(current)} failed before answering ({type(error).__name__}: {error}); "
                    "check the URL or try again"
                ) from None
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _url_error(f"{display_url(current)} redirected without a Location header")
                current = urljoin(current, location.strip())
                continue
            if response.status != 200:
                raise _status_error(response.status, response.reason, current)
            return _stream_to_file(response, destination, limits, deadline=deadline, url=current)
        finally:
            connection.close()
    raise _url_error(f"more than {MAX_REDIRECTS} redirects starting at {display_url(url)}; give the final URL")


def _stream_to_file(
    response: http.client.HTTPResponse,
    destination: Path,
    limits: DatasetLimits,
    *,
    deadline: float,
    url: str,
) -> int:
    cap = limits.max_download_bytes
    declared = response.getheader("Content-Length")
    declared_bytes = int(declared) if declared and declared.strip().isdigit() else None
    if declared_bytes is not None and declared_bytes > cap:
        raise _url_error(
            f"{display_url(url)} is {_megabytes(declared_bytes)}, over the {_megabytes(cap)} download cap; "
            "use a smaller dataset"
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    if declared_bytes is not None:
        ensure_free_disk(destination.parent, declared_bytes + DISK_RESERVE_BYTES, purpose="downloading the dataset")
    received = 0
    partial = destination.with_name(destination.name + ".part")
    try:
        with partial.open("wb") as sink:
            while True:
                try:
                    # read1: whatever has arrived, so the deadline is checked even while a server trickles.
                    chunk = response.read1(CHUNK_BYTES)
                except TimeoutError:
                    raise _url_error(
                        f"{display_url(url)} stopped sending data for {limits.download_timeout_seconds} s "
                        f"after {_megabytes(received)}; the server is too slow, host the file elsewhere"
                    ) from None
                except (http.client.IncompleteRead, ConnectionError) as error:
                    raise _url_error(
                        f"the connection to {display_url(url)} broke after {_megabytes(received)} "
                        f"({type(error).__name__}); try again"
                    ) from None
                if not chunk:
                    break
                received += len(chunk)
                if received > cap:
                    raise _url_error(
                        f"{display_url(url)} sent more than the {_megabytes(cap)} download cap; use a smaller dataset"
                    )
                if time.monotonic() > deadline:
                    raise _url_error(
                        f"downloading {display_url(url)} took too long ({_megabytes(received)} so far); "
                        "the server is too slow, host the file elsewhere"
                    )
                sink.write(chunk)
        if declared_bytes is not None and received != declared_bytes:
            raise _url_error(
                f"{display_url(url)} promised {declared_bytes:,} bytes but sent {received:,}; try again"
            )
        if received == 0:
            raise _url_error(f"{display_url(url)} returned an empty body; check the URL")
        partial.replace(destination)
        return received
    finally:
        partial.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- archive


def _describe_non_zip(path: Path) -> str:
    with path.open("rb") as source:
        head = source.read(512)
    if not head:
        return "the archive is empty"
    if head.startswith(b"PK\x03\x04"):
        return "the zip is truncated or damaged (no central directory found); re-create and re-upload it"
    kinds = {
        b"\x1f\x8b": "a gzip file",
        b"BZh": "a bzip2 file",
        b"\xfd7zXZ": "an xz file",
        b"7z\xbc\xaf": "a 7-Zip archive",
        b"Rar!": "a RAR archive",
        b"\x89PNG": "a single PNG image",
        b"\xff\xd8\xff": "a single JPEG image",
        b"%PDF": "a PDF",
    }
    for magic, kind in kinds.items():
        if head.startswith(magic):
            return f"the upload is {kind}, not a zip archive; put the images in a .zip"
    if head[257:262] == b"ustar":
        return "the upload is a tar archive, not a zip archive; put the images in a .zip"
    return "the upload is not a zip archive; put the images in a .zip"


def _member_parts(info: zipfile.ZipInfo) -> tuple[str, ...]:
    """The member's path components, or an invalid_dataset error for a hostile or unsafe name."""
    name = info.filename
    shown = _quoted(name)
    if _CONTROL_CHARACTERS.search(name):
        raise _dataset_error(f"member {shown} has control characters in its name; rename it and re-zip")
    if "\\" in name:
        raise _dataset_error(
            f"member {shown} uses backslashes in its path (a non-standard zip); re-zip with a standard tool"
        )
    if name.startswith("/"):
        raise _dataset_error(f"member {shown} has an absolute path; re-zip with relative paths")
    if _DRIVE_LETTER.match(name):
        raise _dataset_error(f"member {shown} starts with a drive letter; re-zip with relative paths")
    parts = name.split("/")
    if ".." in parts:
        raise _dataset_error(f"member {shown} escapes the archive root; remove it and re-zip")
    return tuple(part for part in parts if part not in ("", "."))


def _check_member_type(info: zipfile.ZipInfo) -> bool:
    """True for a regular file, False for a directory; refuses links and special files."""
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    shown = _quoted(info.filename)
    if kind == stat.S_IFLNK:
        raise _dataset_error(f"member {shown} is a symbolic link; zip the real files instead")
    if info.is_dir() or kind == stat.S_IFDIR:
        return False
    if kind not in (0, stat.S_IFREG):
        raise _dataset_error(f"member {shown} is not a regular file (a device, pipe or socket); remove it")
    if info.flag_bits & 0x1:
        raise _dataset_error(f"member {shown} is encrypted; re-zip without a password")
    if info.compress_type not in SUPPORTED_COMPRESSION:
        method = COMPRESSION_NAMES.get(info.compress_type, f"method {info.compress_type}")
        raise _dataset_error(
            f"member {shown} uses unsupported compression ({method}); re-zip with standard Deflate"
        )
    return True


def _skip_reason(parts: tuple[str, ...]) -> str | None:
    basename = parts[-1]
    if parts[0] == "__MACOSX" or basename == ".DS_Store" or any(part.startswith("._") for part in parts):
        return "macos_metadata"
    if any(part.startswith(".") for part in parts):
        return "hidden"
    suffixes = [suffix.lower() for suffix in PurePosixPath(basename).suffixes]
    if suffixes and suffixes[-1] in ARCHIVE_EXTENSIONS:
        return "nested_archive"
    if suffixes and suffixes[-1] in UNSUPPORTED_IMAGE_EXTENSIONS:
        return "unsupported_image_format"
    if suffixes and suffixes[-1] in IMAGE_EXTENSIONS | {CAPTION_EXTENSION}:
        return None
    return "not_image"


_Candidate = tuple[tuple[str, ...], zipfile.ZipInfo]


def _strip_wrapper_folder(members: list[_Candidate]) -> list[_Candidate]:
    """Zipping a folder puts everything under `folder/`; treat that folder as the archive root."""
    if not members or any(len(parts) < 2 for parts, _ in members):
        return members
    roots = {parts[0] for parts, _ in members}
    if len(roots) != 1 or next(iter(roots)).lower() == "class":
        return members
    return [(parts[1:], info) for parts, info in members]


def _role(parts: tuple[str, ...]) -> Role:
    return "class" if len(parts) > 1 and parts[0].lower() == "class" else "instance"


def _pairing_key(parts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(part.casefold() for part in parts[:-1]) + (PurePosixPath(parts[-1]).stem.casefold(),)


@dataclass(frozen=True)
class _PlannedMember:
    info: zipfile.ZipInfo
    name: str
    role: Role
    caption: zipfile.ZipInfo | None = None


def _plan_extraction(infos: Iterable[zipfile.ZipInfo]) -> tuple[list[_PlannedMember], Counter[str]]:
    skipped: Counter[str] = Counter()
    candidates: list[_Candidate] = []
    for info in infos:
        parts = _member_parts(info)
        if not _check_member_type(info) or not parts:
            continue
        reason = _skip_reason(parts)
        if reason is not None:
            skipped[reason] += 1
            continue
        candidates.append((parts, info))
    candidates = _strip_wrapper_folder(candidates)

    captions: dict[tuple[str, ...], _Candidate] = {}
    images: list[_Candidate] = []
    for parts, info in candidates:
        if parts[-1].lower().endswith(CAPTION_EXTENSION):
            captions[(_role(parts), *_pairing_key(parts))] = (parts, info)
        else:
            images.append((parts, info))

    planned: list[_PlannedMember] = []
    used_captions: set[tuple[str, ...]] = set()
    for parts, info in sorted(images, key=lambda item: item[1].filename):
        role = _role(parts)
        key = (role, *_pairing_key(parts))
        caption = captions.get(key) if role == "instance" else None
        if caption is not None:
            used_captions.add(key)
        planned.append(_PlannedMember(info, info.filename, role, caption[1] if caption else None))
    for key in captions.keys() - used_captions:
        skipped["class_caption" if key[0] == "class" else "unpaired_caption"] += 1
    return planned, skipped


def _check_declared_sizes(planned: list[_PlannedMember], limits: DatasetLimits) -> int:
    """Refuse on what the headers declare, before anything is decompressed; returns the declared total."""
    total = 0
    for member in planned:
        for info in (member.info, member.caption):
            if info is None:
                continue
            shown = _quoted(info.filename)
            if info is member.caption and info.file_size > MAX_CAPTION_BYTES:
                raise _dataset_error(
                    f"caption {shown} is {info.file_size:,} bytes; captions are at most {MAX_CAPTION_CHARS} characters"
                )
            if info.file_size > limits.max_member_bytes:
                raise _dataset_error(
                    f"member {shown} declares {_megabytes(info.file_size)}, over the "
                    f"{_megabytes(limits.max_member_bytes)} per-file cap; use smaller images"
                )
            ratio = info.file_size / max(info.compress_size, 1)
            if info.file_size > RATIO_CHECK_MIN_BYTES and ratio > limits.max_compression_ratio:
                raise _dataset_error(
                    f"member {shown} expands {ratio:,.0f}x (the cap is {limits.max_compression_ratio}x), "
                    "which looks like a zip bomb; images do not compress like that"
                )
            total += info.file_size
    if total > limits.max_expanded_bytes:
        raise _dataset_error(
            f"the archive declares {_megabytes(total)} of files, over the {_megabytes(limits.max_expanded_bytes)} "
            "cap; use fewer or smaller images"
        )
    return total


def _check_counts(planned: list[_PlannedMember], skipped: Counter[str], limits: DatasetLimits) -> None:
    instance = sum(1 for member in planned if member.role == "instance")
    class_count = len(planned) - instance
    if instance == 0:
        found = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())) or "nothing"
        held = f" (class/ holds {class_count})" if class_count else ""
        raise _dataset_error(
            f"no usable instance images in the archive{held}; skipped: {found}. "
            f"Put {', '.join(ALLOWED_IMAGE_FORMATS)} files in the zip"
        )
    if instance < limits.min_images:
        raise _dataset_error(
            f"found {instance} instance image(s); at least {limits.min_images} are needed. Add more photos"
        )
    if instance > limits.max_images:
        raise _dataset_error(f"found {instance} instance images; at most {limits.max_images} are accepted")
    if class_count > limits.max_images:
        raise _dataset_error(f"found {class_count} class images; at most {limits.max_images} are accepted")


def _extracted_name(index: int, member_name: str) -> str:
    suffix = PurePosixPath(member_name).suffix.lower()
    if not re.fullmatch(r"\.[a-z0-9]{1,8}", suffix):
        suffix = ""
    return f"{index:05d}{suffix}"


_ARCHIVE_READ_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


class _ExpansionCounter:
    """Counts decompressed bytes across the whole archive; headers can lie, this cannot."""

    def __init__(self, limits: DatasetLimits) -> None:
        self.limits = limits
        self.total = 0

    def add(self, info: zipfile.ZipInfo, member_bytes: int, chunk_bytes: int) -> None:
        self.total += chunk_bytes
        shown = _quoted(info.filename)
        if member_bytes > info.file_size or member_bytes > self.limits.max_member_bytes:
            raise _dataset_error(
                f"member {shown} expands beyond its declared size ({_megabytes(info.file_size)}); "
                "the archive is damaged or hostile, re-create it"
            )
        if self.total > self.limits.max_expanded_bytes:
            raise _dataset_error(
                f"the archive expands beyond the {_megabytes(self.limits.max_expanded_bytes)} cap "
                f"(reached while extracting {shown}); use fewer or smaller images"
            )


def _extract_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, counter: _ExpansionCounter
) -> None:
    member_bytes = 0
    shown = _quoted(info.filename)
    try:
        source = archive.open(info)
    except (*_ARCHIVE_READ_ERRORS, NotImplementedError, RuntimeError) as error:
        raise _dataset_error(f"member {shown} is corrupt ({error}); re-create the zip") from None
    with target.open("xb") as sink, source:
        while True:
            try:
                chunk = source.read(CHUNK_BYTES)
            except _ARCHIVE_READ_ERRORS as error:
                raise _dataset_error(f"member {shown} is corrupt ({error}); re-create the zip") from None
            if not chunk:
                break
            member_bytes += len(chunk)
            counter.add(info, member_bytes, len(chunk))
            try:
                sink.write(chunk)
            except OSError as error:
                if error.errno == errno.ENOSPC:
                    raise FluxboothError(
                        ErrorCode.DOES_NOT_FIT,
                        f"disk: the disk filled up while extracting {shown}; free disk space or use a bigger volume",
                    ) from None
                raise


def extract_archive(archive_path: Path, destination: Path, limits: DatasetLimits) -> ExtractedArchive:
    """Check every member, then stream the images (and their captions) into `destination`.

    Member names are only inspected, never used as paths: extracted files are `destination/00000.jpg`,
    ... so no name can place a file elsewhere.
    """
    try:
        archive = zipfile.ZipFile(archive_path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError):
        raise _dataset_error(_describe_non_zip(archive_path)) from None
    with archive:
        infos = archive.infolist()
        if len(infos) > limits.max_members:
            raise _dataset_error(
                f"the archive has {len(infos):,} members, over the {limits.max_members:,} cap; use fewer files"
            )
        planned, skipped = _plan_extraction(infos)
        _check_counts(planned, skipped, limits)
        declared_total = _check_declared_sizes(planned, limits)
        destination.mkdir(parents=True, exist_ok=True)
        root = destination.resolve()
        ensure_free_disk(root, declared_total + DISK_RESERVE_BYTES, purpose="extracting the dataset")

        counter = _ExpansionCounter(limits)
        images: list[ExtractedImage] = []
        written = 0
        for member in planned:
            image_path = ensure_inside(root / _extracted_name(written, member.name), root)
            _extract_member(archive, member.info, image_path, counter)
            written += 1
            caption_path = None
            if member.caption is not None:
                caption_path = ensure_inside(root / _extracted_name(written, member.caption.filename), root)
                _extract_member(archive, member.caption, caption_path, counter)
                written += 1
            images.append(
                ExtractedImage(
                    member=member.name,
                    role=member.role,
                    path=image_path,
                    caption_member=member.caption.filename if member.caption else None,
                    caption_path=caption_path,
                )
            )
    return ExtractedArchive(images=tuple(images), skipped=dict(skipped))


# ----------------------------------------------------------------------------------------------- images


def _to_eight_bit(image: Image.Image) -> Image.Image:
    """16-bit and float greyscale → 8-bit 'L', scaling instead of clipping."""
    if image.mode.startswith("I;16"):
        image = image.convert("I")
    if image.mode == "I":
        _, high = image.getextrema()
        if high > 255:
            image = image.point(lambda value: value * (1 / 256))
        return image.convert("L")
    if image.mode == "F":
        _, high = image.getextrema()
        if high <= 1.0:
            image = image.point(lambda value: value * 255)
        return image.convert("L")
    return image


def _to_srgb(image: Image.Image, icc_profile: bytes | None) -> Image.Image:
    """Honour an embedded colour profile (Display P3 phones, CMYK print files) when there is one."""
    if not icc_profile or image.mode not in ("RGB", "RGBA", "CMYK"):
        return image
    try:
        source_profile = ImageCms.ImageCmsProfile(io.BytesIO(icc_profile))
        output_mode = "RGBA" if image.mode == "RGBA" else "RGB"
        converted = ImageCms.profileToProfile(
            image, source_profile, ImageCms.createProfile("sRGB"), outputMode=output_mode
        )
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        # A broken profile should not sink the photo: fall back to Pillow's plain conversion.
        return image
    return converted if converted is not None else image


def _to_rgb(image: Image.Image) -> Image.Image:
    icc_profile = image.info.get("icc_profile")
    image = _to_eight_bit(image)
    has_alpha = image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info
    if has_alpha:
        image = image.convert("RGBA")
    elif image.mode not in ("RGB", "CMYK"):
        image = image.convert("RGB")
    image = _to_srgb(image, icc_profile)
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, WHITE)
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB") if image.mode != "RGB" else image


def _transposed(image: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(image) or image
    except (OSError, ValueError, TypeError, KeyError, struct.error, ZeroDivisionError, SyntaxError):
        # Unreadable EXIF is common in edited photos; the pixels are still fine.
        return image


def _covering_size(width: int, height: int, resolution: tuple[int, int]) -> tuple[int, int] | None:
    """The smallest size whose shorter side is max(resolution): still enough for any resize-and-crop the
    trainer does, without carrying 24-megapixel PNGs through the job. None when no downscale is needed."""
    target_short = max(resolution)
    short = min(width, height)
    if short <= target_short:
        return None
    scale = target_short / short
    new_width = target_short if width == short else max(target_short, round(width * scale))
    new_height = target_short if height == short else max(target_short, round(height * scale))
    return new_width, new_height


def normalise_image(
    source: Path,
    destination: Path,
    *,
    member: str,
    limits: DatasetLimits,
    resolution: tuple[int, int],
) -> NormalisedImage:
    """Decode `source` fully (first frame), EXIF-transpose, convert to 8-bit sRGB, save as PNG."""
    shown = _quoted(member)
    previous_cap = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its cap and raises above; the size check below is exact.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                opened = Image.open(source, formats=ALLOWED_IMAGE_FORMATS)
            except Image.DecompressionBombError as error:
                declared = re.search(r"\((\d+) pixels\)", str(error))
                amount = f"{int(declared.group(1)):,}" if declared else "too many"
                raise _dataset_error(
                    f"image {shown} declares {amount} pixels, over the {limits.max_image_pixels:,}-pixel cap; "
                    "downscale it"
                ) from None
            except UnidentifiedImageError:
                raise _dataset_error(
                    f"image {shown} is not a readable {'/'.join(ALLOWED_IMAGE_FORMATS)} file; "
                    "re-export it as JPEG or PNG"
                ) from None
            except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
                raise _dataset_error(f"image {shown} is corrupt ({error}); re-export it") from None
            with opened:
                width, height = opened.size
                if width * height > limits.max_image_pixels:
                    raise _dataset_error(
                        f"image {shown} declares {width}x{height} pixels, over the "
                        f"{limits.max_image_pixels:,}-pixel cap; downscale it"
                    )
                if min(width, height) < limits.min_image_side:
                    raise _dataset_error(
                        f"image {shown} is {width}x{height}; the shorter side must be at least "
                        f"{limits.min_image_side} px. Use a larger photo or remove it"
                    )
                planned_size = _covering_size(width, height, resolution)
                if planned_size is not None and opened.format in ("JPEG", "MPO"):
                    # JPEG can decode at 1/2, 1/4 or 1/8 scale directly; it still reads the whole stream.
                    opened.draft(opened.mode, planned_size)
                try:
                    opened.load()
                except Image.DecompressionBombError:
                    raise _dataset_error(
                        f"image {shown} has frames over the {limits.max_image_pixels:,}-pixel cap; downscale it"
                    ) from None
                except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as error:
                    raise _dataset_error(f"image {shown} is truncated or corrupt ({error}); re-export it") from None
                # Everything happens while `opened` is open: a closed Pillow image refuses further work.
                image = _to_rgb(_transposed(opened))
                target_size = _covering_size(image.width, image.height, resolution)
                if target_size is not None:
                    image = image.resize(target_size, Image.Resampling.LANCZOS, reducing_gap=3.0)
                image.save(destination, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
                # `planned_size` also counts a JPEG that draft() already reduced on decode.
                downscaled = planned_size is not None or target_size is not None
                return NormalisedImage(width=image.width, height=image.height, downscaled=downscaled)
    finally:
        Image.MAX_IMAGE_PIXELS = previous_cap


def read_caption(path: Path, *, member: str) -> str:
    """UTF-8 caption text, whitespace collapsed to single spaces; empty means 'no caption'."""
    shown = _quoted(member)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _dataset_error(f"caption {shown} is not UTF-8 text; save it as UTF-8") from None
    text = " ".join(text.split())
    if "\x00" in text:
        raise _dataset_error(f"caption {shown} contains NUL bytes; save it as plain UTF-8 text")
    if len(text) > MAX_CAPTION_CHARS:
        raise _dataset_error(
            f"caption {shown} has {len(text)} characters; the limit is {MAX_CAPTION_CHARS}. Shorten it"
        )
    return text


def _output_stem(member: str, taken: set[str]) -> str:
    """A readable, unique file stem: `photo1`, and `photo1-2` for a second `photo1` in another folder."""
    stem = _UNSAFE_STEM_CHARACTERS.sub("_", PurePosixPath(member).stem).strip("._")[:80] or "image"
    candidate = stem
    suffix = 2
    while candidate.casefold() in taken:
        candidate = f"{stem}-{suffix}"
        suffix += 1
    taken.add(candidate.casefold())
    return candidate


# ------------------------------------------------------------------------------------------- the whole


def _fetch_archive(request: TrainingRequest, archive_path: Path, limits: DatasetLimits) -> None:
    if request.dataset is not None:
        data = decode_base64_dataset(request.dataset, limits)
        ensure_free_disk(archive_path.parent, len(data) + DISK_RESERVE_BYTES, purpose="storing the dataset")
        archive_path.write_bytes(data)
    elif request.dataset_url is not None:
        download_dataset(request.dataset_url, archive_path, limits)
    else:
        raise _input_error("dataset", "give the dataset zip as base64 in dataset, or a link in dataset_url")


def prepare_dataset(
    request: TrainingRequest,
    job_dir: Path,
    limits: DatasetLimits,
    *,
    on_image: Callable[[int, int], None] | None = None,
) -> PreparedDataset:
    """Fetch, check, extract and normalise the request's dataset inside `job_dir`.

    `on_image(done, total)` is called after each image, for progress reporting.
    """
    job_dir = job_dir.resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    archive_path = ensure_inside(job_dir / "dataset.zip", job_dir)
    raw_dir = ensure_inside(job_dir / "raw", job_dir)
    data_dir = ensure_inside(job_dir / "data", job_dir)

    _fetch_archive(request, archive_path, limits)
    extracted = extract_archive(archive_path, raw_dir, limits)
    archive_path.unlink()

    output_dirs: dict[Role, Path] = {"instance": data_dir / "instance"}
    if extracted.count("class"):
        output_dirs["class"] = data_dir / "class"
    for directory in output_dirs.values():
        directory.mkdir(parents=True, exist_ok=True)

    taken: dict[Role, set[str]] = {"instance": set(), "class": set()}
    counts: Counter[str] = Counter()
    for done, item in enumerate(extracted.images, start=1):
        directory = output_dirs[item.role]
        stem = _output_stem(item.member, taken[item.role])
        result = normalise_image(
            item.path,
            ensure_inside(directory / f"{stem}.png", job_dir),
            member=item.member,
            limits=limits,
            resolution=request.resolution,
        )
        item.path.unlink()
        counts[f"{item.role}_images"] += 1
        counts["downscaled"] += result.downscaled
        width, height = request.resolution
        counts["smaller"] += result.width < width or result.height < height
        if item.caption_path is not None:
            caption = read_caption(item.caption_path, member=item.caption_member or item.member)
            item.caption_path.unlink()
            if caption:
                ensure_inside(directory / f"{stem}.txt", job_dir).write_text(caption + "\n", encoding="utf-8")
                counts["captions"] += 1
        if on_image is not None:
            on_image(done, len(extracted.images))
    shutil.rmtree(raw_dir, ignore_errors=True)

    notes: list[str] = []
    width, height = request.resolution
    if counts["smaller"]:
        notes.append(
            f"{counts['smaller']} image(s) are smaller than {width}x{height} and will be upscaled; "
            "larger photos train sharper"
        )
    if counts["class_images"] and not request.with_prior_preservation:
        notes.append("the archive's class/ images are unused because with_prior_preservation is false")
    return PreparedDataset(
        instance_dir=output_dirs["instance"],
        class_dir=output_dirs.get("class"),
        instance_images=counts["instance_images"],
        class_images=counts["class_images"],
        captions=counts["captions"],
        skipped=dict(extracted.skipped),
        smaller_than_resolution=counts["smaller"],
        downscaled=counts["downscaled"],
        notes=tuple(notes),
    )
