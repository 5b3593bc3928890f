"""Checkpoint folders as the trainer leaves them (`checkpoint-<step>/`, a nested folder included), filled with
random bytes, for the checkpoint store's tests and the jobs that resume from one."""

from __future__ import annotations

import random
from pathlib import Path

# What accelerate + DeepSpeed write into a checkpoint folder (a nested folder included).
CHECKPOINT_FILES = {
    "fluxbooth_state.json": 120,
    "random_states_0.pkl": 300,
    "pytorch_model/mp_rank_00_model_states.pt": 2000,
    "pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 5000,
}


def build_checkpoint(root: Path, step: int, seed: int = 0) -> Path:
    """A `checkpoint-<step>` folder of random files, as the trainer leaves it."""
    folder = root / f"checkpoint-{step}"
    generator = random.Random(seed * 1000 + step)
    for name, size in CHECKPOINT_FILES.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(generator.randbytes(size))
    return folder
