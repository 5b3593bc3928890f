"""Where the base model comes from: a local folder for every `base_model`, found or fetched before any
money is spent.

A hub id (`org/name`, optionally pinned with `base_model_revision`) is looked up, in this order, in
- the standard Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`);
- RunPod's cached models (`FLUXBOOTH_RUNPOD_MODEL_CACHE`, default `/runpod-volume/huggingface-cache/hub`);
- the models baked into the image (`FLUXBOOTH_BAKED_MODELS_DIR`, default `/models`), either as a Hugging
  Face cache (`hf download ID --cache-dir /models`) or as plain `org/name` folders (`--local-dir`).

Found nowhere with downloads off (`HF_HUB_OFFLINE=1`), the job is refused at once, naming every place
looked at. With downloads on, the hub's metadata is read first (gated access, file sizes, free disk), only
the configs are fetched for the planner, and the weights of the diffusers pipeline (never the repo's
single-file checkpoints) are downloaded later into the standard cache, with progress.

Everything goes through the real `huggingface_hub` client (`snapshot_download`, `scan_cache_dir`), with
the cache, endpoint and token passed explicitly from the job's settings, and imported where it is used (as
tqdm is): the handler's cold start, and a job whose model is cached, never load it. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.disk_space import device_of
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.model_refusals import DEFAULT_MODEL_FIELD, base_model_refusal, endpoint_refusal
from fluxbooth.families import ALL_PIPELINE_FOLDERS, FLUX1, PIPELINE_FILE_KINDS, Family, family_of
from fluxbooth.hardware import format_bytes, free_disk_bytes
from fluxbooth.progress import throttled
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings

DEFAULT_RUNPOD_MODEL_CACHE = "/runpod-volume/huggingface-cache/hub"
DEFAULT_BAKED_MODELS_DIR = "/models"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
TINY_BUILD_TIMEOUT_SECONDS = 600

# The folders of every FLUX family's diffusers pipeline and the file kinds in them (fluxbooth.families).
# Anything else in the repo (the original single-file checkpoints at the root, sample images) is never
# downloaded; a family's own folders are a subset, so one pattern list serves every family.
PIPELINE_FILE_PATTERNS = ("model_index.json",) + tuple(
    f"{folder}/*.{kind}" for folder in ALL_PIPELINE_FOLDERS for kind in PIPELINE_FILE_KINDS
)
# What the planner reads to size the model and tell its family (sizing.model_size): fetched before the
# weights. FLUX.2 has no text_encoder_2; its pattern then matches nothing.
SIZING_FILE_PATTERNS = ("model_index.json", "transformer/config.json", "text_encoder/config.json",
                        "text_encoder_2/config.json", "vae/config.json")

ProgressSink = Callable[[int, int], None]
# What a full or unwritable cache volume raises while the client writes.
CACHE_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


class DownloadStopped(Exception):
    """Raised inside the download's progress hook to stop it (job cancelled or deadline reached)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The standard Hugging Face hub cache, resolved like huggingface_hub.constants does, from `environ`."""
    explicit = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    cache_home = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(cache_home).expanduser() / "huggingface" / "hub"


@dataclass(frozen=True)
class ModelPlaces:
    """Where a hub id may already be, whether the hub may be asked, and how. Read per job from the environment."""

    hub_cache: Path
    runpod_cache: Path
    baked_dir: Path
    offline: bool
    endpoint: str | None
    token: str | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ModelPlaces:
        return cls(
            hub_cache=hub_cache_dir(environ),
            runpod_cache=Path(environ.get("FLUXBOOTH_RUNPOD_MODEL_CACHE") or DEFAULT_RUNPOD_MODEL_CACHE),
            baked_dir=Path(environ.get("FLUXBOOTH_BAKED_MODELS_DIR") or DEFAULT_BAKED_MODELS_DIR),
            offline=_truthy(environ.get("HF_HUB_OFFLINE")) or _truthy(environ.get("TRANSFORMERS_OFFLINE")),
            endpoint=(environ.get("HF_ENDPOINT") or "").rstrip("/") or None,
            token=environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN") or None,
        )

    def caches(self) -> list[tuple[str, Path]]:
        """Each Hugging Face cache to look in, once, with the name people know it by."""
        labelled = [
            ("Hugging Face cache, HF_HUB_CACHE / HF_HOME", self.hub_cache),
            ("RunPod cached models, FLUXBOOTH_RUNPOD_MODEL_CACHE", self.runpod_cache),
            ("baked into the image, FLUXBOOTH_BAKED_MODELS_DIR", self.baked_dir),
        ]
        seen: dict[Path, int] = {}
        places: list[tuple[str, Path]] = []
        for label, path in labelled:
            key = path.absolute()
            if key in seen:
                index = seen[key]
                places[index] = (f"{places[index][0]}; {label}", places[index][1])
                continue
            seen[key] = len(places)
            places.append((label, path))
        return places

    @property
    def hub_url(self) -> str:
        return self.endpoint or DEFAULT_HUB_ENDPOINT


