"""The trainer's input (train.json): written by launch_files.py in the worker from the job spec
(fluxbooth.spec), read by fluxbooth.train.

Plain data, no torch, so the worker can build it and tests can golden-file it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import DEFAULT_LORA_TARGET_MODULES


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES


@dataclass(frozen=True)
class TrainerConfig:
    # Where things are (absolute paths inside the job directory).
    base_model: str
    instance_dir: str
    class_dir: str | None
    output_dir: str
    cache_dir: str
    # What to learn.
    instance_prompt: str
    class_prompt: str | None
    with_prior_preservation: bool
    prior_loss_weight: float
    num_class_images: int
    # The shapes images train at (aspect buckets, or one fixed shape); its render_shape is what validation
    # images and generated class images render at. In train.json as the request spells it ("WxH", or the sizes).
    resolution: Resolution
    # How to learn.
    training_type: str  # "full" | "lora"
    steps: int
    learning_rate: float
    batch_size: int
    gradient_accumulation_steps: int
    mixed_precision: str  # "bf16" | "fp16" | "no"
    gradient_checkpointing: bool
    seed: int
    zero_stage: int
    offload_optimizer: str  # "none" | "cpu" | "nvme"
    offload_param: str
    # How the base model is prompted and sampled (its family's defaults unless the request says otherwise).
    max_sequence_length: int  # T5 tokens (FLUX.1) or the text encoder's (FLUX.2)
    validation_inference_steps: int
    validation_guidance_scale: float  # validation images and generated class images
    class_image_inference_steps: int  # prior preservation: steps per generated class image
    optimizer: str = "adamw"
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0
    guidance_scale: float = 1.0
    # How sigmas are drawn (train.names.SUPPORTED_TIMESTEP_SAMPLING; train/flow.py) and the loss weighted by them
    # ("none" | "sigma_sqrt" | "cosmap"); the parameters at diffusers' and kohya's defaults.
    timestep_sampling: str = "uniform"
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    lora: LoraSettings = field(default_factory=LoraSettings)
    checkpointing_steps: int | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    validation_prompts: tuple[str, ...] = ()
    export_formats: tuple[str, ...] = ("diffusers",)
    ema_decay: float | None = None  # keep an EMA of the trained weights on the CPU and export it too
    max_shard_size: str = "5GB"  # safetensors shard size of the exported transformer
    checkpoints_keep: int = 2  # local checkpoint-N folders kept (older ones are deleted once uploaded)
    class_image_cache_dir: str | None = None  # keep generated class images here across jobs (one folder per recipe)
    encoders_on_cpu: bool = False  # run the text encoders and VAE on the CPU while caching (Plan.cache_encoders_on_cpu)
    validation_steps: int | None = None  # also render validation_prompts every N optimizer steps, with the weights being trained
    # How the frozen LoRA base is stored (Plan.base_precision): "bf16" (unquantised, in the compute dtype), "fp8"
    # or "nf4".
    base_precision: str = "bf16"
    # The frozen LoRA base's blocks live in pinned host RAM and stream to the accelerator as the forward and the
    # backward reach them, two at a time (Plan.block_swap, fluxbooth.train.blockswap); needs gradient
    # checkpointing, and ZeRO-2 at most. DeepSpeed is not told: it never sees the swapped tensors.
    block_swap: bool = False
    # The loss at fixed noise before and after training (a repeatable learning measure): 24 extra forward
    # passes, so only when asked (the request's `learning_check`).
    measure_fixed_noise_loss: bool = False
    # The share of instance samples whose caption is replaced by the empty prompt (seeded per sample position).
    caption_dropout: float = 0.0
    # What the exported files say about themselves (train/export/metadata): the request's model_name, the base
    # model as the request (or the endpoint's default) named it, and the trigger word its captions carry.
    model_name: str = ""
    base_model_name: str = ""
    # Put in front of every caption that lacks it, and in place of `[trigger]` (fluxbooth.contract.captions), as
    # captions are read; the instance and validation prompts above already carry it (the job spec put it there).
    trigger_word: str | None = None
    # A full fine-tune on bf16 weights, stepped by Adafactor per parameter inside the backward pass, without
    # DeepSpeed (train/fused_adafactor.py; kohya's --fused_backward_pass --full_bf16; Plan.fused_backward_pass).
    fused_backward_pass: bool = False
    # Image pairs (FLUX.1 Kontext): the control image of each instance image, same stem as a PNG in this folder
    # (the dataset's `control/` folder); None: no pairs.
    control_dir: str | None = None
    # Each validation prompt's control image (FLUX.1 Kontext), by prompt order; fewer than the prompts: none for the rest.
    validation_images: tuple[str, ...] = ()
    # Likeness scoring (the worker scores the renders after training): render the validation prompts before the
    # first step too, into validation/step-000000/ (LoRA's zero-initialised B makes them the base model's), and,
    # when set, save the LoRA at every validation step in each requested LoRA format under
    # step_loras_dir/step-NNNNNN/ (laid out as output_dir is: lora/...), for the worker to choose from.
    validation_at_start: bool = False
    step_loras_dir: str | None = None
    # The job's deadline less what a stopped run needs to checkpoint, export and upload (seconds since the epoch):
    # past it the trainer stops at the next step boundary, checkpoints, exports what it trained and reports the
    # step reached (the `done` event's metrics.stopped_for_deadline). None: train every step.
    stop_at_unix_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["resolution"] = self.resolution.to_json()
        return json.loads(json.dumps(values))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        values = dict(data)
        values["resolution"] = Resolution.from_json(values["resolution"])
        values["lora"] = LoraSettings(
            **{**values.get("lora", {}), "target_modules": tuple(values.get("lora", {}).get("target_modules", LoraSettings.target_modules))}
        )
        values["validation_prompts"] = tuple(values.get("validation_prompts", ()))
        values["validation_images"] = tuple(values.get("validation_images", ()))
        values["export_formats"] = tuple(values.get("export_formats", ("diffusers",)))
        return cls(**values)

    @classmethod
    def read(cls, path: Path) -> TrainerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
