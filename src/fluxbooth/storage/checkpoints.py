"""Checkpoints that outlive the worker: uploaded as the trainer makes them, found and fetched to resume.

Layout in the store (per model, shared by every job of that model):
    <prefix>/<model_name>/checkpoints/checkpoint-<step>/<files of the trainer's checkpoint folder>
    <prefix>/<model_name>/checkpoints/checkpoint-<step>/COMPLETE
COMPLETE is uploaded last and lists every file with its size and sha256: a checkpoint without it
(an upload cut short by a timeout or a crash) is never resumed from, and a download is verified
against it. After each upload, older checkpoints are pruned (`prune_checkpoints`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import unquote, urlsplit

from fluxbooth.contract.checkpoint_record import (
    CHECKPOINT_RECORD_NAME,
    COMPLETE_MARKER,
    CheckpointRecord,
    CompleteIndex,
    checkpoint_record,
)
from fluxbooth.contract.events import CheckpointEvent, TrainerEvent
from fluxbooth.contract.layout import checkpoint_folder_name, checkpoint_root, step_of_folder
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.settings import WorkerSettings
from fluxbooth.storage.artifacts import sha256_file
from fluxbooth.storage.local import LocalStore
from fluxbooth.storage.protocol import ReadableStore
from fluxbooth.storage.stores import open_bucket_store, open_checkpoint_store

if TYPE_CHECKING:
    from fluxbooth.request.spec import JobSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")

LATEST = "latest"


# ------------------------------------------------------------------------------------ upload


def upload_checkpoint(store: ReadableStore, folder: Path, step: int) -> str:
    """Upload every file of `folder` under `checkpoint-<step>/`, then the COMPLETE index; return its URI."""
    name = checkpoint_folder_name(step)
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != COMPLETE_MARKER)
    index = CompleteIndex(step=step, files={})
    for path in files:
        relative = path.relative_to(folder).as_posix()
        stored = store.upload(path, f"{name}/{relative}", sha256=sha256_file(path))
        index.files[relative] = (stored.bytes, stored.sha256)
    marker = folder / COMPLETE_MARKER
    marker.write_text(index.to_json())
    store.upload(marker, f"{name}/{COMPLETE_MARKER}", sha256=sha256_file(marker))
    return f"{store.describe()}/{name}"


def stored_steps(store: ReadableStore) -> list[int]:
    """The steps of the `checkpoint-N` folders in `store`, ascending (complete or not)."""
    return sorted(step for step in map(step_of_folder, store.list_folders()) if step is not None)


def is_complete(store: ReadableStore, step: int) -> bool:
    """Whether checkpoint `step` finished uploading: its COMPLETE marker, written last, exists."""
    return store.exists(f"{checkpoint_folder_name(step)}/{COMPLETE_MARKER}")


def prune_checkpoints(store: ReadableStore, keep: int, just_uploaded: int) -> list[str]:
    """Delete what a resume no longer needs; return the deleted folder names, oldest first.

    Kept: the newest `keep` complete checkpoints (by step), the one just uploaded, and incomplete
    folders above the newest complete step (another job of this model may be uploading one right now).
    Deleted: older complete checkpoints and incomplete folders below the newest complete step (uploads
    cut short). `keep` 0 deletes nothing. Folders that are not `checkpoint-N` are never touched."""
    if keep <= 0:
        return []
    steps = stored_steps(store)
    complete = [step for step in steps if step == just_uploaded or is_complete(store, step)]
    if not complete:
        return []
    kept = set(complete[-keep:]) | {just_uploaded}
    newest_complete = complete[-1]
    doomed = [step for step in steps if step not in kept and (step in complete or step < newest_complete)]
    deleted: list[str] = []
    for step in doomed:
        name = checkpoint_folder_name(step)
        removed = store.delete_folder(name)
        what = "checkpoint" if step in complete else "incomplete checkpoint upload"
        logger.info("pruned %s %s/%s (%d objects)", what, store.describe(), name, removed)
        deleted.append(name)
    return deleted


def _snapshot(folder: Path, snapshot: Path) -> None:
    """Hard-link the checkpoint's files into `snapshot` (copy where linking is refused): the trainer
    prunes old checkpoint folders on its own schedule, and an upload still running must keep its files."""
    for path in sorted(folder.rglob("*")):
        target = snapshot / path.relative_to(folder)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


class CheckpointUploader:
    """Uploads each checkpoint the trainer reports, in order, on one background thread.

    `checkpoint_made` is called from the trainer's log pump in the event loop, so it only snapshots the
    folder (hard links: milliseconds) and queues the upload. `finish` waits for the queue. A failed
    upload is a warning: the trained weights matter more than an intermediate checkpoint. After each
    upload the model's stored checkpoints are pruned to the newest `keep` (0: never pruned); a failed
    prune is a warning too."""

    def __init__(self, store: ReadableStore, checkpoint_root: Path, staging_root: Path, *, keep: int = 0) -> None:
        self._store = store
        self._keep = keep
        self._checkpoint_root = checkpoint_root.resolve()
        self._staging_root = staging_root
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-upload")
        self._pending: list[Future[tuple[str, str | None]]] = []
        self.uploaded: list[str] = []
        self.warnings: list[str] = []

    def on_trainer_event(self, event: TrainerEvent) -> None:
        if isinstance(event, CheckpointEvent):
            self.checkpoint_made(event)

    def checkpoint_made(self, event: CheckpointEvent) -> None:
        step = event.step
        try:
            folder = Path(event.path).resolve()
            if folder.parent != self._checkpoint_root or not folder.is_dir():
                raise ValueError(f"{folder} is not a checkpoint folder under {self._checkpoint_root}")
            snapshot = self._staging_root / checkpoint_folder_name(step)
            shutil.rmtree(snapshot, ignore_errors=True)
            _snapshot(folder, snapshot)
        except (ValueError, OSError) as error:
            self._warn(f"checkpoint at step {step} was not uploaded: {error}")
            return
        self._pending.append(self._executor.submit(self._upload, snapshot, step))

    def _upload(self, snapshot: Path, step: int) -> tuple[str, str | None]:
        """The uploaded checkpoint's URI, and a warning when pruning after it failed."""
        try:
            uri = upload_checkpoint(self._store, snapshot, step)
            logger.info("checkpoint %d uploaded to %s", step, uri)
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)
        return uri, self._prune_after(step)

    def _prune_after(self, step: int) -> str | None:
        try:
            prune_checkpoints(self._store, self._keep, just_uploaded=step)
        except FluxboothError as error:
            return f"pruning old checkpoints after checkpoint {step} failed, they stay in storage: {error.message}"
        except Exception as error:  # same: a warning, never the job's failure
            return f"pruning old checkpoints after checkpoint {step} failed ({type(error).__name__}: {error})"
        return None

    async def finish(self) -> None:
        """Wait for every queued upload. When cancelled, drop the queue but wait for the upload in
        flight: it reads from the job directory, which is removed next."""
        try:
            for future in self._pending:
                try:
                    uri, prune_warning = await asyncio.wrap_future(future)
                    self.uploaded.append(uri)
                    if prune_warning is not None:
                        self._warn(prune_warning)
                except FluxboothError as error:
                    self._warn(f"a checkpoint upload failed, resuming from it will not be possible: {error.message}")
                except Exception as error:  # same: a warning, never the job's failure
                    self._warn(f"a checkpoint upload failed ({type(error).__name__}: {error})")
        finally:
            await self.abandon()

    async def abandon(self) -> None:
        """Drop the uploads not yet started and wait for the one in flight."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.shield(asyncio.to_thread(self._executor.shutdown, wait=True))

    def _warn(self, message: str) -> None:
        logger.warning(message)
        self.warnings.append(message)


# ------------------------------------------------------------------------------------ resume


@dataclass(frozen=True)
class StoredCheckpoint:
    store: ReadableStore
    step: int

    @property
    def uri(self) -> str:
        return f"{self.store.describe()}/{checkpoint_folder_name(self.step)}"


def latest_complete_checkpoint(store: ReadableStore) -> StoredCheckpoint | None:
    """The highest step whose COMPLETE marker exists; half-uploaded checkpoints are passed over."""
    for step in reversed(stored_steps(store)):
        if is_complete(store, step):
            return StoredCheckpoint(store, step)
    return None


def _invalid_resume(message: str) -> FluxboothError:
    return FluxboothError(ErrorCode.INVALID_INPUT, f"input.resume_from: {message}")


def checkpoint_at_uri(uri: str, settings: WorkerSettings) -> StoredCheckpoint:
    """`s3://<configured bucket>/<key prefix>/checkpoint-N` or `file://<inside the output dir>/checkpoint-N`."""
    parts = urlsplit(uri)
    path = unquote(parts.path).rstrip("/")
    parent, _, folder = path.rpartition("/")
    step = step_of_folder(folder)
    if parts.scheme not in {"s3", "file"} or step is None or parts.query or parts.fragment:
        raise _invalid_resume(
            "expected 'latest', s3://<bucket>/<prefix>/checkpoint-<step> or file:///<path>/checkpoint-<step>"
        )
    if parts.scheme == "s3":
        if settings.bucket is None:
            raise _invalid_resume("this worker has no bucket (BUCKET_NAME is unset); pass 'latest' or a file:// URI")
        if parts.netloc != settings.bucket.bucket:
            raise _invalid_resume(f"the checkpoint must be in the worker's bucket {settings.bucket.bucket!r}")
        return StoredCheckpoint(open_bucket_store(settings, parent.strip("/")), step)
    output_dir = settings.output_dir.resolve()
    if parts.netloc not in {"", "localhost"} or not Path(path).resolve().is_relative_to(output_dir):
        raise _invalid_resume(f"a file:// checkpoint must be inside the worker's output directory {output_dir}")
    return StoredCheckpoint(LocalStore(Path(parent)), step)


def find_resume_checkpoint(
    resume_from: str, settings: WorkerSettings, model_name: str
) -> tuple[StoredCheckpoint | None, list[str]]:
    """The checkpoint `resume_from` names, and warnings. `latest` with nothing stored is not an error:
    the first attempt of a job that is meant to be resubmitted has nothing to resume yet."""
    if resume_from == LATEST:
        store = open_checkpoint_store(settings, model_name)
        found = latest_complete_checkpoint(store)
        if found is None:
            return None, [f"resume_from 'latest': no complete checkpoint under {store.describe()}; started at step 0"]
        return found, []
    checkpoint = checkpoint_at_uri(resume_from, settings)
    if not is_complete(checkpoint.store, checkpoint.step):
        raise _invalid_resume(
            f"{resume_from} is not a complete checkpoint (no {COMPLETE_MARKER} marker): its upload was cut "
            "short or it does not exist; pass 'latest' or another checkpoint"
        )
    return checkpoint, []


def _read_stored(checkpoint: StoredCheckpoint, name: str, local: Path, what: str, parse: Callable[[str], T]) -> T:
    """The checkpoint's file `name`, downloaded to `local` and parsed; `invalid_input` naming resume_from when
    `parse` finds it unsound (never a crash on a negative, huge or fractional number)."""
    checkpoint.store.download(f"{checkpoint_folder_name(checkpoint.step)}/{name}", local)
    try:
        return parse(local.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        raise _invalid_resume(
            f"the {what} of {checkpoint.uri} is unreadable ({error}); pass another checkpoint"
        ) from error


def _read_index(checkpoint: StoredCheckpoint, index_path: Path) -> CompleteIndex:
    """The checkpoint's COMPLETE index, downloaded to `index_path`: a sound one for this very checkpoint."""
    index = _read_stored(checkpoint, COMPLETE_MARKER, index_path, f"{COMPLETE_MARKER} index", CompleteIndex.from_json)
    if index.step != checkpoint.step:
        raise _invalid_resume(
            f"the {COMPLETE_MARKER} index of {checkpoint.uri} says step {index.step}, not {checkpoint.step}; "
            "pass another checkpoint"
        )
    return index


