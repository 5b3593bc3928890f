"""What a dry run plans for: the instance images of the dataset actually sent, counted from the zip's central
directory by the dataset stage's own rules (archive.count_instance_images), with nothing extracted.

- `dataset` (base64): the zip is decoded as the job would decode it, and only its directory is read.
- `dataset_url`: at most two HTTP range requests, through the download's SSRF-safe connection (fetch.py:
  every hop's scheme and resolved addresses checked, the connection pinned to the checked address): the zip's
  last bytes, where the end-of-central-directory record says where the directory starts, then the rest of the
  directory when it begins before those bytes. The whole zip is never fetched.
  Every request, its status line and headers included, ends within the count's budget and the job's clock.
- When the zip cannot be counted that way (a server that ignores ranges, a directory too large to fetch, a
  damaged or odd zip, a server too slow for the count's budget), the job is planned for the worker's cap, as
  before, and the answer says why. A server silent for the download's idle timeout is refused as the download
  refuses it.

A zip the dataset stage would refuse (not a zip, its names, its counts, a member declaring more than the limits)
is refused here the same way (`invalid_dataset`); a URL the download would refuse (`invalid_input`) or a server
that answers an error status likewise; the job's deadline passing while counting is the job's `timeout`.
"""

from __future__ import annotations

import http.client
import io
import re
import struct
import time
import zipfile
from dataclasses import dataclass
from urllib.parse import urljoin

from fluxbooth.clock import JobClock
from fluxbooth.dataset.archive import count_instance_images, describe_non_zip
from fluxbooth.dataset.fetch import (
    MAX_REDIRECTS,
    _checked_url,
    _connect,
    _cut_off_at,
    _resolve_allowed_addresses,
    _response,
    _status_error,
    decode_base64_dataset,
    display_url,
)
from fluxbooth.dataset.guards import dataset_error, url_error
from fluxbooth.errors import FluxboothError
from fluxbooth.messages import format_bytes
from fluxbooth.request.dataset_spec import DatasetSpec
from fluxbooth.settings import DatasetLimits

SOURCE_ZIP = "zip"  # counted from the base64 zip in `dataset`
SOURCE_URL = "url"  # counted from the directory of the zip at `dataset_url`, by range requests
SOURCE_CAP = "cap"  # not counted: the most images the worker accepts (FLUXBOOTH_MAX_IMAGES)

# The first request asks for the zip's last bytes: the end-of-central-directory record with the longest comment
# a zip may carry (22 + 65,535 bytes), the zip64 record and locator before it, and the directory of about a
# thousand photos (some 90 bytes an entry), so most datasets take one request.
TAIL_BYTES = 128 * 1024
# A larger directory is not fetched (the cap is used): 5,000 members (the default member cap) with 200-byte
# names take about 1.3 MB.
MAX_DIRECTORY_BYTES = 16 * 1024 * 1024
# The whole count gets this many of the download's idle timeouts; a slower server gets the cap.
COUNT_TIMEOUT_FACTOR = 2
# What a job's `timeout` names when its deadline passes while the dry run counts.
COUNT_STAGE = "counting the dataset's images for the dry run"

_END_RECORD = struct.Struct("<4s4H2LH")  # signature, disks, entries (disk, total), directory size and offset, comment
_END_RECORD_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR_BYTES = 20
_ZIP64_RECORD = struct.Struct("<4sQ2H2L4Q")  # signature, record size, versions, disks, entries, directory size, offset
_ZIP64_RECORD_SIGNATURE = b"PK\x06\x06"
_ZIP64_MARKERS = (0xFFFF, 0xFFFFFFFF)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


@dataclass(frozen=True)
class DatasetCount:
    instance_images: int
    source: str  # SOURCE_ZIP, SOURCE_URL or SOURCE_CAP
    note: str | None = None  # with SOURCE_CAP: why the dataset was not counted


class _NotCounted(Exception):
    """The zip's directory could not be read from what was fetched; the message says why."""


