"""Downloading a base model from the hub: its metadata read first (access, file sizes, free disk), then the
pipeline's files into the standard cache with progress, stopped by a cancelled job or the deadline.

`huggingface_hub` and tqdm are imported where they are used (fluxbooth.models.source says why). No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.disk import device_of
from fluxbooth.host.hardware import free_disk_bytes
from fluxbooth.messages import format_bytes
from fluxbooth.models.source.cache import missing_pipeline_files
from fluxbooth.models.source.errors import (
    cache_error,
    describe_model,
    download_and_training_do_not_fit,
    download_does_not_fit,
    hub_error,
)
from fluxbooth.models.source.places import (
    PIPELINE_FILE_PATTERNS,
    SIZING_FILE_PATTERNS,
    ModelPlaces,
    PendingDownload,
    ResolvedModel,
)
from fluxbooth.progress import throttled

ProgressSink = Callable[[int, int], None]


class DownloadStopped(Exception):
    """Raised inside the download's progress hook to stop it (job cancelled or deadline reached)."""


def prepare_download(repo_id: str, revision: str | None, places: ModelPlaces, field: str) -> ResolvedModel:
    """Ask the hub what the pipeline's files weigh (refusing early on gated access, unknown ids and
    revisions, or a disk too small), then fetch only the configs the planner reads."""
    from huggingface_hub import snapshot_download  # on use only: see fluxbooth.models.source

    cache_dir = places.hub_cache
    common: dict[str, Any] = {
        "revision": revision,
        "cache_dir": cache_dir,
        "endpoint": places.endpoint,
        "token": places.token,
        "tqdm_class": _progress_bar_class(None),
    }
    try:
        preview = snapshot_download(repo_id, allow_patterns=list(PIPELINE_FILE_PATTERNS), dry_run=True, **common)
        if not preview:
            raise FluxboothError(
                ErrorCode.INVALID_INPUT,
                f"{field}: {describe_model(repo_id, revision)} on the Hub has no diffusers pipeline files "
                "(model_index.json, transformer/, vae/, ...); give the id of a diffusers FLUX repository",
                refresh_worker=False,
            )
        commit = preview[0].commit_hash
        pending = PendingDownload(
            repo_id=repo_id,
            commit=commit,
            cache_dir=cache_dir,
            files=tuple((info.filename, info.file_size or 0) for info in preview if info.will_download),
        )
        refusal = download_does_not_fit(pending, free_disk_bytes(cache_dir))
        if refusal is not None:
            raise refusal
        folder = Path(
            snapshot_download(repo_id, allow_patterns=list(SIZING_FILE_PATTERNS), **{**common, "revision": commit})
        )
    except FluxboothError:
        raise
    except Exception as error:  # the hub client's errors (gated, not found, unreachable) or the cache's disk
        raise cache_error(error, cache_dir, repo_id) or hub_error(error, repo_id, revision, places, field) from error
    return ResolvedModel(folder=folder, source="download", pending=pending)


def ensure_room_to_download(model: ResolvedModel, training_bytes: int, work_root: Path) -> None:
    """At plan time: the pending download, plus the training run when it writes to the same disk."""
    pending = model.pending
    if pending is None or device_of(pending.cache_dir) != device_of(work_root):
        return
    refusal = download_and_training_do_not_fit(pending, training_bytes, free_disk_bytes(pending.cache_dir))
    if refusal is not None:
        raise refusal


class _ByteTally:
    """Bytes written so far, from the client's own progress bars (it reports network bytes and written
    bytes on separate bars; the largest count is what is on disk). Stops the download when asked."""

    def __init__(self, sink: ProgressSink, total: int, should_stop: Callable[[], str | None]) -> None:
        self.sink, self.total, self.should_stop = sink, total, should_stop
        self.counts: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, bar_id: int, count: int) -> None:
        reason = self.should_stop()
        if reason is not None:
            raise DownloadStopped(reason)
        with self.lock:
            self.counts[bar_id] = self.counts.get(bar_id, 0) + count
            done = max(self.counts.values())
        self.sink(min(done, self.total), self.total)


def _progress_bar_class(tally: _ByteTally | None) -> type:
    """A tqdm for the client that draws nothing (the worker reports progress as events, not on a
    terminal) and hands the bytes of its byte bars to `tally`."""
    from tqdm.auto import tqdm  # on use only: see fluxbooth.models.source

    # tqdm has no types (mypy sees Any); strict mode refuses subclassing Any.
    class ByteCountingBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.counts_bytes = tally is not None and kwargs.get("unit") == "B"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if tally is not None and self.counts_bytes and n:
                tally.add(id(self), int(n))
            drawn: bool | None = super().update(n)
            return drawn

    return ByteCountingBar


def download_pending(
    pending: PendingDownload, places: ModelPlaces, sink: ProgressSink, should_stop: Callable[[], str | None]
) -> Path:
    """Download the pipeline files into the standard cache (blocking). Files already there are kept."""
    from huggingface_hub import snapshot_download  # on use only: see fluxbooth.models.source

    refusal = download_does_not_fit(pending, free_disk_bytes(pending.cache_dir))
    if refusal is not None:
        raise refusal
    tally = _ByteTally(sink, pending.bytes_total, should_stop)
    folder = snapshot_download(
        pending.repo_id,
        revision=pending.commit,
        cache_dir=pending.cache_dir,
        endpoint=places.endpoint,
        token=places.token,
        allow_patterns=list(PIPELINE_FILE_PATTERNS),
        tqdm_class=_progress_bar_class(tally),
    )
    sink(pending.bytes_total, pending.bytes_total)
    return Path(folder)


async def download_base_model(
    model: ResolvedModel,
    environ: Mapping[str, str],
    report: Callable[[dict[str, Any]], None],
    min_interval: float,
    deadline_monotonic: float,
) -> Path:
    """Complete `model` in a thread, reporting bytes done and total; a cancelled job or the deadline
    stops the download at its next chunk."""
    pending = model.pending
    if pending is None:
        return model.folder
    places = ModelPlaces.from_environ(environ)
    sink = throttled(report, min_interval)
    cancelled = threading.Event()

    def should_stop() -> str | None:
        if cancelled.is_set():
            return "the job was cancelled"
        return "the job's deadline was reached" if time.monotonic() > deadline_monotonic else None

    work = asyncio.ensure_future(asyncio.to_thread(download_pending, pending, places, sink, should_stop))
    try:
        folder = await asyncio.shield(work)
    except asyncio.CancelledError:
        cancelled.set()
        with contextlib.suppress(Exception):  # the cancellation is what the caller must see
            await work
        raise
    except DownloadStopped as stopped:
        raise FluxboothError(
            ErrorCode.TIMEOUT,
            f"base_model: downloading {pending.repo_id} ({format_bytes(pending.bytes_total)}) stopped: {stopped}; "
            f"the files finished so far stay in {pending.cache_dir}. Raise timeout_seconds, or provide the model "
            "on the worker (baked into the image, RunPod cached model, network volume)",
            refresh_worker=False,
        ) from stopped
    except FluxboothError:
        raise
    except Exception as error:
        raise cache_error(error, pending.cache_dir, pending.repo_id) or hub_error(
            error, pending.repo_id, pending.commit, places, "base_model"
        ) from error
    missing = missing_pipeline_files(folder)
    if missing:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"base_model: {pending.repo_id} was downloaded but is not a diffusers FLUX folder (missing "
            f"{', '.join(missing[:5])})",
            refresh_worker=False,
        )
    return folder
