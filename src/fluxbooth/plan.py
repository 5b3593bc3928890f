"""Choosing how a job runs: ZeRO stage, offload targets, precision, training type.

The `Plan` dataclass is shared with configs.py and the result contract. `choose_plan` picks the
fastest strategy whose predicted memory fits this machine with a safety margin, or refuses with
`does_not_fit` before anything is downloaded or a GPU is touched.

The memory model — every formula, where each number comes from, what was measured and what was
not — is documented in docs/memory.md; the code below follows it term by term (the names in
`MemoryEstimate.breakdown` are the terms of that document). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.hardware import GIB, Hardware, format_bytes
from fluxbooth.modelsize import ModelSize, model_size
from fluxbooth.train.names import normalise_optimizer_name

__all__ = ["Candidate", "JobShape", "Plan", "Strategy", "choose_plan", "evaluate_candidates", "model_size", "plan_for_strategy"]

Offload = Literal["none", "cpu", "nvme"]

# Default LoRA targets when a request names none: the trainer's (TrainerConfig's LoraSettings).
DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "to_q", "to_k", "to_v", "to_out.0",
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    "proj_mlp", "proj_out",
)
ALTERNATIVE_LORA_RANK = 16

# ---- Safety margins: a plan fits when predicted * (1 + margin) <= available. -------------------
GPU_MARGIN = 0.10  # allocator fragmentation, cuDNN/cuBLAS workspaces we do not model
HOST_MARGIN = 0.10  # page cache, the handler's own memory, pinned-buffer rounding
DISK_MARGIN = 0.05

# ---- DeepSpeed bucket sizes in elements: the values configs.py writes (keep them in step). -----
ZERO2_REDUCE_BUCKET_ELEMENTS = 200_000_000
ZERO2_ALLGATHER_BUCKET_ELEMENTS = 200_000_000
ZERO3_REDUCE_BUCKET_ELEMENTS = 50_000_000
ZERO3_PREFETCH_BUCKET_ELEMENTS = 50_000_000
ZERO3_SUB_GROUP_ELEMENTS = 1_000_000_000
# DeepSpeed's NVMe defaults (configs.py leaves them): pinned host buffers for swapping parameters
# (offload_param.buffer_count x buffer_size elements, 16-bit) and optimizer sub-groups
# (offload_optimizer.buffer_count fp32 buffers of one sub-group each), and the 16-bit parameter elements
# ZeRO-3 keeps in host RAM before the rest lives only on disk (offload_param.max_in_cpu).
PARAM_SWAP_BUFFER_COUNT = 5
PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000
OPTIMIZER_SWAP_BUFFER_COUNT = 4
PARAMS_KEPT_IN_CPU_ELEMENTS = 1_000_000_000

# ---- Fixed costs (see docs/memory.md, "Fixed costs"). ------------------------------------------
# Proportional set size of the trainer process with torch, diffusers, transformers and accelerate
# imported, of DeepSpeed's engine and CPU ops on top, and of the `accelerate launch` parent — measured
# by bench/memory.py on the tiny model (whose own weights are a few hundred KiB).
TRAINER_PROCESS_BASELINE_BYTES = int(0.39 * GIB)
DEEPSPEED_RUNTIME_BYTES = int(0.05 * GIB)
LAUNCHER_PROCESS_BYTES = int(0.19 * GIB)
# On the CPU accelerator, memory glibc keeps after frees, in units of the 16-bit weights (P x w):
# bench/memory.py measured 0.75-1.2 (ZeRO-2, no DeepSpeed) and 1.6-2.2 (ZeRO-3) with glibc's default
# mmap threshold, and none with MALLOC_MMAP_THRESHOLD_ fixed.
CPU_ALLOCATOR_RETENTION = 1.0
CPU_ALLOCATOR_RETENTION_ZERO3 = 2.0
# CUDA adds its libraries (cuBLAS, cuDNN, NCCL) to every process's resident memory and a context
# with kernel images and workspaces to every GPU. Not measured here (no GPU in CI); published
# figures for torch 2.x on Hopper/Ampere are 0.5-0.9 GiB per context and 1.5-3 GiB of host RSS.
CUDA_CONTEXT_GPU_BYTES = int(0.75 * GIB)
CUDA_RUNTIME_HOST_BYTES = int(2.5 * GIB)

# ---- Activation coefficients (bench/activations.py, docs/memory.md "Activations"). -------------
# Bytes saved for backward per (token x hidden unit) by one block, measured with
# torch.autograd.graph.saved_tensors_hooks on FLUX blocks with FLUX's head dim (128) and 2-4 heads
# at 512^2 and 1024^2; linear in heads and tokens to within 4 %. Attention is the SDPA kernel
# (saves q, k, v, output and log-sum-exp, no tokens^2 matrix), as on GPUs with flash/mem-efficient.
SAVED_BYTES_PER_TOKEN_HIDDEN = {
    # compute dtype bytes -> (double-stream block, single-stream block, embedders and output)
    2: (56.1, 50.8, 4.0),
    4: (96.2, 85.5, 8.1),
}

# ---- Throughput assumptions for the time estimate (rough; see docs/memory.md "Time"). ----------
# Sustained training throughput in FLOP/s by GPU name (about 40 % of dense bf16 peak).
GPU_TRAINING_FLOPS = (
    ("H200", 400e12),
    ("H100", 380e12),
    ("B200", 800e12),
    ("A100", 125e12),
    ("L40S", 145e12),
    ("L40", 72e12),
    ("RTX 6000 Ada", 145e12),
    ("4090", 66e12),
    ("A6000", 62e12),
    ("A40", 60e12),
    ("3090", 28e12),
    ("A10", 50e12),
    ("L4", 48e12),
    ("A5000", 44e12),
    ("4080", 40e12),
)
DEFAULT_GPU_TRAINING_FLOPS = 40e12
# bf16 training on this CI machine's cores: 50-70 GFLOP/s per core in the least disturbed runs of
# bench/memory.py (a shared 2-core machine: the measured seconds per step vary 3x between runs).
CPU_FLOPS_PER_CORE = 50e9
# Python, accelerate and DeepSpeed bookkeeping per optimizer step: 0.3-2 s per step for the
# 135 k-parameter tiny model on a busy 2-core machine (bench/memory.py); a guess on GPUs.
STEP_OVERHEAD_SECONDS = {"cpu": 0.5, "cuda": 0.05}
PCIE_BYTES_PER_SECOND = 20e9
HOST_MEMCPY_BYTES_PER_SECOND = 5e9
NVME_BYTES_PER_SECOND = 2e9
# DeepSpeedCPUAdam: 50 M parameters in 0.036 s on 2 cores (bench/cpu_adam_threads.py), until host
# memory bandwidth caps it: it reads and writes fp32 weights, m and v, reads fp32 grads and
# writes 16-bit weights, about 30 bytes per parameter.
CPU_ADAM_PARAMS_PER_SECOND_PER_CORE = 0.7e9
CPU_ADAM_BYTES_PER_PARAM = 30
HOST_MEMORY_BYTES_PER_SECOND = 40e9
# torch.optim.AdamW (foreach) on the CPU: 0.62 s for the same 50 M parameters on this 2-core machine.
TORCH_ADAM_CPU_SLOWDOWN = 10.0
GPU_ADAM_PARAMS_PER_SECOND = 20e9
ZERO3_HOOK_OVERHEAD = 0.10  # per-module gather/release hooks on one GPU
DEADLINE_WARN_FRACTION = 0.8
# The time model is rough; refuse only when even a generous error cannot save the run.
DEADLINE_REFUSE_FACTOR = 1.5


@dataclass(frozen=True)
class Plan:
    accelerator: Literal["cuda", "cpu"]
    num_processes: int
    training_type: Literal["full", "lora"]
    use_deepspeed: bool
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    mixed_precision: Literal["bf16", "fp16", "no"]
    gradient_checkpointing: bool
    optimizer: str
    predicted_gpu_bytes: int
    predicted_host_bytes: int
    predicted_disk_bytes: int
    nvme_path: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    predicted_seconds_per_step: float | None = None
    # Text encoders and VAE run on the CPU while caching when they would not fit the GPU.
    cache_encoders_on_cpu: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["warnings"] = list(self.warnings)
        return data


# =================================================================================================
# The job, as the planner needs it
# =================================================================================================


@dataclass(frozen=True)
class JobShape:
    """The request fields the planner reads, with the names `TrainingRequest` uses, so a
    `JobShape` can stand in for a request (the CLI builds one from flags)."""

    training_type: str = "full"
    lora_rank: int = 16
    lora_target_modules: tuple[str, ...] | None = None
    zero_stage: int | str = "auto"
    offload: str = "auto"
    use_deepspeed: bool = True
    mixed_precision: str = "bf16"
    gradient_checkpointing: bool = True
    resolution: tuple[int, int] = (1024, 1024)
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    steps: int = 1000
    optimizer: str = "adamw"
    with_prior_preservation: bool = False
    num_class_images: int = 0
    num_instance_images: int = 0
    checkpointing_steps: int | None = None
    max_sequence_length: int = 512
    timeout_seconds: int | None = None

    @classmethod
    def from_request(cls, request: Any) -> JobShape:
        """Read a `TrainingRequest` (or anything with its attribute names) by attribute."""
        defaults = cls()
        targets = getattr(request, "lora_target_modules", None)
        with_prior = bool(getattr(request, "with_prior_preservation", False))
        return cls(
            training_type=str(getattr(request, "training_type", defaults.training_type)),
            lora_rank=int(getattr(request, "lora_rank", defaults.lora_rank)),
            lora_target_modules=tuple(targets) if targets else None,
            zero_stage=getattr(request, "zero_stage", defaults.zero_stage),
            offload=str(getattr(request, "offload", defaults.offload)),
            use_deepspeed=bool(getattr(request, "use_deepspeed", defaults.use_deepspeed)),
            mixed_precision=str(getattr(request, "mixed_precision", defaults.mixed_precision)),
            gradient_checkpointing=bool(getattr(request, "gradient_checkpointing", defaults.gradient_checkpointing)),
            resolution=_resolution(getattr(request, "resolution", defaults.resolution)),
            batch_size=int(getattr(request, "batch_size", defaults.batch_size)),
            gradient_accumulation_steps=int(
                getattr(request, "gradient_accumulation_steps", defaults.gradient_accumulation_steps)
            ),
            steps=int(getattr(request, "steps", defaults.steps)),
            optimizer=str(getattr(request, "optimizer", defaults.optimizer)),
            with_prior_preservation=with_prior,
            num_class_images=int(getattr(request, "num_class_images", 0) or 0) if with_prior else 0,
            num_instance_images=int(getattr(request, "num_instance_images", 0) or 0),
            checkpointing_steps=getattr(request, "checkpointing_steps", None),
            max_sequence_length=int(getattr(request, "max_sequence_length", defaults.max_sequence_length)),
            timeout_seconds=getattr(request, "timeout_seconds", None),
        )

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return self.lora_target_modules or DEFAULT_LORA_TARGETS

    @property
    def samples_per_micro_step(self) -> int:
        # Prior preservation concatenates a class image to every instance image.
        return self.batch_size * (2 if self.with_prior_preservation else 1)


def _resolution(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, str):
        width, _, height = value.lower().partition("x")
        return (int(width), int(height or width))
    width, height = value
    return (int(width), int(height))


# =================================================================================================
# Strategies and estimates
# =================================================================================================


@dataclass(frozen=True)
class Strategy:
    training_type: str
    use_deepspeed: bool
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload

    def describe(self) -> str:
        kind = "full fine-tune" if self.training_type == "full" else "LoRA"
        if not self.use_deepspeed:
            return f"{kind} without DeepSpeed"
        offloads = []
        if self.offload_optimizer != "none":
            offloads.append(f"optimizer to {self.offload_optimizer}")
        if self.offload_param != "none":
            offloads.append(f"parameters to {self.offload_param}")
        where = f", offload {' and '.join(offloads)}" if offloads else ", no offload"
        return f"{kind} with ZeRO-{self.zero_stage}{where}"


@dataclass(frozen=True)
class MemoryEstimate:
    gpu_bytes: int  # per GPU
    host_bytes: int  # the whole node (all processes)
    disk_bytes: int  # work dir plus offload swap
    nvme_bytes: int  # the part of disk_bytes that lives on the offload path
    breakdown: dict[str, int]
    cache_encoders_on_cpu: bool


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    estimate: MemoryEstimate
    seconds_per_step: float
    fits: bool
    reason: str
    lora_rank: int | None
    honours_request: bool
    relative_speed: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "training_type": self.strategy.training_type,
            "use_deepspeed": self.strategy.use_deepspeed,
            "zero_stage": self.strategy.zero_stage,
            "offload_optimizer": self.strategy.offload_optimizer,
            "offload_param": self.strategy.offload_param,
            "lora_rank": self.lora_rank,
            "fits": self.fits,
            "gpu_bytes": self.estimate.gpu_bytes,
            "host_bytes": self.estimate.host_bytes,
            "disk_bytes": self.estimate.disk_bytes,
            "seconds_per_step": round(self.seconds_per_step, 3),
            "relative_speed": round(self.relative_speed, 3),
            "honours_request": self.honours_request,
            "reason": self.reason,
            "breakdown": dict(self.estimate.breakdown),
        }


def strategies_for(training_type: str, use_deepspeed: bool, has_nvme: bool) -> list[Strategy]:
    """Every strategy worth considering, in the order ties are broken (simplest first)."""
    if not use_deepspeed:
        return [Strategy(training_type, False, 0, "none", "none")]
    layouts: list[tuple[int, Offload, Offload]] = [
        (2, "none", "none"),
        (2, "cpu", "none"),
        (3, "none", "none"),
        (3, "cpu", "none"),
        (3, "cpu", "cpu"),
    ]
    if has_nvme:
        # DeepSpeed offloads to NVMe only under ZeRO-3 (ZeRO-Infinity).
        layouts += [(3, "nvme", "none"), (3, "nvme", "cpu")]
        if training_type == "full":
            # A frozen LoRA base swapped to NVMe runs DeepSpeed 0.19 out of swap buffers under gradient
            # checkpointing (the trainer refuses it); LoRA's base fits in host RAM wherever FLUX trains anyway.
            layouts.append((3, "nvme", "nvme"))
    return [Strategy(training_type, True, stage, optimizer, param) for stage, optimizer, param in layouts]


def _requested_stage(job: JobShape) -> int | None:
    return None if job.zero_stage in (None, "auto") else int(job.zero_stage)


def honours_request(strategy: Strategy, job: JobShape) -> bool:
    """The request's `zero_stage` and `offload` (the optimizer's offload target) are honoured."""
    if strategy.training_type != job.training_type:
        return False
    if not strategy.use_deepspeed:
        return not job.use_deepspeed
    stage = _requested_stage(job)
    if stage is not None and stage != strategy.zero_stage:
        return False
    return job.offload in ("auto", strategy.offload_optimizer)


# ---- the memory model ----------------------------------------------------------------------------


def compute_dtype_bytes(mixed_precision: str) -> int:
    return 4 if mixed_precision == "no" else 2


def image_tokens(resolution: tuple[int, int]) -> int:
    """FLUX packs 2x2 patches of 8x-downsampled latents: one token per 16x16 pixels."""
    width, height = resolution
    return math.ceil(height / 16) * math.ceil(width / 16)


def activation_bytes(model: ModelSize, job: JobShape, mixed_precision: str) -> dict[str, int]:
    """Activation memory of one micro-step at its peak (docs/memory.md, "Activations").

    Without checkpointing the peak is at the start of backward: everything every block saved,
    plus the gradient flowing back. With checkpointing each block keeps only its inputs, and the
    peak is while the first block is recomputed and back-propagated: all inputs plus one block's
    full activations."""
    shape = model.transformer
    width = compute_dtype_bytes(mixed_precision)
    double, single, outer = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    tokens = image_tokens(job.resolution) + job.max_sequence_length
    token_hidden = tokens * shape.hidden_size
    samples = job.samples_per_micro_step
    inputs = (
        job.max_sequence_length * shape.joint_attention_dim + image_tokens(job.resolution) * shape.in_channels
    ) * width
    embedders = outer * token_hidden + inputs
    largest_block = max(double if shape.num_layers else 0.0, single if shape.num_single_layers else 0.0)
    if job.gradient_checkpointing:
        saved = shape.num_blocks * token_hidden * width
        working = largest_block * token_hidden
    else:
        saved = (shape.num_layers * double + shape.num_single_layers * single) * token_hidden
        working = 2 * token_hidden * width
    # Rotary tables (cos, sin in fp32) are shared by all blocks.
    rotary = 2 * tokens * shape.attention_head_dim * 4
    return {
        "activations_saved": int(samples * (saved + embedders) + rotary),
        "activations_working": int(samples * working),
    }


def trainable_params(model: ModelSize, training_type: str, lora_rank: int, targets: Sequence[str]) -> int:
    if training_type == "lora":
        return model.lora_params(lora_rank, targets)
    return model.transformer_params


# fp32 optimizer state per trainable parameter, besides the master weights: Adam's m and v; one buffer for
# Adagrad's sum, Lion's and SGD's momentum; Adafactor keeps a full second moment on ZeRO's flat partitions.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adagrad": 4, "lion": 4, "sgd": 4, "adafactor": 4}

# The class that steps each optimizer when DeepSpeed offloads it to the CPU (or NVMe).
OFFLOADED_OPTIMIZER_CLASSES = {
    "adamw": "DeepSpeedCPUAdam", "adam": "DeepSpeedCPUAdam", "adagrad": "DeepSpeedCPUAdagrad",
    "lion": "DeepSpeedCPULion", "sgd": "SGD", "adafactor": "Adafactor",
}
# Not offloaded: DeepSpeed builds its fused GPU kernels for its own types; torch's classes otherwise.
DEEPSPEED_GPU_OPTIMIZER_CLASSES = {"adamw": "FusedAdam", "adam": "FusedAdam", "lion": "FusedLion"}
TORCH_OPTIMIZER_CLASSES = {"adamw": "AdamW", "adam": "Adam", "adagrad": "Adagrad", "sgd": "SGD", "adafactor": "Adafactor"}


def optimizer_state_bytes(optimizer: str) -> int:
    return OPTIMIZER_STATE_BYTES.get(normalise_optimizer_name(optimizer), 8)


def model_state_bytes(
    strategy: Strategy,
    model: ModelSize,
    trainable: int,
    processes: int,
    width: int,
    on_cuda: bool = True,
    state: int = 8,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(device, host, disk) terms of the model states. DeepSpeed's estimators
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) without
    their 1.5x buffer factor — margins are applied once, in `fits` — extended to frozen weights
    (LoRA's base) and to NVMe. Device terms are per GPU, host and disk terms for the node. `state`: the
    optimizer's fp32 state bytes per trainable parameter (8 for Adam, as DeepSpeed's estimators assume)."""
    frozen = model.transformer_params if strategy.training_type == "lora" else 0
    n = processes
    # fp32 master weights exist only when training in 16 bits.
    master = 4 if width == 2 else 0
    # Per trainable parameter: 16-bit grads, fp32 grads, fp32 master, optimizer state (Adam: DeepSpeed's 18).
    partitioned_state = width + 4 + master + state if width == 2 else 4 + state
    offloaded_state = 4 + master + state if width == 2 else 4 + state  # fp32 grads, master, state on the host
    device: dict[str, int] = {}
    host: dict[str, int] = {}
    disk: dict[str, int] = {}
    if not strategy.use_deepspeed:
        # Plain accelerate: fp32 trainable weights under autocast, fp32 grads, Adam; frozen in
        # the compute dtype.
        device["trainable_weights_grads_optimizer"] = trainable * (8 + state)
        device["frozen_weights"] = frozen * width
        return device, host, disk
    stage = strategy.zero_stage
    if stage in (1, 2):
        device["weights_16bit"] = (trainable + frozen) * width
        if strategy.offload_optimizer == "none":
            if stage == 1:
                device["gradients"] = trainable * width
                device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
            else:
                device["optimizer_states_partition"] = trainable * partitioned_state // n
        else:
            host["optimizer_states_offloaded"] = trainable * offloaded_state
        # DeepSpeed allocates whole buckets: the CUDA allocator reserves them, while on the CPU only
        # the pages written (at most the trainable parameters) become resident. With overlap_comm
        # (CUDA only, see configs.py) the reduce bucket is double-buffered.
        if on_cuda:
            device["gradient_buckets"] = ZERO2_REDUCE_BUCKET_ELEMENTS * width * 2
            if n > 1:
                device["allgather_bucket"] = ZERO2_ALLGATHER_BUCKET_ELEMENTS * width
        else:
            device["gradient_buckets"] = min(trainable, ZERO2_REDUCE_BUCKET_ELEMENTS) * width
        return device, host, disk
    # ZeRO-3: the largest layer is gathered (weights and grads, 16-bit) while it computes.
    device["largest_layer_gathered"] = 4 * model.largest_layer_params
    reduce_bucket = ZERO3_REDUCE_BUCKET_ELEMENTS if on_cuda else min(trainable, ZERO3_REDUCE_BUCKET_ELEMENTS)
    prefetch = min(model.transformer_params, ZERO3_PREFETCH_BUCKET_ELEMENTS)
    device["zero3_buckets"] = (reduce_bucket + prefetch) * width
    weights_16bit = (trainable + frozen) * width
    if strategy.offload_param == "none":
        device["weights_16bit_partition"] = weights_16bit // n
    elif strategy.offload_param == "cpu":
        host["weights_16bit_offloaded"] = weights_16bit
    else:
        disk["weights_16bit_swapped"] = weights_16bit
        host["param_swap_buffers"] = PARAM_SWAP_BUFFER_COUNT * min(model.transformer_params, PARAM_SWAP_BUFFER_ELEMENTS) * width
        host["weights_16bit_kept_in_cpu"] = min(trainable + frozen, PARAMS_KEPT_IN_CPU_ELEMENTS) * width
    if strategy.offload_optimizer == "none":
        device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
    elif strategy.offload_optimizer == "cpu":
        host["optimizer_states_offloaded"] = trainable * offloaded_state
    else:
        # ZeRO-Infinity swaps the fp32 master and Adam states; fp32 gradients stay in host RAM.
        host["gradients_fp32"] = trainable * 4
        disk["optimizer_states_swapped"] = trainable * (master + state)
        # Pinned fp32 buffers of one sub-group each (configs.py: sub_group_size 1e9) for the master and state.
        host["optimizer_swap_buffers"] = OPTIMIZER_SWAP_BUFFER_COUNT * min(trainable, ZERO3_SUB_GROUP_ELEMENTS) * 4
    return device, host, disk