def job_checkpoint_record(spec: JobSpec, family: str) -> CheckpointRecord:
    """What a checkpoint of this job records (the trainer writes the same from its config)."""
    return checkpoint_record(
        spec.export.base_model_name,
        family,
        spec.training_type,
        spec.lora.rank,
        spec.lora.alpha,
        spec.lora.target_modules,
    )


def check_resume_checkpoint(checkpoint: StoredCheckpoint, job: CheckpointRecord, steps: int) -> list[str]:
    """Before launch: refuse (`invalid_input` naming resume_from) a checkpoint at or past the requested `steps`,
    or one made on another base model, family, training type or LoRA shape; return warnings. A checkpoint from
    before checkpoints recorded their base is accepted with a warning: the trainer still checks the training type,
    ZeRO stage and process count, but whether its base is this job's cannot be told."""
    with tempfile.TemporaryDirectory(prefix="fluxbooth-resume-") as scratch:
        index = _read_index(checkpoint, Path(scratch) / COMPLETE_MARKER)
        if index.step >= steps:
            raise _invalid_resume(
                f"{checkpoint.uri} is at step {index.step}, not before this job's steps={steps}: steps is the total, "
                f"so raise it above {index.step} to train further, or pass another checkpoint"
            )
        if CHECKPOINT_RECORD_NAME not in index.files:
            return [
                f"resume_from: {checkpoint.uri} was made before checkpoints recorded their base model, so it is assumed "
                f"to be trained on {job.base_model!r}; if it was not, the run fails or trains the wrong model"
            ]
        record = _read_stored(
            checkpoint,
            CHECKPOINT_RECORD_NAME,
            Path(scratch) / CHECKPOINT_RECORD_NAME,
            CHECKPOINT_RECORD_NAME,
            CheckpointRecord.from_json,
        )
    differences = record.differences(job)
    if differences:
        raise _invalid_resume(
            f"{checkpoint.uri} was trained on base_model {record.base_model!r}, this job's is {job.base_model!r}; "
            f"it differs in {', '.join(differences)}. Resume with the checkpoint's base model and LoRA settings, "
            "or pass another checkpoint (or another model_name to start a new run)"
        )
    return []