@dataclass(frozen=True)
class PendingDownload:
    """Pipeline files of `repo_id` at `commit` that are not in `cache_dir` yet."""

    repo_id: str
    commit: str
    cache_dir: Path
    files: tuple[tuple[str, int], ...]

    @property
    def bytes_total(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class ResolvedModel:
    """A local diffusers folder for the base model. While `pending` is set it holds only the configs
    (enough for the planner); `download_base_model` then completes it in place."""

    folder: Path
    source: str
    pending: PendingDownload | None = None


@dataclass(frozen=True)
class Look:
    """One place looked at, and what was (not) there."""

    label: str
    path: Path
    finding: str

    def describe(self) -> str:
        return f"{self.path} ({self.label}: {self.finding})"


# ------------------------------------------------------------------------------------------ pure core


def _family_for_completeness(folder: Path) -> Family:
    """The folder's family, or FLUX.1's layout when it names none or an unknown pipeline: the planner
    refuses an unknown family with the supported ones; here only the files count."""
    try:
        return family_of(folder)
    except FluxboothError:
        return FLUX1


def missing_pipeline_files(folder: Path) -> list[str]:
    """What a diffusers FLUX folder lacks: its family's configs, and safetensors weights per model component."""
    family = _family_for_completeness(folder)
    missing = [name for name in family.required_files if not (folder / name).is_file()]
    for component in family.weight_folders:
        component_dir = folder / component
        if component_dir.is_dir() and not any(path.is_file() for path in component_dir.glob("*.safetensors")):
            missing.append(f"{component}/*.safetensors")
    return missing


def describe_model(repo_id: str, revision: str | None) -> str:
    return f"{repo_id} (revision {revision})" if revision else repo_id


def how_to_provide(repo_id: str) -> str:
    return (
        f"Provide it one of these ways: bake it into the image (`hf download {repo_id} --cache-dir /models`, "
        "FLUXBOOTH_BAKED_MODELS_DIR); select it as the endpoint's RunPod cached model (it appears under "
        f"{DEFAULT_RUNPOD_MODEL_CACHE}); put it on a network volume in the Hugging Face cache layout and "
        "point HF_HOME at it (HF_HOME=/runpod-volume/huggingface-cache); or let the worker download it once "
        "(unset HF_HUB_OFFLINE, and set HF_TOKEN for gated models)"
    )


def not_found_error(repo_id: str, revision: str | None, looks: Sequence[Look], field: str) -> FluxboothError:
    looked = "; ".join(look.describe() for look in looks)
    return base_model_refusal(
        field,
        f"{field}: {describe_model(repo_id, revision)} is not on this worker and downloads are off "
        f"(HF_HUB_OFFLINE=1). Looked in: {looked}. {how_to_provide(repo_id)}",
        looked_in=[str(look.path) for look in looks],
    )


def download_does_not_fit(pending: PendingDownload, free_bytes: int) -> FluxboothError | None:
    if pending.bytes_total <= free_bytes:
        return None
    return FluxboothError(
        ErrorCode.DOES_NOT_FIT,
        f"disk: downloading {pending.repo_id} needs {format_bytes(pending.bytes_total)} "
        f"({len(pending.files)} files) but only {format_bytes(free_bytes)} are free under {pending.cache_dir}; "
        "free space there, point HF_HOME at a bigger volume, or provide the model another way "
        "(baked into the image, RunPod cached model)",
        refresh_worker=False,
        details={"needed_bytes": pending.bytes_total, "free_bytes": free_bytes},
    )


def download_and_training_do_not_fit(pending: PendingDownload, training_bytes: int, free_bytes: int) -> FluxboothError | None:
    """When the cache and the job's directory share a disk, the model and the training run must both fit."""
    needed = pending.bytes_total + training_bytes
    if needed <= free_bytes:
        return None
    return FluxboothError(
        ErrorCode.DOES_NOT_FIT,
        f"disk: downloading {pending.repo_id} ({format_bytes(pending.bytes_total)}) and then training (about "
        f"{format_bytes(training_bytes)}: caches, checkpoints and the exported weights) need "
        f"{format_bytes(needed)} on the disk holding {pending.cache_dir}, but only {format_bytes(free_bytes)} "
        "are free; free space there, point HF_HOME at another volume, or provide the model another way "
        "(baked into the image, RunPod cached model)",
        refresh_worker=False,
        details={"needed_bytes": needed, "free_bytes": free_bytes},
    )


def hub_error(error: Exception, repo_id: str, revision: str | None, places: ModelPlaces, field: str) -> FluxboothError:
    """The hub's refusal in the worker's error contract, saying what to change."""
    # huggingface_hub on use only: see the module docstring.
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    # The client wraps what the hub said (a dry run raises DryRunError from it): look down the chain.
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, RepositoryNotFoundError | RevisionNotFoundError):
        cause = cause.__cause__
    error = cause if isinstance(cause, Exception) else error
    page = f"{places.hub_url}/{repo_id}"
    if isinstance(error, GatedRepoError):
        if places.token is None:
            message = (
                f"{field}: {repo_id} is a gated model and the worker has no Hugging Face token: accept its "
                f"license at {page} with your account, then set HF_TOKEN (a read token of that account) on "
                "the endpoint"
            )
        else:
            message = (
                f"{field}: the account of HF_TOKEN has no access to the gated model {repo_id}: accept its "
                f"license at {page} with that account, or set HF_TOKEN to a token of an account that has"
            )
        return endpoint_refusal(message)
    if isinstance(error, RevisionNotFoundError):
        return FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input.base_model_revision: {repo_id} has no revision {revision!r} on the Hub ({page}); give a "
            "branch, tag or commit hash that exists",
            refresh_worker=False,
        )
    if isinstance(error, RepositoryNotFoundError):
        return base_model_refusal(
            field,
            f"{field}: {repo_id} was not found on the Hub ({page}); check the id, and set HF_TOKEN if the "
            "repository is private",
        )
    return endpoint_refusal(
        f"{field}: {describe_model(repo_id, revision)} is not on this worker and the Hub at {places.hub_url} "
        f"could not be asked ({type(error).__name__}: {str(error)[:300]}). {how_to_provide(repo_id)}"
    )