def estimate_memory(
    strategy: Strategy,
    model: ModelSize,
    job: JobShape,
    hardware: Hardware,
    mixed_precision: str,
) -> MemoryEstimate:
    """Predicted peak GPU (per GPU), host (node) and disk bytes of one strategy."""
    width = compute_dtype_bytes(mixed_precision)
    on_cpu = hardware.accelerator == "cpu"
    processes = 1 if on_cpu else max(1, hardware.gpu_count)
    trainable = trainable_params(model, strategy.training_type, job.lora_rank, job.lora_targets)
    state = optimizer_state_bytes(job.optimizer)
    device, host, disk = model_state_bytes(strategy, model, trainable, processes, width, on_cuda=not on_cpu, state=state)
    device.update(activation_bytes(model, job, mixed_precision))

    fixed_host = {
        "trainer_processes": processes
        * (TRAINER_PROCESS_BASELINE_BYTES + (DEEPSPEED_RUNTIME_BYTES if strategy.use_deepspeed else 0)),
        "launcher_process": LAUNCHER_PROCESS_BYTES,
    }
    if not on_cpu:
        fixed_host["cuda_runtime"] = processes * CUDA_RUNTIME_HOST_BYTES
        device["cuda_context"] = CUDA_CONTEXT_GPU_BYTES

    # Cached embeddings and latents stay in host RAM for the whole run.
    images = max(1, job.num_instance_images) + job.num_class_images
    latent_pixels = image_tokens(job.resolution) * model.transformer.in_channels
    per_image = (job.max_sequence_length * model.text_encoder_2_hidden_size + latent_pixels + 2 * 768) * width
    host["cached_embeddings"] = processes * images * per_image

    # Phase 1: caching. The text encoders load in the compute dtype, the VAE in fp32 (its latents
    # are the targets); they run on the GPU when they fit there, else on the CPU, and are freed.
    encoders = (model.text_encoder_params + model.text_encoder_2_params) * width + model.vae_params * 4
    gpu_limit = hardware.gpu_memory_bytes / (1 + GPU_MARGIN)
    cache_on_cpu = on_cpu or encoders + CUDA_CONTEXT_GPU_BYTES > gpu_limit
    caching_host = processes * encoders
    # Phase 2: loading the transformer. Under ZeRO-3 it is built partitioned (zero.Init) and the
    # weights are streamed in module by module, so no process ever holds all of it; otherwise every
    # process reads it into host RAM before it moves to the GPU (on the CPU accelerator it stays).
    loading_host = 0 if strategy.zero_stage == 3 else processes * model.transformer_params * width

    # Phase 4: export. The trainer saves and then reloads the trained weights to verify them while
    # the engine (and its offloaded states) is still alive: the reloaded copy plus the safetensors
    # pages it was read from are on the host.
    exported = trainable * width if strategy.training_type == "lora" else model.transformer_params * width
    export_transient = 2 * exported

    device_total = sum(device.values())
    activations = device["activations_saved"] + device["activations_working"]
    if on_cpu:
        # glibc raises its mmap threshold after large frees, so the buffers freed between steps
        # (activations, ZeRO-3's gathered parameters) stay in the heap: measured by bench/memory.py
        # as about the 16-bit weights once, twice under ZeRO-3.
        host["allocator_retention"] = (
            CPU_ALLOCATOR_RETENTION_ZERO3 if strategy.zero_stage == 3 else CPU_ALLOCATOR_RETENTION
        ) * model.transformer_params * width
        # Everything the GPU would hold lives in host RAM, next to the offloaded states.
        training_host = sum(host.values()) + device_total
        gpu_peak = 0
        host_phases = {
            "phase_caching": caching_host + host["cached_embeddings"],
            "phase_loading": loading_host,
            "phase_training": training_host,
            "phase_export": training_host - activations + export_transient,
        }
    else:
        training_host = sum(host.values())
        gpu_peak = max(device_total, 0 if cache_on_cpu else encoders + CUDA_CONTEXT_GPU_BYTES)
        host_phases = {
            "phase_caching": caching_host + host["cached_embeddings"],
            "phase_loading": loading_host + host["cached_embeddings"],
            "phase_training": training_host,
            "phase_export": training_host + export_transient,
        }
    host_peak = sum(fixed_host.values()) + max(host_phases.values())

    # Disk in the job directory: exported weights and one checkpoint at a time.
    disk_work = exported + images * per_image
    if job.checkpointing_steps:
        # One resumable checkpoint at a time: 16-bit weights, fp32 master and optimizer state of what trains.
        disk_work += trainable * (width + 4 + state)
    nvme = sum(disk.values())
    breakdown = {**{f"gpu.{k}": v for k, v in device.items()}, **{f"host.{k}": v for k, v in host.items()}}
    breakdown.update({f"host.{k}": v for k, v in fixed_host.items()})
    breakdown.update({f"host.{k}": v for k, v in host_phases.items()})
    breakdown.update({f"disk.{k}": v for k, v in disk.items()})
    breakdown["disk.exported_weights_and_cache"] = disk_work
    breakdown["trainable_params"] = trainable
    return MemoryEstimate(
        gpu_bytes=int(gpu_peak),
        host_bytes=int(host_peak),
        disk_bytes=int(disk_work + nvme),
        nvme_bytes=int(nvme),
        breakdown=breakdown,
        cache_encoders_on_cpu=cache_on_cpu and not on_cpu,
    )


