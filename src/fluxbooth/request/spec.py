"""The job spec: the request resolved once, right after the base model is sized, into every value the planner,
the quote, the launch files and the trainer need, with every default filled in.

The request (fluxbooth.request.model) says what the customer asked for, leaving much open; the spec says what will
run: the learning rate, the LoRA targets and alpha of this model's family, its sampling settings (schnell: 4
steps without guidance), the prompts with the trigger word, the export formats, the deadline. Nothing after
it fills a default. Frozen and torch-free: the handler process builds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captions import contains_word, with_trigger
from fluxbooth.contract.names import FUSED_ADAFACTOR_LEARNING_RATE, SamplingDefaults
from fluxbooth.contract.settings_groups import Export, Optimisation, Prompts, Sampling
from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.families import family_named, read_model_index
from fluxbooth.request.class_noun import noun_after_trigger, noun_in_class_prompt
from fluxbooth.request.dataset_spec import DatasetSpec, dataset_spec
from fluxbooth.request.limits import DEFAULT_LEARNING_RATES
from fluxbooth.request.model import TrainingRequest
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import ModelSize

# What a run exports when the request names no formats: a full fine-tune its diffusers transformer, a LoRA
# both its diffusers file and the kohya/ComfyUI one.
DEFAULT_EXPORT_FORMATS = {"full": ("diffusers",), "lora": ("diffusers", "comfyui")}
# The scenes of the default validation prompts (after the instance prompt): the subject somewhere its photos were
# not, so the renders show whether the LoRA follows a prompt as well as whether it looks like the subject.
DEFAULT_VALIDATION_SCENES = ("on a beach at sunset", "in a snowy forest")
# The class noun when the request names no class (docs/request.md, `subject_type`).
SUBJECT_TYPE_NOUNS = {"person": "person", "pet": "pet", "object": "object"}
UNNAMED_CLASS_NOUN = "subject"


@dataclass(frozen=True)
class JobSpec:
    """One training job as it will run (before the planner picks how: strategy, precision, offload)."""

    training_type: Literal["full", "lora"]
    resolution: Resolution
    # The prompts as trained and rendered (the trigger word in the instance prompt), prior preservation, captions.
    prompts: Prompts
    # The schedule, optimizer and noise levels as the request (else the defaults) set them; the plan may still
    # trade the optimizer for Adafactor fused into the backward pass (launch_files.trainer_config_for).
    optimisation: Optimisation
    # The rate a full fine-tune runs with when the planner fuses Adafactor into the backward pass (the request's
    # rate, else kohya's for that optimizer).
    fused_pass_learning_rate: float
    # Whether the request named its optimizer: one left to its default lets the planner fuse Adafactor.
    optimizer_named: bool
    # LoRA's rank, alpha, dropout and the layers it adapts (the request's, else the model family's).
    lora: LoraSettings
    # How this base model is prompted and sampled (its family's, from its own files), and the guidance trained at.
    sampling: Sampling
    # What is exported and what the files say: the model name, the base model as the request (or the endpoint's
    # default) named it.
    export: Export
    # The request's validation prompts, or the defaults when it named none (`default_validation_prompts`).
    validation_prompts: tuple[str, ...]
    validation_steps: int | None
    default_validation_prompts: bool
    # Likeness scoring (fluxbooth.likeness): the request's subject type, the class noun (class_noun), each
    # validation prompt with the trigger word replaced by it (what prompt fidelity reads), and whether the best
    # validation step's LoRA becomes the main artifact.
    likeness: bool
    keep_best_step: bool
    subject_type: str
    class_noun: str
    fidelity_prompts: tuple[str, ...]
    # The memory strategy the request asks for ("auto": the planner's choice).
    use_deepspeed: bool
    mixed_precision: Literal["bf16", "fp16", "no"]
    gradient_checkpointing: bool | None  # None: the planner's choice
    zero_stage: Literal["auto", 1, 2, 3]
    offload: Literal["auto", "none", "cpu", "nvme"]
    fused_backward_pass: Literal["auto"] | bool
    base_precision: Literal["auto", "bf16", "fp8", "nf4"]
    checkpointing_steps: int | None
    resume_from: str | None
    # Seconds the job may take: the request's timeout_seconds (`deadline_from_request`), else the endpoint's.
    deadline_seconds: int
    deadline_from_request: bool
    measure_fixed_noise_loss: bool
    debug: bool
    # The request's accepted but questionable settings (TrainingRequest.warnings).
    warnings: tuple[str, ...]
    # What the dataset stage reads (fluxbooth.dataset): the dataset's source, the control images, the checks.
    dataset: DatasetSpec
    # The endpoint's captioner (FLUXBOOTH_CAPTION_MODEL) when the request captions (`captioning: "missing"`).
    captioner: str | None = None

    @property
    def planned_class_images(self) -> int:
        """Class images the run generates or reads: none without prior preservation."""
        return self.prompts.num_class_images if self.prompts.with_prior_preservation else 0


def model_sampling(model: ModelSize) -> SamplingDefaults:
    """How the sized base model is prompted and sampled: its family's defaults for its transformer (schnell has
    no guidance embedding) and, for a local folder, its model_index.json (FLUX.2 [klein]'s distilled flag)."""
    folder = Path(model.name)
    model_index = read_model_index(folder) if folder.is_dir() else {}
    transformer_config = {"guidance_embeds": model.transformer.guidance_embeds}
    return family_named(model.family).sampling_defaults(transformer_config, model_index)


def _sampling(defaults: SamplingDefaults, guidance_scale: float) -> Sampling:
    """The family's sampling `defaults` as the trainer reads them: validation images and generated class images
    at its steps and guidance, training at the request's `guidance_scale`."""
    return Sampling(
        max_sequence_length=defaults.max_sequence_length,
        validation_inference_steps=defaults.inference_steps,
        validation_guidance_scale=defaults.guidance_scale,
        class_image_inference_steps=defaults.inference_steps,
        guidance_scale=guidance_scale,
    )


def _learning_rates(request: TrainingRequest) -> tuple[float, float]:
    if request.learning_rate is not None:
        return request.learning_rate, request.learning_rate
    return DEFAULT_LEARNING_RATES[request.training_type], FUSED_ADAFACTOR_LEARNING_RATE


def class_noun(request: TrainingRequest) -> str:
    """The noun for the subject's class (fluxbooth.request.class_noun reads it): the one `class_prompt` names
    when prior preservation uses it ("a photo of a dog in the park" → dog), else the one after the trigger word
    in the instance prompt ("a photo of [trigger] dog" → dog), else the subject type's noun, else "subject".
    A class prompt the job ignores (no prior preservation) names nothing."""
    if request.with_prior_preservation and request.class_prompt is not None:
        if (noun := noun_in_class_prompt(request.class_prompt, request.trigger_word)) is not None:
            return noun
    if request.trigger_word and (noun := noun_after_trigger(request.instance_prompt, request.trigger_word)):
        return noun
    return SUBJECT_TYPE_NOUNS.get(request.subject_type, UNNAMED_CLASS_NOUN)


def default_validation_prompts(instance_prompt: str, trigger_word: str | None, noun: str) -> tuple[str, ...]:
    """The instance prompt (`instance_prompt`, the trigger word in it) and the subject in each default scene:
    "a photo of <trigger word> <noun>", or without a trigger word the instance prompt itself."""
    subject = f"a photo of {trigger_word} {noun}" if trigger_word else instance_prompt
    return (instance_prompt, *(f"{subject}, {scene}" for scene in DEFAULT_VALIDATION_SCENES))


def fidelity_prompt(prompt: str, trigger_word: str | None, noun: str) -> str:
    """`prompt` as prompt fidelity reads it: the trigger word replaced by the class noun, once ("TOK dog" → "dog",
    not "dog dog"); without a trigger word, unchanged."""
    if not trigger_word or not contains_word(prompt, trigger_word):
        return prompt
    word = rf"(?<!\w){re.escape(trigger_word)}(?!\w)"
    collapsed = re.sub(rf"{word}\s+(?={re.escape(noun)}(?!\w))", "", prompt, flags=re.IGNORECASE)
    return re.sub(word, noun, collapsed)


def _validation_prompts(
    request: TrainingRequest, model: ModelSize, instance_prompt: str, noun: str
) -> tuple[tuple[str, ...], bool]:
    """(the prompts rendered, whether they are the defaults): the request's, else the defaults where the family
    renders from text alone; a family that needs a control image per prompt (FLUX.1 Kontext) gets none."""
    if request.validation_prompts is not None:
        return tuple(with_trigger(prompt, request.trigger_word) for prompt in request.validation_prompts), False
    family = family_named(model.family)
    if not family.control_images:
        return default_validation_prompts(instance_prompt, request.trigger_word, noun), True
    needs = [name for name in ("validation_steps", "likeness", "keep_best_step") if getattr(request, name)]
    if needs:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"{', '.join(f'input.{name}' for name in needs)}: {family.title} gets no default validation prompts (each "
            "needs its control image); give validation_prompts with validation_images, or remove "
            f"{' and '.join(needs)}",
        )
    return (), False


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
    instance_prompt = with_trigger(request.instance_prompt, request.trigger_word)
    noun = class_noun(request)
    validation_prompts, defaults = _validation_prompts(request, model, instance_prompt, noun)
    likeness = bool(validation_prompts) if request.likeness is None else request.likeness
    return JobSpec(
        training_type=request.training_type,
        resolution=request.resolution,
        prompts=Prompts(
            instance_prompt=instance_prompt,
            class_prompt=request.class_prompt,
            with_prior_preservation=request.with_prior_preservation,
            prior_loss_weight=request.prior_loss_weight,
            num_class_images=request.num_class_images,
            trigger_word=request.trigger_word,
            caption_dropout=request.caption_dropout,
        ),
        optimisation=Optimisation(
            steps=request.steps,
            learning_rate=learning_rate,
            batch_size=request.batch_size,
            gradient_accumulation_steps=request.gradient_accumulation_steps,
            seed=request.seed,
            optimizer=request.optimizer,
            lr_scheduler=request.lr_scheduler,
            lr_warmup_steps=request.lr_warmup_steps,
            max_grad_norm=request.max_grad_norm,
            timestep_sampling=request.timestep_sampling,
            ema_decay=request.ema_decay,
        ),
        fused_pass_learning_rate=fused_pass_learning_rate,
        optimizer_named="optimizer" in request.model_fields_set,
        lora=lora,
        sampling=_sampling(model_sampling(model), request.guidance_scale),
        export=Export(
            formats=tuple(request.output_formats or DEFAULT_EXPORT_FORMATS[request.training_type]),
            model_name=request.model_name,
            base_model_name=request.base_model or settings.default_base_model,
        ),
        validation_prompts=validation_prompts,
        validation_steps=request.validation_steps,
        default_validation_prompts=defaults,
        likeness=likeness,
        keep_best_step=request.keep_best_step,
        subject_type=request.subject_type,
        class_noun=noun,
        fidelity_prompts=tuple(fidelity_prompt(prompt, request.trigger_word, noun) for prompt in validation_prompts),
        use_deepspeed=request.use_deepspeed,
        mixed_precision=request.mixed_precision,
        gradient_checkpointing=request.gradient_checkpointing,
        zero_stage=request.zero_stage,
        offload=request.offload,
        fused_backward_pass=request.fused_backward_pass,
        base_precision=request.base_precision,
        checkpointing_steps=request.checkpointing_steps,
        resume_from=request.resume_from,
        deadline_seconds=request.timeout_seconds or settings.job_deadline_seconds,
        deadline_from_request=request.timeout_seconds is not None,
        measure_fixed_noise_loss=request.learning_check,
        debug=request.debug,
        warnings=tuple(request.warnings()),
        dataset=dataset_spec(request),
        captioner=settings.caption_model if request.captioning == "missing" else None,
    )
