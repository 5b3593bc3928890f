"""The request's dataset as bytes on disk: strict base64, or an SSRF-safe, bounded HTTP(S) download.

Problems with the request's fields themselves (bad base64, a forbidden URL) are `invalid_input`; problems
with what the server sends are `invalid_dataset`; too little free disk is `does_not_fit`.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit

from fluxbooth.addresses import forbidden_address_reason
from fluxbooth.clock import JobClock
from fluxbooth.dataset.guards import (
    CHUNK_BYTES,
    DISK_RESERVE_BYTES,
    disk_stage,
    input_error,
    url_error,
)
from fluxbooth.errors import FluxboothError
from fluxbooth.messages import format_bytes
from fluxbooth.request.dataset_spec import DatasetSpec
from fluxbooth.settings import DatasetLimits

MAX_REDIRECTS = 5
# A server that trickles bytes can stay under the idle timeout forever; the whole download gets this
# many idle timeouts in total unless the caller says otherwise.
TOTAL_TIMEOUT_FACTOR = 30

_DATA_URI_PREFIX = re.compile(rb"^data:[^,]{0,200};base64,", re.IGNORECASE)
_BASE64_WHITESPACE = b" \t\r\n\v\f"

# ----------------------------------------------------------------------------------------------- base64


def decode_base64_dataset(
    text: str, limits: DatasetLimits, *, content: str = "the dataset zip", link: str = "a link in dataset_url"
) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, whitespace tolerated) → the bytes of `content` (the zip,
    or a validation control image); `link` is what to send instead of base64 that is too long."""
    if len(text) > limits.max_base64_chars:
        raise input_error(
            "dataset",
            f"is {len(text):,} characters of base64, over the {limits.max_base64_chars:,} cap; send {link} instead",
        )
    try:
        encoded = text.encode("ascii")
    except UnicodeEncodeError:
        raise input_error("dataset", f"contains non-base64 characters; send {content} as plain base64") from None
    encoded = _DATA_URI_PREFIX.sub(b"", encoded, count=1).translate(None, _BASE64_WHITESPACE)
    if not encoded:
        raise input_error("dataset", f"is empty; send {content} as base64, or {link}")
    if (b"-" in encoded or b"_" in encoded) and b"+" not in encoded and b"/" not in encoded:
        encoded = encoded.translate(bytes.maketrans(b"-_", b"+/"))
    try:
        data = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise input_error(
            "dataset", f"is not valid base64 ({error}); send standard base64 of {content}, with '=' padding"
        ) from None
    if not data:
        raise input_error("dataset", f"decodes to zero bytes; send {content} as base64")
    return data


# ------------------------------------------------------------------------------------------------- URLs