@dataclass(frozen=True)
class _Budget:
    """When the count's requests must be over: its own budget or the job's deadline, whichever comes first."""

    seconds: float
    own_deadline: float
    clock: JobClock | None

    @classmethod
    def starting_now(cls, limits: DatasetLimits, clock: JobClock | None) -> _Budget:
        seconds = float(limits.download_timeout_seconds * COUNT_TIMEOUT_FACTOR)
        return cls(seconds, time.monotonic() + seconds, clock)

    @property
    def cut_at(self) -> float:
        return min(self.own_deadline, self.clock.deadline_at) if self.clock is not None else self.own_deadline

    def overdue(self, url: str) -> Exception:
        """The job's `timeout` when its deadline came first; otherwise not counted, naming the budget."""
        if self.clock is not None and self.clock.deadline_at <= self.own_deadline:
            return self.clock.expired(COUNT_STAGE)
        return _NotCounted(
            f"{display_url(url)} did not send what a dry run asks for within its {self.seconds:g} s "
            f"({COUNT_TIMEOUT_FACTOR} x FLUXBOOTH_DOWNLOAD_TIMEOUT_SECONDS)"
        )


def count_dataset(spec: DatasetSpec, limits: DatasetLimits, clock: JobClock | None = None) -> DatasetCount:
    """The instance images the job's dataset holds, and where the count came from; a `dataset_url`'s requests
    end by the job's `clock` too."""
    try:
        if spec.dataset is not None:
            zip_bytes = decode_base64_dataset(spec.dataset, limits)
            entries = _directory_entries(zip_bytes, whole_zip=True)
            return DatasetCount(count_instance_images(entries, limits, len(zip_bytes)), SOURCE_ZIP)
        if spec.dataset_url is not None:
            return DatasetCount(count_remote_zip(spec.dataset_url, limits, clock), SOURCE_URL)
    except _NotCounted as why:
        return DatasetCount(
            limits.max_images,
            SOURCE_CAP,
            f"the dataset's images were not counted ({why}); planned for the worker's cap of {limits.max_images} "
            "(FLUXBOOTH_MAX_IMAGES)",
        )
    return DatasetCount(limits.max_images, SOURCE_CAP, "no dataset was sent; planned for the worker's cap")


def _directory_entries(zip_bytes: bytes, *, whole_zip: bool = False) -> list[zipfile.ZipInfo]:
    """The central directory's entries, from the whole zip (one that is no zip is refused as the dataset stage
    refuses it) or from its directory to its end (not counted: only part of the file is here)."""
    try:
        with zipfile.ZipFile(io.BytesIO(zip_bytes)) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError, struct.error) as error:
        if whole_zip:
            raise dataset_error(describe_non_zip(zip_bytes[:512])) from None
        raise _NotCounted(f"its zip directory cannot be read: {error}") from None


def count_remote_zip(url: str, limits: DatasetLimits, clock: JobClock | None = None) -> int:
    """The instance images of the zip at `url`, from its central directory fetched by at most two range requests,
    all within the count's budget and the job's `clock`."""
    budget = _Budget.starting_now(limits, clock)
    tail, total, url = _fetch_range(url, None, TAIL_BYTES, limits, budget)
    if total > limits.max_download_bytes:
        # The download refuses it in the same words.
        raise url_error(
            f"{display_url(url)} is {format_bytes(total)}, over the {format_bytes(limits.max_download_bytes)} download "
            "cap; use a smaller dataset"
        )
    tail_start = total - len(tail)
    directory_start = tail_start + _directory_offset_in(tail)
    if directory_start < 0:
        raise _NotCounted("its end record points before the file's start; the zip is damaged")
    if directory_start >= tail_start:
        return count_instance_images(_directory_entries(tail[directory_start - tail_start :]), limits, total)
    head, _, _ = _fetch_range(url, directory_start, tail_start - directory_start, limits, budget)
    return count_instance_images(_directory_entries(head + tail), limits, total)


