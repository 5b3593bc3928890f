"""The launch files: the job spec and its `Plan` in; the trainer's config (train.json), DeepSpeed JSON,
accelerate YAML and the trainer's environment out. Nothing here touches the GPU or imports torch;
`write_launch_files` is the only function that writes.

Deviations from the reference guide (each explained in README "Differences from the guide"):
- no `offload_param` below ZeRO stage 3: DeepSpeed ignores it there without a word;
- `train_batch_size` = micro batch x accumulation x world size, as DeepSpeed asserts;
- bf16 by default: FLUX overflows fp16;
- `CUDA_LAUNCH_BLOCKING`, `PYTORCH_NO_CUDA_MEMORY_CACHING` only with `debug`, they serialise the GPU;
- `OMP/MKL/NUMEXPR_NUM_THREADS` = the cores each process may use, not 1 (DeepSpeedCPUAdam is
  an OpenMP kernel); `DS_REPORT_BUG_MODE` dropped, no library reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from fluxbooth.contract import deepspeed_numbers as ds
from fluxbooth.contract.environment import CUDA_ALLOCATOR_SETTING, CUDA_MEMORY_FRACTION_ENV
from fluxbooth.contract.layout import checkpoint_root
from fluxbooth.contract.names import (
    DEEPSPEED_OPTIMIZER_PARAMS,
    DEEPSPEED_OPTIMIZER_TYPES,
    OPTIMIZER_HYPERPARAMETERS,
    SUPPORTED_OPTIMIZERS,
    normalise_optimizer_name,
)
from fluxbooth.contract.scoring import STEP_LORAS_FOLDER
from fluxbooth.contract.settings_groups import Checkpoints, Memory, Optimisation, Validation
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.plan.types import Plan
from fluxbooth.request.spec import JobSpec

# Parent-environment variables the trainer may inherit. Everything else (bucket keys above
# all) stays in the worker: the trainer needs no object-storage credentials.
INHERITED_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "TERM",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
        "LIBRARY_PATH",
        "CPATH",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "TORCH_EXTENSIONS_DIR",
        "TORCH_HOME",
        "TRITON_CACHE_DIR",
        "CC",
        "CXX",
        # bench/gpu.py emulates a smaller card inside the trainer (train/session.py); unset on real workers.
        CUDA_MEMORY_FRACTION_ENV,
    }
)

DEBUG_ONLY_ENV = {"CUDA_LAUNCH_BLOCKING": "1", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}

# The guide's fp16 loss-scaling block, kept verbatim for requests that ask for fp16.
GUIDE_FP16_SECTION: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


@dataclass(frozen=True)
class LaunchFiles:
    deepspeed_config: Path | None
    accelerate_config: Path
    trainer_config: Path


def _offload_section(device: str, plan: Plan, trainer: TrainerConfig) -> dict[str, Any]:
    # Pinned host memory needs a CUDA driver; on the CPU accelerator it is meaningless.
    section: dict[str, Any] = {"device": device, "pin_memory": plan.accelerator == "cuda"}
    if device == "nvme":
        section["nvme_path"] = plan.nvme_path or str(Path(trainer.output_dir).parent / "nvme-swap")
    return section


def zero_optimization_section(plan: Plan, trainer: TrainerConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_section(plan.offload_optimizer, plan, trainer)
    if plan.zero_stage == 3:
        if plan.offload_param != "none":
            zero["offload_param"] = _offload_section(plan.offload_param, plan, trainer)
        # DiffSynth-Studio's low-VRAM ZeRO-3 settings (see deepspeed_numbers).
        zero.update(
            {
                "overlap_comm": False,
                "contiguous_gradients": True,
                "sub_group_size": float(ds.ZERO3_SUB_GROUP_ELEMENTS),
                "reduce_bucket_size": ds.ZERO3_REDUCE_BUCKET_ELEMENTS,
                "stage3_prefetch_bucket_size": ds.ZERO3_PREFETCH_BUCKET_ELEMENTS,
                "stage3_param_persistence_threshold": float(ds.ZERO3_PARAM_PERSISTENCE_THRESHOLD),
                "stage3_max_live_parameters": float(ds.ZERO3_MAX_LIVE_PARAMETERS),
                "stage3_max_reuse_distance": float(ds.ZERO3_MAX_REUSE_DISTANCE),
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    else:
        zero.update(
            {
                "allgather_partitions": True,
                "allgather_bucket_size": ds.zero2_bucket_elements(
                    ds.ZERO2_ALLGATHER_BUCKET_ELEMENTS, plan.trainable_params
                ),
                "overlap_comm": plan.accelerator == "cuda",
                "reduce_scatter": True,
                "reduce_bucket_size": ds.zero2_bucket_elements(ds.ZERO2_REDUCE_BUCKET_ELEMENTS, plan.trainable_params),
                "contiguous_gradients": True,
            }
        )
    return zero


def optimizer_section(plan: Plan, trainer: TrainerConfig) -> dict[str, Any] | None:
    """DeepSpeed's block for the requested optimizer when DeepSpeed offloads it (it then steps its host C++
    DeepSpeedCPUAdam/CPUAdagrad/CPULion), else None: the trainer builds the optimizer and hands it to DeepSpeed
    (torch's fused AdamW, its own Lion, ...). Not offloaded, a block would make DeepSpeed build its CUDA
    kernels, which need nvcc; the torch-only optimizers (adafactor, sgd) never have one."""
    name = normalise_optimizer_name(trainer.optimisation.optimizer)
    if name not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"optimizer {trainer.optimisation.optimizer!r} is not supported; use one of {list(SUPPORTED_OPTIMIZERS)}"
        )
    deepspeed_type = DEEPSPEED_OPTIMIZER_TYPES.get(name)
    if deepspeed_type is None or plan.offload_optimizer == "none":
        return None
    values = {"lr": trainer.optimisation.learning_rate, **OPTIMIZER_HYPERPARAMETERS[name]}
    accepted = DEEPSPEED_OPTIMIZER_PARAMS[deepspeed_type]
    params = {
        key: list(value) if isinstance(value, tuple) else value for key, value in values.items() if key in accepted
    }
    if deepspeed_type == "Adam":
        # DeepSpeed's "Adam" is AdamW unless told otherwise; "adam" means Adam.
        params["adam_w_mode"] = False
    return {"type": deepspeed_type, "params": params}


def deepspeed_config(plan: Plan, trainer: TrainerConfig) -> dict[str, Any]:
    """The reference guide's ZeRO config, corrected (see module docstring)."""
    config: dict[str, Any] = {
        "train_batch_size": trainer.optimisation.batch_size
        * trainer.optimisation.gradient_accumulation_steps
        * plan.num_processes,
        "train_micro_batch_size_per_gpu": trainer.optimisation.batch_size,
        "gradient_accumulation_steps": trainer.optimisation.gradient_accumulation_steps,
        "gradient_clipping": trainer.optimisation.max_grad_norm,
        "zero_optimization": zero_optimization_section(plan, trainer),
        "steps_per_print": ds.STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if plan.mixed_precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.mixed_precision == "fp16":
        config["fp16"] = dict(GUIDE_FP16_SECTION)
    optimizer = optimizer_section(plan, trainer)
    if optimizer is not None:
        config["optimizer"] = optimizer
    elif plan.offload_optimizer != "none":
        # DeepSpeed refuses a torch optimizer next to ZeRO-Offload unless told the slower CPU update is wanted.
        config["zero_force_ds_cpu_optimizer"] = False
    # No `scheduler` block: the trainer's own schedule runs (warm-up from a non-zero first rate, cosine with or
    # without warm-up; DeepSpeed's WarmupLR starts at 0 and WarmupCosineLR refuses 0 warm-up steps).
    if "nvme" in (plan.offload_optimizer, plan.offload_param):
        config["aio"] = {
            "block_size": ds.AIO_BLOCK_SIZE,
            "queue_depth": ds.AIO_QUEUE_DEPTH,
            "thread_count": ds.AIO_THREAD_COUNT,
            "single_submit": False,
            "overlap_events": True,
        }
    return config


def accelerate_config(plan: Plan, deepspeed_config_path: Path | None) -> dict[str, Any]:
    """The reference guide's accelerate YAML, with the stage, precision and process count of the plan."""
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "NO",
        "downcast_bf16": "no",
        "gpu_ids": "all",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": plan.mixed_precision,
        "num_machines": 1,
        "num_processes": plan.num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": plan.accelerator == "cpu" and not plan.use_deepspeed,
    }
    if plan.use_deepspeed:
        if deepspeed_config_path is None:
            raise ValueError("a DeepSpeed plan needs the path of its DeepSpeed JSON")
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(deepspeed_config_path),
            # ZeRO-3 must build the model partitioned; otherwise the whole model lands on one GPU first.
            "zero3_init_flag": plan.zero_stage == 3,
        }
        # accelerate refuses a second source for what the DeepSpeed JSON already sets.
        del config["mixed_precision"]
    elif plan.num_processes > 1:
        # accelerate starts several CPU processes only through mpirun (MULTI_CPU + an MPI hostfile); without
        # one it quietly runs a single process. Its torchrun launcher (MULTI_GPU) starts them all, and each
        # falls back to gloo on a machine without GPUs.
        config["distributed_type"] = "MULTI_GPU"
        config["use_cpu"] = False
    if config["distributed_type"] in ("DEEPSPEED", "MULTI_GPU"):
        # Both launchers rendezvous over TCP; accelerate's default port 29500 is then taken by anything else
        # listening there (a trainer on the same host, a leftover from a killed job) and the trainer dies with
        # EADDRINUSE. 0 makes accelerate ask the OS for a free port when it launches.
        config["main_process_port"] = 0
    return config