# ---- the time model -----------------------------------------------------------------------------


def training_flops_per_sample(model: ModelSize, job: JobShape, training_type: str) -> float:
    """Forward 2*P*T, backward 4*P*T (2*P*T when weights are frozen: no weight gradients), plus a
    second forward under checkpointing; attention 4*T^2*D per block forward, twice that backward."""
    shape = model.transformer
    tokens = image_tokens(job.resolution) + job.max_sequence_length
    forward = 2 * model.transformer_params * tokens + 4 * tokens * tokens * shape.hidden_size * shape.num_blocks
    backward_factor = 2.0 if training_type == "full" else 1.0
    recompute = 1.0 if job.gradient_checkpointing else 0.0
    return forward * (1 + backward_factor + recompute)


def gpu_training_flops(hardware: Hardware) -> float:
    if not hardware.gpus:
        return CPU_FLOPS_PER_CORE * max(1, hardware.cpu_count)
    name = hardware.gpus[0].name.upper()
    for key, flops in GPU_TRAINING_FLOPS:
        if key.upper() in name:
            return flops
    return DEFAULT_GPU_TRAINING_FLOPS


def seconds_per_step(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, width: int
) -> float:
    """Estimated wall time of one optimizer step (gradient_accumulation_steps micro-steps)."""
    on_cpu = hardware.accelerator == "cpu"
    micro_steps = job.gradient_accumulation_steps
    compute = micro_steps * job.samples_per_micro_step * training_flops_per_sample(
        model, job, strategy.training_type
    ) / gpu_training_flops(hardware)
    if strategy.use_deepspeed and strategy.zero_stage == 3:
        compute *= 1 + ZERO3_HOOK_OVERHEAD
    link = HOST_MEMCPY_BYTES_PER_SECOND if on_cpu else PCIE_BYTES_PER_SECOND
    cores = max(1, hardware.cpu_count)
    transfer = 0.0
    cpu_adam = max(
        trainable / (CPU_ADAM_PARAMS_PER_SECOND_PER_CORE * cores),
        trainable * CPU_ADAM_BYTES_PER_PARAM / HOST_MEMORY_BYTES_PER_SECOND,
    )
    if strategy.offload_optimizer == "none":
        optimizer = cpu_adam * TORCH_ADAM_CPU_SLOWDOWN if on_cpu else trainable / GPU_ADAM_PARAMS_PER_SECOND
    else:
        optimizer = cpu_adam
        # Gradients go down and updated 16-bit weights come back once per optimizer step.
        transfer += 2 * trainable * width / link
        if strategy.offload_optimizer == "nvme":
            transfer += 2 * trainable * 12 / NVME_BYTES_PER_SECOND
    frozen = model.transformer_params if strategy.training_type == "lora" else 0
    weights = (trainable + frozen) * width
    passes = 3 if job.gradient_checkpointing else 2  # forward, (recompute,) backward
    if strategy.offload_param == "cpu":
        transfer += micro_steps * passes * weights / link
    elif strategy.offload_param == "nvme":
        transfer += micro_steps * passes * weights / NVME_BYTES_PER_SECOND
    return STEP_OVERHEAD_SECONDS[hardware.accelerator] + compute + optimizer + transfer


