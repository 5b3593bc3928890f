"""Stages "save" and "export": the trained weights (and their EMA) gathered from the engine and written
in every requested format, each file checked by loading it back. The order of the stage; what each
format's files hold is in `lora` and `transformer`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fluxbooth.contract.events import EXPORTED_STATUS
from fluxbooth.contract.layout import LORA_FOLDER, step_folder_name
from fluxbooth.train.export.lora import LORA_WEIGHTS_NAME, lora_state_dict, save_lora_comfyui, save_lora_diffusers
from fluxbooth.train.export.metadata import FileLayout, TrainingRecord, safetensors_metadata
from fluxbooth.train.export.transformer import export_single_file, save_transformer, verify_saved_transformer
from fluxbooth.train.runtime import free_accelerator_memory
from fluxbooth.train.state import Artifact, EncodedImages, Session, TrainerState, TrainingRun

TRANSFORMER_FOLDER = "transformer"
COMFYUI_LORA_NAME = "lora_comfyui.safetensors"
SINGLE_FILE_NAME = "flux_transformer.safetensors"


@dataclass
class SavedWeights:
    """What the save stage gathered from the engine, for the export stage once the engine may be gone."""

    record: TrainingRecord
    lora_state: dict[str, torch.Tensor] | None  # LoRA: the adapter's tensors on the main process
    samples: dict[str, torch.Tensor] | None  # full: tensors sampled from what was written, to check the files


def save_weights(state: TrainerState) -> SavedWeights:
    """*Collective.* Stage "save": gather the trained weights (a full fine-tune's are written here)."""
    session, run = state.session, state.training()
    config, accelerator = session.config, session.accelerator
    model = accelerator.unwrap_model(run.engine)
    saved = SavedWeights(training_record(state), None, None)
    with session.clock.stage("save"):
        if config.training_type == "full":
            saved.samples = save_transformer(
                model,
                Path(config.output_dir) / TRANSFORMER_FOLDER,
                is_main_process=session.is_main,
                max_shard_size=config.export.max_shard_size,
                metadata=safetensors_metadata(saved.record, FileLayout.TRANSFORMER_DIFFUSERS),
            )
        else:
            saved.lora_state = lora_state_dict(model, is_main_process=session.is_main)
    return saved


def exports_before_release(training_type: str) -> bool:
    """Whether the export stage runs while the engine still lives, before the final renders. A LoRA's files are
    small (no host memory to free first) and then never depend on a render finishing; a full fine-tune's
    export reloads the whole transformer, so the engine and its offloaded optimizer state go first."""
    return training_type == "lora"


def export_weights(state: TrainerState, saved: SavedWeights) -> list[Artifact]:
    """*Collective.* Stage "export": every requested format (and the EMA's), each file checked by loading it."""
    session, run = state.session, state.training()
    config = session.config
    output_dir = Path(config.output_dir)
    artifacts: list[Artifact] = []
    with session.clock.stage("export", formats=list(config.export.formats)):
        if session.is_main:
            if saved.samples is not None:
                artifacts += _export_full(session, output_dir, saved.samples, saved.record)
            if saved.lora_state is not None:
                artifacts += export_lora(session, output_dir, saved.lora_state, saved.record, ema=False)
            if run.ema is not None:
                artifacts += _export_ema(session, run.ema.export_state(), output_dir, saved.record)
            session.reporter.stage(
                "export", status=EXPORTED_STATUS, artifacts=[artifact.to_dict() for artifact in artifacts]
            )
        session.accelerator.wait_for_everyone()
    return artifacts


def save_step_lora(state: TrainerState, step: int) -> None:
    """*Collective.* The LoRA as it is after `step`, in every requested LoRA format, under
    step_loras_dir/step-NNNNNN/ laid out as the output folder is (lora/...): the worker makes it the main artifact
    when this validation step scores best. Gathered as the final export gathers it (ZeRO-3: on every rank)."""
    session, run = state.session, state.training()
    config = session.config
    assert config.validation.step_loras_dir is not None
    with session.clock.stage("save", step=step, what="step_lora"):
        lora_state = lora_state_dict(session.accelerator.unwrap_model(run.engine), is_main_process=session.is_main)
        if session.is_main:
            folder = Path(config.validation.step_loras_dir) / step_folder_name(step)
            export_lora(session, folder, lora_state, training_record(state, steps=step), ema=False)
        session.accelerator.wait_for_everyone()


def training_record(state: TrainerState, steps: int | None = None) -> TrainingRecord:
    """The run as every exported file describes it (train/export/metadata), taken when training ends, or after
    `steps` for a validation step's LoRA."""
    session, run, data = state.session, state.training(), state.cached()
    config = session.config
    family = session.base.ops.family
    image_sets = {"instance": data.instance_set, "class": data.class_set}
    return TrainingRecord(
        config=config,
        architecture=family.modelspec_architecture(session.base.transformer_config),
        base_model_version=family.kohya_base_model_version,
        started_at=session.started_at,
        finished_at=time.time(),
        optimizer=run.optimizer_class,
        total_batch_size=config.optimisation.batch_size
        * config.optimisation.gradient_accumulation_steps
        * session.accelerator.num_processes,
        resolution=config.resolution.render_shape,
        captions={name: image_captions(images) for name, images in image_sets.items() if images is not None},
        buckets=data.instance_set.bucket_counts() if config.resolution.bucketed else {},
        steps_trained=steps,
    )


def image_captions(images: EncodedImages) -> list[str]:
    """The caption (the prompt it was trained with) of each image of a set."""
    return [images.prompts[index] for index in images.prompt_index.tolist()]


def release_engine(session: Session, run: TrainingRun) -> None:
    """Drop the engine, optimizer and schedule everywhere they are held (accelerate destroys DeepSpeed's
    engine), and record which of them still lives once released (metrics.alive_at_export, named for a full
    fine-tune's export, which follows; empty when all were freed)."""
    run.release()
    session.accelerator.free_memory()
    free_accelerator_memory()
    run.alive_at_export = run.engine_references.alive()


def _export_full(
    session: Session, output_dir: Path, samples: dict[str, torch.Tensor], record: TrainingRecord
) -> list[Artifact]:
    folder = output_dir / TRANSFORMER_FOLDER
    verify_saved_transformer(folder, samples)
    artifacts = []
    if "diffusers" in session.config.export.formats:
        artifacts.append(Artifact(name="transformer", path=TRANSFORMER_FOLDER, kind="diffusers_transformer"))
    if "single_file" in session.config.export.formats:
        export_single_file(
            folder,
            output_dir / SINGLE_FILE_NAME,
            safetensors_metadata(record, FileLayout.TRANSFORMER_ORIGINAL),
            session.base.ops.key_tables,
        )
        artifacts.append(
            Artifact(name="transformer_single_file", path=SINGLE_FILE_NAME, kind="single_file_transformer")
        )
    return artifacts


def export_lora(
    session: Session, output_dir: Path, lora_state: dict[str, torch.Tensor], record: TrainingRecord, *, ema: bool
) -> list[Artifact]:
    """Each requested LoRA format, in `lora/` (or, for the EMA weights, `ema_lora/` with "ema_" in front of
    the artifact names and kinds)."""
    config = session.config
    prefix = "ema_" if ema else ""
    folder_name = f"{prefix}{LORA_FOLDER}"
    folder = output_dir / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    artifacts = []
    if "diffusers" in config.export.formats:
        save_lora_diffusers(
            lora_state,
            folder,
            config.lora.alpha,
            safetensors_metadata(record, FileLayout.LORA_DIFFUSERS, ema=ema),
            session.base.ops.lora_file,
        )
        artifacts.append(
            Artifact(name=f"{prefix}lora", path=f"{folder_name}/{LORA_WEIGHTS_NAME}", kind=f"{prefix}lora_diffusers")
        )
    if "comfyui" in config.export.formats:
        metadata = safetensors_metadata(record, FileLayout.LORA_KOHYA, ema=ema)
        save_lora_comfyui(
            lora_state,
            folder / COMFYUI_LORA_NAME,
            config.lora,
            session.base.transformer_config,
            metadata,
            session.base.ops.key_tables,
        )
        artifacts.append(
            Artifact(
                name=f"{prefix}lora_comfyui", path=f"{folder_name}/{COMFYUI_LORA_NAME}", kind=f"{prefix}lora_comfyui"
            )
        )
    return artifacts


def _export_ema(
    session: Session, ema_state: dict[str, torch.Tensor], output_dir: Path, record: TrainingRecord
) -> list[Artifact]:
    """The EMA weights (on the main process's CPU) in the same formats as the trained ones."""
    if session.config.training_type == "lora":
        return export_lora(session, output_dir, ema_state, record, ema=True)
    folder = output_dir / "ema_transformer"
    with torch.device("meta"):
        skeleton = session.base.ops.transformer_class.from_config(session.base.transformer_config)
    skeleton.load_state_dict(ema_state, assign=True)
    metadata = safetensors_metadata(record, FileLayout.TRANSFORMER_DIFFUSERS, ema=True)
    samples = save_transformer(
        skeleton, folder, is_main_process=True, max_shard_size=session.config.export.max_shard_size, metadata=metadata
    )
    verify_saved_transformer(folder, samples)
    return [Artifact(name="ema_transformer", path="ema_transformer", kind="ema_diffusers_transformer")]