def threads_per_process(plan: Plan, cpu_count: int) -> int:
    return max(1, cpu_count // max(1, plan.num_processes))


def child_environment(
    plan: Plan,
    parent_env: Mapping[str, str],
    *,
    cpu_count: int,
    torch_extensions_dir: Path,
    debug: bool = False,
) -> dict[str, str]:
    """The trainer's whole environment: an allow-list of the parent's plus the guide's variables."""
    env = {name: value for name, value in parent_env.items() if name in INHERITED_ENV_NAMES}
    threads = str(threads_per_process(plan, cpu_count))
    env.update(
        {
            "DS_ACCELERATOR": plan.accelerator,
            "DS_SKIP_CUDA_CHECK": "0",
            "PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOCATOR_SETTING,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "NUMEXPR_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if plan.accelerator == "cuda" and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in range(plan.num_processes))
    if plan.nccl_shm_disable:
        # /dev/shm is too small for NCCL's shared-memory transport between the GPUs (the plan says so).
        env["NCCL_SHM_DISABLE"] = "1"
    if debug:
        env.update(DEBUG_ONLY_ENV)
    return env


def write_launch_files(job_dir: Path, plan: Plan, trainer: TrainerConfig) -> LaunchFiles:
    """Write ds_config.json, accelerate.yaml and train.json into `job_dir/config/`."""
    config_dir = job_dir / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    deepspeed_path: Path | None = None
    if plan.use_deepspeed:
        deepspeed_path = config_dir / "ds_config.json"
        deepspeed_path.write_text(json.dumps(deepspeed_config(plan, trainer), indent=2) + "\n")
    accelerate_path = config_dir / "accelerate.yaml"
    accelerate_path.write_text(yaml.safe_dump(accelerate_config(plan, deepspeed_path), sort_keys=True))
    trainer_path = config_dir / "train.json"
    trainer.write(trainer_path)
    return LaunchFiles(deepspeed_path, accelerate_path, trainer_path)


def trainer_config_for(
    spec: JobSpec,
    plan: Plan,
    *,
    base_model: str,
    instance_dir: Path,
    class_dir: Path | None,
    job_dir: Path,
    class_image_cache_dir: Path | None = None,
    control_dir: Path | None = None,
    validation_images: tuple[Path, ...] = (),
    resume_from: str | None = None,
    stop_at_unix_seconds: float | None = None,
) -> TrainerConfig:
    """The trainer's input for the job `spec` run as `plan` decides, from the local `base_model` folder;
    generated class images are kept in `class_image_cache_dir` (outside the job) for the next job with the
    same recipe. `resume_from`: the local folder of the checkpoint to continue from (the trainer only ever sees
    a local folder); `stop_at_unix_seconds`: when the trainer stops short of its steps (TrainerConfig)."""
    output_dir = job_output_dir(job_dir)
    return TrainerConfig(
        base_model=base_model,
        instance_dir=str(instance_dir),
        class_dir=str(class_dir) if class_dir else None,
        control_dir=str(control_dir) if control_dir else None,
        output_dir=str(output_dir),
        cache_dir=str(job_dir / "cache"),
        class_image_cache_dir=str(class_image_cache_dir) if class_image_cache_dir else None,
        resolution=spec.resolution,
        training_type=plan.training_type,
        prompts=spec.prompts,
        optimisation=_optimisation(spec, plan),
        sampling=spec.sampling,
        memory=memory_for(plan),
        lora=spec.lora,
        # Checkpoints as the plan says: the request's checkpointing_steps, or the planner's for a run near its
        # deadline (the trainer's default folder is the same job_dir/checkpoints).
        checkpoints=Checkpoints(
            every=plan.checkpointing_steps,
            dir=str(job_checkpoint_dir(job_dir)) if spec.checkpointing_steps else None,
            resume_from=resume_from,
        ),
        validation=Validation(
            prompts=spec.validation_prompts,
            steps=spec.validation_steps,
            images=tuple(str(path) for path in validation_images),
            at_start=spec.likeness,
            step_loras_dir=str(output_dir / STEP_LORAS_FOLDER) if spec.keep_best_step else None,
        ),
        export=spec.export,
        measure_fixed_noise_loss=spec.measure_fixed_noise_loss,
        stop_at_unix_seconds=stop_at_unix_seconds,
    )


def job_output_dir(job_dir: Path) -> Path:
    """Where the trainer of the job in `job_dir` writes what it exports."""
    return job_dir / "output"


def job_checkpoint_dir(job_dir: Path) -> Path:
    """Where the trainer of the job in `job_dir` writes its checkpoint-N folders: the trainer's own default
    (contract/layout.py's checkpoint_root), so a resume downloaded here is where the trainer looks."""
    return checkpoint_root(None, str(job_output_dir(job_dir)))


def memory_for(plan: Plan) -> Memory:
    """The memory strategy `plan` decided, as the trainer reads it."""
    return Memory(
        mixed_precision=plan.mixed_precision,
        checkpoint_every=plan.checkpoint_every if plan.gradient_checkpointing else 0,
        zero_stage=plan.zero_stage,
        offload_optimizer=plan.offload_optimizer,
        offload_param=plan.offload_param,
        base_precision=plan.base_precision,
        block_swap=plan.block_swap,
        fused_backward_pass=plan.fused_backward_pass,
        encoders_on_cpu=plan.cache_encoders_on_cpu,
    )


def _optimisation(spec: JobSpec, plan: Plan) -> Optimisation:
    """The spec's optimisation, save that the plan may trade the default AdamW for Adafactor fused into the
    backward pass, at its own rate."""
    if not plan.fused_backward_pass:
        return spec.optimisation
    return replace(spec.optimisation, optimizer="adafactor", learning_rate=spec.fused_pass_learning_rate)