# =================================================================================================
# Choosing
# =================================================================================================


def effective_precision(job: JobShape, hardware: Hardware) -> tuple[str, list[str]]:
    precision = job.mixed_precision
    notes: list[str] = []
    if hardware.accelerator == "cpu" and precision == "fp16":
        notes.append("mixed_precision: fp16 is not reliable on DeepSpeed's CPU accelerator; using bf16")
        precision = "bf16"
    elif hardware.accelerator == "cuda" and precision == "bf16" and not hardware.bf16_supported:
        notes.append(
            f"mixed_precision: {hardware.gpus[0].name} has no bf16 support (compute capability < 8.0); "
            "using fp16, which FLUX may overflow"
        )
        precision = "fp16"
    return precision, notes


def _fit_reason(estimate: MemoryEstimate, hardware: Hardware) -> str:
    problems = []
    on_cpu = hardware.accelerator == "cpu"
    if not on_cpu and estimate.gpu_bytes * (1 + GPU_MARGIN) > hardware.gpu_memory_bytes:
        problems.append(
            f"needs ≈{format_bytes(estimate.gpu_bytes)} per GPU, has {format_bytes(hardware.gpu_memory_bytes)}"
        )
    if estimate.host_bytes * (1 + HOST_MARGIN) > hardware.host_available_bytes:
        problems.append(
            f"needs ≈{format_bytes(estimate.host_bytes)} host RAM, has "
            f"{format_bytes(hardware.host_available_bytes)} available"
        )
    work_disk = estimate.disk_bytes - estimate.nvme_bytes
    if work_disk * (1 + DISK_MARGIN) > hardware.disk_free_bytes:
        problems.append(
            f"needs ≈{format_bytes(work_disk)} disk at {hardware.work_dir}, has {format_bytes(hardware.disk_free_bytes)}"
        )
    if estimate.nvme_bytes and estimate.nvme_bytes * (1 + DISK_MARGIN) > (hardware.nvme_free_bytes or 0):
        problems.append(
            f"needs ≈{format_bytes(estimate.nvme_bytes)} at the offload path, has "
            f"{format_bytes(hardware.nvme_free_bytes or 0)}"
        )
    return "; ".join(problems)


