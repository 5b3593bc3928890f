"""Checkpoints: accelerate/DeepSpeed state plus the trainer's own, written whole or not at all, and
resumed from. The folder layout is `fluxbooth.contract.layout`'s (shared with the worker's uploader)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fluxbooth.contract.checkpoint_record import CHECKPOINT_RECORD_NAME, checkpoint_record
from fluxbooth.contract.layout import (
    CHECKPOINT_STATE_NAME,
    EMA_STATE_NAME,
    checkpoint_folder_name,
    checkpoint_root,
    local_checkpoints,
    staging_folder_name,
)
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.state import Session, TrainingRun


def save_checkpoint(session: Session, run: TrainingRun, step: int) -> None:
    """*Collective.* accelerate/DeepSpeed state after `step` optimizer steps, written under a temporary
    name and renamed, so a checkpoint folder either is complete or does not exist."""
    config, accelerator = session.config, session.accelerator
    root = checkpoint_root(config.checkpoints.dir, config.output_dir)
    final = root / checkpoint_folder_name(step)
    staging = root / staging_folder_name(step)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with session.clock.stage("checkpoint", step=step):
        save_arguments: dict[str, Any] = {}
        if session.deepspeed_config is not None and config.training_type == "lora":
            # Without this every LoRA checkpoint would carry the whole frozen base model.
            save_arguments["exclude_frozen_parameters"] = True
        accelerator.save_state(str(staging), **save_arguments)
        if accelerator.is_main_process:
            _write_trainer_state(session, run, step, staging)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            prune_checkpoints(root, keep=config.checkpoints.keep)
            session.reporter.checkpoint(step=step, path=str(final))
        accelerator.wait_for_everyone()


def _write_trainer_state(session: Session, run: TrainingRun, step: int, folder: Path) -> None:
    state = {
        "step": step,
        "seed": session.config.optimisation.seed,
        "training_type": session.config.training_type,
        "zero_stage": session.zero_stage,
        "num_processes": session.accelerator.num_processes,
        "fused_backward_pass": session.config.memory.fused_backward_pass,
        "scheduler": None if run.scheduler_stepped_by_engine else run.scheduler.state_dict(),
        "ema": None,
    }
    if run.ema is not None:
        torch.save(run.ema.state_dict(), folder / EMA_STATE_NAME)
        state["ema"] = EMA_STATE_NAME
    (folder / CHECKPOINT_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    # What it was trained on: the worker refuses to resume it on another base or LoRA shape, before launch.
    config = session.config
    record = checkpoint_record(
        config.export.base_model_name or config.base_model,
        session.base.ops.family.name,
        config.training_type,
        config.lora.rank,
        config.lora.alpha,
        config.lora.target_modules,
    )
    (folder / CHECKPOINT_RECORD_NAME).write_text(record.to_json())


def prune_checkpoints(root: Path, keep: int) -> None:
    found = local_checkpoints(root)
    for _, path in found[: max(0, len(found) - max(1, keep))]:
        shutil.rmtree(path, ignore_errors=True)


def resolve_resume(session: Session) -> Path | None:
    config = session.config
    if not config.checkpoints.resume_from:
        return None
    if config.checkpoints.resume_from == "latest":
        found = local_checkpoints(checkpoint_root(config.checkpoints.dir, config.output_dir), complete_only=True)
        return found[-1][1] if found else None
    path = Path(config.checkpoints.resume_from)
    if not (path / CHECKPOINT_STATE_NAME).is_file():
        raise TrainerFailure(
            "resume_failed",
            f"resume_from {path.name!r} is not a fluxbooth checkpoint (no {CHECKPOINT_STATE_NAME}); pass a checkpoint-N folder",
        )
    return path


def resume(session: Session, run: TrainingRun) -> Path | None:
    """*Collective.* Restore a checkpoint's model, optimizer, schedule and RNG state into `run`; return the
    checkpoint's EMA state file, if it has one (the EMA is made from the resumed weights, then loaded)."""
    config = session.config
    path = resolve_resume(session)
    if path is None:
        return None
    state = json.loads((path / CHECKPOINT_STATE_NAME).read_text())
    expected_settings = {
        "training_type": config.training_type,
        "zero_stage": session.zero_stage,
        "num_processes": session.accelerator.num_processes,
        # Its optimizer state is Adafactor's on bf16 weights; checkpoints from before the fused pass have no such key.
        "fused_backward_pass": config.memory.fused_backward_pass,
    }
    made_with = {"fused_backward_pass": False, **state}
    for name, expected in expected_settings.items():
        if made_with.get(name) != expected:
            raise TrainerFailure(
                "resume_failed",
                f"checkpoint {path.name} was made with {name}={made_with.get(name)!r}, this run has {expected!r}; resume with the same settings",
            )
    step = int(state["step"])
    if step >= config.optimisation.steps:
        raise TrainerFailure(
            "resume_failed", f"checkpoint {path.name} is at step {step}, not before steps={config.optimisation.steps}"
        )
    load_arguments: dict[str, Any] = {}
    if session.deepspeed_config is not None:
        # LoRA checkpoints hold only the adapter (exclude_frozen_parameters), so the base must not be required.
        load_arguments["load_module_strict"] = config.training_type != "lora"
    session.accelerator.load_state(str(path), **load_arguments)
    if state.get("scheduler") is not None and not run.scheduler_stepped_by_engine:
        run.scheduler.load_state_dict(state["scheduler"])
    run.start_step = step
    session.reporter.stage("train", status="resumed", step=step, checkpoint=path.name)
    return path / state["ema"] if state.get("ema") else None
