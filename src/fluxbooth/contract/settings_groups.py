"""One job's settings in groups, each built once: the job spec (fluxbooth.request.spec) is made of the groups it
decides, the launch files add the plan's `Memory` and the job's paths, and the trainer's config
(fluxbooth.contract.trainer_config) carries them whole, as train.json nests them.

Plain frozen data, standard library only: the worker, the trainer and the tests all build and read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

Group = TypeVar("Group")


@dataclass(frozen=True)
class Prompts:
    """What is learnt from which words: the prompts as trained (the trigger word already in the instance prompt),
    prior preservation, and how captions are read."""

    instance_prompt: str
    class_prompt: str | None = None
    with_prior_preservation: bool = False
    prior_loss_weight: float = 1.0
    num_class_images: int = 0
    # Put in front of every caption that lacks it, and in place of `[trigger]` (fluxbooth.contract.captions), as
    # captions are read; the instance and validation prompts already carry it (the job spec put it there).
    trigger_word: str | None = None
    # The share of instance samples whose caption is replaced by the empty prompt (seeded per sample position).
    caption_dropout: float = 0.0


@dataclass(frozen=True)
class Optimisation:
    """How the weights are stepped: the schedule, the optimizer, the noise levels trained at."""

    steps: int
    learning_rate: float
    batch_size: int
    gradient_accumulation_steps: int
    seed: int
    optimizer: str = "adamw"
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0
    # How sigmas are drawn (train.names.SUPPORTED_TIMESTEP_SAMPLING; train/flow.py) and the loss weighted by them
    # ("none" | "sigma_sqrt" | "cosmap"); the parameters at diffusers' and kohya's defaults.
    timestep_sampling: str = "uniform"
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    # Keep an EMA of the trained weights on the CPU and export it too; None: no EMA.
    ema_decay: float | None = None


@dataclass(frozen=True)
class Sampling:
    """How the base model is prompted and sampled (its family's defaults unless the request says otherwise)."""

    max_sequence_length: int  # T5 tokens (FLUX.1) or the text encoder's (FLUX.2)
    validation_inference_steps: int
    validation_guidance_scale: float  # validation images and generated class images
    class_image_inference_steps: int  # prior preservation: steps per generated class image
    guidance_scale: float = 1.0  # the guidance embedding's value while training


@dataclass(frozen=True)
class Memory:
    """The memory strategy the planner decided (fluxbooth.plan.types.Plan): precision, ZeRO and offloads, how the
    frozen base is stored and streamed."""

    mixed_precision: str  # "bf16" | "fp16" | "no"
    # Activation checkpointing (Plan.checkpoint_every): every k-th block of the double and of the single stack
    # keeps only its inputs and is recomputed in the backward (`checkpointed_blocks`); 0: none, 1: every block.
    checkpoint_every: int
    zero_stage: int
    offload_optimizer: str  # "none" | "cpu" | "nvme"
    offload_param: str
    # How the frozen LoRA base is stored (Plan.base_precision): "bf16" (unquantised, in the compute dtype), "fp8"
    # or "nf4".
    base_precision: str = "bf16"
    # The frozen LoRA base's blocks live in pinned host RAM and stream to the accelerator as the forward and the
    # backward reach them, two at a time (Plan.block_swap, fluxbooth.train.blockswap); needs gradient
    # checkpointing, and ZeRO-2 at most. DeepSpeed is not told: it never sees the swapped tensors.
    block_swap: bool = False
    # A full fine-tune on bf16 weights, stepped by Adafactor per parameter inside the backward pass, without
    # DeepSpeed (train/fused_adafactor.py; kohya's --fused_backward_pass --full_bf16; Plan.fused_backward_pass).
    fused_backward_pass: bool = False
    # Run the text encoders and VAE on the CPU while caching (Plan.cache_encoders_on_cpu).
    encoders_on_cpu: bool = False

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether any block is recomputed in the backward."""
        return self.checkpoint_every > 0


def checkpointed_blocks(blocks: int, every: int) -> range:
    """The indices, in a stack of `blocks` transformer blocks, of those checkpointed when every `every`-th is (0:
    none): the planner prices them (plan/memory/activations.py), the trainer checkpoints them (train/model.py)."""
    return range(0, blocks, every) if every > 0 else range(0)


@dataclass(frozen=True)
class Checkpoints:
    """When the run saves its state, where, and what it resumes from."""

    every: int | None = None  # optimizer steps between checkpoints; None: none periodically
    dir: str | None = None  # None: the trainer's default beside the output folder (contract.layout)
    resume_from: str | None = None  # a local checkpoint-N folder
    keep: int = 2  # local checkpoint-N folders kept (older ones are deleted once uploaded)


@dataclass(frozen=True)
class Validation:
    """What is rendered to show the run's progress, and what likeness scoring needs kept."""

    prompts: tuple[str, ...] = ()
    # Also render the prompts every N optimizer steps, with the weights being trained.
    steps: int | None = None
    # Each prompt's control image (FLUX.1 Kontext), by prompt order; fewer than the prompts: none for the rest.
    images: tuple[str, ...] = ()
    # Likeness scoring (the worker scores the renders after training): render the prompts before the first step
    # too, into validation/step-000000/ (LoRA's zero-initialised B makes them the base model's), and, when set,
    # save the LoRA at every validation step in each requested LoRA format under step_loras_dir/step-NNNNNN/
    # (laid out as the output folder is: lora/...), for the worker to choose from.
    at_start: bool = False
    step_loras_dir: str | None = None


@dataclass(frozen=True)
class Export:
    """What the run exports and what the exported files say about themselves (train/export/metadata)."""

    formats: tuple[str, ...] = ("diffusers",)
    max_shard_size: str = "5GB"  # safetensors shard size of the exported transformer
    # The request's model_name, and the base model as the request (or the endpoint's default) named it.
    model_name: str = ""
    base_model_name: str = ""


def group_from_dict(cls: type[Group], data: dict[str, Any]) -> Group:
    """The group `cls` from its train.json object: JSON's lists back to the tuples the groups hold."""
    return cls(**{name: tuple(value) if isinstance(value, list) else value for name, value in data.items()})