def _shortfall(estimate: MemoryEstimate, hardware: Hardware) -> tuple[int, float]:
    """How far a candidate is from fitting: how many resources are short, then the worst
    need/available ratio — so a strategy short only of host RAM is closer than one short of both."""
    ratios = [estimate.host_bytes * (1 + HOST_MARGIN) / max(1, hardware.host_available_bytes)]
    if hardware.accelerator == "cuda":
        ratios.append(estimate.gpu_bytes * (1 + GPU_MARGIN) / max(1, hardware.gpu_memory_bytes))
    return sum(ratio > 1 for ratio in ratios), max(ratios)


def evaluate_candidates(
    request: Any, hardware: Hardware, model: ModelSize, *, include_alternatives: bool = True
) -> list[Candidate]:
    """Every strategy for this job on this machine, with predicted memory, time and fit. With
    `include_alternatives`, the other training type is evaluated too (LoRA at rank 16 for a full
    fine-tune), so a refusal can say what would fit instead."""
    job = request if isinstance(request, JobShape) else JobShape.from_request(request)
    precision, _ = effective_precision(job, hardware)
    width = compute_dtype_bytes(precision)
    has_nvme = bool(hardware.nvme_path)
    plans: list[tuple[Strategy, int]] = [
        (strategy, job.lora_rank) for strategy in strategies_for(job.training_type, job.use_deepspeed, has_nvme)
    ]
    if job.use_deepspeed and _requested_stage(job) is not None and _requested_stage(job) == 1:
        plans.insert(0, (Strategy(job.training_type, True, 1, "none", "none"), job.lora_rank))
        plans.insert(1, (Strategy(job.training_type, True, 1, "cpu", "none"), job.lora_rank))
    if include_alternatives:
        other = "lora" if job.training_type == "full" else "full"
        rank = ALTERNATIVE_LORA_RANK if other == "lora" else job.lora_rank
        plans += [(strategy, rank) for strategy in strategies_for(other, True, has_nvme)]
    candidates = []
    for strategy, rank in plans:
        shaped = replace(job, lora_rank=rank)
        estimate = estimate_memory(strategy, model, shaped, hardware, precision)
        trainable = estimate.breakdown["trainable_params"]
        reason = _fit_reason(estimate, hardware)
        candidates.append(
            Candidate(
                strategy=strategy,
                estimate=estimate,
                seconds_per_step=seconds_per_step(strategy, model, shaped, hardware, trainable, width),
                fits=not reason,
                reason=reason or "fits",
                lora_rank=rank if strategy.training_type == "lora" else None,
                honours_request=honours_request(strategy, job) and rank == job.lora_rank,
            )
        )
    fastest = min(candidate.seconds_per_step for candidate in candidates)
    return [replace(candidate, relative_speed=fastest / candidate.seconds_per_step) for candidate in candidates]


