"""The memory estimate of one strategy: its terms summed per phase, with the fixed costs of the processes that
run them and the margins a plan must leave (docs/memory.md). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

from fluxbooth.host.hardware import GIB, Hardware
from fluxbooth.plan.host_buffers import (
    largest_trainable_parameter,
)
from fluxbooth.plan.memory.activations import (
    activation_bytes,
    compute_dtype_bytes,
    image_tokens,
    inference_activation_bytes,
)
from fluxbooth.plan.memory.model_states import ema_host_bytes, model_state_bytes
from fluxbooth.plan.memory.weights import (
    frozen_base_bytes,
    largest_quantised_layer_params,
    layer_being_quantised,
    optimizer_state_bytes,
    trainable_params,
)
from fluxbooth.plan.types import PHASES, JobShape, MemoryEstimate, Strategy
from fluxbooth.sizing import ModelSize

# ---- Safety margins: a plan fits when predicted * (1 + margin) <= available. -------------------
GPU_MARGIN = 0.10  # allocator fragmentation, cuDNN/cuBLAS workspaces we do not model
HOST_MARGIN = 0.10  # page cache, the handler's own memory (pinned buffers are charged as allocated)
DISK_MARGIN = 0.05

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
# The training report in the worker process: matplotlib, one decoded image and a sheet at a time.
REPORT_HOST_BYTES = 256 * 2**20
# The likeness scoring process (fluxbooth.likeness) after the trainer has exited, estimates: torch and transformers
# (about 1 GiB), DINOv2 and SigLIP in fp32 (about 1.2 GiB), dlib's models and one decoded image at a time; on a
# GPU its CUDA context and the two models' weights.
SCORING_HOST_BYTES = 3 * GIB
SCORING_GPU_BYTES = CUDA_CONTEXT_GPU_BYTES + int(1.25 * GIB)
CUDA_RUNTIME_HOST_BYTES = int(2.5 * GIB)
# The captioning process (fluxbooth.captions) before the trainer starts, estimates: torch and transformers (about
# 1 GiB) and the captioner's weights while they load; on a GPU its CUDA context, the bf16 weights and a batch's
# activations and KV cache (8 photos at 512², about 0.5 GiB).
CAPTIONING_LIBRARY_HOST_BYTES = GIB
CAPTIONING_BATCH_GPU_BYTES = GIB // 2


def cached_bytes(model: ModelSize, job: JobShape, width: int) -> int:
    """What the trainer caches: the VAE posterior's mean and std in fp32 of every instance sample in its
    shape and of every class image in each shape (prior preservation pairs them), and (upper bound: every
    image may carry its own caption) one prompt's T5 sequence and CLIP pooled embedding per image."""

    def latent_bytes(shape: tuple[int, int]) -> int:
        # With Kontext's pairs the control image's latents too (a bound: only their mean is kept).
        return 2 * 4 * image_tokens(shape) * model.transformer.in_channels * model.sequence_images

    latents = sum(samples * latent_bytes(shape) for shape, samples in job.training_mix)
    latents += job.num_class_images * sum(latent_bytes(shape) for shape, _ in job.training_mix)
    prompt = (
        job.max_sequence_length * model.text_encoder_2_hidden_size + model.transformer.pooled_projection_dim
    ) * width
    return latents + (job.num_instance_images + job.num_class_images) * prompt


def encoder_bytes(model: ModelSize, width: int) -> int:
    """The text encoders in the compute dtype and the VAE in fp32 (its latents are the targets)."""
    return (model.text_encoder_params + model.text_encoder_2_params) * width + model.vae_params * 4


def _fixed_host(strategy: Strategy, processes: int, on_cpu: bool) -> dict[str, int]:
    fixed = {
        "trainer_processes": processes
        * (TRAINER_PROCESS_BASELINE_BYTES + (DEEPSPEED_RUNTIME_BYTES if strategy.use_deepspeed else 0)),
        "launcher_process": LAUNCHER_PROCESS_BYTES,
    }
    if not on_cpu:
        fixed["cuda_runtime"] = processes * CUDA_RUNTIME_HOST_BYTES
    return fixed


