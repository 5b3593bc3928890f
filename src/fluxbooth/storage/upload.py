"""The job's artifacts to their store; when the upload fails, kept on the persistent volume instead, and the
failure says where (or that no volume is mounted to keep them)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import format_bytes, os_reason
from fluxbooth.settings import WorkerSettings
from fluxbooth.storage.artifacts import LocalArtifact
from fluxbooth.storage.local import copy_atomically
from fluxbooth.storage.protocol import check_path_segment
from fluxbooth.storage.stores import open_store

logger = logging.getLogger(__name__)

UNUPLOADED_DIR_NAME = "fluxbooth-unuploaded"


def upload_artifacts(
    artifacts: list[LocalArtifact], settings: WorkerSettings, model_name: str, job_id: str
) -> list[dict[str, Any]]:
    """Every artifact to the job's store; when the upload fails, the artifacts are copied to the persistent
    volume and the failure says where."""
    store = open_store(settings, model_name, job_id)
    try:
        return [store.upload(artifact.path, artifact.name, sha256=artifact.sha256).to_dict() for artifact in artifacts]
    except FluxboothError as error:
        keep_dir = settings.volume_dir
        if keep_dir is None:
            raise FluxboothError(
                error.code,
                f"{error.message}. No persistent volume is mounted (FLUXBOOTH_VOLUME_DIR), so the weights "
                "could not be kept; mount a network volume to keep them on upload failures",
                refresh_worker=error.refresh_worker,
            ) from error
        kept = preserve_on_volume([artifact.path for artifact in artifacts], keep_dir, model_name, job_id)
        raise FluxboothError(
            error.code,
            f"{error.message}. The trained weights were kept at {kept} on the persistent volume",
            refresh_worker=error.refresh_worker,
            details={"kept_at": str(kept)},
        ) from error


def preserve_on_volume(paths: list[Path], volume_dir: Path, model_name: str, job_id: str) -> Path:
    """Copy artifacts that could not be uploaded to `<volume>/fluxbooth-unuploaded/<model>/<job>/`.

    Files keep their layout relative to their common folder, so sharded model folders stay loadable.
    """
    check_path_segment(model_name, "model_name")
    check_path_segment(job_id, "job id")
    destination = volume_dir / UNUPLOADED_DIR_NAME / model_name / job_id
    files = _files_with_relative_names(paths)
    needed_bytes = sum(source.stat().st_size for source, _ in files)
    try:
        destination.mkdir(parents=True, exist_ok=True)
        free_bytes = shutil.disk_usage(destination).free
        if free_bytes < needed_bytes:
            raise OSError(
                f"{format_bytes(needed_bytes)} needed but only {format_bytes(free_bytes)} free; free space on the volume"
            )
        for source, relative_name in files:
            target = destination / relative_name
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_atomically(source, target)
    except OSError as error:
        raise FluxboothError(
            ErrorCode.UPLOAD_FAILED,
            f"the upload failed, and keeping the trained weights on the persistent volume at {destination} "
            f"failed too: {os_reason(error)}",
        ) from error
    logger.warning("kept %d unuploaded artifact file(s) at %s", len(files), destination)
    return destination


def _files_with_relative_names(paths: list[Path]) -> list[tuple[Path, Path]]:
    """Every file under `paths` (folders are walked), named relative to the paths' common folder."""
    if not paths:
        return []
    absolute = [Path(path).absolute() for path in paths]
    common = Path(os.path.commonpath([path.parent for path in absolute]))
    files: list[tuple[Path, Path]] = []
    for path in absolute:
        if path.is_dir():
            files.extend((file, file.relative_to(common)) for file in sorted(path.rglob("*")) if file.is_file())
        else:
            files.append((path, path.relative_to(common)))
    return files
