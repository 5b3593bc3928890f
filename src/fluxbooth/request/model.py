"""The training request (**contract**): `job["input"]`, validated before any file is written.

Field names and meaning follow the reference guide's Basic and Advanced requests; the additions
(`dataset_url`, `base_model`, `seed`, LoRA and DeepSpeed knobs, ...) are flat and documented in the README.
The fields themselves (types, bounds, defaults, descriptions) are declared in fluxbooth.request.fields; this
module holds the rules on their values and between them.

Validation is strict about types (JSON numbers for numbers, JSON booleans for booleans): a value that
pydantic would otherwise coerce (`"steps": "2000"`, `"use_deepspeed": "no"`) is refused, so a typo never
silently becomes a different training run. `resolution` is the one field with several spellings
(fluxbooth.request.resolution parses them).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePosixPath

from pydantic import ValidationError, field_validator, model_validator

from fluxbooth.addresses import http_url_problem, literal_address_reason
from fluxbooth.contract.captions import contains_word
from fluxbooth.contract.names import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_TIMESTEP_SAMPLING,
    normalise_optimizer_name,
)
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.fields import LORA_FIELDS, RequestFields
from fluxbooth.request.fused import fused_pass_conflicts
from fluxbooth.request.limits import ADAM_FAMILY, DEFAULT_LEARNING_RATES, SUITABLE_LEARNING_RATES
from fluxbooth.request.problems import RequestProblems, describe_validation_error
from fluxbooth.request.text import (
    BLANK_MESSAGE,
    PROMPT_CONTROL_CHARACTERS,
    PROMPT_CONTROL_MESSAGE,
    is_blank,
    prompt_text,
)
from fluxbooth.settings import TINY_MODEL_NAME

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
# Control characters and the line and paragraph separators that end a line as surely as a newline does.
_LINE_BREAKING = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_DATA_URI_PREFIX = re.compile(r"^data:[^,]{0,200};base64,", re.IGNORECASE)
# Any scheme, any case: `ftp://` is a URL to refuse, not base64 to decode.
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# The standard and URL-safe alphabets, '=' padding and whitespace (line-wrapped base64), nothing else.
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=_\-\s]+")


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


def _has_parent_reference(path: str) -> bool:
    return ".." in PurePosixPath(path).parts


class TrainingRequest(RequestFields):
    """`job["input"]`: what to train, on what, and how."""

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
        problems = [
            f"[{index}] {problem}"
            for index, value in enumerate(values)
            if (problem := _validation_image_problem(value)) is not None
        ]
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
    def _prompt_is_text(cls, value: str | None) -> str | None:
        return None if value is None else prompt_text(value)

    @field_validator("validation_prompts")
    @classmethod
    def _validation_prompts_are_text(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if any(is_blank(prompt) for prompt in value):
            raise ValueError("must not contain blank prompts")
        controlled = [index for index, prompt in enumerate(value) if PROMPT_CONTROL_CHARACTERS.search(prompt)]
        if controlled:
            raise ValueError(f"[{', '.join(str(index) for index in controlled)}] {PROMPT_CONTROL_MESSAGE}")
        return [prompt_text(prompt) for prompt in value]

    @field_validator("trigger_word")
    @classmethod
    def _trigger_word_is_one_line(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if _LINE_BREAKING.search(value):
            raise ValueError("must be one line, without newlines, line separators or other control characters")
        if is_blank(value):
            raise ValueError(BLANK_MESSAGE)
        return unicodedata.normalize("NFC", value.strip())

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
            f"expected an absolute local path (/models/flux), a Hugging Face id (org/name) or '{TINY_MODEL_NAME}'"
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

    # Declared after every other field validator so that a field's own rule (a control character, a URL's
    # problem) is the one reported; this one catches the text those rules let through, e.g. a zero-width space.
    @field_validator("*")
    @classmethod
    def _text_not_blank(cls, value: object) -> object:
        if isinstance(value, str) and is_blank(value):
            raise ValueError(BLANK_MESSAGE)
        return value

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
                "input.class_prompt: required when input.with_prior_preservation is true (e.g. 'a photo of a person')"
            )
        if self.training_type == "full":
            lora_settings = [name for name in LORA_FIELDS if name in self.model_fields_set]
            if lora_settings:
                named = ", ".join(f"input.{name}" for name in lora_settings)
                problems.append(
                    f"{named}: only apply when input.training_type is 'lora'; remove them or set training_type 'lora'"
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
        elif self.validation_steps >= self.steps:
            problems.append(
                f"input.keep_best_step, input.validation_steps: validation_steps {self.validation_steps} is not below "
                f"steps {self.steps}, so the final step is the only validation round, nothing to choose between; set "
                "validation_steps below steps or remove keep_best_step"
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
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            optimizer=self.optimizer,
            optimizer_named="optimizer" in self.model_fields_set,
            mixed_precision=self.mixed_precision,
            zero_stage=self.zero_stage,
            offload=self.offload,
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
