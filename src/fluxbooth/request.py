"""The training request (**contract**): `job["input"]`, validated before any file is written.

Field names and meaning follow the reference guide's Basic and Advanced requests; the additions
(`dataset_url`, `base_model`, `seed`, LoRA and DeepSpeed knobs, ...) are flat and documented in the README.

Validation is strict about types (JSON numbers for numbers, JSON booleans for booleans): a value that
pydantic would otherwise coerce (`"steps": "2000"`, `"use_deepspeed": "no"`) is refused, so a typo never
silently becomes a different training run. `resolution` is the one field with several spellings
(fluxbooth.request_resolution parses them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from fluxbooth.addresses import http_url_problem, literal_address_reason
from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captions import MAX_TRIGGER_CHARS, contains_word
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import listed, short_name
from fluxbooth.request_resolution import DEFAULT_RESOLUTION, parse_resolution
from fluxbooth.settings import TINY_MODEL_NAME
from fluxbooth.contract.names import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_TIMESTEP_SAMPLING,
    normalise_optimizer_name,
)

# LoRA by default: a rank-16 LoRA trains on 24, 48 and 80 GiB cards, while a full fine-tune of FLUX.1-dev with
# AdamW needs more host RAM for its offloaded optimizer states than any single-GPU RunPod tier has (the figure:
# fluxbooth.plan.full_finetune_host_bytes), and with Adafactor fused into the backward pass (bf16 weights) it
# needs a 48 or 80 GiB card.
DEFAULT_TRAINING_TYPE = "lora"
# The learning rate of a request that names none, by training type (the job spec fills it in).
DEFAULT_LEARNING_RATES = {"lora": 1e-4, "full": 2e-6}
# Learning rates that suit each training type (Adam-family optimizers): outside them an explicit rate is
# accepted with a warning. A LoRA's low-rank update starts at zero and needs 1e-5..1e-3 to move (diffusers'
# FLUX DreamBooth LoRA recipe: 1e-4); a full fine-tune moves 12 B pretrained weights and diverges above ~1e-5.
SUITABLE_LEARNING_RATES = {"lora": (1e-5, 1e-3), "full": (1e-7, 1e-5)}
ADAM_FAMILY = ("adamw", "adam")
MAX_PROMPT_CHARS = 2000
# Replicate's FLUX trainer defaults to it and ai-toolkit's FLUX examples set it (kohya and diffusers: 0): a few
# steps without a caption keep the subject from being tied to every word of the captions.
DEFAULT_CAPTION_DROPOUT = 0.05
MAX_TIMEOUT_SECONDS = 86_400

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
# Control characters and the line and paragraph separators that end a line as surely as a newline does.
_LINE_BREAKING = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A prompt may span lines; other control characters (NUL first) are no text.
_PROMPT_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_DATA_URI_PREFIX = re.compile(r"^data:[^,]{0,200};base64,", re.IGNORECASE)
# Any scheme, any case: `ftp://` is a URL to refuse, not base64 to decode.
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# The standard and URL-safe alphabets, '=' padding and whitespace (line-wrapped base64), nothing else.
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=_\-\s]+")

Prompt = Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)]
LoraModuleName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.]+$")]
# A control image: base64 (a `data:` prefix allowed) or an http(s) URL; its content is checked when fetched.
ValidationImage = Annotated[str, StringConstraints(min_length=1, max_length=64 * 1024 * 1024, strip_whitespace=True)]
DatasetCheckMode = Literal["warn", "strict"]
OutputFormat = Literal["diffusers", "single_file", "comfyui"]
SubjectTypeField = Literal["person", "pet", "object", "auto"]
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")


def _validation_image_problem(value: str) -> str | None:
    """Why a validation image can never be fetched, or None: a URL that is not http(s) (file://, ftp://) or names
    an address the worker never connects to (cloud metadata, link-local; loopback and private ones are checked
    against FLUXBOOTH_ALLOW_PRIVATE_URLS when fetched), or text that is not base64."""
    if _URL_SCHEME.match(value) or value.lower().startswith("file:"):
        problem = http_url_problem(value)
        if problem is None and (address := literal_address_reason(value, allow_private=True)) is not None:
            problem = f"names {address}; the worker only downloads from public addresses"
        return problem
    if not _BASE64_TEXT.fullmatch(_DATA_URI_PREFIX.sub("", value, count=1)):
        return "is neither base64 image data (a `data:` prefix allowed) nor an http(s) URL"
    return None


class RequestProblems(ValueError):
    """The cross-field rules a request breaks, each naming its fields: reported one by one, never cut."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class FusedPassConflict:
    """A setting the fused Adafactor full fine-tune (kohya's `--fused_backward_pass`) cannot run with."""

    fields: tuple[str, ...]
    # What to set instead, as a refusal's "The same job fits with ..." names it.
    change: str
    why: str


def fused_pass_conflicts(
    *, gradient_accumulation_steps: int, optimizer: str, optimizer_named: bool, mixed_precision: str,
    zero_stage: int | str, offload: str,
) -> list[FusedPassConflict]:
    """The request settings that rule the fused pass out (none: it may run). The one list the request's
    validation (`fused_backward_pass: true`) and the planner (which strategies honour a request) read."""
    conflicts = []
    if gradient_accumulation_steps != 1:
        conflicts.append(FusedPassConflict(
            ("gradient_accumulation_steps",), "gradient_accumulation_steps 1",
            "each weight is stepped as its gradient appears: no gradient buffer to accumulate in",
        ))
    if optimizer_named and normalise_optimizer_name(optimizer) != "adafactor":
        conflicts.append(FusedPassConflict(("optimizer",), "optimizer 'adafactor' (or none)", "the fused pass steps with Adafactor"))
    if mixed_precision != "bf16":
        conflicts.append(FusedPassConflict(("mixed_precision",), "mixed_precision 'bf16'", "the fused pass trains bf16 weights"))
    if zero_stage != "auto" or offload not in ("auto", "none"):
        conflicts.append(FusedPassConflict(
            ("zero_stage", "offload"), "zero_stage and offload 'auto'", "the fused pass runs without DeepSpeed's ZeRO",
        ))
    return conflicts


def _has_parent_reference(path: str) -> bool:
    return ".." in PurePosixPath(path).parts


class TrainingRequest(BaseModel):
    """`job["input"]`: what to train, on what, and how."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # What to train, on what (the guide's fields, plus dataset_url and base_model).
    model_name: str = Field(min_length=1, max_length=64)
    # Kept out of repr(): the zip is megabytes, and a presigned URL carries a signature.
    dataset: str | None = Field(default=None, repr=False)
    dataset_url: str | None = Field(default=None, max_length=8192, repr=False)
    instance_prompt: Prompt
    class_prompt: Prompt | None = None
    base_model: str | None = Field(default=None, max_length=1024)
    # A branch, tag or commit of a hub id in base_model (Hugging Face `revision`); None: the default branch.
    base_model_revision: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")

    # How long and how fast.
    steps: int = Field(default=1000, ge=1, le=100_000)
    learning_rate: float | None = Field(default=None, gt=0, le=1e-2)
    batch_size: int = Field(default=1, ge=1, le=64)
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024)
    resolution: Annotated[Resolution, PlainValidator(parse_resolution), PlainSerializer(Resolution.to_json)] = (
        DEFAULT_RESOLUTION
    )
    seed: int = Field(default=42, ge=0, le=2**32 - 1)

    # DreamBooth prior preservation.
    with_prior_preservation: bool = False
    prior_loss_weight: float = Field(default=1.0, ge=0, le=1000)
    num_class_images: int = Field(default=50, ge=1, le=10_000)

    # Memory strategy ("auto": the planner decides from the hardware).
    use_deepspeed: bool = True
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    gradient_checkpointing: bool = True
    zero_stage: Literal["auto", 1, 2, 3] = "auto"
    offload: Literal["auto", "none", "cpu", "nvme"] = "auto"
    # A full fine-tune as kohya's `--fused_backward_pass` runs it (bf16 weights, Adafactor stepping each weight
    # inside the backward pass, no DeepSpeed): "auto" lets the planner choose it where it is the fastest that
    # fits; true asks for it (the job is refused where it does not fit); false rules it out.
    fused_backward_pass: Literal["auto"] | bool = "auto"

    # Full fine-tune or LoRA.
    training_type: Literal["full", "lora"] = DEFAULT_TRAINING_TYPE
    # How the frozen base is stored under LoRA ("auto": the planner picks the fastest that fits).
    base_precision: Literal["auto", "bf16", "fp8", "nf4"] = "auto"
    lora_rank: int = Field(default=16, ge=1, le=512)
    lora_alpha: float | None = Field(default=None, gt=0, le=100_000)
    lora_target_modules: list[LoraModuleName] | None = Field(default=None, min_length=1, max_length=64)
    # peft's dropout on the LoRA branch's input (kohya's network_dropout): none by default, as diffusers' scripts.
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)

    # Optimisation details.
    optimizer: str = Field(default="adamw", min_length=1, max_length=32)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0, le=100_000)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    guidance_scale: float = Field(default=1.0, ge=0, le=100)
    # How training sigmas are drawn (train/flow.py): diffusers' scripts' default, uniform, unless asked.
    timestep_sampling: str = Field(default="uniform", min_length=1, max_length=32)
    # An EMA of the trained weights kept on the CPU and exported beside them (ema_lora/, ema_transformer/).
    ema_decay: float | None = Field(default=None, gt=0, lt=1)

    # Checkpoints, outputs, limits.
    checkpointing_steps: int | None = Field(default=None, ge=1, le=100_000)
    resume_from: str | None = Field(default=None, min_length=1, max_length=1024)
    # None (not given): the job spec's defaults; []: no validation renders at all.
    validation_prompts: list[Prompt] | None = Field(default=None, max_length=8)
    # Each validation prompt's control image (FLUX.1 Kontext edits), in prompt order: base64 or an http(s) URL,
    # fetched and checked like the dataset. Kept out of repr(): base64 images are megabytes.
    validation_images: list[ValidationImage] = Field(default_factory=list, max_length=8, repr=False)
    validation_steps: int | None = Field(default=None, ge=1, le=100_000)
    output_formats: list[OutputFormat] | None = Field(default=None, min_length=1, max_length=3)
    timeout_seconds: int | None = Field(default=None, ge=60, le=MAX_TIMEOUT_SECONDS)
    # The reference guide's debugging variables for the trainer (CUDA_LAUNCH_BLOCKING=1,
    # PYTORCH_NO_CUDA_MEMORY_CACHING=1: every kernel waits, no allocator cache, so no memory peaks), nothing else.
    debug: bool = False
    # The loss at fixed noise before and after training (a repeatable learning measure, in the result's metrics):
    # extra forward passes, the allocator and the GPU left as they are.
    learning_check: bool = False
    # Plan and quote only: nothing fetched, no trainer started (job.py answers with the plan report).
    dry_run: bool = False
    # fluxbooth.dataset.checks: its findings become warnings, or (strict) refuse the job.
    dataset_checks: DatasetCheckMode = "warn"

    # Likeness scoring of the validation renders (fluxbooth.likeness, in its own process after training).
    subject_type: SubjectTypeField = "auto"
    # None: on whenever validation prompts are rendered.
    likeness: bool | None = None
    keep_best_step: bool = False

    # Captions (ai-toolkit's and Replicate's names).
    trigger_word: str | None = Field(default=None, min_length=1, max_length=MAX_TRIGGER_CHARS)
    caption_dropout: float = Field(default=DEFAULT_CAPTION_DROPOUT, ge=0, le=1)

    @field_validator("dataset")
    @classmethod
    def _dataset_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not _DATA_URI_PREFIX.sub("", value, count=1).strip():
            raise ValueError("is empty; send the dataset zip as base64, or use dataset_url")
        return value

    @field_validator("dataset_url")
    @classmethod
    def _dataset_url_is_http(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        problem = http_url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("validation_images")
    @classmethod
    def _validation_images_can_be_fetched(cls, values: list[str]) -> list[str]:
        problems = [f"[{index}] {problem}" for index, value in enumerate(values)
                    if (problem := _validation_image_problem(value)) is not None]
        if problems:
            raise ValueError("; ".join(problems))
        return values

    @field_validator("model_name")
    @classmethod
    def _model_name_is_a_safe_key(cls, value: str) -> str:
        if not _MODEL_NAME.fullmatch(value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' only, starting with a letter or digit "
                "(it becomes part of storage keys and paths)"
            )
        if ".." in value:
            raise ValueError("must not contain '..' (it becomes part of storage keys and paths)")
        return value

    @field_validator("instance_prompt", "class_prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if _PROMPT_CONTROL_CHARACTERS.search(value):
            raise ValueError("contains a control character (NUL or another); send plain text")
        if not value.strip():
            raise ValueError("must not be blank")
        return value.strip()

    @field_validator("validation_prompts")
    @classmethod
    def _validation_prompts_not_blank(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if any(not prompt.strip() for prompt in value):
            raise ValueError("must not contain blank prompts")
        return [prompt.strip() for prompt in value]

    @field_validator("trigger_word")
    @classmethod
    def _trigger_word_is_one_line(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if _LINE_BREAKING.search(value):
            raise ValueError("must be one line, without newlines, line separators or other control characters")
        if not value.strip():
            raise ValueError("must not be blank")
        return value.strip()

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _zero_stage_not_bool(cls, value: object) -> object:
        # Literal[1] would otherwise accept `true` and `1.0`; no other whole-number field takes either.
        if isinstance(value, bool | float):
            raise ValueError("expected 'auto', 1, 2 or 3")
        return value

    @field_validator("base_model")
    @classmethod
    def _base_model_is_path_or_hub_id(cls, value: str | None) -> str | None:
        if value is None or value == TINY_MODEL_NAME:
            return value
        if _CONTROL_CHARACTERS.search(value):
            raise ValueError("contains control characters")
        if value.startswith("/"):
            if _has_parent_reference(value):
                raise ValueError("must not contain '..'; give the model directory's absolute path")
            return value
        if _HUB_ID.fullmatch(value) and ".." not in value:
            return value
        raise ValueError(
            "expected an absolute local path (/models/flux), a Hugging Face id (org/name) "
            f"or '{TINY_MODEL_NAME}'"
        )

    @field_validator("base_model_revision")
    @classmethod
    def _revision_has_no_traversal(cls, value: str | None) -> str | None:
        if value is not None and ".." in value:
            raise ValueError("must not contain '..'")
        return value

    @field_validator("resume_from")
    @classmethod
    def _resume_from_has_no_traversal(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if _CONTROL_CHARACTERS.search(value):
            raise ValueError("contains control characters")
        if _has_parent_reference(value.replace("\\", "/")):
            raise ValueError("must not contain '..'")
        return value

    @field_validator("timestep_sampling")
    @classmethod
    def _timestep_sampling_is_known(cls, value: str) -> str:
        if value not in SUPPORTED_TIMESTEP_SAMPLING:
            raise ValueError(f"is not known; use one of {', '.join(SUPPORTED_TIMESTEP_SAMPLING)}")
        return value

    @field_validator("optimizer")
    @classmethod
    def _optimizer_is_supported(cls, value: str) -> str:
        name = normalise_optimizer_name(value)
        if name not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"is not supported; use one of {', '.join(SUPPORTED_OPTIMIZERS)}")
        return name

    @field_validator("output_formats")
    @classmethod
    def _output_formats_unique(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _fields_agree(self) -> TrainingRequest:
        problems: list[str] = []
        if (self.dataset is None) == (self.dataset_url is None):
            problems.append(
                "input.dataset, input.dataset_url: give exactly one of them "
                "(base64 zip in dataset, or a link in dataset_url)"
            )
        if self.with_prior_preservation and self.class_prompt is None:
            problems.append(
                "input.class_prompt: required when input.with_prior_preservation is true "
                "(e.g. 'a photo of a person')"
            )
        if self.training_type == "full":
            lora_settings = [name for name in LORA_FIELDS if name in self.model_fields_set]
            if lora_settings:
                named = ", ".join(f"input.{name}" for name in lora_settings)
                problems.append(
                    f"{named}: only apply when input.training_type is 'lora'; "
                    "remove them or set training_type 'lora'"
                )
        if self.training_type == "full" and self.base_precision in ("fp8", "nf4"):
            problems.append(
                f"input.base_precision, input.training_type: {self.base_precision!r} stores a frozen, quantised "
                "base, and a full fine-tune trains every weight; use training_type 'lora' with it, or "
                "base_precision 'auto' or 'bf16'"
            )
        if not self.use_deepspeed:
            forced = [
                f"input.{name}"
                for name, setting in (("zero_stage", self.zero_stage), ("offload", self.offload))
                if setting != "auto"
            ]
            if forced:
                problems.append(
                    f"{', '.join(forced)}: need input.use_deepspeed true; leave them 'auto' or enable DeepSpeed"
                )
        problems += self._fused_pass_problems()
        if self.offload == "nvme" and self.zero_stage in (1, 2):
            problems.append(
                "input.offload, input.zero_stage: 'nvme' offload needs ZeRO stage 3; at stages 1 and 2 "
                "DeepSpeed silently keeps the optimizer in CPU RAM instead. Use zero_stage 3 or offload 'cpu'"
            )
        prompts = len(self.validation_prompts or ())
        if len(self.validation_images) > prompts:
            problems.append(
                f"input.validation_images: {len(self.validation_images)} control image(s) for {prompts} "
                "validation prompt(s); give at most one per prompt, in prompt order"
            )
        if self.validation_steps is not None and self.validation_prompts == []:
            problems.append(
                "input.validation_steps: needs validation prompts (the prompts rendered every validation_steps steps), "
                "and input.validation_prompts [] turns them off; give prompts, leave validation_prompts out for the "
                "defaults, or remove validation_steps"
            )
        problems += self._likeness_problems()
        if self.lr_warmup_steps > self.steps:
            problems.append(
                f"input.lr_warmup_steps, input.steps: warmup ({self.lr_warmup_steps}) is longer "
                f"than the run ({self.steps} steps)"
            )
        if problems:
            raise RequestProblems(problems)
        return self

    def _likeness_problems(self) -> list[str]:
        """`likeness` scores the validation renders; `keep_best_step` chooses among a LoRA's validation steps by it."""
        problems = []
        if self.likeness and self.validation_prompts == []:
            problems.append(
                "input.likeness: scores the validation renders, and input.validation_prompts [] turns them off; "
                "give prompts, leave validation_prompts out for the defaults, or remove likeness"
            )
        if not self.keep_best_step:
            return problems
        if self.likeness is False or self.validation_prompts == []:
            problems.append(
                "input.keep_best_step: chooses the step by its likeness score, and likeness is off (likeness false "
                "or validation_prompts []); remove keep_best_step, or leave likeness and validation_prompts out"
            )
        if self.training_type == "full":
            problems.append(
                "input.keep_best_step: applies to training_type 'lora' (it keeps the weights of every validation "
                "step, a full transformer each for a full fine-tune); remove it or set training_type 'lora'"
            )
        if self.validation_steps is None:
            problems.append(
                "input.keep_best_step: needs input.validation_steps (without renders during training there is only "
                "the final step, nothing to choose between); add validation_steps or remove keep_best_step"
            )
        return problems

    def _fused_pass_problems(self) -> list[str]:
        if self.fused_backward_pass is not True:
            return []
        if self.training_type != "full":
            return [
                "input.fused_backward_pass: applies to training_type 'full' (it steps every weight of a full "
                "fine-tune inside the backward pass); remove it or set training_type 'full'"
            ]
        conflicts = fused_pass_conflicts(
            gradient_accumulation_steps=self.gradient_accumulation_steps, optimizer=self.optimizer,
            optimizer_named="optimizer" in self.model_fields_set, mixed_precision=self.mixed_precision,
            zero_stage=self.zero_stage, offload=self.offload,
        )
        return [
            f"input.fused_backward_pass, {', '.join(f'input.{name}' for name in conflict.fields)}: {conflict.why}; "
            f"use {conflict.change}"
            for conflict in conflicts
        ]

    def _learning_rate_warnings(self) -> list[str]:
        # The ranges are Adam's; Lion, Adagrad, SGD and Adafactor are tuned on other scales.
        if self.learning_rate is None or self.optimizer not in ADAM_FAMILY:
            return []
        low, high = SUITABLE_LEARNING_RATES[self.training_type]
        if low <= self.learning_rate <= high:
            return []
        default = DEFAULT_LEARNING_RATES[self.training_type]
        kind = "a LoRA" if self.training_type == "lora" else "a full fine-tune"
        direction = "low" if self.learning_rate < low else "high"
        return [
            f"learning_rate {self.learning_rate:g} is {direction} for {kind} (suitable: {low:g} to {high:g}); "
            f"it is used as given — remove learning_rate to get the default {default:g}"
        ]

    def warnings(self) -> list[str]:
        """Accepted but questionable settings; carried into the log and the result."""
        notes: list[str] = []
        if self.mixed_precision == "fp16":
            notes.append(
                "mixed_precision 'fp16': FLUX activations overflow fp16 (expect NaN or inf losses); "
                "'bf16' is recommended on any GPU that supports it"
            )
        notes += self._learning_rate_warnings()
        if self.caption_dropout >= 1:
            notes.append(
                "caption_dropout 1: every caption is dropped, so the model trains on the instance prompt alone; "
                "lower it (the default is 0.05) to train on the captions"
            )
        if self.class_prompt is not None and not self.with_prior_preservation:
            notes.append("class_prompt is ignored because with_prior_preservation is false")
        prior = self.class_prompt if self.with_prior_preservation else None
        if self.trigger_word and prior and contains_word(prior, self.trigger_word):
            notes.append(
                f"class_prompt contains the trigger word {self.trigger_word!r}: prior preservation then teaches "
                "the class images as the subject; describe the class without it"
            )
        if self.validation_steps is not None and self.validation_steps >= self.steps:
            notes.append(
                f"validation_steps {self.validation_steps} is not below steps {self.steps}: "
                "validation images are rendered only at the end"
            )
        return notes


def _field_label(location: tuple[int | str, ...]) -> str:
    label = "input"
    for part in location:
        if isinstance(part, int):
            label += f"[{part}]"
        else:
            label += f".{short_name(str(part), 64)}"
    return label


def _describe_error(error: dict[str, Any]) -> list[str]:
    location = tuple(error.get("loc", ()))
    if error.get("type") == "extra_forbidden":
        return [f"{_field_label(location)}: unknown field"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, RequestProblems):
        # Cross-field rules name their fields themselves, one problem each.
        return list(cause.problems)
    reason = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return [f"{_field_label(location)}: {reason}" if location else reason]


def describe_validation_error(error: ValidationError) -> str:
    """One line naming every failing field (up to messages.MAX_LISTED_PROBLEMS, then how many more), each
    problem whole, never echoing values."""
    problems = [problem for item in error.errors(include_url=False, include_input=False) for problem in _describe_error(item)]
    return "invalid request: " + listed(problems)


def parse_request(raw: object) -> TrainingRequest:
    """Validate `job["input"]`; every refusal is `invalid_input` naming the fields."""
    if not isinstance(raw, dict):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input: expected a JSON object with the training fields, got {type(raw).__name__}",
        )
    try:
        return TrainingRequest.model_validate(raw)
    except ValidationError as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, describe_validation_error(error)) from None
