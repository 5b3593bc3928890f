"""Where the scoring models come from: DINOv2 and SigLIP, resolved like the base model (fluxbooth.models.source).

In order: an operator's own folder (FLUXBOOTH_LIKENESS_DINO, FLUXBOOTH_LIKENESS_SIGLIP: any folder
`save_pretrained` wrote; its weights are hashed and reported, not held to the pin), then the pinned revision in
the Hugging Face cache, RunPod's cached models or the models baked into the image (a cache, or a plain
`org/name` folder), then (downloads on) the pinned revision downloaded into the Hugging Face cache with the real
`huggingface_hub` client. Weights found or fetched are checked against the pinned sha256 of model.safetensors.
A model found nowhere, unreachable, or not matching its pin is `unavailable`, with the reason: scoring goes on
without it, and a job never fails because of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.models.source import ModelPlaces
from fluxbooth.storage.artifacts import sha256_file

WEIGHTS_FILE = "model.safetensors"
# What every model folder must hold; the processor's and tokenizer's files come with the patterns below.
REQUIRED_FILES = ("config.json", WEIGHTS_FILE)


class ModelUnavailable(Exception):
    """A scoring model that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class HubModel:
    """One pinned hub model: the commit, the sha256 of its weights, its licence, the files to fetch (patterns)."""

    role: str
    repo_id: str
    revision: str
    sha256: str
    licence: str
    override_variable: str
    patterns: tuple[str, ...]


# The pins: the repositories' commits and the sha256 of their model.safetensors, as the hub lists them (the
# same values are published in several independent projects that pin these models). Change them together.
DINO = HubModel(
    role="likeness",
    repo_id="facebook/dinov2-small",
    revision="ed25f3a31f01632728cabb09d1542f84ab7b0056",
    sha256="ae1e99fcefd534ed978cdeb8326f08030c96e28b7a81ffcbc98a857c84d14be1",
    licence="Apache-2.0",
    override_variable="FLUXBOOTH_LIKENESS_DINO",
    patterns=("*.json", WEIGHTS_FILE),
)
SIGLIP = HubModel(
    role="prompt_fidelity",
    repo_id="google/siglip-base-patch16-224",
    revision="7fd15f0689c79d79e38b1c2e2e2370a7bf2761ed",
    sha256="2c63cb7d1f2e95ba501893cbb8faeb4ea9a3af295498d35097126228659c2af8",
    licence="Apache-2.0",
    override_variable="FLUXBOOTH_LIKENESS_SIGLIP",
    patterns=("*.json", "spiece.model", WEIGHTS_FILE),
)


@dataclass(frozen=True)
class ModelRecord:
    """One entry of the section's `models`: what was used, or why not."""

    role: str
    name: str
    revision: str
    sha256: str | None
    licence: str
    status: str  # "used" | "unavailable"
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "name": self.name,
            "revision": self.revision,
            "sha256": self.sha256,
            "licence": self.licence,
            "status": self.status,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class ResolvedWeights:
    folder: Path
    record: ModelRecord


def unavailable_record(model: HubModel, reason: str, role: str | None = None) -> ModelRecord:
    return ModelRecord(
        role or model.role, model.repo_id, model.revision, model.sha256, model.licence, "unavailable", reason
    )


def _missing_files(folder: Path) -> list[str]:
    return [name for name in REQUIRED_FILES if not (folder / name).is_file()]


def _checked(model: HubModel, folder: Path, where: str, role: str) -> ResolvedWeights:
    """The folder's weights held to the pin."""
    missing = _missing_files(folder)
    if missing:
        raise ModelUnavailable(f"{model.repo_id} in {where} lacks {', '.join(missing)}")
    actual = sha256_file(folder / WEIGHTS_FILE)
    if actual != model.sha256:
        raise ModelUnavailable(
            f"{model.repo_id} in {where}: {WEIGHTS_FILE} has sha256 {actual}, not the pinned {model.sha256} "
            f"(revision {model.revision}); provide the pinned revision or point {model.override_variable} at a folder"
        )
    return ResolvedWeights(folder, ModelRecord(role, model.repo_id, model.revision, actual, model.licence, "used"))


def _override(model: HubModel, folder: Path, role: str) -> ResolvedWeights:
    where = f"{model.override_variable}={folder}"
    missing = _missing_files(folder) if folder.is_dir() else ["the folder itself"]
    if missing:
        raise ModelUnavailable(f"{where} lacks {', '.join(missing)}: give a folder that save_pretrained wrote")
    record = ModelRecord(
        role,
        model.repo_id,
        f"operator's folder ({model.override_variable})",
        sha256_file(folder / WEIGHTS_FILE),
        model.licence,
        "used",
    )
    return ResolvedWeights(folder, record)


def _in_cache(model: HubModel, cache_root: Path) -> Path | None:
    from huggingface_hub import snapshot_download  # on use only: the worker's process never loads it for this
    from huggingface_hub.errors import LocalEntryNotFoundError  # on use only, as above

    if not cache_root.is_dir():
        return None
    try:
        folder = Path(
            snapshot_download(
                model.repo_id,
                revision=model.revision,
                cache_dir=cache_root,
                local_files_only=True,
                allow_patterns=list(model.patterns),
            )
        )
    except (LocalEntryNotFoundError, OSError):
        return None
    return folder if not _missing_files(folder) else None


def _download(model: HubModel, places: ModelPlaces) -> Path:
    from huggingface_hub import snapshot_download  # on use only: see _in_cache

    try:
        return Path(
            snapshot_download(
                model.repo_id,
                revision=model.revision,
                cache_dir=places.hub_cache,
                endpoint=places.endpoint,
                token=places.token,
                allow_patterns=list(model.patterns),
            )
        )
    except Exception as error:  # the hub client's errors (unreachable, not found) or the cache's disk
        # The hub client's message runs over several lines (its advice on the cache): the first says what failed.
        first_line = next(iter(str(error).splitlines()), "")[:200]
        raise ModelUnavailable(
            f"{model.repo_id} (revision {model.revision}) is not on this worker and could not be downloaded from "
            f"{places.hub_url} ({type(error).__name__}: {first_line}); bake it into the image or set "
            f"{model.override_variable}"
        ) from error


def resolve_weights(model: HubModel, environ: Mapping[str, str], role: str | None = None) -> ResolvedWeights:
    """A local folder holding `model`'s files and its record, or ModelUnavailable saying why not."""
    role = role or model.role
    override = (environ.get(model.override_variable) or "").strip()
    if override:
        return _override(model, Path(override), role)
    places = ModelPlaces.from_environ(environ)
    for label, cache_root in places.caches():
        folder = _in_cache(model, cache_root)
        if folder is not None:
            return _checked(model, folder, label, role)
    plain = places.baked_dir / model.repo_id
    if plain.is_dir():
        return _checked(model, plain, f"{plain} (baked folder)", role)
    if places.offline:
        looked = ", ".join(str(path) for _, path in places.caches())
        raise ModelUnavailable(
            f"{model.repo_id} (revision {model.revision}) is not on this worker (looked in {looked} and {plain}) and "
            f"downloads are off (HF_HUB_OFFLINE=1); bake it into the image or set {model.override_variable}"
        )
    return _checked(model, _download(model, places), "the download", role)
