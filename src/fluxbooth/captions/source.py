"""Where the captioner comes from: the built-in tiny captioner, a local folder, or a Hugging Face repo id at a
revision, found where the base model is (fluxbooth.models.source: the Hugging Face cache, RunPod's cached models,
the models baked into the image) and else, downloads on, downloaded into the Hugging Face cache with the real
client. No torch here: a job whose captioner is nowhere learns it before the captioning process loads torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download

from fluxbooth.contract.captioning import TINY_CAPTIONER, CaptioningInput
from fluxbooth.models.source.cache import complete_snapshot
from fluxbooth.models.source.places import ModelPlaces
from fluxbooth.synthetic.tiny_captioner import ensure_tiny_captioner

# The tiny captioner's folder: this under FLUXBOOTH_CACHE_DIR (the worker's cache), else under the user's cache.
CACHE_SUBFOLDER = "captioner"
# What is fetched of a hub captioner: configs, weights, tokenizer files and chat templates; never the repo's
# other files.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt")
# What a model folder must hold besides weights (the tokenizer's own files differ between tokenizers).
REQUIRED_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json")


class CaptionerUnavailable(Exception):
    """The captioner cannot caption (no model, no device, an unreadable photo): the message is the output's
    reason."""


@dataclass(frozen=True)
class ModelFolder:
    """A captioner's local folder and the revision to report (a hub snapshot's commit; None for a folder)."""

    folder: Path
    revision: str | None


def cannot_load(name: str, reason: str) -> CaptionerUnavailable:
    return CaptionerUnavailable(f"the captioner {name} could not be loaded: {reason}")


def first_line(error: BaseException, limit: int = 200) -> str:
    """The error's type and first line: libraries' messages run over several lines of advice."""
    return f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')[:limit]}"


def captioner_cache_dir(environ: Mapping[str, str]) -> Path:
    """Where the tiny captioner is built: FLUXBOOTH_CACHE_DIR/captioner, else ~/.cache/fluxbooth/captioner (the
    worker's cache folder, as fluxbooth.settings resolves it)."""
    explicit = environ.get("FLUXBOOTH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / CACHE_SUBFOLDER
    cache_home = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache_home / "fluxbooth" / CACHE_SUBFOLDER


def missing_model_files(folder: Path) -> list[str]:
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _snapshot(cache_root: Path, repo_id: str, revision: str | None) -> Path | None:
    """The complete snapshot of `repo_id` at `revision` in one cache, as the base model's is found."""
    if not cache_root.is_dir():
        return None
    return complete_snapshot(cache_root, repo_id, revision, MODEL_FILE_PATTERNS, missing_model_files)


def _download(repo_id: str, revision: str | None, places: ModelPlaces) -> Path:
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=places.hub_cache,
                endpoint=places.endpoint,
                token=places.token,
                allow_patterns=list(MODEL_FILE_PATTERNS),
            )
        )
    except Exception as error:  # the hub client's errors (unreachable, not found, gated) or the cache's disk
        raise cannot_load(
            repo_id,
            f"revision {revision or 'main'} is not on this worker and could not be downloaded from "
            f"{places.hub_url} ({first_line(error)})",
        ) from error
    missing = missing_model_files(folder)
    if missing:
        raise cannot_load(repo_id, f"its revision {revision or 'main'} lacks {', '.join(missing)}")
    return folder


def hub_model_folder(repo_id: str, revision: str | None, environ: Mapping[str, str]) -> ModelFolder:
    """A hub captioner's snapshot: from a cache on this worker, else (downloads on) downloaded."""
    places = ModelPlaces.from_environ(environ)
    for _label, cache_root in places.caches():
        folder = _snapshot(cache_root, repo_id, revision)
        if folder is not None:
            return ModelFolder(folder, folder.name)
    # A plain `org/name` folder among the baked models has no revision: it serves only a request that pins none.
    plain = places.baked_dir / repo_id
    if revision is None and plain.is_dir() and not missing_model_files(plain):
        return ModelFolder(plain, None)
    if places.offline:
        looked = ", ".join(str(path) for _, path in places.caches())
        raise cannot_load(
            repo_id,
            f"revision {revision or 'main'} is not on this worker (looked in {looked} and {plain}) and downloads "
            "are off (HF_HUB_OFFLINE=1)",
        )
    folder = _download(repo_id, revision, places)
    return ModelFolder(folder, folder.name)


def model_folder(request: CaptioningInput, environ: Mapping[str, str]) -> ModelFolder:
    """The requested captioner's local folder: the tiny captioner (built once), a local folder, or a hub id."""
    if request.model == TINY_CAPTIONER:
        return ModelFolder(ensure_tiny_captioner(captioner_cache_dir(environ), seed=request.seed), None)
    if request.model.startswith(("/", ".", "~")):
        folder = Path(request.model).expanduser()
        if not folder.is_dir():
            raise cannot_load(request.model, "there is no such folder")
        missing = missing_model_files(folder)
        if missing:
            raise cannot_load(request.model, f"the folder lacks {', '.join(missing)}")
        return ModelFolder(folder, request.revision)
    return hub_model_folder(request.model, request.revision, environ)
