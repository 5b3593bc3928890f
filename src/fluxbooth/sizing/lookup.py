"""A base model sized for the planner: by a known hub id from its published configs (no download), or from
the configs of a local diffusers folder after telling its family from its own files.

No torch here: this runs in the handler process.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.jsonfiles import read_json_file
from fluxbooth.models.configs import check_model_configs
from fluxbooth.models.families import Family, family_named, family_of, unreadable_config
from fluxbooth.models.published_configs import PUBLISHED_PIPELINES
from fluxbooth.sizing.core import ModelSize
from fluxbooth.sizing.flux1 import model_size_from_configs
from fluxbooth.sizing.flux2 import flux2_model_size

FLUX_DEV_NAME = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL_NAME = "black-forest-labs/FLUX.1-schnell"
# Hub ids the planner sizes without their files: each maps to its published pipeline (fluxbooth.models.published_configs),
# which the synthetic preset of the same name builds.
PRESET_OF_MODEL: dict[str, str] = {
    FLUX_DEV_NAME: "flux1-dev",
    FLUX_SCHNELL_NAME: "flux1-schnell",
    "black-forest-labs/FLUX.1-Krea-dev": "flux1-dev",  # FLUX.1-dev's configs unchanged
    "black-forest-labs/FLUX.1-Kontext-dev": "flux1-kontext-dev",
    "black-forest-labs/FLUX.2-dev": "flux2-dev",
    "black-forest-labs/FLUX.2-klein-4B": "flux2-klein-4b",
    "black-forest-labs/FLUX.2-klein-base-4B": "flux2-klein-4b",
    "black-forest-labs/FLUX.2-klein-9B": "flux2-klein-9b",
    "black-forest-labs/FLUX.2-klein-base-9B": "flux2-klein-9b",
}


def _sized(name: str, family: Family, configs: Mapping[str, Mapping[str, Any]], source: str) -> ModelSize:
    if family.is_flux2:
        return flux2_model_size(
            name, family, configs["transformer"], configs["text_encoder"], configs["vae"], source=source
        )
    return model_size_from_configs(
        name,
        configs["transformer"],
        configs["text_encoder"],
        configs["text_encoder_2"],
        configs["vae"],
        source=source,
        family=family,
    )


def _preset(name: str) -> ModelSize | None:
    """A known hub id sized from its published configs."""
    preset_name = PRESET_OF_MODEL.get(name)
    if preset_name is None:
        return None
    published = PUBLISHED_PIPELINES[preset_name]
    configs = {
        "transformer": published.transformer,
        "text_encoder": published.text_encoder,
        "text_encoder_2": published.text_encoder_2 or {},
        "vae": published.vae,
    }
    return _sized(name, family_named(published.family), configs, "preset")


def _read_config(folder: Path, component: str) -> dict[str, Any]:
    path = folder / component / "config.json"
    try:
        data = read_json_file(path)
    except FileNotFoundError as error:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"base_model: {path} is missing; point base_model at a complete diffusers pipeline folder",
        ) from error
    except (OSError, ValueError) as error:
        raise unreadable_config(path, error) from None
    if not isinstance(data, dict):
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"base_model: {path} must hold a JSON object")
    return data


def model_size(base_model_path_or_name: str) -> ModelSize:
    """Size a FLUX model by a known hub id (PRESET_OF_MODEL: no download) or from the configs of a local
    diffusers folder, after telling its family from its own files (an unknown one is `invalid_input`)."""
    folder = Path(base_model_path_or_name).expanduser()
    if folder.is_dir():
        family = family_of(folder)
        components = ("transformer", "vae", *family.text_encoders)
        configs = {component: _read_config(folder, component) for component in components}
        check_model_configs(folder, family, configs)
        return _sized(str(folder), family, configs, "config")
    sized = _preset(base_model_path_or_name)
    if sized is not None:
        return sized
    raise FluxboothError(
        ErrorCode.INVALID_INPUT,
        f"base_model: {base_model_path_or_name!r} is neither a local diffusers folder nor a known "
        f"model ({', '.join(PRESET_OF_MODEL)}); bake the model into the image or mount it "
        "and pass its path",
    )
