"""`python -m fluxbooth.train --config train.json`, run by `accelerate launch`: FLUX DreamBooth.

The stages, in order (`run`): session (accelerator, configs checked) → cache (text embeddings, latents;
encoders and VAE freed afterwards) → load (the transformer, then the DeepSpeed engine) → cache (missing class
images rendered in the training placement, then encoded) → train (checkpoints and validation renders between
steps) → save → export (a LoRA) → validate (the final renders, in the training placement) → release of the engine
→ export (a full fine-tune) → done. They hand each other one `TrainerState`. Progress goes to stdout as typed
`fluxbooth.contract.events` lines from the main process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fluxbooth.contract.events import ErrorEvent, StageEvent, format_event
from fluxbooth.contract.names import EXIT_INVALID_CONFIG
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.host.container_limits import raise_locked_memory_limit
from fluxbooth.train.cpu_probe import ask_cpu_info_once
from fluxbooth.train.failures import TrainerFailure

# This module imports nothing heavy at its top: a bad train.json is reported before torch, diffusers and DeepSpeed
# import (seconds), and the CPU probe starts before they do. The stages' modules are imported where they are needed.


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fluxbooth.train", description="FLUX DreamBooth trainer (run under accelerate launch)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help="train.json written by the worker (fluxbooth.contract.trainer_config)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    try:
        config = TrainerConfig.read(arguments.config)
    except (OSError, ValueError, TypeError, KeyError) as error:
        print(f"cannot read trainer config {arguments.config}: {error}", file=sys.stderr, flush=True)
        print(
            format_event(ErrorEvent(code="invalid_config", message=f"cannot read {arguments.config.name}: {error}")),
            flush=True,
        )
        return EXIT_INVALID_CONFIG
    # Before the Accelerator exists; accelerate launch sets RANK for every process.
    is_main = os.environ.get("RANK", "0") == "0"
    if is_main:
        # Importing torch, diffusers and DeepSpeed takes seconds: say so before it starts.
        print(format_event(StageEvent(stage="load", details={"what": "libraries"})), flush=True)
    ask_cpu_info_once()
    if "nvme" in (config.memory.offload_optimizer, config.memory.offload_param):
        # DeepSpeed mlocks its NVMe swap buffers, capped by the soft RLIMIT_MEMLOCK: the planner kept this plan
        # because the hard limit allows them (plan/container_limits.py), so raise the soft one to it.
        raise_locked_memory_limit()
    # Deferred (imports torch): see the note at the top.
    from fluxbooth.train.runtime import EventReporter

    reporter = EventReporter(enabled=is_main)
    try:
        run(config, reporter)
    except TrainerFailure as failure:
        reporter.error(failure.code, failure.message, **failure.details)
        print(f"fluxbooth trainer: {failure.code}: {failure.message}", file=sys.stderr, flush=True)
        return failure.exit_status
    except Exception as error:  # classify what we can; the traceback goes to the log
        traceback.print_exc()
        sys.stderr.flush()
        # Not `failure`: Python deletes an except clause's target when its block ends, the other clause's too.
        classified = _classified(error)
        reporter.error(classified.code, classified.message)
        return classified.exit_status
    return 0


def _classified(error: Exception) -> TrainerFailure:
    # Deferred: see the note at the top (torch is loaded by the time anything fails after the config).
    import torch

    first_line = str(error).splitlines()[0][:300] if str(error) else ""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return TrainerFailure("cuda_oom", f"the GPU ran out of memory: {first_line}")
    return TrainerFailure("trainer_failed", f"{type(error).__name__}: {first_line}")


def run(config: TrainerConfig, reporter: Any) -> None:
    """The stages in order, each reading what the earlier ones left in the state."""
    # Deferred (torch, diffusers, DeepSpeed): see the note at the top.
    from fluxbooth.train.cache import build_caches
    from fluxbooth.train.class_images import class_image_set, complete_class_images
    from fluxbooth.train.export.stage import export_weights, exports_before_release, release_engine, save_weights
    from fluxbooth.train.loop import start_training, train
    from fluxbooth.train.model import load_trainable_transformer
    from fluxbooth.train.session import open_session
    from fluxbooth.train.state import TrainerState
    from fluxbooth.train.validation import render_final

    session = open_session(config, reporter)
    started = time.perf_counter()
    state = TrainerState(session)
    state.data = build_caches(session, class_image_set(session))
    with session.clock.stage("load", what="transformer"):
        transformer, state.loading_report = load_trainable_transformer(session)
    with session.clock.stage("load", what="engine"):
        state.run = start_training(session, state.data, transformer)
    # The engine owns the model from here; dropping this name lets its release free it.
    del transformer
    complete_class_images(state)
    train(state)
    saved = save_weights(state)
    early_export = exports_before_release(config.training_type)
    if early_export:
        state.artifacts += export_weights(state, saved)
    # In the training placement, so before the release. A run stopped by its deadline keeps its time for the
    # upload: no final renders.
    if state.training().stopped_at_step is None:
        state.artifacts += render_final(state)
    release_engine(session, state.training())
    if not early_export:
        state.artifacts += export_weights(state, saved)
    report_done(state, seconds_total=time.perf_counter() - started)


def report_done(state: Any, seconds_total: float) -> None:
    """metrics.json and the `done` event (main process), then the end of the accelerate session."""
    # Deferred (import torch): see the note at the top.
    from fluxbooth.train.runtime import peak_gpu_metrics, peak_host_rss_bytes
    from fluxbooth.train.state import write_json

    session, run, data = state.session, state.training(), state.cached()
    config, accelerator = session.config, session.accelerator
    metrics: dict[str, Any] = {
        "steps": config.optimisation.steps,
        "final_loss": run.final_loss,
        "optimizer": run.optimizer_class,
        "zero_stage": session.zero_stage,
        "offload_optimizer": session.offload_device("offload_optimizer"),
        "offload_param": session.offload_device("offload_param"),
        "training_type": config.training_type,
        "base_precision": config.memory.base_precision,
        "export_formats": list(config.export.formats),
        "mixed_precision": session.precision.name,
        "num_processes": accelerator.num_processes,
        "seconds_per_stage": dict(session.clock.seconds),
        "seconds_total": round(seconds_total, 3),
        "peak_host_rss_bytes": peak_host_rss_bytes(),
        "transformer_loading": state.loading_report,
        "released_before_training": data.released_before_training,
        # The engine and optimizer still in memory when export began (empty: freed before it).
        "alive_at_export": run.alive_at_export,
    }
    metrics.update(peak_gpu_metrics())
    if session.cuda_memory_fraction is not None:
        metrics["cuda_memory_fraction"] = session.cuda_memory_fraction
    if run.fixed_noise_loss:
        metrics["fixed_noise_loss"] = run.fixed_noise_loss
    if run.start_step:
        metrics["resumed_from_step"] = run.start_step
    if run.stopped_at_step is not None:
        metrics["stopped_for_deadline"] = True
        metrics["steps_done"] = run.stopped_at_step
    if run.nvme_swap_peak_bytes:
        metrics["nvme_swap_peak_bytes"] = run.nvme_swap_peak_bytes
    if session.is_main:
        artifacts = [artifact.to_dict() for artifact in state.artifacts]
        write_json(Path(config.output_dir) / "metrics.json", {"metrics": metrics, "artifacts": artifacts})
        reporter_artifacts = [*artifacts, {"name": "metrics", "path": "metrics.json", "kind": "metrics"}]
        session.reporter.done(metrics=metrics, artifacts=reporter_artifacts)
    accelerator.wait_for_everyone()
    accelerator.end_training()
