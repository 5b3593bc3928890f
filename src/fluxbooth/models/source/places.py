"""Where a base model is looked for (the caches and the hub, from the job's environment) and what looking yields:
the places looked at, a resolved folder, a download still pending. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fluxbooth.models.families import ALL_PIPELINE_FOLDERS, PIPELINE_FILE_KINDS

DEFAULT_RUNPOD_MODEL_CACHE = "/runpod-volume/huggingface-cache/hub"
DEFAULT_BAKED_MODELS_DIR = "/models"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"

# The folders of every FLUX family's diffusers pipeline and the file kinds in them (fluxbooth.models.families).
# Anything else in the repo (the original single-file checkpoints at the root, sample images) is never
# downloaded; a family's own folders are a subset, so one pattern list serves every family.
PIPELINE_FILE_PATTERNS = ("model_index.json",) + tuple(
    f"{folder}/*.{kind}" for folder in ALL_PIPELINE_FOLDERS for kind in PIPELINE_FILE_KINDS
)
# What the planner reads to size the model and tell its family (sizing.model_size): fetched before the
# weights. FLUX.2 has no text_encoder_2; its pattern then matches nothing.
SIZING_FILE_PATTERNS = (
    "model_index.json",
    "transformer/config.json",
    "text_encoder/config.json",
    "text_encoder_2/config.json",
    "vae/config.json",
)


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
