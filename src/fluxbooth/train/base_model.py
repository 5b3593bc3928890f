"""The base model the trainer fine-tunes, resolved once when the session opens (train.session): its local
folder, its family's operations (train.family_ops) and its transformer's config. Every later stage reads it
from the session (`Session.base`) instead of resolving `TrainerConfig.base_model` again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download

from fluxbooth.errors import FluxboothError
from fluxbooth.models.families import family_of
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.family_ops import OPS_BY_FAMILY, FamilyOps

TRANSFORMER_SUBFOLDER = "transformer"


@dataclass(frozen=True)
class BaseModel:
    """The base model as the trainer uses it: where its files are, what its family does, its transformer's shape."""

    name: str  # as train.json names it: a pipeline folder or a cached hub id
    folder: Path  # the local pipeline folder
    ops: FamilyOps
    transformer_config: dict[str, Any]  # the base transformer's config.json (read, never its weights)


def resolve_base_model(base_model: str) -> BaseModel:
    """`base_model`'s folder, family and transformer config; a model that is not there or of no supported
    family is an invalid config."""
    ops = ops_for(base_model)
    return BaseModel(name=base_model, folder=ops.folder, ops=ops, transformer_config=ops.transformer_config())


def resolve_model_folder(base_model: str | Path) -> Path:
    """A local folder for `base_model`: itself when it is a path, else its snapshot in the local HF cache."""
    path = Path(base_model)
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(str(base_model), local_files_only=True))
    except Exception as error:  # huggingface_hub raises several unrelated types for "not cached"
        raise TrainerFailure(
            "invalid_config",
            f"base model {str(base_model)!r} is neither a folder nor in the local Hugging Face cache; "
            "bake it into the image or put it on the network volume (nothing is downloaded at run time)",
        ) from error


def ops_for(base_model: str | Path) -> FamilyOps:
    """The operations of the family of `base_model` (a pipeline folder or a cached hub id), read from its own
    files; a model of no supported family is an invalid config."""
    folder = resolve_model_folder(base_model)
    try:
        family = family_of(folder)
    except FluxboothError as error:
        raise TrainerFailure("invalid_config", error.message) from error
    return OPS_BY_FAMILY[family.name](family, folder)


def transformer_weight_files(base_model: str | Path) -> list[Path]:
    """The safetensors files of `base_model`'s transformer (a local pipeline folder or a cached hub id)."""
    folder = resolve_model_folder(base_model) / TRANSFORMER_SUBFOLDER
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    single = folder / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise TrainerFailure(
        "invalid_config",
        f"base model {str(base_model)!r} has no transformer safetensors under {folder}; "
        "point base_model at a diffusers FLUX pipeline folder",
    )
