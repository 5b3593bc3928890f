"""What a checkpoint was trained on, shared by the trainer (which writes it into every checkpoint-N folder) and
the worker (which reads it from storage before a resume is launched): the base model as the request named it, its
family, the training type and a LoRA's shape. A checkpoint resumed on another base, or with another LoRA shape,
would load weights made for different layers (or silently train a different model), so such a resume is refused
before any GPU time is spent. Torch-free: the worker imports it.

Also the COMPLETE index the worker uploads last with each checkpoint, read back strictly: a step or a size that is
negative, huge or not an integer makes the checkpoint unusable, never a crash."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

# Beside fluxbooth_state.json in each checkpoint-N folder.
CHECKPOINT_RECORD_NAME = "fluxbooth_record.json"
# The worker's index of an uploaded checkpoint, uploaded last (fluxbooth.storage.checkpoints).
COMPLETE_MARKER = "COMPLETE"
# checkpoint-N folder names carry at most 9 digits (contract.layout); a step beyond is not a real checkpoint.
MAX_CHECKPOINT_STEP = 999_999_999
# No checkpoint file is larger than this (a full fine-tune's optimizer shards stay far below 1 TiB each).
MAX_CHECKPOINT_FILE_BYTES = 1 << 40
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CheckpointRecord:
    """The base a checkpoint was trained on and the shape of what it trained."""

    base_model: str  # as the request (or the endpoint's default) named it
    family: str  # fluxbooth.models.families' name
    training_type: str  # "full" | "lora"
    # A LoRA's shape; None for a full fine-tune.
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CheckpointRecord:
        """The record in `text`; ValueError when it is not one."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        base_model, family, training_type = data.get("base_model"), data.get("family"), data.get("training_type")
        if not (isinstance(base_model, str) and isinstance(family, str) and isinstance(training_type, str)):
            raise ValueError("base_model, family and training_type must be strings")
        targets = data.get("lora_targets")
        if targets is not None and not (isinstance(targets, list) and all(isinstance(name, str) for name in targets)):
            raise ValueError("lora_targets must be a list of strings")
        rank, alpha = data.get("lora_rank"), data.get("lora_alpha")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ValueError("lora_rank must be an integer")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
            raise ValueError("lora_alpha must be a number")
        return cls(
            base_model=base_model,
            family=family,
            training_type=training_type,
            lora_rank=rank,
            lora_alpha=None if alpha is None else float(alpha),
            lora_targets=None if targets is None else tuple(targets),
        )

    def differences(self, job: CheckpointRecord) -> list[str]:
        """`name: the checkpoint's value, this job's value` for each field that differs from `job`'s."""
        return [
            f"{name} {mine!r} (this job: {theirs!r})"
            for name, mine, theirs in (
                (name, getattr(self, name), getattr(job, name)) for name in self.__dataclass_fields__
            )
            if mine != theirs
        ]


def checkpoint_record(
    base_model: str, family: str, training_type: str, rank: int, alpha: float, targets: tuple[str, ...]
) -> CheckpointRecord:
    """The record of a run: the LoRA's shape only when it trains a LoRA."""
    if training_type != "lora":
        return CheckpointRecord(base_model=base_model, family=family, training_type=training_type)
    return CheckpointRecord(
        base_model=base_model,
        family=family,
        training_type=training_type,
        lora_rank=rank,
        lora_alpha=float(alpha),
        lora_targets=tuple(targets),
    )


@dataclass(frozen=True)
class CompleteIndex:
    """A COMPLETE index: the checkpoint's step and each file's size and sha256."""

    step: int
    files: dict[str, tuple[int, str]]

    def to_json(self) -> str:
        entries = [
            {"name": name, "bytes": size, "sha256": sha256} for name, (size, sha256) in sorted(self.files.items())
        ]
        return json.dumps({"step": self.step, "files": entries}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CompleteIndex:
        """The index in `text`; ValueError naming what is wrong when it is not a sound one."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), list):
            raise ValueError("not an object with a files list")
        step = _whole_number(data.get("step"), "step", MAX_CHECKPOINT_STEP)
        files: dict[str, tuple[int, str]] = {}
        for entry in data["files"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ValueError("a files entry without a name")
            size = _whole_number(entry.get("bytes"), f"the size of {entry['name']!r}", MAX_CHECKPOINT_FILE_BYTES)
            sha256 = entry.get("sha256")
            if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
                raise ValueError(f"the sha256 of {entry['name']!r} is not 64 hex digits")
            files[entry["name"]] = (size, sha256)
        return cls(step=step, files=files)


def _whole_number(value: Any, what: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, not a whole number")
    if not 0 <= value <= most:
        raise ValueError(f"{what} is {value}, outside 0..{most}")
    return value