def _loading_host(strategy: Strategy, model: ModelSize, processes: int, width: int, on_cpu: bool) -> int:
    """Host bytes while the transformer loads. Under ZeRO-3 it is built partitioned (zero.Init) and streamed
    in module by module; a quantised base is quantised layer by layer as it loads, so one layer in the
    compute dtype is the most the host holds of it (on the CPU accelerator the quantiser's working copies
    too, and the base as stored); otherwise every process reads it whole into host RAM before it moves to
    the GPU (on the CPU accelerator it stays)."""
    if strategy.zero_stage == 3 and strategy.use_deepspeed:
        return 0
    if strategy.block_swap:
        # Built in host RAM tensor by tensor (quantised there), where its blocks stay.
        stored = sum(frozen_base_bytes(model, strategy.base_precision, width).values())
        in_flight = (
            layer_being_quantised(model, strategy.base_precision, width)
            if strategy.quantised
            else model.largest_layer_params * width
        )
        return processes * (stored + in_flight)
    if strategy.quantised and on_cpu:
        stored = sum(frozen_base_bytes(model, strategy.base_precision, width).values())
        return processes * (stored + layer_being_quantised(model, strategy.base_precision, width))
    if strategy.quantised:
        return processes * model.largest_layer_params * width
    return processes * model.transformer_params * width


def _inference_gpu(device: dict[str, int], activations: int, inference: int) -> int:
    """GPU peak of a render (class images, validation) with the training transformer: its states stay
    allocated (renders during training), the training activations are replaced by one block's."""
    return sum(device.values()) - activations + inference


def _cpu_allocator_retention(strategy: Strategy, model: ModelSize, width: int) -> float:
    """glibc raises its mmap threshold after large frees, so the buffers freed between steps (activations,
    ZeRO-3's gathered parameters) stay in the heap: measured by bench/memory.py as about the 16-bit weights
    once, twice under ZeRO-3."""
    retention = CPU_ALLOCATOR_RETENTION_ZERO3 if strategy.zero_stage == 3 else CPU_ALLOCATOR_RETENTION
    return retention * model.transformer_params * width