def pick(candidates: Iterable[Candidate]) -> Candidate | None:
    """The fastest candidate that honours the request and fits; ties go to the simpler one."""
    eligible = [candidate for candidate in candidates if candidate.honours_request and candidate.fits]
    if not eligible:
        return None
    return min(enumerate(eligible), key=lambda item: (round(item[1].seconds_per_step, 9), item[0]))[1]


def _describe_candidate(candidate: Candidate) -> str:
    text = candidate.strategy.describe()
    if candidate.lora_rank is not None:
        text = text.replace("LoRA", f"LoRA rank {candidate.lora_rank}", 1)
    return text


def job_variants(job: JobShape) -> list[tuple[str, JobShape]]:
    """Smaller versions of a job, in the order a person would try them."""
    variants = []
    if not job.gradient_checkpointing:
        variants.append(("gradient_checkpointing true", replace(job, gradient_checkpointing=True)))
    if job.batch_size > 1:
        variants.append(("batch_size 1", replace(job, batch_size=1, gradient_accumulation_steps=job.gradient_accumulation_steps * job.batch_size)))
    if max(job.resolution) > 512:
        variants.append(("resolution 512x512", replace(job, resolution=(512, 512))))
    return variants


def _fitting_variants(job: JobShape, hardware: Hardware, model: ModelSize) -> list[str]:
    found = []
    for change, variant in job_variants(job):
        candidate = pick(evaluate_candidates(variant, hardware, model, include_alternatives=False))
        if candidate is not None:
            found.append(f"{change} ({_describe_candidate(candidate)})")
    return found