def download_checkpoint(checkpoint: StoredCheckpoint, checkpoint_root: Path) -> Path:
    """Fetch the checkpoint into `<checkpoint_root>/checkpoint-N/`, each file checked against COMPLETE."""
    name = checkpoint_folder_name(checkpoint.step)
    target = checkpoint_root / name
    shutil.rmtree(target, ignore_errors=True)
    index_path = target / COMPLETE_MARKER
    index_path.parent.mkdir(parents=True, exist_ok=True)
    expected = _read_index(checkpoint, index_path).files
    for relative, (size, sha256) in expected.items():
        local = target / relative
        if not local.resolve().is_relative_to(target.resolve()):
            raise _invalid_resume(f"{checkpoint.uri} lists a file outside the checkpoint; pass another checkpoint")
        checkpoint.store.download(f"{name}/{relative}", local)
        if local.stat().st_size != size or sha256_file(local) != sha256:
            raise FluxboothError(
                ErrorCode.UPLOAD_FAILED,
                f"checkpoint file {relative} of {checkpoint.uri} differs from its {COMPLETE_MARKER} index "
                "(size or sha256); it was altered in storage, resume from another checkpoint",
            )
    index_path.unlink()
    return target


def trainer_checkpoint_root(trainer: TrainerConfig) -> Path:
    """Where the trainer writes (and looks for) checkpoint-N folders: its own default when unset."""
    return checkpoint_root(trainer.checkpoints.dir, trainer.output_dir)


def checkpoint_uploader(
    trainer: TrainerConfig, settings: WorkerSettings, model_name: str, job_dir: Path
) -> CheckpointUploader | None:
    """Uploads each checkpoint the trainer writes, when it writes any (checkpointing steps or a stop time)."""
    if not trainer.checkpoints.every and trainer.stop_at_unix_seconds is None:
        return None
    store = open_checkpoint_store(settings, model_name)
    return CheckpointUploader(
        store,
        trainer_checkpoint_root(trainer),
        staging_root=job_dir / "checkpoint-uploads",
        keep=settings.checkpoints_keep,
    )


def with_resume_hint(failure: FluxboothError, uploader: CheckpointUploader | None) -> FluxboothError:
    """A job cut short by its deadline can be resubmitted: say so when a checkpoint made it to storage."""
    if uploader is None or not uploader.uploaded:
        return failure
    return FluxboothError(
        failure.code,
        f"{failure.message}. The checkpoint {uploader.uploaded[-1]} is stored: resubmit the job with "
        '"resume_from": "latest" to continue from it',
        refresh_worker=failure.refresh_worker,
        details={**failure.details, "latest_checkpoint": uploader.uploaded[-1]},
    )
