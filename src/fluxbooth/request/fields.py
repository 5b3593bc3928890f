"""The request's fields (**contract**): each one's name, type, bounds, default and, in its description, meaning.

docs/request.md is generated from these declarations (fluxbooth.request.reference), so a field's description is
the text a caller reads. The rules on a field's value and across fields are fluxbooth.request.model's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, StringConstraints

from fluxbooth.contract.buckets import BUCKET_MULTIPLE, Resolution
from fluxbooth.contract.captioning import CaptioningMode
from fluxbooth.contract.captions import MAX_TRIGGER_CHARS
from fluxbooth.request.limits import (
    DEFAULT_CAPTION_DROPOUT,
    DEFAULT_TRAINING_TYPE,
    MAX_PROMPT_CHARS,
    MAX_TIMEOUT_SECONDS,
    DatasetCheckMode,
)
from fluxbooth.request.resolution import (
    DEFAULT_RESOLUTION,
    MAX_RESOLUTION_SIDE,
    MAX_RESOLUTION_SIZES,
    MIN_RESOLUTION_SIDE,
    parse_resolution,
)

Prompt = Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)]
LoraModuleName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.]+$")]
# A control image: base64 (a `data:` prefix allowed) or an http(s) URL; its content is checked when fetched.
ValidationImage = Annotated[str, StringConstraints(min_length=1, max_length=64 * 1024 * 1024, strip_whitespace=True)]
OutputFormat = Literal["diffusers", "single_file", "comfyui"]
SubjectTypeField = Literal["person", "pet", "object", "auto"]
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")


class RequestFields(BaseModel):
    """The fields of `job["input"]`, in the order docs/request.md lists them; `TrainingRequest` adds the rules."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # What to train, on what (the guide's fields, plus dataset_url and base_model).
    model_name: str = Field(
        min_length=1,
        max_length=64,
        description="Name of the result: letters, digits, `._-`. It becomes part of the storage key.",
    )
    # Kept out of repr(): the zip is megabytes, and a presigned URL carries a signature.
    dataset: str | None = Field(
        default=None,
        repr=False,
        description=(
            "The photos as a base64 zip (a `data:...;base64,` prefix is allowed). RunPod refuses a /run body over "
            "10 MB: above about 7.4 MB of zip use `dataset_url` (the client does this for you)."
        ),
    )
    dataset_url: str | None = Field(
        default=None,
        max_length=8192,
        repr=False,
        description=(
            "An http(s) link to the zip (a presigned GET works). Private and link-local addresses are refused."
        ),
    )
    instance_prompt: Prompt = Field(
        description=(
            "What the photos show, e.g. `a photo of sks person`. A caption beside a photo replaces it for that photo."
        ),
    )
    class_prompt: Prompt | None = Field(
        default=None,
        description="The class, e.g. `a photo of a person`: needed with `with_prior_preservation`.",
    )
    base_model: str | None = Field(
        default=None,
        max_length=1024,
        description=(
            "A Hugging Face hub id, the absolute path of a diffusers FLUX folder, or `fluxbooth/tiny-flux` (the "
            "built-in tiny model). Unset: `FLUXBOOTH_BASE_MODEL`, else `black-forest-labs/FLUX.1-dev`. See "
            "[base-model.md](base-model.md)."
        ),
    )
    # None: the hub's default branch.
    base_model_revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description=(
            "A branch, tag or commit of the hub id in `base_model` (Hugging Face's `revision`). Refused with a path "
            "or the tiny model."
        ),
    )

    # How long and how fast.
    steps: int = Field(default=1000, ge=1, le=100_000, description="Optimizer steps.")
    learning_rate: float | None = Field(
        default=None,
        gt=0,
        le=1e-2,
        description=(
            "Unset: 1e-4 for a LoRA, 2e-6 for a full fine-tune (1e-5 for the fused Adafactor pass). A rate outside "
            "its type's usual range is used as given, with a warning."
        ),
    )
    batch_size: int = Field(default=1, ge=1, le=64, description="Micro batch per GPU.")
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Micro batches per optimizer step. The fused Adafactor full fine-tune needs 1.",
    )
    resolution: Annotated[Resolution, PlainValidator(parse_resolution), PlainSerializer(Resolution.to_json)] = Field(
        default=DEFAULT_RESOLUTION,
        description=(
            'Training sizes: `1024`, `"1024"`, `[512, 768, 1024]` or `"512,768,1024"` (up to '
            f"{MAX_RESOLUTION_SIZES}, each a multiple of {BUCKET_MULTIPLE} from {MIN_RESOLUTION_SIDE} to "
            f"{MAX_RESOLUTION_SIDE}). Each photo trains at each size in its aspect-ratio bucket (about size² pixels); "
            '`"768x1024"` (width x height) fixes one shape, every photo centre-cropped to it.'
        ),
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=2**32 - 1,
        description=(
            "Seeds the noise, the caption dropout and the class images. The same request and photos on the same "
            "machine (the same hardware, image and settings) train the same weights, bit for bit; on another GPU "
            "or CPU, driver or thread count the floating-point sums run in another order, so the weights differ "
            "slightly. A file's sha256 differs on every run: its metadata records when it was trained."
        ),
    )

    # DreamBooth prior preservation.
    with_prior_preservation: bool = Field(
        default=False, description="Adds the class loss (DreamBooth's prior preservation)."
    )
    prior_loss_weight: float = Field(default=1.0, ge=0, le=1000, description="Weight of the class loss.")
    num_class_images: int = Field(
        default=50,
        ge=1,
        le=10_000,
        description=(
            "Class images used: the zip's `class/` folder, topped up with images the base model generates from "
            "`class_prompt` (cached across jobs, never customer data)."
        ),
    )

    # Memory strategy ("auto": the planner decides from the hardware).
    use_deepspeed: bool = Field(
        default=True,
        description="`false`: plain accelerate, no ZeRO. The result's `plan.use_deepspeed` says what ran.",
    )
    mixed_precision: Literal["bf16", "fp16", "no"] = Field(
        default="bf16", description="`fp16` is accepted with a warning: FLUX overflows in fp16."
    )
    gradient_checkpointing: bool | None = Field(
        default=None,
        description=(
            "Recompute activations in the backward pass: less memory, more time. `true`: every transformer block; "
            "`false`: none; unset: the planner's choice, the fastest that fits (none, every k-th block, or every "
            "block). The result's `plan.checkpoint_every` says what ran."
        ),
    )
    zero_stage: Literal["auto", 1, 2, 3] = Field(
        default="auto",
        description="DeepSpeed's ZeRO stage; `auto` lets the planner choose (a stage you set is still checked).",
    )
    offload: Literal["auto", "none", "cpu", "nvme"] = Field(
        default="auto",
        description=(
            "Where optimizer states (and, at stage 3, weights) live: `none`, `cpu`, `nvme` (needs stage 3). `none` "
            "also rules out streaming the base's blocks from host RAM."
        ),
    )
    fused_backward_pass: Literal["auto"] | bool = Field(
        default="auto",
        description=(
            "Full fine-tune only: `true` runs kohya's fused pass (bf16 weights, Adafactor stepping each weight inside "
            "the backward pass, no DeepSpeed) or refuses the job where it does not fit; `false` never; `auto` where "
            "it is the fastest that fits."
        ),
    )

    # Full fine-tune or LoRA.
    training_type: Literal["full", "lora"] = Field(
        default=DEFAULT_TRAINING_TYPE,
        description=(
            "`lora` or `full`. A full fine-tune of FLUX.1-dev with AdamW needs hundreds of GiB of host RAM; see "
            "[gpus.md](gpus.md)."
        ),
    )
    base_precision: Literal["auto", "bf16", "fp8", "nf4"] = Field(
        default="auto",
        description=(
            "LoRA only: how the frozen base is stored, `bf16`, `fp8` or `nf4`; `auto` picks the fastest that fits "
            "(see [quantisation.md](quantisation.md))."
        ),
    )
    lora_rank: int = Field(default=16, ge=1, le=512, description="LoRA only: the rank.")
    lora_alpha: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="LoRA only: the scale numerator; unset, the rank (a scale of 1).",
    )
    lora_target_modules: list[LoraModuleName] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description=(
            "LoRA only: module names to adapt; unset, the attention and feed-forward projections. Checked against "
            "the model's module names before any download; one that matches nothing is refused, listing the valid "
            "names."
        ),
    )
    # kohya's network_dropout; none by default, as diffusers' scripts.
    lora_dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="LoRA only: dropout on the LoRA branch's input (peft's `lora_dropout`).",
    )

    # Optimisation details.
    optimizer: str = Field(
        default="adamw",
        min_length=1,
        max_length=32,
        description=(
            "`adamw`, `adam`, `adagrad`, `lion`, `adafactor`, `sgd`. Offloaded to the CPU, Adam runs as "
            "DeepSpeedCPUAdam; the result's `metrics.optimizer` names what stepped."
        ),
    )
    lr_scheduler: Literal["constant", "cosine"] = Field(
        default="constant", description="`constant`, or `cosine` (to 0 at the last step), after the warm-up."
    )
    lr_warmup_steps: int = Field(default=0, ge=0, le=100_000, description="Linear warm-up steps.")
    max_grad_norm: float = Field(
        default=1.0,
        gt=0,
        le=1e6,
        description="Gradient clipping by the global norm (per parameter in the fused pass).",
    )
    guidance_scale: float = Field(
        default=1.0, ge=0, le=100, description="Fed to FLUX.1-dev's guidance embedding during training."
    )
    # Drawn in train/flow.py; uniform, diffusers' scripts' default, unless asked.
    timestep_sampling: str = Field(
        default="uniform",
        min_length=1,
        max_length=32,
        description=(
            "How each step's noise level is drawn: `uniform`, `logit_normal`, `mode`, `sigmoid`, `shift`, `flux_shift`."
        ),
    )
    # Exported as ema_lora/ or ema_transformer/.
    ema_decay: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Keep an exponential moving average of the trained weights (e.g. 0.99) on the CPU and export it beside "
            "them (`ema_` files)."
        ),
    )

    # Checkpoints, outputs, limits.
    checkpointing_steps: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Save and upload a checkpoint every N steps; see [checkpoints.md](checkpoints.md).",
    )
    resume_from: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="`latest`, or a checkpoint's URI: continue a run; see [checkpoints.md](checkpoints.md).",
    )
    # None (not given): the job spec's defaults; []: no validation renders at all.
    validation_prompts: list[Prompt] | None = Field(
        default=None,
        max_length=8,
        description=(
            "Up to 8 prompts rendered with the trained weights at the end (`validation/*.png`), sampled as the base "
            "model is. Left out: three defaults, the instance prompt and the subject in two new scenes (`a photo of "
            "<trigger word> <class noun>, on a beach at sunset`, `…, in a snowy forest`; without a trigger word the "
            "instance prompt stands for the subject), whose render time the plan counts; `[]`: no renders. FLUX.1 "
            "Kontext gets no defaults (each prompt needs its control image)."
        ),
    )
    # Fetched and checked like the dataset. Kept out of repr(): base64 images are megabytes.
    validation_images: list[ValidationImage] = Field(
        default_factory=list,
        max_length=8,
        repr=False,
        description=(
            "FLUX.1 Kontext: each validation prompt's input image, in prompt order: base64 or an http(s) link, "
            "checked like the dataset."
        ),
    )
    validation_steps: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description=(
            "Also render the validation prompts (given or the defaults) every N steps during training; refused with "
            "`validation_prompts: []`."
        ),
    )
    output_formats: list[OutputFormat] | None = Field(
        default=None,
        min_length=1,
        max_length=3,
        description=(
            'Unset: `["diffusers"]` for a full fine-tune, `["diffusers", "comfyui"]` for a LoRA; also `single_file`. '
            "See [result.md](result.md)."
        ),
    )
    timeout_seconds: int | None = Field(
        default=None,
        ge=60,
        le=MAX_TIMEOUT_SECONDS,
        description=(
            "The job's deadline. Unset: the worker's `FLUXBOOTH_JOB_DEADLINE_SECONDS`. Keep it below the endpoint's "
            "execution timeout; see [deploy.md](deploy.md)."
        ),
    )
    # The reference guide's debugging variables, nothing else: every kernel waits, no allocator cache.
    debug: bool = Field(
        default=False,
        description=(
            "Sets CUDA's debugging variables (`CUDA_LAUNCH_BLOCKING=1`, `PYTORCH_NO_CUDA_MEMORY_CACHING=1`) for the "
            "trainer: slow, and memory peaks are then not meaningful."
        ),
    )
    # A repeatable learning measure: extra forward passes, the allocator and the GPU left as they are.
    learning_check: bool = Field(
        default=False,
        description=(
            "`true`: measures the loss at fixed noise before and after training (`metrics.fixed_noise_loss`), a "
            "check that the model learned; changes nothing else."
        ),
    )
    # fluxbooth.job answers with the plan report.
    dry_run: bool = Field(
        default=False,
        description=(
            "`true`: plan and quote only, no trainer started; the dataset is counted from the zip's central "
            "directory (inline, or at most two HTTP range requests to `dataset_url`), else planned for the worker's "
            "image cap; the answer is the plan report with `instance_images` and `instance_images_source` (and a "
            "cost when the endpoint sets `FLUXBOOTH_PRICE_PER_HOUR`)."
        ),
    )
    # Read by fluxbooth.dataset.checks.
    dataset_checks: DatasetCheckMode = Field(
        default="warn",
        description=(
            "What the dataset check does with duplicates, blur, tiny or extreme photos, missing or extra faces: "
            "`warn` lists them in `warnings`; `strict` refuses the job naming each file."
        ),
    )

    # Likeness scoring of the validation renders (fluxbooth.likeness, in its own process after training).
    subject_type: SubjectTypeField = Field(
        default="auto",
        description=(
            "What the photos show, for the likeness score: `person` (face identity), `pet` or `object` (image "
            "similarity); `auto`: `person` when most photos hold exactly one face. The class noun the default prompts "
            "and the prompt-fidelity score use is the noun after the article in `class_prompt` when prior preservation "
            "uses it (`a photo of a dog in the park`: dog), else the noun after `trigger_word` in `instance_prompt` "
            "(`[trigger]` replaced first), else `person`, `pet` or `object` by this field, else `subject`."
        ),
    )
    likeness: bool | None = Field(
        default=None,
        description=(
            "Score every validation round for likeness to the photos, prompt fidelity, copying and variety, after "
            "training in its own process, against renders of the same prompts and seeds by the base model (step 0, "
            "rendered first); the result's `likeness` section. Unset: on whenever validation prompts are rendered. "
            "Scoring that cannot run says why in the section and never fails the job. The scores are automatic "
            "proxies."
        ),
    )
    keep_best_step: bool = Field(
        default=False,
        description=(
            "LoRA only, with `likeness` and `validation_steps` below `steps`: keep the LoRA of every validation "
            "step and make the main artifact the earliest step within one standard error of the best likeness among "
            "the steps that pass the guards (not copying the photos, prompt fidelity and variety kept), unless the "
            "final step is within the scores' noise of it; the final weights stay beside it with `final_` in front "
            "of their names and folder ([likeness.md](likeness.md)). When no step "
            "passes, the final weights stay main and the `likeness` section says which guard failed."
        ),
    )

    # Captions (ai-toolkit's and Replicate's names).
    trigger_word: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TRIGGER_CHARS,
        description=(
            "Put in front of every caption and the instance prompt that do not already hold it as a word, and in "
            "place of `[trigger]`; validation prompts too, never the class prompt. Compared in Unicode NFC, as the "
            "prompts and captions are kept. Written into the LoRA's metadata."
        ),
    )
    # fluxbooth.job.captioning_stage runs the captioner (fluxbooth.captions) in its own process before training.
    captioning: CaptioningMode = Field(
        default="off",
        description=(
            "`off`: each photo trains on its caption file or the instance prompt. `missing`: before training, a "
            "small vision-language model (the endpoint's `FLUXBOOTH_CAPTION_MODEL`) describes each photo that has "
            "no caption file (pose, framing, clothing, expression, setting, light; for persons never the face, hair, "
            "skin, age or ethnicity), and the caption trained is `{trigger_word} {class noun}, {description}`. Your "
            "own caption files are never changed. A captioner that cannot run leaves those photos on the instance "
            "prompt, with a warning; `report/captions.json` lists every caption as trained and where it came from."
        ),
    )
    caption_dropout: float = Field(
        default=DEFAULT_CAPTION_DROPOUT,
        ge=0,
        le=1,
        description="The share of training samples that use the empty prompt instead of their caption.",
    )
