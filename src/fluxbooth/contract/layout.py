"""The checkpoint layout, shared by the trainer (which writes checkpoint-N folders) and the worker
(which uploads, prunes and fetches them), and where the validation renders and the LoRA go (the worker's report
and likeness scoring read them). Torch-free: the worker imports it.

    <checkpoint root>/checkpoint-<step>/          accelerate/DeepSpeed state (save_state)
    <checkpoint root>/checkpoint-<step>/fluxbooth_state.json   step, settings to match on resume, schedule
    <checkpoint root>/checkpoint-<step>/ema.pt     the EMA weights, when kept
    <checkpoint root>/.checkpoint-<step>.partial/  a checkpoint being written (renamed when complete)
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_STATE_NAME = "fluxbooth_state.json"
EMA_STATE_NAME = "ema.pt"
# The trainer's own default when train.json names no checkpoint_dir: beside the output folder.
DEFAULT_CHECKPOINT_FOLDER = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d{1,9})")
# Under the output folder: the final renders at the top of VALIDATION_FOLDER, those made during training in its
# step-NNNNNN/ folders, every one indexed (prompt, seed, training step) in VALIDATION_INDEX_NAME.
VALIDATION_FOLDER = "validation"
VALIDATION_INDEX_NAME = "validation.json"
_RENDER_NAME = re.compile(r"validation_(\d{2,9})\.png")
# Under the output folder: the exported LoRA's files.
LORA_FOLDER = "lora"


def step_folder_name(step: int) -> str:
    """The folder of one training step's files: its validation renders, its LoRA (keep_best_step)."""
    return f"step-{step:06d}"


def validation_render_name(index: int) -> str:
    """The file of the render of validation prompt `index`: its position in the request's list, so a prompt
    given twice has two renders, told apart by their file names only."""
    return f"validation_{index:02d}.png"


def render_index(file: str) -> int | None:
    """The prompt position a render's file (as validation.json names it, folders included) carries; None for
    a name the trainer does not write."""
    match = _RENDER_NAME.fullmatch(PurePosixPath(file).name)
    return int(match.group(1)) if match else None


def checkpoint_folder_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def staging_folder_name(step: int) -> str:
    return f".{CHECKPOINT_PREFIX}{step}.partial"


def step_of_folder(name: str) -> int | None:
    """The step of a `checkpoint-N` folder name, None for anything else."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoint_root(checkpoint_dir: str | None, output_dir: str) -> Path:
    """Where the trainer writes (and looks for) checkpoint-N folders."""
    return Path(checkpoint_dir or Path(output_dir).parent / DEFAULT_CHECKPOINT_FOLDER)


def local_checkpoints(root: Path, *, complete_only: bool = False) -> list[tuple[int, Path]]:
    """(step, folder) of the checkpoint-N folders under `root`, ascending; `complete_only` keeps those
    whose fluxbooth state file was written."""
    found = []
    for path in root.glob(f"{CHECKPOINT_PREFIX}*"):
        step = step_of_folder(path.name)
        if step is not None and (not complete_only or (path / CHECKPOINT_STATE_NAME).is_file()):
            found.append((step, path))
    return sorted(found)
