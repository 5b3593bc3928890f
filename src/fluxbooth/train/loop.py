"""Stage "train": the DeepSpeed engine built only now, resumed if asked, then the optimizer steps,
with checkpoints and validation renders between them as configured."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fluxbooth.contract.names import FIXED_NOISE_IMAGES, FIXED_NOISE_SIGMAS
from fluxbooth.train.batches import first_samples, micro_batch
from fluxbooth.train.blockswap import release_swapped_blocks
from fluxbooth.train.checkpointing import resume, save_checkpoint
from fluxbooth.train.ema import CpuEma
from fluxbooth.train.export.stage import save_step_lora
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.flow import SigmaSampler, build_flow_inputs, per_sample_loss, unpack_prediction
from fluxbooth.train.model import trainable_parameters
from fluxbooth.train.optim import (
    build_optimizer,
    build_scheduler,
    innermost_optimizer,
    optimizer_class_name,
    schedule_stepped_by_deepspeed,
)
from fluxbooth.train.state import (
    CachedData,
    EncodedImages,
    Session,
    TrainerState,
    TrainingRun,
    release_prefetched_partitions,
    seed_for,
)
from fluxbooth.train.validation import render_base_model, render_during_training


def start_training(session: Session, data: CachedData, transformer: Any) -> TrainingRun:
    """*Collective.* The engine, optimizer and schedule around `transformer`, restored from a checkpoint
    when asked, and the fixed-noise loss before the first step when measured."""
    config, accelerator = session.config, session.accelerator
    optimizer = build_optimizer(
        session.optimizer_name, trainable_parameters(transformer), config, session.deepspeed_config
    )
    stepped_by_engine = schedule_stepped_by_deepspeed(optimizer, session.deepspeed_config)
    if stepped_by_engine:
        scheduler = build_scheduler(optimizer, config, session.deepspeed_config, accelerator.num_processes)
        engine, optimizer, scheduler = accelerator.prepare(transformer, optimizer, scheduler)
    else:
        # Stepped by hand once per optimizer step: accelerate's wrapper would step it once per process. Built on
        # the optimizer that really steps (accelerate swaps an offloaded torch AdamW for DeepSpeedCPUAdam).
        # Block swapping placed the model itself (accelerate's `.to` would move every swapped trained block).
        # DeepSpeed places its engine's module itself, and accelerate refuses a placement list beside it.
        placement = [False, True] if config.memory.block_swap and session.deepspeed_config is None else None
        engine, optimizer = accelerator.prepare(transformer, optimizer, device_placement=placement)
        scheduler = build_scheduler(
            innermost_optimizer(optimizer), config, session.deepspeed_config, accelerator.num_processes
        )
    noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(session.base.folder), subfolder="scheduler")
    run = TrainingRun(
        engine=engine,
        optimizer=optimizer,
        scheduler=scheduler,
        scheduler_stepped_by_engine=stepped_by_engine,
        optimizer_class=optimizer_class_name(optimizer),
        ema=None,
        sampler=SigmaSampler.from_scheduler(noise_scheduler, config),
        normalisation=session.base.ops.latent_normalisation(),
        guidance_scale=config.sampling.guidance_scale
        if accelerator.unwrap_model(engine).config.guidance_embeds
        else None,
    )
    run.engine_references.track("engine", engine)
    run.engine_references.track("optimizer", innermost_optimizer(optimizer))
    ema_state = resume(session, run)
    run.ema = _make_ema(session, engine)
    if run.ema is not None and ema_state is not None and session.is_main:
        run.ema.load_state_dict(torch.load(ema_state, map_location="cpu", weights_only=True))
    if config.measure_fixed_noise_loss:
        run.fixed_noise_loss["start"] = fixed_noise_loss(session, run, data.instance_set)
    elif session.offload_device("offload_param") == "nvme":
        # ZeRO-3 records the order its modules run in during the first forward; a first forward *with*
        # gradients over NVMe-swapped parameters runs out of swap buffers ("Not enough buffers 0 for
        # swapping 1", DeepSpeed 0.19.8, the NVMe tests). One no-grad pass records the order first.
        fixed_noise_loss(session, run, data.instance_set, images=1, sigmas=(0.5,))
    return run


def _make_ema(session: Session, engine: Any) -> Any:
    if session.config.optimisation.ema_decay is None:
        return None
    model = session.accelerator.unwrap_model(engine)
    return CpuEma.from_model(model, decay=session.config.optimisation.ema_decay, is_main_process=session.is_main)


def train(state: TrainerState) -> None:
    """*Collective.* The optimizer steps from the run's start step to `steps`, then the fixed-noise loss
    when measured."""
    session, run, data = state.session, state.training(), state.cached()
    config = session.config
    with session.clock.stage(
        "train", steps=config.optimisation.steps, start_step=run.start_step, optimizer=run.optimizer_class
    ):
        if config.validation.prompts and config.validation.at_start:
            render_base_model(state)
        for step in range(run.start_step, config.optimisation.steps):
            step_started = time.perf_counter()
            # The rate this step trains with (schedulers advance inside the optimizer step).
            step_lr = float(run.optimizer.param_groups[0]["lr"])
            run.final_loss = _optimizer_step(session, run, data, step)
            # Swapped trained blocks written back to the host before the EMA, a checkpoint, a render or the export reads them.
            release_swapped_blocks(session.accelerator.unwrap_model(run.engine))
            if run.ema is not None:
                run.ema.update(session.accelerator.unwrap_model(run.engine))
            _measure_nvme_swap(session, run)
            done = step + 1
            session.reporter.step(
                step=done,
                total=config.optimisation.steps,
                loss=run.final_loss,
                lr=step_lr,
                seconds_per_step=time.perf_counter() - step_started,
            )
            if config.checkpoints.every and done % config.checkpoints.every == 0 and done < config.optimisation.steps:
                save_checkpoint(session, run, done)
            # The last step is left to the final validation, which renders the same weights once exported.
            if (
                config.validation.prompts
                and config.validation.steps
                and done % config.validation.steps == 0
                and done < config.optimisation.steps
            ):
                render_during_training(state, done)
                if config.validation.step_loras_dir:
                    save_step_lora(state, done)
            if done < config.optimisation.steps and stop_time_reached(session):
                _stop_for_deadline(session, run, done)
                return
        if config.measure_fixed_noise_loss:
            # A dozen forward passes after the last step: announced, so the worker does not see silence.
            session.reporter.stage("train", status="measuring_fixed_noise_loss")
            run.fixed_noise_loss["end"] = fixed_noise_loss(session, run, data.instance_set)


def stop_time_reached(session: Session) -> bool:
    """*Collective.* Whether any rank is past the run's stop time: every rank stops at the same step boundary."""
    stop_at = session.config.stop_at_unix_seconds
    if stop_at is None:
        return False
    late = time.time() >= stop_at
    accelerator = session.accelerator
    if accelerator.num_processes == 1:
        return late
    flag = torch.tensor([1.0 if late else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def _stop_for_deadline(session: Session, run: TrainingRun, done: int) -> None:
    """*Collective.* The stop time came after `done` steps: a checkpoint there (unless one was just made), so a
    resubmitted job resumes from it; the export that follows writes the weights trained so far."""
    config = session.config
    session.reporter.stage("train", status="stopped_for_deadline", step=done, total=config.optimisation.steps)
    if not (config.checkpoints.every and done % config.checkpoints.every == 0):
        save_checkpoint(session, run, done)
    run.stopped_at_step = done


def _optimizer_step(session: Session, run: TrainingRun, data: CachedData, step: int) -> float:
    """One optimizer step over its accumulated micro-batches; the loss averaged over them and the ranks."""
    config, accelerator = session.config, session.accelerator
    accumulation = config.optimisation.gradient_accumulation_steps
    world, rank = accelerator.num_processes, accelerator.process_index
    losses = []
    for micro in range(accumulation):
        with accelerator.accumulate(run.engine):
            index = (step * accumulation + micro) * world + rank
            batch = micro_batch(
                config.optimisation.seed,
                config.optimisation.batch_size,
                data,
                index,
                run.normalisation,
                config.prompts.caption_dropout,
            )
            generator = torch.Generator("cpu").manual_seed(
                seed_for(config.optimisation.seed, "noise", step, micro, rank)
            )
            per_sample = per_sample_losses(session, run, batch, generator)
            if data.class_set is not None:
                instance_loss, class_loss = per_sample.chunk(2)
                loss = instance_loss.mean() + config.prompts.prior_loss_weight * class_loss.mean()
            else:
                loss = per_sample.mean()
            accelerator.backward(loss)
            # The fused pass has already clipped (per parameter), stepped and freed every gradient.
            fused = config.memory.fused_backward_pass
            if (
                accelerator.sync_gradients
                and session.deepspeed_config is None
                and config.optimisation.max_grad_norm > 0
                and not fused
            ):
                accelerator.clip_grad_norm_(trainable_parameters(run.engine), config.optimisation.max_grad_norm)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
    if not run.scheduler_stepped_by_engine:
        run.scheduler.step()
    step_loss = float(accelerator.reduce(torch.stack(losses).mean(), reduction="mean"))
    if not math.isfinite(step_loss):
        raise TrainerFailure(
            "nan_loss",
            f"the loss became {step_loss} at step {step + 1}; lower learning_rate or use bf16 instead of fp16",
            step=step + 1,
        )
    return step_loss


def per_sample_losses(
    session: Session, run: TrainingRun, batch: dict[str, Any], generator: torch.Generator, sigmas: Any = None
) -> torch.Tensor:
    """The rectified-flow loss of each sample in `batch` [B], float32."""
    device, dtype = session.accelerator.device, session.precision.input_dtype
    layout = session.base.ops
    inputs = build_flow_inputs(
        batch["latents"],
        sampler=run.sampler,
        generator=generator,
        guidance_scale=run.guidance_scale,
        device=device,
        dtype=dtype,
        layout=layout,
        sigmas=sigmas,
        control=batch.get("control_latents"),
    )
    prediction = run.engine(**layout.transformer_inputs(inputs, batch, device, dtype))[0]
    return per_sample_loss(unpack_prediction(prediction, inputs, layout), inputs)


def fixed_noise_loss(
    session: Session,
    run: TrainingRun,
    instance_set: EncodedImages,
    images: int = FIXED_NOISE_IMAGES,
    sigmas: tuple[float, ...] = FIXED_NOISE_SIGMAS,
) -> float:
    """*Collective.* The unweighted loss on the first `images` instance samples (posterior means) at fixed
    noise and `sigmas`: a repeatable measure of learning, free of the sampling noise of step losses."""
    losses = []
    with torch.no_grad():
        for index, sample in enumerate(first_samples(instance_set, images)):
            batch: dict[str, torch.Tensor] = {
                **sample,
                **{
                    key: run.normalisation.apply(sample[key]) for key in ("latents", "control_latents") if key in sample
                },
            }
            for sigma in sigmas:
                generator = torch.Generator("cpu").manual_seed(
                    seed_for(session.config.optimisation.seed, "fixed_noise", index, sigma)
                )
                losses.append(float(per_sample_losses(session, run, batch, generator, torch.tensor([sigma])).mean()))
    release_prefetched_partitions(run.engine)
    return sum(losses) / len(losses)


def _measure_nvme_swap(session: Session, run: TrainingRun) -> None:
    """Record how many bytes DeepSpeed keeps in its swap files (this machine's ranks), per kind.

    The proof that NVMe offload really swaps: DeepSpeed deletes the files when the engine goes away, and
    keeps parameters below `stage3_param_persistence_threshold` elements in memory instead."""
    if not session.nvme_paths or not session.accelerator.is_local_main_process:
        return
    for kind, pattern in (("optimizer", "zero_stage_3/optimizer"), ("params", "zero_stage_3/*params")):
        swapped = sum(
            file.stat().st_size
            for path in session.nvme_paths
            for folder in path.glob(pattern)
            for file in folder.rglob("*.swp")
            if file.is_file()
        )
        run.nvme_swap_peak_bytes[kind] = max(run.nvme_swap_peak_bytes.get(kind, 0), swapped)
