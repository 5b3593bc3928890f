"""Names the trainer accepts and the exit statuses it uses. Torch-free: the worker imports this to
validate requests and classify exits before anything is launched."""

from __future__ import annotations

from dataclasses import dataclass

# Optimizers the trainer can build, by canonical (lower-case) name: the DeepSpeed optimizer types SimpleTuner's
# DeepSpeed guide lists that run here, plus two torch ones. When DeepSpeed offloads the optimizer, the names in
# DEEPSPEED_OPTIMIZER_TYPES come from the DeepSpeed JSON's `optimizer` block and step as DeepSpeed's host C++
# DeepSpeedCPUAdam / DeepSpeedCPUAdagrad / DeepSpeedCPULion. Otherwise the trainer builds them (torch's fused
# AdamW and Adam, torch's Adagrad, train/lion.py's Lion) and hands them to DeepSpeed: DeepSpeed's own GPU
# kernels (FusedAdam, FusedLion) are CUDA ops that need nvcc to build. "adafactor" and "sgd" are always torch
# optimizers, which DeepSpeed takes next to an offload only with `zero_force_ds_cpu_optimizer: false`. SimpleTuner's other names (Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam, MuAdam,
# MuAdamW, MuSGD, Muon) need CUDA-only kernels or extra packages and are refused, as are the
# implementation names "cpuadam"/"fusedadam" (SimpleTuner silently swaps those for AdamW).
SUPPORTED_OPTIMIZERS = ("adamw", "adam", "adagrad", "lion", "adafactor", "sgd")
DEEPSPEED_OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "adagrad": "Adagrad", "lion": "Lion"}
# The parameters each DeepSpeed optimizer type accepts in its JSON block (DeepSpeedCPUAdagrad refuses `betas`,
# DeepSpeedCPULion has no `eps`).
DEEPSPEED_OPTIMIZER_PARAMS = {
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "Adagrad": ("lr", "eps", "weight_decay"),
    "Lion": ("lr", "betas", "weight_decay"),
}
# Each optimizer's hyperparameters besides the learning rate: one table for the DeepSpeed JSON blocks
# (launch_files.py, each type keeping only the keys it accepts) and the torch optimizers (train/optim.py), so a
# name means the same update with or without DeepSpeed. torch's Adam and Adagrad default to no weight decay,
# Adagrad to eps 1e-10; Lion uses its paper's betas (DeepSpeed's default second beta, 0.999, is Adam's).
OPTIMIZER_HYPERPARAMETERS: dict[str, dict[str, object]] = {
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adagrad": {"eps": 1e-10, "weight_decay": 0.0},
    "lion": {"betas": (0.9, 0.99), "weight_decay": 0.01},
    "sgd": {"momentum": 0.9},
    "adafactor": {"relative_step": False, "scale_parameter": False, "warmup_init": False},
}
# A full fine-tune with Adafactor fused into the backward pass (train/fused_adafactor.py) runs kohya's FLUX
# settings: the Adafactor row above, and this learning rate when the request names none (sd-scripts'
# docs/fine_tune.md, FLUX.1 with flux_train.py: 1e-5). Its class is what metrics.optimizer reports.
FUSED_ADAFACTOR_LEARNING_RATE = 1e-5
FUSED_ADAFACTOR_CLASS = "FusedBackwardAdafactor"

# The layers LoRA adapts when a request names none (diffusers' FLUX LoRA script's set): every attention
# projection and feed-forward layer of both block kinds. The one definition: the request, the planner and
# the trainer read it from here (via TrainerConfig's LoraSettings).
DEFAULT_LORA_TARGET_MODULES: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
    "proj_out",
)


@dataclass(frozen=True)
class SamplingDefaults:
    """How a FLUX.1 variant is prompted and sampled when train.json leaves it to the model."""

    max_sequence_length: int  # T5 tokens
    inference_steps: int  # validation images and generated class images
    guidance_scale: float  # validation images and generated class images