def estimate_memory(
    strategy: Strategy,
    model: ModelSize,
    job: JobShape,
    hardware: Hardware,
    mixed_precision: str,
) -> MemoryEstimate:
    """Predicted peak GPU (per GPU), host (node) and disk bytes of one strategy, and of each phase."""
    width = compute_dtype_bytes(mixed_precision)
    on_cpu = hardware.accelerator == "cpu"
    processes = 1 if on_cpu else max(1, hardware.gpu_count)
    device, training_terms, disk, trainable, state = _training_terms(
        strategy, model, job, processes, mixed_precision, on_cpu
    )
    # Float: the allocator's retention below is a measured fraction of the weights, not whole bytes.
    host: dict[str, float] = dict(training_terms)
    fixed_host = _fixed_host(strategy, processes, on_cpu)
    encoders = encoder_bytes(model, width)
    gpu_limit = hardware.gpu_memory_bytes / (1 + GPU_MARGIN)
    cache_on_cpu = on_cpu or encoders + CUDA_CONTEXT_GPU_BYTES > gpu_limit
    exported = trainable * width if strategy.training_type == "lora" else model.transformer_params * width
    # Export: the trainer saves and then reloads the trained weights to verify them while the engine
    # (and its offloaded states) is still alive: the reloaded copy plus the safetensors pages it was
    # read from are on the host.
    export_transient = 2 * exported
    activations = device["activations_saved"] + device["activations_working"]
    inference = inference_activation_bytes(model, job, mixed_precision)
    renders = _inference_gpu(device, activations, inference)
    loading_host = _loading_host(strategy, model, processes, width, on_cpu)
    if on_cpu:
        host["allocator_retention"] = _cpu_allocator_retention(strategy, model, width)
        # Everything the GPU would hold lives in host RAM, next to the offloaded states.
        training_host = sum(host.values()) + sum(device.values())
        phase_gpu = dict.fromkeys(PHASES, 0)
        render_host = training_host - activations + inference
        export_host = training_host - activations + export_transient
    else:
        training_host = sum(host.values())
        phase_gpu = _gpu_phases(strategy, model, job, device, width, renders - inference, renders)
        if not cache_on_cpu:
            phase_gpu["caching"] = encoders + CUDA_CONTEXT_GPU_BYTES
        render_host = training_host
        # A LoRA exports while the engine lives (train/export/stage.exports_before_release); a full fine-tune
        # after its release.
        released = 0 if strategy.training_type == "lora" else pinned_blocks_bytes(host)
        export_host = training_host - released + export_transient
    phase_host = {
        "captioning": CAPTIONING_LIBRARY_HOST_BYTES + job.captioner_bytes if job.captioner_bytes else 0,
        "loading": loading_host + (0 if on_cpu else host["cached_embeddings"]),
        "caching": processes * encoders + host["cached_embeddings"],
        "class_images": render_host if job.num_class_images else 0,
        "training": training_host,
        "validation": render_host if job.validation_prompts else 0,
        "export": export_host,
        "scoring": SCORING_HOST_BYTES,
        # The trainer has exited: the worker alone, drawing (bench/dataset_checks.py: 115 MiB at its peak).
        "report": REPORT_HOST_BYTES,
    }
    fixed = sum(fixed_host.values())
    # The breakdown's phase figures leave out the fixed costs it lists (never negative, as for a phase that never runs).
    own_phase_host = phase_host
    phase_host = _with_fixed_costs(phase_host, fixed, job)
    exported_files = exported * (2 if job.ema else 1)
    disk_work = _work_disk(exported_files, cached_bytes(model, job, width), trainable, width, state, job)
    nvme = sum(disk.values())
    breakdown = _breakdown(device, {**host, **fixed_host}, own_phase_host, disk)
    breakdown["disk.exported_weights_and_cache"] = disk_work
    breakdown["trainable_params"] = trainable
    return MemoryEstimate(
        gpu_bytes=int(max(phase_gpu.values())),
        host_bytes=int(max(phase_host.values())),
        disk_bytes=int(disk_work + nvme),
        nvme_bytes=int(nvme),
        breakdown=breakdown,
        cache_encoders_on_cpu=cache_on_cpu and not on_cpu,
        phase_gpu_bytes={name: int(value) for name, value in phase_gpu.items()},
        phase_host_bytes={name: int(value) for name, value in phase_host.items()},
    )


def _training_terms(
    strategy: Strategy, model: ModelSize, job: JobShape, processes: int, mixed_precision: str, on_cpu: bool
) -> tuple[dict[str, int], dict[str, int], dict[str, int], int, int]:
    """(device, host, disk) terms of a training step, the trainable parameters and the optimizer's state bytes
    per parameter."""
    width = compute_dtype_bytes(mixed_precision)
    # A hand-built shape without targets gets its model family's (FLUX.2 names its layers differently from FLUX.1).
    targets = job.lora_targets or model.default_lora_targets
    trainable = trainable_params(model, strategy.training_type, job.lora_rank, targets)
    state = optimizer_state_bytes(job.optimizer)
    largest = largest_trainable_parameter(model, strategy.training_type, job.lora_rank, targets)
    device, host, disk = model_state_bytes(
        strategy, model, trainable, processes, width, not on_cpu, state, largest, (job.lora_rank, targets)
    )
    device.update(activation_bytes(model, job, mixed_precision, strategy.checkpoint_every))
    if strategy.quantised:
        # Each quantised Linear is dequantised to the compute dtype for its matmul, forward and backward.
        device["dequantised_layer"] = 2 * largest_quantised_layer_params(model) * width
    if not on_cpu:
        device["cuda_context"] = CUDA_CONTEXT_GPU_BYTES
    # Cached embeddings and latents stay in host RAM for the whole run.
    host["cached_embeddings"] = processes * cached_bytes(model, job, width)
    if job.ema:
        host.update(ema_host_bytes(trainable, largest, width))
    return device, host, disk, trainable, state


