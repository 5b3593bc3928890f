"""The time model: seconds per optimizer step and seconds per phase (rough, for ranking and deadlines).

docs/memory.md "Time" writes the formulas down. GPU numbers are datasheet peaks times efficiency factors
fitted to other trainers' published FLUX.1 LoRA step times (docs/published_timings.md), not measurements of
fluxbooth; CPU numbers were measured on the CI machine by bench/. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from fluxbooth.contract.budgets import MAX_SCORED_PHOTOS, MAX_SHEET_IMAGES, MAX_SHOWN_ROUNDS
from fluxbooth.contract.captioning import DEFAULT_CAPTION_MODEL_BYTES
from fluxbooth.contract.names import FIXED_NOISE_IMAGES, FIXED_NOISE_SIGMAS
from fluxbooth.contract.precision import is_quantised_layer
from fluxbooth.host.hardware import Hardware
from fluxbooth.plan.ema import ema_update_seconds
from fluxbooth.plan.flops import forward_flops, recomputed_flops, training_flops_per_sample
from fluxbooth.plan.gpus import UNKNOWN_GPU, GpuSpec, gpu_spec, pcie_link_bytes_per_second
from fluxbooth.plan.memory import compute_dtype_bytes, frozen_block_bytes
from fluxbooth.plan.types import JobShape, Strategy
from fluxbooth.sizing import ModelSize

# Sustained share of the datasheet's dense bf16 peak a FLUX step reaches (large matmuls, flash attention),
# and share of the datasheet memory bandwidth the dequantising element-wise ops reach: fitted by
# bench/fit_gpu_timing.py to published FLUX.1 LoRA step times (docs/published_timings.md), with the FLOPs each
# Linear really does (forward_flops: no 2*P*T for the modulation, each double-stream weight on its own stream).
# That fit holds for the cards it was fitted on (RTX 4090, T4: ratio of peak FLOPs to memory bandwidth near A100's
# and the other Ampere and Ada cards', which use it too).
GPU_EFFICIENCY = 0.475
# Hopper and Blackwell data-centre cards (H100, H200, B200): not fitted, an estimate. The one published H100 step
# time (0.5 s, SimpleTuner #1033) ran torch.compile and FlashAttention 3; this trainer runs eager PyTorch with SDPA's
# FlashAttention 2 kernels, which reach about 35 % of an H100's bf16 peak against FlashAttention 3's 75 %
# (FlashAttention 3 paper), and its element-wise ops (norms, modulation, rotary, GELU) are memory bound on a card
# with twice the 4090's FLOPs per byte of bandwidth. 0.36 of the peak is 0.475 scaled by the share of peak cuBLAS's
# bf16 GEMMs reach on an H100 against a 4090 (about 0.6 against 0.8); until a fluxbooth run on one measures it, the
# H100 times are predictions about 1.4x slower than the published compiled run.
DATACENTER_GPU_EFFICIENCY = 0.36
DATACENTER_GPUS = ("H100", "H200", "B200")
DEQUANTISE_BANDWIDTH_EFFICIENCY = 0.32
# Pinned host-to-GPU copies reach about 20 of PCIe gen4 x16's 32 GB/s per direction.
PCIE_EFFICIENCY = 0.625
# bf16 training on this CI machine's cores: 50-70 GFLOP/s per core in the least disturbed runs of
# bench/memory.py (a shared 2-core machine: the measured seconds per step vary 3x between runs).
CPU_FLOPS_PER_CORE = 50e9
# Python, accelerate and DeepSpeed bookkeeping per optimizer step: 0.3-2 s per step for the
# 135 k-parameter tiny model on a busy 2-core machine (bench/memory.py); a guess on GPUs.
STEP_OVERHEAD_SECONDS = {"cpu": 0.5, "cuda": 0.05}
HOST_MEMCPY_BYTES_PER_SECOND = 5e9
NVME_BYTES_PER_SECOND = 2e9
# Reading the model at load time and writing the exports: a guess for RunPod's container disk and
# network volumes (not measured here).
DISK_READ_BYTES_PER_SECOND = 1e9
DISK_WRITE_BYTES_PER_SECOND = 1e9
# DeepSpeedCPUAdam: 50 M parameters in 0.036 s on 2 cores (bench/cpu_adam_threads.py), until host
# memory bandwidth caps it: it reads and writes fp32 weights, m and v, reads fp32 grads and
# writes 16-bit weights, about 30 bytes per parameter.
CPU_ADAM_PARAMS_PER_SECOND_PER_CORE = 0.7e9
CPU_ADAM_BYTES_PER_PARAM = 30
HOST_MEMORY_BYTES_PER_SECOND = 40e9
# torch.optim.AdamW (foreach) on the CPU: 0.62 s for the same 50 M parameters on this 2-core machine.
TORCH_ADAM_CPU_SLOWDOWN = 10.0
GPU_ADAM_PARAMS_PER_SECOND = 20e9
# Adafactor fused into the backward pass (train/fused_adafactor.py), per parameter: on a GPU its memory traffic,
# counted from the ops (each reads its inputs and writes its output): the fp32 copies of weight and gradient
# (12 bytes), Adafactor.step's squared gradient, factored estimate, scaling and update (about 60), the stochastic
# rounding and the bf16 write-back (about 28): ~100 bytes, not measured on a GPU. On the CPU measured by timing
# the hooks on bench/memory.py's scaled transformer (71 M parameters, 2 busy cores): 32-52 ns per parameter.
FUSED_ADAFACTOR_TRAFFIC_BYTES = 100
FUSED_ADAFACTOR_CPU_PARAMS_PER_SECOND_PER_CORE = 12e6
ZERO3_HOOK_OVERHEAD = 0.10  # per-module gather/release hooks on one GPU
# GPU memory traffic per quantised weight and pass to rebuild it for a bf16 matmul, counted from
# fluxbooth.train.quantize's ops (each op reads its inputs from and writes its output to GPU memory):
# fp8: cast the codes (read 1, write 2), multiply by the row scales (read 2, write 2), the matmul reads the
# 2 again: 9 bytes. nf4: widen the packed bytes to int32 (read 0.5, write 2), look up the value pairs (read
# 2, write 2), multiply by the block absmax (read 2, write 2), the matmul reads the 2 again: 12.5 bytes.
DEQUANTISE_TRAFFIC_BYTES = {"fp8": 9.0, "nf4": 12.5}
# Quantising the frozen base on the CPU while loading (train/model.py builds a block-swapped base in host RAM,
# quantised there; without a GPU everything is): nanoseconds of one thread per quantised weight, the trainer's
# own layers, the 1-thread rows of bench/quantise_cpu.py (bench/RESULTS.md, "Quantising a frozen base on the
# CPU": AMD EPYC, 2 cores shared with a CI run, torch 2.13 CPU). Charged as weights x ns / threads.
CPU_QUANTISE_NS_PER_WEIGHT_THREAD = {"fp8": 16.5, "nf4": 53.8}
# The FLUX VAE (AutoencoderKL, 128-256-512-512 channels): its 3x3 convolutions cost about 4 MFLOP per
# pixel to encode and 9 MFLOP per pixel to decode, counted layer by layer from the config's layout.
VAE_ENCODE_FLOPS_PER_PIXEL = 4e6
VAE_DECODE_FLOPS_PER_PIXEL = 9e6
# The training report, on the worker's CPU after training (bench/dataset_checks.py, a shared 2-core machine):
# 1.4 s whatever the run (matplotlib, the loss curve, empty sheets); 36 to 66 ns per pixel of each image it decodes
# and scales (the contact sheet's images, the shown renders) in two runs under load, the slower one used; 75 us
# of CPU per step (history and event file).
# learning_check: the trainer's loss at fixed noise (train/loop.py fixed_noise_loss), 4 images at 3 sigmas before
# training and again after it: no-grad forward passes of one sample, each about a third of one sample's training
# (a backward costs about two forwards).
LEARNING_CHECK_FORWARD_PASSES = 2 * FIXED_NOISE_IMAGES * len(FIXED_NOISE_SIGMAS)
FORWARD_SHARE_OF_TRAINING = 1 / 3
# Likeness scoring (fluxbooth.likeness, its own process after the trainer has exited): estimates, not measured
# yet. Per job, the process's start and its models' load (torch and transformers imported, dlib's face models
# read, DINOv2 and SigLIP of about 0.1 and 0.2 B parameters read from disk): about 20 s. Per image it embeds (each
# training photo once, at most MAX_SCORED_PHOTOS of them, each render of each scored round): dlib's HOG face detector on a ~1 MP image is about 0.3 s
# on one CPU core, a face descriptor 0.05 s, DINOv2 and SigLIP about 0.3 s more on the CPU together: about 1 s.
SCORING_MODEL_LOAD_SECONDS = 20.0
SCORING_SECONDS_PER_IMAGE = 1.0
# Captioning (fluxbooth.captions, its own process before the trainer): estimates, not measured yet. The process's
# start (torch and transformers imported) about 15 s, then the captioner's bf16 weights read from disk. Per photo,
# batched 8 at a time on the GPU: the default 2 B decoder writes its ≤ CAPTION_MAX_NEW_TOKENS tokens for a batch in about 2-3 s,
# so about 0.4 s a photo; on a CPU the same decoder is about 50x slower per token.
CAPTIONING_START_SECONDS = 15.0
CAPTIONING_SECONDS_PER_IMAGE = {"cuda": 0.4, "cpu": 20.0}
REPORT_FIXED_SECONDS = 1.5
REPORT_SECONDS_PER_PIXEL = 66e-9
REPORT_SECONDS_PER_STEP = 1e-4


def gpu_spec_for(hardware: Hardware) -> tuple[GpuSpec, bool]:
    """(the spec used, whether the card is in the table)."""
    if not hardware.gpus:
        return UNKNOWN_GPU, True
    spec = gpu_spec(hardware.gpus[0].name)
    return (spec, True) if spec is not None else (UNKNOWN_GPU, False)


def gpu_efficiency(spec: GpuSpec) -> float:
    """The share of `spec`'s bf16 peak a FLUX step sustains: its class's (GPU_EFFICIENCY, DATACENTER_GPU_EFFICIENCY)."""
    return DATACENTER_GPU_EFFICIENCY if spec.name.startswith(DATACENTER_GPUS) else GPU_EFFICIENCY


def sustained_flops(hardware: Hardware) -> float:
    if not hardware.gpus:
        return CPU_FLOPS_PER_CORE * max(1, hardware.cpu_count)
    spec = gpu_spec_for(hardware)[0]
    return spec.bf16_flops * gpu_efficiency(spec)


def host_link_bytes_per_second(hardware: Hardware) -> float:
    """The host link's sustained rate: the datasheet's x16 link, or the link NVML reports (hardware.pcie_link)
    when it is narrower or older (a card in an x8 slot, a gen4 board under a gen5 card)."""
    if not hardware.gpus:
        return HOST_MEMCPY_BYTES_PER_SECOND
    datasheet = gpu_spec_for(hardware)[0].pcie_bytes_per_second
    gpu = hardware.gpus[0]
    measured = None
    if gpu.pcie_generation is not None and gpu.pcie_width is not None:
        measured = pcie_link_bytes_per_second(gpu.pcie_generation, gpu.pcie_width)
    return (datasheet if measured is None else min(datasheet, measured)) * PCIE_EFFICIENCY


@lru_cache(maxsize=64)
def quantised_elements(model: ModelSize) -> int:
    return sum(
        layer.in_features * layer.out_features for layer in model.linear_layers if is_quantised_layer(layer.name)
    )


def dequantise_pass_seconds(strategy: Strategy, model: ModelSize, hardware: Hardware) -> float:
    """Seconds one pass over a quantised base spends rebuilding its weights in the compute dtype: memory
    bound, at DEQUANTISE_BANDWIDTH_EFFICIENCY of the datasheet bandwidth."""
    if not strategy.quantised:
        return 0.0
    if hardware.gpus:
        bandwidth = gpu_spec_for(hardware)[0].memory_bytes_per_second * DEQUANTISE_BANDWIDTH_EFFICIENCY
    else:
        bandwidth = HOST_MEMORY_BYTES_PER_SECOND
    return quantised_elements(model) * DEQUANTISE_TRAFFIC_BYTES[strategy.base_precision] / bandwidth


def cpu_quantise_seconds(strategy: Strategy, model: ModelSize, hardware: Hardware) -> float:
    """Seconds loading spends quantising the base on the CPU: a quantised base that is block-swapped (built in
    host RAM) or on a machine without a GPU; 0 where the GPU quantises it, or for bf16. Each process quantises
    its own copy at once, on its share of the cores (the threads job/launch_files.py gives each process)."""
    if not strategy.quantised or (hardware.gpus and not strategy.block_swap):
        return 0.0
    threads = max(1, hardware.cpu_count // max(1, hardware.gpu_count))
    nanoseconds = quantised_elements(model) * CPU_QUANTISE_NS_PER_WEIGHT_THREAD[strategy.base_precision]
    return nanoseconds * 1e-9 / threads


def streaming_pass_seconds(
    strategy: Strategy, model: ModelSize, hardware: Hardware, width: int, trainable: int
) -> float:
    """Seconds one pass spends streaming offloaded weights to the GPU (ZeRO-3 parameter offload)."""
    frozen = model.transformer_params if strategy.training_type == "lora" else 0
    if strategy.offload_param == "cpu":
        return (trainable + frozen) * width / host_link_bytes_per_second(hardware)
    if strategy.offload_param == "nvme":
        return (trainable + frozen) * width / NVME_BYTES_PER_SECOND
    return 0.0


def exposed_swap_seconds(
    strategy: Strategy,
    model: ModelSize,
    hardware: Hardware,
    width: int,
    passes: int,
    hidden_behind: float,
    write_backs: int = 0,
) -> float:
    """What block swapping adds to `passes` passes over the base: each pass streams every block over the host
    link while the blocks before it compute, so only what the compute (`hidden_behind` seconds) cannot hide
    shows, plus each pass's first block, which has nothing to hide behind. `write_backs`: backward passes after
    which every trained block goes back to the host (the fused full fine-tune), on the same copy stream."""
    if not strategy.block_swap:
        return 0.0
    blocks = frozen_block_bytes(model, strategy.base_precision, width)
    link = host_link_bytes_per_second(hardware)
    every_block = sum(blocks.values()) / link
    first_block = max(blocks.values(), default=0.0) / link
    return max(0.0, (passes + write_backs) * every_block - hidden_behind) + passes * first_block


def base_pass_seconds(strategy: Strategy, model: ModelSize, hardware: Hardware, width: int, trainable: int) -> float:
    """Seconds one pass over the frozen base costs beyond the matmuls: dequantising a quantised base, and
    streaming offloaded weights to the GPU."""
    return dequantise_pass_seconds(strategy, model, hardware) + streaming_pass_seconds(
        strategy, model, hardware, width, trainable
    )


def fused_adafactor_seconds(hardware: Hardware, trainable: int) -> float:
    """The fused pass's Adafactor steps of one optimizer step: memory bound on a GPU (element-wise kernels at
    the share of the bandwidth DEQUANTISE_BANDWIDTH_EFFICIENCY was fitted to), measured on the CPU."""
    if not hardware.gpus:
        return trainable / (FUSED_ADAFACTOR_CPU_PARAMS_PER_SECOND_PER_CORE * max(1, hardware.cpu_count))
    bandwidth = gpu_spec_for(hardware)[0].memory_bytes_per_second * DEQUANTISE_BANDWIDTH_EFFICIENCY
    return trainable * FUSED_ADAFACTOR_TRAFFIC_BYTES / bandwidth


def optimizer_seconds(strategy: Strategy, hardware: Hardware, trainable: int, width: int) -> float:
    if strategy.fused_backward_pass:
        return fused_adafactor_seconds(hardware, trainable)
    on_cpu = hardware.accelerator == "cpu"
    cores = max(1, hardware.cpu_count)
    cpu_adam = max(
        trainable / (CPU_ADAM_PARAMS_PER_SECOND_PER_CORE * cores),
        trainable * CPU_ADAM_BYTES_PER_PARAM / HOST_MEMORY_BYTES_PER_SECOND,
    )
    if strategy.offload_optimizer == "none":
        return cpu_adam * TORCH_ADAM_CPU_SLOWDOWN if on_cpu else trainable / GPU_ADAM_PARAMS_PER_SECOND
    # Gradients go down and updated 16-bit weights come back once per optimizer step.
    transfer = 2 * trainable * width / host_link_bytes_per_second(hardware)
    if strategy.offload_optimizer == "nvme":
        transfer += 2 * trainable * 12 / NVME_BYTES_PER_SECOND
    return cpu_adam + transfer


def step_terms(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, width: int
) -> dict[str, float]:
    """The seconds of one optimizer step (gradient_accumulation_steps micro-steps), term by term: fixed
    overhead, the matmuls and attention, the optimizer, dequantising a quantised base, streaming offloaded
    weights. bench/fit_gpu_timing.py fits GPU_EFFICIENCY and DEQUANTISE_BANDWIDTH_EFFICIENCY on these terms."""
    micro_steps = job.gradient_accumulation_steps
    compute = (
        micro_steps
        * job.samples_per_micro_step
        * training_flops_per_sample(model, job, strategy.training_type, strategy.checkpoint_every)
        / sustained_flops(hardware)
    )
    if strategy.use_deepspeed and strategy.zero_stage == 3:
        compute *= 1 + ZERO3_HOOK_OVERHEAD
    # Forward, backward, and the recompute over the checkpointed blocks' share of the base's weights (about their
    # share of the forward's FLOPs).
    recomputed = recomputed_flops(model, job, strategy.checkpoint_every) / forward_flops(model, job)
    passes = micro_steps * (2 + recomputed)
    dequantise = passes * dequantise_pass_seconds(strategy, model, hardware)
    return {
        "overhead": STEP_OVERHEAD_SECONDS[hardware.accelerator],
        "compute": compute,
        "optimizer": optimizer_seconds(strategy, hardware, trainable, width),
        "dequantise": dequantise,
        "streaming": passes * streaming_pass_seconds(strategy, model, hardware, width, trainable),
        # A swapped block is copied in for the forward and again for the backward's recompute (a trained one
        # back out after its backward).
        "swapping": exposed_swap_seconds(
            strategy,
            model,
            hardware,
            width,
            2 * micro_steps,
            compute + dequantise,
            write_backs=micro_steps if strategy.training_type == "full" else 0,
        ),
        "ema": ema_update_seconds(
            trainable,
            width,
            host_link_bytes_per_second(hardware) if hardware.gpus else None,
            HOST_MEMORY_BYTES_PER_SECOND,
        )
        if job.ema
        else 0.0,
    }


def seconds_per_step(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, width: int
) -> float:
    """Estimated wall time of one optimizer step (gradient_accumulation_steps micro-steps)."""
    return sum(step_terms(strategy, model, job, hardware, trainable, width).values())


def mixed_seconds_per_step(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, width: int
) -> float:
    """Seconds per optimizer step over the job's training shapes (aspect buckets), each shape weighted by the
    batches it makes (a bucket's samples batch together: ceil(samples / batch_size))."""
    batches = [(shape, math.ceil(samples / job.batch_size)) for shape, samples in job.training_mix]
    total = sum(count for _, count in batches)
    return (
        sum(
            count * seconds_per_step(strategy, model, replace(job, resolution=shape), hardware, trainable, width)
            for shape, count in batches
        )
        / total
    )


def render_seconds(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, inference_steps: int
) -> float:
    """One image rendered with the training transformer (class images, validation): one forward per
    denoising step (FLUX.1 is guidance-distilled: no second, unconditional pass), then the VAE decode."""
    width = compute_dtype_bytes(job.mixed_precision)
    flops = sustained_flops(hardware)
    forward = forward_flops(model, job) / flops + base_pass_seconds(strategy, model, hardware, width, trainable)
    per_step = forward + exposed_swap_seconds(strategy, model, hardware, width, 1, forward)
    pixels = job.resolution[0] * job.resolution[1]
    return inference_steps * per_step + pixels * VAE_DECODE_FLOPS_PER_PIXEL / flops


def phase_seconds(
    strategy: Strategy, model: ModelSize, job: JobShape, hardware: Hardware, trainable: int, step_seconds: float
) -> dict[str, float]:
    """Seconds of every phase of the job (docs/memory.md, "Phases")."""
    width = compute_dtype_bytes(job.mixed_precision)
    flops = sustained_flops(hardware)
    stored = stored_model_bytes(model)
    images = job.num_instance_images + job.num_class_images
    # Each instance sample is encoded in its shape; class images in every shape (prior preservation pairs them).
    shapes = job.training_mix
    pixels = sum(samples * width_px * height_px for (width_px, height_px), samples in shapes)
    pixels += job.num_class_images * sum(width_px * height_px for (width_px, height_px), _ in shapes)
    # Every image may carry its own caption: T5 runs once per distinct prompt.
    text = (images + 1) * 2 * model.text_encoder_2_params * job.max_sequence_length
    exported = trainable if strategy.training_type == "lora" else model.transformer_params
    return {
        "captioning": captioning_seconds(job, hardware),
        "loading": stored / DISK_READ_BYTES_PER_SECOND
        + job.op_build_seconds
        + cpu_quantise_seconds(strategy, model, hardware),
        "caching": (pixels * VAE_ENCODE_FLOPS_PER_PIXEL + text) / flops,
        "class_images": job.num_class_images
        * render_seconds(strategy, model, job, hardware, trainable, job.class_image_inference_steps),
        "training": job.steps * step_seconds + learning_check_seconds(job, step_seconds),
        "validation": job.validation_rounds
        * job.validation_prompts
        * render_seconds(strategy, model, job, hardware, trainable, job.validation_inference_steps),
        # Written, then read back to verify.
        "export": 2 * exported * width / DISK_WRITE_BYTES_PER_SECOND,
        "scoring": scoring_seconds(job),
        "report": report_seconds(job),
        **transfer_phase_seconds(strategy, model, job, trainable),
    }


def captioning_seconds(job: JobShape, hardware: Hardware) -> float:
    """The captioning process: its start and its model's read, then every training photo captioned (the plan
    assumes none has a caption file); 0 when the request does not caption."""
    if not job.captioner_bytes:
        return 0.0
    load = CAPTIONING_START_SECONDS + job.captioner_bytes / DISK_READ_BYTES_PER_SECOND
    # Decoding reads every weight for each token: a captioner's time per photo follows its weights' bytes.
    per_image = CAPTIONING_SECONDS_PER_IMAGE[hardware.accelerator] * job.captioner_bytes / DEFAULT_CAPTION_MODEL_BYTES
    return load + job.num_instance_images * per_image


def scoring_seconds(job: JobShape) -> float:
    """The likeness scoring process: its models' load, then every training photo and every round's renders
    embedded; 0 without likeness."""
    if not job.likeness or not job.validation_prompts:
        return 0.0
    images = min(job.num_instance_images, MAX_SCORED_PHOTOS) + job.validation_rounds * job.validation_prompts
    return SCORING_MODEL_LOAD_SECONDS + images * SCORING_SECONDS_PER_IMAGE


def learning_check_seconds(job: JobShape, step_seconds: float) -> float:
    """The learning check's forward passes, timed from one optimizer step's samples; 0 without it."""
    if not job.learning_check:
        return 0.0
    samples_per_step = job.samples_per_micro_step * job.gradient_accumulation_steps
    return LEARNING_CHECK_FORWARD_PASSES * FORWARD_SHARE_OF_TRAINING * step_seconds / samples_per_step


def stored_model_bytes(model: ModelSize) -> int:
    """Bytes of the base model's files: the transformer and the encoders in bf16, as FLUX ships them."""
    return (model.transformer_params + model.encoder_params) * 2


def report_seconds(job: JobShape) -> float:
    """The training report: a fixed cost, the images it decodes (at most the contact sheet's and the shown
    rounds' renders), every step's history."""
    images = (
        min(job.num_instance_images, MAX_SHEET_IMAGES)
        + min(job.validation_rounds, MAX_SHOWN_ROUNDS) * job.validation_prompts
    )
    pixels = images * job.resolution[0] * job.resolution[1]
    return REPORT_FIXED_SECONDS + pixels * REPORT_SECONDS_PER_PIXEL + job.steps * REPORT_SECONDS_PER_STEP


# A checkpoint holds the trained weights in the compute dtype plus the optimizer's fp32 master copy, m and v.
CHECKPOINT_OPTIMIZER_BYTES_PER_PARAM = 12


def exported_bytes(strategy: Strategy, model: ModelSize, job: JobShape, trainable: int) -> int:
    """Bytes of the exported weights: the adapter of a LoRA, the whole transformer of a full fine-tune (twice with
    an EMA, which is exported too, and twice when the best validation step's LoRA may be kept beside the final one)."""
    width = compute_dtype_bytes(job.mixed_precision)
    weights = trainable if strategy.training_type == "lora" else model.transformer_params
    return int(weights * width * (2 if job.ema else 1) * (2 if job.keep_best_step else 1))


def checkpoint_bytes(job: JobShape, trainable: int) -> int:
    """Bytes of one checkpoint (accelerate/DeepSpeed state: a LoRA's excludes the frozen base)."""
    return int(trainable * (compute_dtype_bytes(job.mixed_precision) + CHECKPOINT_OPTIMIZER_BYTES_PER_PARAM))


def transfer_phase_seconds(strategy: Strategy, model: ModelSize, job: JobShape, trainable: int) -> dict[str, float]:
    """The network phases: the base model's pending download (its bytes from the resolved model's file list) and the
    exported weights' upload, each at the worker's stated rate (settings.TransferRates)."""
    rates = job.transfer_rates
    return {
        "download": job.download_bytes / rates.download_bytes_per_second,
        "upload": exported_bytes(strategy, model, job, trainable) / rates.upload_bytes_per_second,
    }


def deadline_stop_reserve_seconds(plan_phases: dict[str, float], job: JobShape, trainable: int) -> float:
    """Seconds a run cut short by its deadline needs after its last step: a checkpoint written and uploaded, the
    weights exported and uploaded, and the report (the plan's own phases for those)."""
    checkpoint = checkpoint_bytes(job, trainable)
    return (
        checkpoint / DISK_WRITE_BYTES_PER_SECOND
        + checkpoint / job.transfer_rates.upload_bytes_per_second
        + sum(plan_phases.get(name, 0.0) for name in ("export", "report", "upload"))
    )