def refusal_message(candidates: Sequence[Candidate], hardware: Hardware, model: ModelSize, job: JobShape) -> str:
    requested = [candidate for candidate in candidates if candidate.honours_request]
    closest = min(requested, key=lambda candidate: _shortfall(candidate.estimate, hardware))
    width, height = job.resolution
    kind = "full fine-tune" if job.training_type == "full" else f"LoRA rank {job.lora_rank}"
    if hardware.accelerator == "cpu":
        machine = (
            f"this worker has no GPU ({'; '.join(hardware.notes) or 'nvidia-smi found none'}), so everything "
            f"must fit in host RAM: {format_bytes(hardware.host_available_bytes)} available"
        )
    else:
        machine = (
            f"this worker has {hardware.gpu_count}x {format_bytes(hardware.gpu_memory_bytes)} GPU and "
            f"{format_bytes(hardware.host_available_bytes)} host RAM available"
        )
    message = (
        f"{kind} of {model.name} at {width}x{height}, batch {job.batch_size}, does not fit: {machine}. "
        f"Closest: {_describe_candidate(closest)} — {closest.reason}"
    )
    alternatives = [candidate for candidate in candidates if candidate.fits]
    variants = _fitting_variants(job, hardware, model)
    if variants:
        message += ". The same job fits with " + "; or ".join(variants[:2])
    if alternatives:
        best = sorted(alternatives, key=lambda candidate: candidate.seconds_per_step)[:2]
        message += ". Would fit: " + "; ".join(
            f"{_describe_candidate(candidate)} (≈{format_bytes(candidate.estimate.gpu_bytes)} GPU, "
            f"≈{format_bytes(candidate.estimate.host_bytes)} host)"
            for candidate in best
        )
        message += " — set training_type/zero_stage/offload accordingly"
    elif not variants:
        message += ". No strategy fits; use a larger GPU or more host RAM, lower the resolution or use LoRA"
    return message


