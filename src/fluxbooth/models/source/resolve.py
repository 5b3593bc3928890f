"""Resolving `base_model` to a local folder: the built-in tiny model, an absolute path, or a hub id found in a
cache or pending a download. No torch here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.refusals import DEFAULT_MODEL_FIELD, base_model_refusal
from fluxbooth.models.source.cache import locate_hub_model, missing_pipeline_files
from fluxbooth.models.source.download import prepare_download
from fluxbooth.models.source.errors import not_found_error
from fluxbooth.models.source.places import ModelPlaces, ResolvedModel
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings

TINY_BUILD_TIMEOUT_SECONDS = 600


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
        [sys.executable, "-m", "fluxbooth.synthetic.tiny", str(target)],
        capture_output=True,
        text=True,
        timeout=TINY_BUILD_TIMEOUT_SECONDS,
        start_new_session=True,
    )
    if completed.returncode != 0 or not (target / "model_index.json").is_file():
        raise FluxboothError(ErrorCode.INTERNAL, f"building the tiny model failed: {completed.stderr.strip()[-2000:]}")
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
