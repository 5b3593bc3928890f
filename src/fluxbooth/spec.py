"""The job spec: the request resolved once, right after the base model is sized, into every value the planner,
the quote, the launch files and the trainer need, with every default filled in.

The request (fluxbooth.request) says what the customer asked for, leaving much open; the spec says what will
run: the learning rate, the LoRA targets and alpha of this model's family, its sampling settings (schnell: 4
steps without guidance), the prompts with the trigger word, the export formats, the deadline. Nothing after
it fills a default. Frozen and torch-free: the handler process builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captions import with_trigger
from fluxbooth.contract.names import FUSED_ADAFACTOR_LEARNING_RATE, SamplingDefaults
from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.families import family_named, read_model_index
from fluxbooth.sizing import ModelSize
from fluxbooth.request import DEFAULT_LEARNING_RATES, TrainingRequest
from fluxbooth.settings import WorkerSettings

# What a run exports when the request names no formats: a full fine-tune its diffusers transformer, a LoRA
# both its diffusers file and the kohya/ComfyUI one.
DEFAULT_EXPORT_FORMATS = {"full": ("diffusers",), "lora": ("diffusers", "comfyui")}


@dataclass(frozen=True)
class JobSpec:
    """One training job as it will run (before the planner picks how: strategy, precision, offload)."""

    model_name: str
    # The base model as the request (or the endpoint's default) named it: what the exported files say.
    base_model_name: str
    training_type: Literal["full", "lora"]
    steps: int
    batch_size: int
    gradient_accumulation_steps: int
    resolution: Resolution
    seed: int
    # The learning rate, and the one a full fine-tune runs with when the planner fuses Adafactor into the
    # backward pass (the request's rate, else kohya's for that optimizer).
    learning_rate: float
    fused_pass_learning_rate: float
    # LoRA's rank, alpha, dropout and the layers it adapts (the request's, else the model family's).
    lora: LoraSettings
    optimizer: str
    # Whether the request named its optimizer: one left to its default lets the planner fuse Adafactor.
    optimizer_named: bool
    lr_scheduler: str
    lr_warmup_steps: int
    max_grad_norm: float
    guidance_scale: float
    timestep_sampling: str
    ema_decay: float | None
    # The prompts as trained and rendered: the trigger word in the instance and validation prompts.
    instance_prompt: str
    class_prompt: str | None
    with_prior_preservation: bool
    prior_loss_weight: float
    num_class_images: int
    trigger_word: str | None
    caption_dropout: float
    validation_prompts: tuple[str, ...]
    validation_steps: int | None
    # How this base model is prompted and sampled (its family's, from its own files).
    sampling: SamplingDefaults
    # The memory strategy the request asks for ("auto": the planner's choice).
    use_deepspeed: bool
    mixed_precision: Literal["bf16", "fp16", "no"]
    gradient_checkpointing: bool
    zero_stage: Literal["auto", 1, 2, 3]
    offload: Literal["auto", "none", "cpu", "nvme"]
    fused_backward_pass: Literal["auto"] | bool
    base_precision: Literal["auto", "bf16", "fp8", "nf4"]
    checkpointing_steps: int | None
    resume_from: str | None
    export_formats: tuple[str, ...]
    # Seconds the job may take: the request's timeout_seconds (`deadline_from_request`), else the endpoint's.
    deadline_seconds: int
    deadline_from_request: bool
    measure_fixed_noise_loss: bool
    debug: bool
    # The request's accepted but questionable settings (TrainingRequest.warnings).
    warnings: tuple[str, ...]

    @property
    def planned_class_images(self) -> int:
        """Class images the run generates or reads: none without prior preservation."""
        return self.num_class_images if self.with_prior_preservation else 0


def model_sampling(model: ModelSize) -> SamplingDefaults:
    """How the sized base model is prompted and sampled: its family's defaults for its transformer (schnell has
    no guidance embedding) and, for a local folder, its model_index.json (FLUX.2 [klein]'s distilled flag)."""
    folder = Path(model.name)
    model_index = read_model_index(folder) if folder.is_dir() else {}
    transformer_config = {"guidance_embeds": model.transformer.guidance_embeds}
    return family_named(model.family).sampling_defaults(transformer_config, model_index)


def _learning_rates(request: TrainingRequest) -> tuple[float, float]:
    if request.learning_rate is not None:
        return request.learning_rate, request.learning_rate
    return DEFAULT_LEARNING_RATES[request.training_type], FUSED_ADAFACTOR_LEARNING_RATE


def resolve_job_spec(request: TrainingRequest, model: ModelSize, settings: WorkerSettings) -> JobSpec:
    """The job `request` asks for on the sized base `model`, with the endpoint's defaults (`settings`: the
    default base model, the job deadline) and the model's (LoRA targets, sampling) filled in."""
    learning_rate, fused_pass_learning_rate = _learning_rates(request)
    lora = LoraSettings(
        rank=request.lora_rank,
        # peft's default: alpha equal to the rank, a scale of 1.
        alpha=float(request.lora_rank if request.lora_alpha is None else request.lora_alpha),
        dropout=request.lora_dropout,
        target_modules=tuple(request.lora_target_modules or model.default_lora_targets),
    )
    return JobSpec(
        model_name=request.model_name,
        base_model_name=request.base_model or settings.default_base_model,
        training_type=request.training_type,
        steps=request.steps,
        batch_size=request.batch_size,
        gradient_accumulation_steps=request.gradient_accumulation_steps,
        resolution=request.resolution,
        seed=request.seed,
        learning_rate=learning_rate,
        fused_pass_learning_rate=fused_pass_learning_rate,
        lora=lora,
        optimizer=request.optimizer,
        optimizer_named="optimizer" in request.model_fields_set,
        lr_scheduler=request.lr_scheduler,
        lr_warmup_steps=request.lr_warmup_steps,
        max_grad_norm=request.max_grad_norm,
        guidance_scale=request.guidance_scale,
        timestep_sampling=request.timestep_sampling,
        ema_decay=request.ema_decay,
        instance_prompt=with_trigger(request.instance_prompt, request.trigger_word),
        class_prompt=request.class_prompt,
        with_prior_preservation=request.with_prior_preservation,
        prior_loss_weight=request.prior_loss_weight,
        num_class_images=request.num_class_images,
        trigger_word=request.trigger_word,
        caption_dropout=request.caption_dropout,
        validation_prompts=tuple(with_trigger(prompt, request.trigger_word) for prompt in request.validation_prompts),
        validation_steps=request.validation_steps,
        sampling=model_sampling(model),
        use_deepspeed=request.use_deepspeed,
        mixed_precision=request.mixed_precision,
        gradient_checkpointing=request.gradient_checkpointing,
        zero_stage=request.zero_stage,
        offload=request.offload,
        fused_backward_pass=request.fused_backward_pass,
        base_precision=request.base_precision,
        checkpointing_steps=request.checkpointing_steps,
        resume_from=request.resume_from,
        export_formats=tuple(request.output_formats or DEFAULT_EXPORT_FORMATS[request.training_type]),
        deadline_seconds=request.timeout_seconds or settings.job_deadline_seconds,
        deadline_from_request=request.timeout_seconds is not None,
        measure_fixed_noise_loss=request.learning_check,
        debug=request.debug,
        warnings=tuple(request.warnings()),
    )
