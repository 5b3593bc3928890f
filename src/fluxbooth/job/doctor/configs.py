"""The checks of what the plan writes for the trainer: its config files written and re-read, and the
environment it sets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import GUIDANCE_DISTILLED_SAMPLING
from fluxbooth.contract.settings_groups import Memory, Optimisation, Prompts, Sampling
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.job.doctor.results import FAIL, OK, CheckResult
from fluxbooth.job.launch_files import DEBUG_ONLY_ENV, job_output_dir, write_launch_files


def write_and_reread_configs(plan: Any, job_dir: Path, work_dir: Path) -> CheckResult:
    """Write the launch files a job would get and read them back as accelerate and DeepSpeed would."""

    trainer = TrainerConfig(
        base_model="/models/flux",
        instance_dir=str(job_dir / "data" / "instance"),
        class_dir=None,
        output_dir=str(job_output_dir(job_dir)),
        cache_dir=str(job_dir / "cache"),
        resolution=Resolution(fixed=(512, 512)),
        training_type=plan.training_type,
        prompts=Prompts(instance_prompt="a photo of sks dog"),
        optimisation=Optimisation(steps=10, learning_rate=1e-5, batch_size=1, gradient_accumulation_steps=1, seed=0),
        sampling=Sampling(
            max_sequence_length=GUIDANCE_DISTILLED_SAMPLING.max_sequence_length,
            validation_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
            validation_guidance_scale=GUIDANCE_DISTILLED_SAMPLING.guidance_scale,
            class_image_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
        ),
        memory=Memory(
            mixed_precision=plan.mixed_precision,
            checkpoint_every=plan.checkpoint_every if plan.gradient_checkpointing else 0,
            zero_stage=plan.zero_stage,
            offload_optimizer=plan.offload_optimizer,
            offload_param=plan.offload_param,
        ),
    )
    try:
        files = write_launch_files(job_dir, plan, trainer)
        accelerate = yaml.safe_load(files.accelerate_config.read_text())
        reread = TrainerConfig.from_dict(json.loads(files.trainer_config.read_text()))
        problems = []
        if reread != trainer:
            problems.append("train.json does not read back equal")
        if plan.use_deepspeed:
            if files.deepspeed_config is None:
                raise ValueError("the plan uses DeepSpeed but no ds_config.json was written")
            deepspeed = json.loads(files.deepspeed_config.read_text())
            # Under DeepSpeed the precision lives in the DeepSpeed JSON only.
            for precision in ("bf16", "fp16"):
                enabled = bool(deepspeed.get(precision, {}).get("enabled"))
                if enabled != (plan.mixed_precision == precision):
                    problems.append(
                        f"ds_config.json {precision}.enabled={enabled}, the plan says {plan.mixed_precision}"
                    )
            if deepspeed["zero_optimization"]["stage"] != plan.zero_stage:
                problems.append(f"ZeRO stage {deepspeed['zero_optimization']['stage']}")
            section = accelerate.get("deepspeed_config", {})
            if accelerate.get("distributed_type") != "DEEPSPEED" or section.get("deepspeed_config_file") != str(
                files.deepspeed_config
            ):
                problems.append("accelerate.yaml does not point at ds_config.json")
        elif accelerate.get("mixed_precision") != plan.mixed_precision:
            problems.append(
                f"accelerate.yaml mixed_precision {accelerate.get('mixed_precision')!r}, the plan says {plan.mixed_precision}"
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        return CheckResult("config files", FAIL, f"writing or reading them failed: {type(error).__name__}: {error}")
    if problems:
        return CheckResult("config files", FAIL, "; ".join(problems))
    names = ", ".join(
        path.name for path in (files.deepspeed_config, files.accelerate_config, files.trainer_config) if path
    )
    return CheckResult("config files", OK, f"{names} written and re-read in a temporary directory")


def check_environment(plan: Any, child_env: Mapping[str, str]) -> CheckResult:
    problems = []
    if child_env.get("DS_ACCELERATOR") != plan.accelerator:
        problems.append(f"DS_ACCELERATOR={child_env.get('DS_ACCELERATOR')!r}")
    for name in DEBUG_ONLY_ENV:
        if name in child_env:
            problems.append(f"{name} is set outside debug mode (it serialises the GPU)")
    if not child_env.get("TORCH_EXTENSIONS_DIR"):
        problems.append("TORCH_EXTENSIONS_DIR is not set")
    if problems:
        return CheckResult("environment", FAIL, "; ".join(problems))
    shown = {
        name: child_env[name]
        for name in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")
        if name in child_env
    }
    return CheckResult("environment", OK, ", ".join(f"{name}={value}" for name, value in shown.items()))
