"""Changing a TrainerConfig by the flat names its settings had before they were grouped
(fluxbooth.contract.settings_groups): tests keep saying `steps=4` or `validation_prompts=(...)`."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from fluxbooth.contract.settings_groups import Checkpoints, Export, Memory, Optimisation, Prompts, Sampling, Validation
from fluxbooth.contract.trainer_config import TrainerConfig

# Flat names whose field in the group is named otherwise.
RENAMED = {
    "checkpointing_steps": ("checkpoints", "every"),
    "checkpoint_dir": ("checkpoints", "dir"),
    "resume_from": ("checkpoints", "resume_from"),
    "checkpoints_keep": ("checkpoints", "keep"),
    "validation_prompts": ("validation", "prompts"),
    "validation_steps": ("validation", "steps"),
    "validation_images": ("validation", "images"),
    "validation_at_start": ("validation", "at_start"),
    "step_loras_dir": ("validation", "step_loras_dir"),
    "export_formats": ("export", "formats"),
}
GROUPS: dict[str, type] = {
    "prompts": Prompts,
    "optimisation": Optimisation,
    "sampling": Sampling,
    "memory": Memory,
    "checkpoints": Checkpoints,
    "validation": Validation,
    "export": Export,
}


def group_of(name: str) -> tuple[str, str] | None:
    """(group, field) of the flat setting `name`; None for TrainerConfig's own fields (paths, lora, ...)."""
    if name in RENAMED:
        return RENAMED[name]
    for group, cls in GROUPS.items():
        if name in {field.name for field in fields(cls)}:
            return group, name
    return None


def regrouped(config: TrainerConfig, **changes: Any) -> TrainerConfig:
    """`config` with `changes` applied, each flat setting name routed into its group."""
    own: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in changes.items():
        place = group_of(name)
        if place is None:
            own[name] = value
        else:
            grouped.setdefault(place[0], {})[place[1]] = value
    for group, values in grouped.items():
        own[group] = replace(getattr(config, group), **values)
    return replace(config, **own)