def cache_error(error: Exception, cache_dir: Path, repo_id: str) -> FluxboothError | None:
    """A full or unwritable cache volume, told apart from the hub's answers (which are OSErrors too)."""
    if not isinstance(error, OSError) or error.errno not in CACHE_DISK_ERRNOS:
        return None
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: the disk under {cache_dir} filled up while downloading {repo_id} ({error.strerror}); free "
            "space there or point HF_HOME at a bigger volume",
            refresh_worker=False,
        )
    return endpoint_refusal(
        f"base_model: the Hugging Face cache {cache_dir} cannot be written ({error.strerror}); point HF_HOME "
        "at a writable volume"
    )


# ------------------------------------------------------------------------------------------ looking


def _snapshot_in_cache(cache_root: Path, repo_id: str, revision: str | None) -> Path | None:
    """The complete snapshot of `repo_id` at `revision` in one cache, through the client's own lookup
    (refs, and the cached tree listing when there is one, which catches interrupted downloads)."""
    from huggingface_hub import snapshot_download  # on use only: see the module docstring
    from huggingface_hub.errors import LocalEntryNotFoundError  # on use only: see the module docstring

    try:
        folder = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache_root, local_files_only=True,
            allow_patterns=list(PIPELINE_FILE_PATTERNS),
        ))
    except LocalEntryNotFoundError:
        return None
    return folder if not missing_pipeline_files(folder) else None