def _gpu_phases(
    strategy: Strategy,
    model: ModelSize,
    job: JobShape,
    device: dict[str, int],
    width: int,
    weights_on_gpu: int,
    renders: int,
) -> dict[str, int]:
    """GPU bytes of each phase on a CUDA node, caching left at 0 (on the GPU only when the encoders fit there)."""
    return {
        "captioning": (
            CUDA_CONTEXT_GPU_BYTES + job.captioner_bytes + CAPTIONING_BATCH_GPU_BYTES if job.captioner_bytes else 0
        ),
        "loading": weights_on_gpu - training_only_bytes(device) + layer_being_loaded(model, strategy, width),
        "caching": 0,
        "class_images": renders if job.num_class_images else 0,
        "training": sum(device.values()),
        "validation": renders if job.validation_prompts else 0,
        "export": weights_on_gpu,
        "scoring": SCORING_GPU_BYTES if job.likeness else 0,
        "report": 0,
    }


def _breakdown(
    device: dict[str, int], host: dict[str, float], phase_host: dict[str, float], disk: dict[str, int]
) -> dict[str, float]:
    """The estimate's terms by name (docs/memory.md): `gpu.`, `host.` (with each phase's own figure) and `disk.`."""
    breakdown = {**{f"gpu.{k}": v for k, v in device.items()}, **{f"host.{k}": v for k, v in host.items()}}
    breakdown.update({f"host.phase_{k}": v for k, v in phase_host.items()})
    breakdown.update({f"disk.{k}": v for k, v in disk.items()})
    return breakdown


# Phases the worker runs while no trainer process is alive: captioning before it starts, the rest after it exits.
OUTSIDE_TRAINER_PHASES = frozenset({"captioning", "scoring", "report"})


def _with_fixed_costs(phase_host: dict[str, float], fixed: float, job: JobShape) -> dict[str, float]:
    """The trainer's fixed costs count in every phase it runs; a phase the job skips costs nothing, and the
    report is drawn after the trainer has exited."""
    runs = {
        "captioning": job.captioner_bytes,
        "class_images": job.num_class_images,
        "validation": job.validation_prompts,
        "scoring": job.likeness,
    }
    return {
        name: 0 if not runs.get(name, True) else value + (0 if name in OUTSIDE_TRAINER_PHASES else fixed)
        for name, value in phase_host.items()
    }


def pinned_blocks_bytes(host: Mapping[str, float]) -> float:
    """The block-swapped model's blocks in pinned host RAM: they are the model's own tensors, freed with it
    before a full fine-tune's export reloads what was saved (train/export/stage.release_engine;
    metrics.alive_at_export)."""
    return host.get("frozen_blocks_pinned", 0) + host.get("trained_blocks_pinned", 0)


def training_only_bytes(device: dict[str, int]) -> int:
    """Device terms that exist only once training runs: optimizer partitions, gradients, buckets, the
    dequantised layer."""
    transient = (
        "optimizer_states_partition",
        "gradients",
        "gradient_buckets",
        "allgather_bucket",
        "zero3_buckets",
        "trainable_weights_grads_optimizer",
        "dequantised_layer",
        "optimizer_states_factored",
        "fused_step_working",
    )
    return sum(device.get(name, 0) for name in transient)


def layer_being_loaded(model: ModelSize, strategy: Strategy, width: int) -> int:
    """GPU bytes beyond the loaded weights while loading: one layer in the compute dtype on its way to the
    GPU, and for a quantised base the quantiser's working copies of it (it quantises on the GPU; block-swapped,
    on the host)."""
    if strategy.quantised and not strategy.block_swap:
        return layer_being_quantised(model, strategy.base_precision, width)
    return model.largest_layer_params * width


def _work_disk(exported: int, cached: int, trainable: int, width: int, state: int, job: JobShape) -> int:
    """Disk in the job directory: exported weights, the cache, and one resumable checkpoint at a time
    (16-bit weights, fp32 master and optimizer state of what trains); with keep_best_step the LoRA of every
    validation step too."""
    disk = exported * (1 + (job.validation_rounds_during_training if job.keep_best_step else 0)) + cached
    if job.checkpointing_steps:
        disk += trainable * (width + 4 + state)
    return disk