# FLUX.1-dev is guidance-distilled (its transformer embeds the guidance scale: `guidance_embeds` true);
# FLUX.1-schnell is timestep-distilled (no guidance embedding) and is sampled in 4 steps without
# guidance from 256 T5 tokens, as diffusers' FluxPipeline documents for each.
GUIDANCE_DISTILLED_SAMPLING = SamplingDefaults(max_sequence_length=512, inference_steps=28, guidance_scale=3.5)
TIMESTEP_DISTILLED_SAMPLING = SamplingDefaults(max_sequence_length=256, inference_steps=4, guidance_scale=0.0)


def sampling_defaults(transformer_config: dict[str, object]) -> SamplingDefaults:
    """The variant's defaults, told apart by the transformer's config.json (`guidance_embeds`)."""
    return (
        GUIDANCE_DISTILLED_SAMPLING if transformer_config.get("guidance_embeds", True) else TIMESTEP_DISTILLED_SAMPLING
    )


# Learning-rate schedules (with optional linear warm-up in front).
SUPPORTED_LR_SCHEDULERS = ("constant", "cosine")

# How training sigmas are drawn (train/flow.py). diffusers' FLUX scripts index the scheduler's table with a
# density over [0, 1): "uniform" (their weighting_scheme "none", the default), "logit_normal", "mode". kohya's
# sd-scripts draw them continuously: "sigmoid" (sigmoid of a scaled normal), "shift" (that, shifted by a fixed
# discrete_flow_shift) and "flux_shift" (shifted by FLUX's resolution-dependent mu, as its sampler does).
SUPPORTED_TIMESTEP_SAMPLING = ("uniform", "sigmoid", "logit_normal", "mode", "shift", "flux_shift")
# Loss weighting by sigma, as diffusers' compute_loss_weighting_for_sd3 names it (their logit_normal and mode
# are densities, set by timestep_sampling).
SUPPORTED_WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap")

# Export formats: "diffusers" (full: the transformer folder; LoRA: pytorch_lora_weights.safetensors),
# "single_file" (full only: one safetensors file in the original FLUX key layout),
# "comfyui" (LoRA only: kohya/ComfyUI `lora_unet_...` keys).
SUPPORTED_EXPORT_FORMATS = ("diffusers", "single_file", "comfyui")
FULL_EXPORT_FORMATS = ("diffusers", "single_file")
LORA_EXPORT_FORMATS = ("diffusers", "comfyui")

# Exit statuses of `python -m fluxbooth.train` (besides 0). Every failure also prints an `error` event
# whose `code` is one of ERROR_CODES, which is the more precise signal.
EXIT_INVALID_CONFIG = 2
EXIT_NAN_LOSS = 3
EXIT_CUDA_OOM = 4
EXIT_FAILED = 1

ERROR_CODES = (
    "invalid_config",  # train.json or the DeepSpeed JSON asks for something this trainer cannot do
    "invalid_dataset",  # no usable images, unreadable caption, ...
    "nan_loss",  # the loss became NaN or infinite
    "cuda_oom",  # torch.cuda.OutOfMemoryError
    "missing_libaio",  # NVMe offload asked for, but DeepSpeed's async_io op cannot be built
    "resume_failed",  # the checkpoint to resume from is missing or does not match
    "export_failed",  # the saved weights did not load back or did not match
    "trainer_failed",  # anything else
)


def normalise_optimizer_name(name: str) -> str:
    """`"AdamW"`, `"adam-w"`, `"adam_w"` → `"adamw"`, `"Ada-Factor"` → `"adafactor"`: case, `-` and `_` ignored;
    unknown names are returned normalised (callers refuse them)."""
    return name.strip().lower().replace("-", "").replace("_", "")


# The learning check (the request's `learning_check`): the loss at fixed noise on this many instance images at these
# sigmas, measured before training and again after it. The trainer runs it; the planner times its forward passes.
FIXED_NOISE_IMAGES = 4
FIXED_NOISE_SIGMAS: tuple[float, ...] = (0.25, 0.5, 0.75)