def _newest_complete_snapshot(cache_root: Path, repo_id: str) -> Path | None:
    """A cache filled without refs (RunPod's cached models keep only snapshots/<commit>): its newest
    complete snapshot, for a request that pins no revision."""
    from huggingface_hub import scan_cache_dir  # on use only: see the module docstring

    cache = scan_cache_dir(cache_root)
    revisions = [
        revision
        for repo in cache.repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for revision in repo.revisions
        if not missing_pipeline_files(revision.snapshot_path)
    ]
    if not revisions:
        return None
    return max(revisions, key=lambda revision: revision.last_modified).snapshot_path


def _look_in_cache(label: str, cache_root: Path, repo_id: str, revision: str | None) -> tuple[Path | None, Look]:
    from huggingface_hub.file_download import repo_folder_name  # on use only: see the module docstring

    repo_folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    if not cache_root.is_dir():
        return None, Look(label, cache_root, "no such folder")
    if not (cache_root / repo_folder).is_dir():
        return None, Look(label, cache_root, f"no {repo_folder}")
    folder = _snapshot_in_cache(cache_root, repo_id, revision)
    if folder is None and revision is None:
        folder = _newest_complete_snapshot(cache_root, repo_id)
    if folder is None:
        return None, Look(label, cache_root, f"{repo_folder} has no complete snapshot of revision {revision or 'main'}")
    return folder, Look(label, cache_root, "found")


def locate_hub_model(repo_id: str, revision: str | None, places: ModelPlaces) -> tuple[Path | None, list[Look]]:
    """The first complete local copy of `repo_id` at `revision`, and every place looked at."""
    looks: list[Look] = []
    for label, cache_root in places.caches():
        folder, look = _look_in_cache(label, cache_root, repo_id, revision)
        looks.append(look)
        if folder is not None:
            return folder, looks
    plain = places.baked_dir / repo_id
    if revision is None and plain.is_dir() and not missing_pipeline_files(plain):
        return plain, looks + [Look("baked folder", plain, "found")]
    finding = "no such folder" if not plain.is_dir() else "not a complete diffusers FLUX folder"
    if revision is not None:
        finding = "a plain folder has no revision; pinned revisions are looked up in the caches only"
    return None, looks + [Look("baked folder, FLUXBOOTH_BAKED_MODELS_DIR/org/name", plain, finding)]


# ------------------------------------------------------------------------------------------ downloading


def prepare_download(repo_id: str, revision: str | None, places: ModelPlaces, field: str) -> ResolvedModel:
    """Ask the hub what the pipeline's files weigh (refusing early on gated access, unknown ids and
    revisions, or a disk too small), then fetch only the configs the planner reads."""
    from huggingface_hub import snapshot_download  # on use only: see the module docstring

    cache_dir = places.hub_cache
    common: dict[str, Any] = {
        "revision": revision, "cache_dir": cache_dir, "endpoint": places.endpoint, "token": places.token,
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
            repo_id=repo_id, commit=commit, cache_dir=cache_dir,
            files=tuple((info.filename, info.file_size or 0) for info in preview if info.will_download),
        )
        refusal = download_does_not_fit(pending, free_disk_bytes(cache_dir))
        if refusal is not None:
            raise refusal
        folder = Path(snapshot_download(repo_id, allow_patterns=list(SIZING_FILE_PATTERNS), **{**common, "revision": commit}))
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
    from tqdm.auto import tqdm  # on use only: see the module docstring

    class ByteCountingBar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.counts_bytes = tally is not None and kwargs.get("unit") == "B"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if tally is not None and self.counts_bytes and n:
                tally.add(id(self), int(n))
            return super().update(n)

    return ByteCountingBar