def _directory_offset_in(tail: bytes) -> int:
    """Where the central directory starts, relative to `tail` (the zip's last bytes; negative: before them).
    Measured back from the end record, as zipfile does, so data prepended to the zip does not mislead it."""
    at = tail.rfind(_END_RECORD_SIGNATURE, 0, len(tail) - _END_RECORD.size + len(_END_RECORD_SIGNATURE))
    if at < 0:
        raise _NotCounted("no end-of-central-directory record in its last bytes; it is not a zip, or it is truncated")
    _, _, _, _, entries, size, offset, _ = _END_RECORD.unpack_from(tail, at)
    if entries not in _ZIP64_MARKERS and size not in _ZIP64_MARKERS and offset not in _ZIP64_MARKERS:
        end_of_directory = at
    else:
        end_of_directory = at - _ZIP64_LOCATOR_BYTES - _ZIP64_RECORD.size
        if end_of_directory < 0 or tail[end_of_directory : end_of_directory + 4] != _ZIP64_RECORD_SIGNATURE:
            raise _NotCounted("its zip64 end record is not where zip readers look for it")
        size = _ZIP64_RECORD.unpack_from(tail, end_of_directory)[8]
    if size > MAX_DIRECTORY_BYTES:
        raise _NotCounted(
            f"its directory is {format_bytes(size)}, over the {format_bytes(MAX_DIRECTORY_BYTES)} a dry run reads"
        )
    directory_offset: int = end_of_directory - size
    return directory_offset


def _fetch_range(
    url: str, first: int | None, length: int, limits: DatasetLimits, budget: _Budget
) -> tuple[bytes, int, str]:
    """GET `length` bytes of `url` from `first` (None: its last `length` bytes) with a Range header, over the
    download's SSRF-safe connection, following redirects as the download does; (the bytes, the zip's whole size,
    the URL that answered). Connecting, the status line, the headers and the body all end at `budget.cut_at`."""
    byte_range = f"-{length}" if first is None else f"{first}-{first + length - 1}"
    current = url.strip()
    timeout = float(limits.download_timeout_seconds)
    for hop in range(MAX_REDIRECTS + 1):
        if budget.clock is not None:
            budget.clock.check(COUNT_STAGE)
        scheme, host, port, target = _checked_url(current, redirected=hop > 0)
        addresses = _resolve_allowed_addresses(host, port, limits)
        try:
            connection = _connect(scheme, host, port, addresses, timeout, current, budget.cut_at)
        except FluxboothError:
            if time.monotonic() >= budget.cut_at:
                raise budget.overdue(current) from None
            raise
        try:
            with _cut_off_at(connection, budget.cut_at) as cut_off:
                try:
                    response = _response(connection, target, current, timeout, {"Range": f"bytes={byte_range}"})
                    if response.status in (301, 302, 303, 307, 308):
                        location = response.getheader("Location")
                        if not location:
                            raise url_error(f"{display_url(current)} redirected without a Location header")
                        current = urljoin(current, location.strip())
                        continue
                    return (*_range_body(response, first, length, current), current)
                except (_NotCounted, FluxboothError):
                    if cut_off.fired or time.monotonic() >= budget.cut_at:
                        raise budget.overdue(current) from None
                    raise
        finally:
            connection.close()
    raise url_error(f"more than {MAX_REDIRECTS} redirects starting at {display_url(url)}; give the final URL")


def _range_body(response: http.client.HTTPResponse, first: int | None, length: int, url: str) -> tuple[bytes, int]:
    """The body of a 206 answer to the range asked for (see _fetch_range) and the file's whole size; anything else is not counted (a server
    that ignores ranges answers 200 with the whole file, which is never read) or the download's own error."""
    if response.status == 200:
        raise _NotCounted(f"{display_url(url)} ignores range requests")
    if response.status == 416:
        raise _NotCounted(f"{display_url(url)} could not serve the bytes asked for (416)")
    if response.status != 206:
        raise _status_error(response.status, response.reason, url)
    match = _CONTENT_RANGE.match(response.getheader("Content-Range", "").strip())
    if match is None:
        raise _NotCounted(f"{display_url(url)} answered a range request without a usable Content-Range")
    start, last, total = (int(group) for group in match.groups())
    expected = last - start + 1
    asked_start = total - min(length, total) if first is None else first
    if last >= total or start != asked_start or expected > length or (first is None and last != total - 1):
        raise _NotCounted(f"{display_url(url)} answered other bytes than those asked for")
    body = bytearray()
    while len(body) < expected:
        try:
            chunk = response.read1(expected - len(body))
        except TimeoutError:
            raise _NotCounted(f"{display_url(url)} stopped sending") from None
        except (http.client.IncompleteRead, ConnectionError) as error:
            raise _NotCounted(f"the connection to {display_url(url)} broke ({type(error).__name__})") from None
        if not chunk:
            raise _NotCounted(f"{display_url(url)} sent {len(body):,} of the {expected:,} bytes it promised")
        body += chunk
    return bytes(body), total