def _resolve_allowed_addresses(host: str, port: int, limits: DatasetLimits) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise url_error(f"cannot resolve host {host!r} ({error}); check the URL") from None
    # sockaddr[0] is the address string for IPv4 and IPv6; typeshed also allows an int (an IPv6 answer to a
    # Python built without IPv6), which str() keeps from passing as an address it is not.
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise url_error(f"host {host!r} has no addresses; check the URL")
    for text in addresses:
        # Every address must pass: a DNS answer mixing a public and a private address must not let the
        # connection pick the private one.
        address = ipaddress.ip_address(text.split("%", 1)[0])
        reason = forbidden_address_reason(address, allow_private=limits.allow_private_urls)
        if reason is not None:
            raise input_error(
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


class _CutOff:
    """Shuts a connection's socket at a monotonic time, whatever read is waiting: a server that trickles its
    status line or headers a byte at a time never lets a per-read timeout fire."""

    def __init__(self, connection: http.client.HTTPConnection, at: float) -> None:
        self.fired = False
        self._connection = connection
        self._timer = threading.Timer(max(at - time.monotonic(), 0.0), self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        sock = self._connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: nothing left to interrupt


@contextmanager
def _cut_off_at(connection: http.client.HTTPConnection, at: float) -> Iterator[_CutOff]:
    cut_off = _CutOff(connection, at)
    cut_off._timer.start()
    try:
        yield cut_off
    finally:
        cut_off._timer.cancel()


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
        raise input_error("dataset_url", f"{where} a malformed URL") from None
    scheme = parts.scheme.lower()
    if scheme not in {"http", "https"}:
        raise input_error("dataset_url", f"{where} a {scheme or 'scheme-less'}: URL; only http and https are followed")
    if not parts.hostname:
        raise input_error("dataset_url", f"{where} a URL without a host")
    if parts.username is not None or parts.password is not None:
        raise input_error("dataset_url", "must not carry credentials (user:password@); use a presigned URL")
    if port == 0:
        raise input_error("dataset_url", f"{where} a URL with port 0, which no server listens on; check the URL")
    target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return scheme, parts.hostname, port if port is not None else (443 if scheme == "https" else 80), target


def _connect(
    scheme: str, host: str, port: int, addresses: list[str], idle_timeout: float, url: str, cut_at: float
) -> http.client.HTTPConnection:
    """A connected HTTP(S) connection to the first checked address that answers, each try waiting at most
    `idle_timeout` and never past `cut_at`."""
    failure: str = "no address answered"
    for address in addresses:
        timeout = min(idle_timeout, cut_at - time.monotonic())
        if timeout <= 0:
            break
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
            raise url_error(f"TLS failed for {display_url(url)} ({error.reason or error}); check the URL") from None
        except TimeoutError:
            connection.close()
            failure = f"timed out after {timeout:g} s"
        except OSError as error:
            connection.close()
            failure = str(error.strerror or error)
    raise url_error(f"cannot connect to {host}:{port} ({failure}); check the URL or the server")


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
    return url_error(f"the server answered {status} {reason} for {display_url(url)}: {hint}")


def download_dataset(
    url: str,
    destination: Path,
    limits: DatasetLimits,
    *,
    total_timeout_seconds: float | None = None,
    clock: JobClock | None = None,
    stage: str = "downloading dataset_url",
) -> int:
    """GET `url` into `destination`, following up to MAX_REDIRECTS redirects; returns the byte count.

    Every hop is checked (scheme, resolved addresses) and the connection goes to the checked address.
    `limits.download_timeout_seconds` bounds connecting and every wait for data; the whole download
    (connecting, the status line and headers of every hop, the body) is bounded by `total_timeout_seconds`
    (default TOTAL_TIMEOUT_FACTOR idle timeouts) and by the job's `clock`: past the job's deadline it ends as
    the job's `timeout`, naming `stage`.
    """
    idle_timeout = float(limits.download_timeout_seconds)
    own_deadline = time.monotonic() + (total_timeout_seconds or idle_timeout * TOTAL_TIMEOUT_FACTOR)
    job_deadline = clock.deadline_at if clock is not None else float("inf")
    cut_at = min(own_deadline, job_deadline)

    def overdue(current: str) -> FluxboothError:
        if clock is not None and job_deadline <= own_deadline:
            return clock.expired(stage)
        return url_error(
            f"downloading {display_url(current)} took too long; the server is too slow, host the file elsewhere"
        )

    current = url.strip()
    for hop in range(MAX_REDIRECTS + 1):
        if clock is not None:
            clock.check(stage)
        scheme, host, port, target = _checked_url(current, redirected=hop > 0)
        addresses = _resolve_allowed_addresses(host, port, limits)
        try:
            connection = _connect(scheme, host, port, addresses, idle_timeout, current, cut_at)
        except FluxboothError:
            if time.monotonic() >= cut_at:
                raise overdue(current) from None
            raise
        try:
            with _cut_off_at(connection, cut_at) as cut_off:
                try:
                    response = _response(connection, target, current, idle_timeout)
                    if response.status in (301, 302, 303, 307, 308):
                        current = _redirect_target(response, current)
                        continue
                    if response.status != 200:
                        raise _status_error(response.status, response.reason, current)
                    return _stream_to_file(response, destination, limits, deadline=cut_at, url=current)
                except (FluxboothError, OSError, http.client.HTTPException):
                    if cut_off.fired or time.monotonic() >= cut_at:
                        raise overdue(current) from None
                    raise
        finally:
            connection.close()
    raise url_error(f"more than {MAX_REDIRECTS} redirects starting at {display_url(url)}; give the final URL")


def _response(
    connection: http.client.HTTPConnection,
    target: str,
    url: str,
    idle_timeout: float,
    extra_headers: Mapping[str, str] | None = None,
) -> http.client.HTTPResponse:
    """The GET's status line and headers (`extra_headers`: the dry run's Range)."""
    try:
        connection.request(
            "GET",
            target,
            headers={
                "User-Agent": "fluxbooth-worker",
                "Accept-Encoding": "identity",
                "Accept": "*/*",
                **(extra_headers or {}),
            },
        )
        return connection.getresponse()
    except TimeoutError:
        raise url_error(
            f"{display_url(url)} did not answer within {idle_timeout:g} s; check the server or host the file elsewhere"
        ) from None
    except (OSError, http.client.HTTPException) as error:
        raise url_error(
            f"{display_url(url)} failed before answering ({type(error).__name__}: {error}); check the URL or try again"
        ) from None


def _redirect_target(response: http.client.HTTPResponse, url: str) -> str:
    location = response.getheader("Location")
    if not location:
        raise url_error(f"{display_url(url)} redirected without a Location header")
    return urljoin(url, location.strip())


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
        raise url_error(
            f"{display_url(url)} is {format_bytes(declared_bytes)}, over the {format_bytes(cap)} download cap; "
            "use a smaller dataset"
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    received = 0
    partial = destination.with_name(destination.name + ".part")
    needed = (declared_bytes or 0) + DISK_RESERVE_BYTES
    try:
        with (
            disk_stage(destination.parent, needed, purpose="downloading the dataset") as need,
            partial.open("wb") as sink,
        ):
            while True:
                try:
                    # read1: whatever has arrived, so the deadline is checked even while a server trickles.
                    chunk = response.read1(CHUNK_BYTES)
                except TimeoutError:
                    raise url_error(
                        f"{display_url(url)} stopped sending data for {limits.download_timeout_seconds} s "
                        f"after {format_bytes(received)}; the server is too slow, host the file elsewhere"
                    ) from None
                except (http.client.IncompleteRead, ConnectionError) as error:
                    raise url_error(
                        f"the connection to {display_url(url)} broke after {format_bytes(received)} "
                        f"({type(error).__name__}); try again"
                    ) from None
                if not chunk:
                    break
                received += len(chunk)
                if received > cap:
                    raise url_error(
                        f"{display_url(url)} sent more than the {format_bytes(cap)} download cap; use a smaller dataset"
                    )
                if time.monotonic() > deadline:
                    # The caller words it: the download's own budget, or the job's deadline.
                    raise TimeoutError(f"{format_bytes(received)} received")
                need.bytes = max(need.bytes, received + DISK_RESERVE_BYTES)
                sink.write(chunk)
        if declared_bytes is not None and received != declared_bytes:
            raise url_error(f"{display_url(url)} promised {declared_bytes:,} bytes but sent {received:,}; try again")
        if received == 0:
            raise url_error(f"{display_url(url)} returned an empty body; check the URL")
        partial.replace(destination)
        return received
    finally:
        partial.unlink(missing_ok=True)


def fetch_archive(spec: DatasetSpec, archive_path: Path, limits: DatasetLimits, clock: JobClock | None = None) -> None:
    """The job's zip, from `dataset` (base64) or `dataset_url` (within the job's `clock`), written to
    `archive_path`."""
    if spec.dataset is not None:
        data = decode_base64_dataset(spec.dataset, limits)
        with disk_stage(archive_path.parent, len(data) + DISK_RESERVE_BYTES, purpose="storing the dataset"):
            archive_path.write_bytes(data)
    elif spec.dataset_url is not None:
        download_dataset(spec.dataset_url, archive_path, limits, clock=clock)
    else:
        raise input_error("dataset", "give the dataset zip as base64 in dataset, or a link in dataset_url")