def download_pending(pending: PendingDownload, places: ModelPlaces, sink: ProgressSink, should_stop: Callable[[], str | None]) -> Path:
    """Download the pipeline files into the standard cache (blocking). Files already there are kept."""
    from huggingface_hub import snapshot_download  # on use only: see the module docstring

    refusal = download_does_not_fit(pending, free_disk_bytes(pending.cache_dir))
    if refusal is not None:
        raise refusal
    tally = _ByteTally(sink, pending.bytes_total, should_stop)
    folder = snapshot_download(
        pending.repo_id, revision=pending.commit, cache_dir=pending.cache_dir, endpoint=places.endpoint,
        token=places.token, allow_patterns=list(PIPELINE_FILE_PATTERNS), tqdm_class=_progress_bar_class(tally),
    )
    sink(pending.bytes_total, pending.bytes_total)
    return Path(folder)


async def download_base_model(
    model: ResolvedModel, environ: Mapping[str, str], report: Callable[[dict[str, Any]], None],
    min_interval: float, deadline_monotonic: float,
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


def resolve_hub_model(repo_id: str, revision: str | None, environ: Mapping[str, str], field: str) -> ResolvedModel:
    """A local folder for a hub id: from a cache on this worker, or (downloads on) a pending download."""
    places = ModelPlaces.from_environ(environ)
    folder, looks = locate_hub_model(repo_id, revision, places)
    if folder is not None:
        return ResolvedModel(folder=folder, source=looks[-1].label)
    if places.offline:
        raise not_found_error(repo_id, revision, looks, field)
    return prepare_download(repo_id, revision, places, field)


def local_model_folder(name: str, revision: str | None, environ: Mapping[str, str]) -> Path | None:
    """The local diffusers folder for a path or hub id when one is on this machine (for sizing from its
    configs); never asks the hub, never downloads."""
    if name.startswith("/"):
        folder = Path(name)
        return folder if (folder / "transformer" / "config.json").is_file() else None
    return locate_hub_model(name, revision, ModelPlaces.from_environ(environ))[0]


def pending_download_bytes(model: ResolvedModel) -> int:
    """Bytes of the base model still to download before training (its resolved file list); 0 when cached."""
    return model.pending.bytes_total if model.pending is not None else 0


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Build the tiny FLUX pipeline once per cache dir, in a subprocess (this process stays torch-free)."""
    target = cache_dir / "models" / "tiny-flux"
    if (target / "model_index.json").is_file():
        return target
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.tiny", str(target)],
        capture_output=True,
        text=True,
        timeout=TINY_BUILD_TIMEOUT_SECONDS,
        start_new_session=True,
    )
    if completed.returncode != 0 or not (target / "model_index.json").is_file():
        raise FluxboothError(
            ErrorCode.INTERNAL, f"building the tiny model failed: {completed.stderr.strip()[-2000:]}"
        )
    return target


def resolve_base_model(requested: str | None, settings: WorkerSettings, revision: str | None = None) -> ResolvedModel:
    """A local folder for the base model, known before the dataset is fetched: the built-in tiny model, an
    absolute path, or a hub id found in a cache on this worker or (downloads on) pending a download."""
    name = requested or settings.default_base_model
    field = "input.base_model" if requested else DEFAULT_MODEL_FIELD
    if revision is not None and (name == TINY_MODEL_NAME or name.startswith("/")):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input.base_model_revision: pins a revision of a Hugging Face id, but the base model {name} is "
            "not one; leave base_model_revision out",
        )
    if name == TINY_MODEL_NAME:
        return ResolvedModel(folder=ensure_tiny_model(settings.cache_dir), source="built-in tiny model")
    if name.startswith("/"):
        path = Path(name)
        missing = missing_pipeline_files(path) if path.is_dir() else ["the folder itself"]
        if missing:
            raise base_model_refusal(
                field, f"{field}: {name} is not a diffusers FLUX folder (missing {', '.join(missing[:5])})"
            )
        return ResolvedModel(folder=path, source="local folder")
    return resolve_hub_model(name, revision, settings.environ, field)
