"""The plan and trainer config of the guide's default job (full fine-tune at 1024 px, ZeRO-2 with the optimizer
offloaded to the CPU), which the launch-file goldens are written for, and its LoRA variant."""

from __future__ import annotations

from dataclasses import replace

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import GUIDANCE_DISTILLED_SAMPLING
from fluxbooth.contract.settings_groups import Memory, Optimisation, Prompts, Sampling
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.plan import Plan

GUIDE_DEFAULT_PLAN = Plan(
    accelerator="cuda",
    num_processes=1,
    training_type="full",
    use_deepspeed=True,
    zero_stage=2,
    offload_optimizer="cpu",
    offload_param="none",
    mixed_precision="bf16",
    gradient_checkpointing=True,
    optimizer="DeepSpeedCPUAdam",
    predicted_gpu_bytes=0,
    predicted_host_bytes=0,
    predicted_disk_bytes=0,
)

GUIDE_TRAINER = TrainerConfig(
    base_model="/models/flux",
    instance_dir="/job/data/instance",
    class_dir=None,
    output_dir="/job/output",
    cache_dir="/job/cache",
    resolution=Resolution(fixed=(1024, 1024)),
    training_type="full",
    prompts=Prompts(
        instance_prompt="a photo of sks person",
        class_prompt="a photo of a person",
        with_prior_preservation=False,
        prior_loss_weight=1.0,
        num_class_images=50,
    ),
    optimisation=Optimisation(steps=2000, learning_rate=2e-6, batch_size=1, gradient_accumulation_steps=1, seed=42),
    sampling=Sampling(
        max_sequence_length=GUIDANCE_DISTILLED_SAMPLING.max_sequence_length,
        validation_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
        validation_guidance_scale=GUIDANCE_DISTILLED_SAMPLING.guidance_scale,
        class_image_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
    ),
    memory=Memory(
        mixed_precision="bf16", checkpoint_every=1, zero_stage=2, offload_optimizer="cpu", offload_param="none"
    ),
)

LORA_PLAN = replace(GUIDE_DEFAULT_PLAN, training_type="lora", offload_optimizer="none")
