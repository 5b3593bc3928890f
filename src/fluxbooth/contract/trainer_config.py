"""The trainer's input (train.json): written by launch_files.py in the worker from the job spec
(fluxbooth.request.spec), read by fluxbooth.train.

Plain data, no torch, so the worker can build it and tests can golden-file it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import DEFAULT_LORA_TARGET_MODULES
from fluxbooth.contract.settings_groups import (
    Checkpoints,
    Export,
    Memory,
    Optimisation,
    Prompts,
    Sampling,
    Validation,
    group_from_dict,
)


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES


@dataclass(frozen=True)
class TrainerConfig:
    # Where things are (absolute paths inside the job directory).
    base_model: str
    instance_dir: str
    class_dir: str | None
    output_dir: str
    cache_dir: str
    # The shapes images train at (aspect buckets, or one fixed shape); its render_shape is what validation
    # images and generated class images render at. In train.json as the request spells it ("WxH", or the sizes).
    resolution: Resolution
    training_type: str  # "full" | "lora"
    # The job's settings, each group whole (fluxbooth.contract.settings_groups).
    prompts: Prompts
    optimisation: Optimisation
    sampling: Sampling
    memory: Memory
    lora: LoraSettings = field(default_factory=LoraSettings)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    validation: Validation = field(default_factory=Validation)
    export: Export = field(default_factory=Export)
    # Keep generated class images here across jobs (one folder per recipe).
    class_image_cache_dir: str | None = None
    # Image pairs (FLUX.1 Kontext): the control image of each instance image, same stem as a PNG in this folder
    # (the dataset's `control/` folder); None: no pairs.
    control_dir: str | None = None
    # The loss at fixed noise before and after training (a repeatable learning measure): 24 extra forward
    # passes, so only when asked (the request's `learning_check`).
    measure_fixed_noise_loss: bool = False
    # The job's deadline less what a stopped run needs to checkpoint, export and upload (seconds since the epoch):
    # past it the trainer stops at the next step boundary, checkpoints, exports what it trained and reports the
    # step reached (the `done` event's metrics.stopped_for_deadline). None: train every step.
    stop_at_unix_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["resolution"] = self.resolution.to_json()
        # Through JSON and back: tuples become lists, as train.json reads.
        plain: dict[str, Any] = json.loads(json.dumps(values))
        return plain

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        values = dict(data)
        values["resolution"] = Resolution.from_json(values["resolution"])
        for name, group in _GROUPS.items():
            if name in values:
                values[name] = group_from_dict(group, values[name])
        return cls(**values)

    @classmethod
    def read(cls, path: Path) -> TrainerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


# train.json's nested objects, by the TrainerConfig field that holds each.
_GROUPS: dict[str, type] = {
    "prompts": Prompts,
    "optimisation": Optimisation,
    "sampling": Sampling,
    "memory": Memory,
    "lora": LoraSettings,
    "checkpoints": Checkpoints,
    "validation": Validation,
    "export": Export,
}