def _deadline_check(candidate: Candidate, job: JobShape, deadline_seconds: float | None) -> list[str]:
    if not deadline_seconds:
        return []
    total = candidate.seconds_per_step * job.steps
    if total > deadline_seconds * DEADLINE_REFUSE_FACTOR:
        affordable = max(1, int(deadline_seconds / max(candidate.seconds_per_step, 1e-9)))
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"steps: {job.steps} steps at ≈{candidate.seconds_per_step:.1f} s/step with "
            f"{_describe_candidate(candidate)} take ≈{total / 3600:.1f} h, beyond the job deadline of "
            f"{deadline_seconds / 3600:.1f} h; use about {affordable} steps, LoRA, or a faster GPU",
            details={"estimated_seconds": round(total), "deadline_seconds": round(deadline_seconds)},
        )
    if total > deadline_seconds * DEADLINE_WARN_FRACTION:
        return [
            f"steps: the estimated run time (≈{total / 60:.0f} min at ≈{candidate.seconds_per_step:.1f} s/step) "
            f"is close to the job deadline ({deadline_seconds / 60:.0f} min); the run may time out"
        ]
    return []


def optimizer_for(strategy: Strategy, optimizer: str = "adamw") -> str:
    """The optimizer class that will step (what the trainer's metrics.optimizer reports)."""
    name = normalise_optimizer_name(optimizer)
    if strategy.offload_optimizer != "none":
        return OFFLOADED_OPTIMIZER_CLASSES.get(name, name)
    if strategy.use_deepspeed and name in DEEPSPEED_GPU_OPTIMIZER_CLASSES:
        return DEEPSPEED_GPU_OPTIMIZER_CLASSES[name]
    return TORCH_OPTIMIZER_CLASSES.get(name, name)


def choose_plan(
    request: Any,
    hardware: Hardware,
    model: ModelSize,
    *,
    deadline_seconds: float | None = None,
) -> Plan:
    """The fastest strategy that fits with a margin, or `does_not_fit` with the numbers and the
    nearest strategies that would fit. `request` is a TrainingRequest (read by attribute) or a
    JobShape. `deadline_seconds` defaults to the request's `timeout_seconds`."""
    job = request if isinstance(request, JobShape) else JobShape.from_request(request)
    precision, warnings = effective_precision(job, hardware)
    if not job.use_deepspeed and (job.zero_stage != "auto" or job.offload not in ("auto", "none")):
        warnings.append("zero_stage/offload are ignored because use_deepspeed is false")
    if not job.use_deepspeed:
        job = replace(job, zero_stage="auto", offload="auto")
    if (
        job.offload == "nvme" and not hardware.nvme_path
    ):
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            "offload: 'nvme' needs an offload directory on fast disk; set FLUXBOOTH_NVME_PATH on the "
            "worker, or use offload 'cpu' or 'auto'",
        )
    if job.offload == "nvme" and _requested_stage(job) in (1, 2):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            "offload: DeepSpeed offloads to NVMe only under ZeRO-3; set zero_stage to 3 or 'auto'",
        )
    candidates = evaluate_candidates(job, hardware, model)
    chosen = pick(candidates)
    if chosen is None:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            refusal_message(candidates, hardware, model, job),
            details={
                "gpu_memory_bytes": hardware.gpu_memory_bytes,
                "host_available_bytes": hardware.host_available_bytes,
                "alternatives": [
                    candidate.to_dict() for candidate in candidates if candidate.fits
                ][:3],
            },
        )
    deadline = deadline_seconds if deadline_seconds is not None else job.timeout_seconds
    warnings += _deadline_check(chosen, job, deadline)
    if chosen.estimate.cache_encoders_on_cpu:
        warnings.append(
            "the text encoders and VAE do not fit the GPU next to the CUDA context; embeddings and "
            "latents are cached on the CPU (slower start)"
        )
    return _plan_from(chosen, job, hardware, precision, warnings)


def _plan_from(candidate: Candidate, job: JobShape, hardware: Hardware, precision: str, warnings: list[str]) -> Plan:
    strategy = candidate.strategy
    on_cpu = hardware.accelerator == "cpu"
    return Plan(
        accelerator="cpu" if on_cpu else "cuda",
        num_processes=1 if on_cpu else hardware.gpu_count,
        training_type=strategy.training_type,  # type: ignore[arg-type]
        use_deepspeed=strategy.use_deepspeed,
        zero_stage=strategy.zero_stage,
        offload_optimizer=strategy.offload_optimizer,
        offload_param=strategy.offload_param,
        mixed_precision=precision,  # type: ignore[arg-type]
        gradient_checkpointing=job.gradient_checkpointing,
        optimizer=optimizer_for(strategy, job.optimizer),
        predicted_gpu_bytes=candidate.estimate.gpu_bytes,
        predicted_host_bytes=candidate.estimate.host_bytes,
        predicted_disk_bytes=candidate.estimate.disk_bytes,
        nvme_path=hardware.nvme_path if "nvme" in (strategy.offload_optimizer, strategy.offload_param) else None,
        warnings=tuple(warnings),
        predicted_seconds_per_step=round(candidate.seconds_per_step, 4),
        cache_encoders_on_cpu=candidate.estimate.cache_encoders_on_cpu,
    )


def plan_for_strategy(strategy: Strategy, request: Any, hardware: Hardware, model: ModelSize) -> Plan:
    """The plan for one given strategy with its predictions, without checking that it fits:
    for benchmarks and hand launches that must run a particular strategy."""
    job = request if isinstance(request, JobShape) else JobShape.from_request(request)
    job = replace(job, training_type=strategy.training_type)
    precision, warnings = effective_precision(job, hardware)
    estimate = estimate_memory(strategy, model, job, hardware, precision)
    trainable = estimate.breakdown["trainable_params"]
    candidate = Candidate(
        strategy=strategy,
        estimate=estimate,
        seconds_per_step=seconds_per_step(strategy, model, job, hardware, trainable, compute_dtype_bytes(precision)),
        fits=not _fit_reason(estimate, hardware),
        reason=_fit_reason(estimate, hardware) or "fits",
        lora_rank=job.lora_rank if strategy.training_type == "lora" else None,
        honours_request=True,
    )
    return _plan_from(candidate, job, hardware, precision, warnings)
