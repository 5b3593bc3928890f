"""Finding a base model already on this worker: a complete snapshot in one of the Hugging Face caches, or a
plain folder among the baked models. Never asks the hub. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from fluxbooth.errors import FluxboothError
from fluxbooth.models.families import FLUX1, Family, family_of
from fluxbooth.models.source.places import PIPELINE_FILE_PATTERNS, Look, ModelPlaces


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


def complete_snapshot(
    cache_root: Path,
    repo_id: str,
    revision: str | None,
    patterns: Sequence[str],
    missing_files: Callable[[Path], list[str]],
) -> Path | None:
    """The complete snapshot of `repo_id` at `revision` in one cache (`missing_files` finds nothing missing),
    through the client's own lookup (refs, and the cached tree listing when there is one, which catches interrupted
    downloads of `patterns`); with no revision, else the newest complete one: a cache filled without refs (RunPod's
    cached models keep only snapshots/<commit>). The base model's and the captioner's lookup."""
    from huggingface_hub import scan_cache_dir, snapshot_download  # on use only: see fluxbooth.models.source
    from huggingface_hub.errors import CacheNotFound, LocalEntryNotFoundError  # on use only, as above

    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache_root, local_files_only=True, allow_patterns=list(patterns)
            )
        )
        if not missing_files(folder):
            return folder
    except (LocalEntryNotFoundError, OSError):
        pass
    if revision is not None:
        return None
    try:
        repos = scan_cache_dir(cache_root).repos
    except (CacheNotFound, OSError):
        return None
    snapshots = [
        snapshot
        for repo in repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for snapshot in repo.revisions
        if not missing_files(snapshot.snapshot_path)
    ]
    return max(snapshots, key=lambda snapshot: snapshot.last_modified).snapshot_path if snapshots else None


def _look_in_cache(label: str, cache_root: Path, repo_id: str, revision: str | None) -> tuple[Path | None, Look]:
    from huggingface_hub.file_download import repo_folder_name  # on use only: see fluxbooth.models.source

    repo_folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    if not cache_root.is_dir():
        return None, Look(label, cache_root, "no such folder")
    if not (cache_root / repo_folder).is_dir():
        return None, Look(label, cache_root, f"no {repo_folder}")
    folder = complete_snapshot(cache_root, repo_id, revision, PIPELINE_FILE_PATTERNS, missing_pipeline_files)
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
