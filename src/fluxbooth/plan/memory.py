"""The memory model: predicted GPU, host-RAM and disk bytes of one strategy, per phase.

Every formula is written down in docs/memory.md and followed here term by term (the names in
`MemoryEstimate.breakdown` are the terms of that document). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fluxbooth.contract import deepspeed_numbers as ds
from fluxbooth.hardware import GIB, Hardware
from fluxbooth.contract.precision import block_of, is_quantised_layer
from fluxbooth.sizing import ModelSize
from fluxbooth.pinned import BLOCK_SWAP_DEVICE_SLOTS
from fluxbooth.plan.host_buffers import (
    allocated_bytes,
    block_store_bytes,
    block_store_sizes,
    block_tensor_bytes,
    largest_trainable_parameter,
    parameter_numels,
    zero3_optimizer_offload_allocations,
    zero3_param_offload_allocations,
    zero12_offload_allocations,
)
from fluxbooth.plan.types import PHASES, JobShape, MemoryEstimate, Strategy
from fluxbooth.contract.names import normalise_optimizer_name

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

# ---- Quantised bases (docs/memory.md, "Quantised bases"). --------------------------------------
# fp8 (e4m3): one byte per weight plus one fp32 scale per output channel.
FP8_BYTES_PER_PARAM = 1.0
FP8_SCALE_BYTES_PER_OUTPUT = 4
# NF4 with double quantisation (bitsandbytes): 4 bits per weight, an 8-bit absmax per 64-weight block and
# one fp32 constant per 256 absmax values: 8/64 + 32/(64*256) = 0.127 bit per weight on top of the 4; each
# layer also keeps its two fp32 lookup tables (16 NF4 values, 256 dynamic-map values).
NF4_BITS_PER_PARAM = 4 + 8 / 64 + 32 / (64 * 256)
NF4_TABLE_BYTES_PER_LAYER = 4 * (16 + 256)
# The quantiser's working copies of the layer it is quantising, per weight of that layer, beyond its bf16
# weight and its stored result (fluxbooth.train.quantize, docs/memory.md "Quantised bases"): fp8 holds an
# fp32 copy and the fp32 copy divided by the row scales (4 + 4) when the e4m3 codes are cast; nf4 holds the
# padded fp32 copy, the copy divided by the block absmax (4 + 4) and torch.bucketize's int64 indices (8).
# Measured on the 3072x12288 layer (RSS peak of one quantised_linear call): 8.0 and 15.5 B above the stored.
QUANTISER_WORKING_BYTES_PER_PARAM = {"fp8": 8, "nf4": 16}

# fp32 optimizer state per trainable parameter, besides the master weights: Adam's m and v; one buffer for
# Adagrad's sum, Lion's and SGD's momentum; Adafactor keeps a full second moment on ZeRO's flat partitions.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adagrad": 4, "lion": 4, "sgd": 4, "adafactor": 4}
# The fused pass (Strategy.fused_backward_pass) steps one parameter at a time inside the backward pass: that
# parameter's bf16 gradient (2 bytes per element), then its fp32 working copies while transformers' Adafactor
# steps it: the weight, the gradient, the update and the factored estimate it is built from (4 x 4 bytes),
# counted from train/fused_adafactor.py and Adafactor.step. The largest layer sets the peak.
FUSED_STEP_BYTES_PER_PARAM = 2 + 16


def compute_dtype_bytes(mixed_precision: str) -> int:
    return 4 if mixed_precision == "no" else 2


def image_tokens(resolution: tuple[int, int]) -> int:
    """FLUX packs 2x2 patches of 8x-downsampled latents: one token per 16x16 pixels."""
    width, height = resolution
    return math.ceil(height / 16) * math.ceil(width / 16)


def sequence_tokens(model: ModelSize, job: JobShape) -> int:
    """Tokens in the transformer's sequence: the image's (with FLUX.1 Kontext's pairs, the control image's too)
    and the prompt's."""
    return image_tokens(job.resolution) * model.sequence_images + job.max_sequence_length


def token_hidden(model: ModelSize, job: JobShape) -> int:
    return sequence_tokens(model, job) * model.transformer.hidden_size


def activation_bytes(model: ModelSize, job: JobShape, mixed_precision: str) -> dict[str, int]:
    """Activation memory of one micro-step at its peak (docs/memory.md, "Activations").

    Without checkpointing the peak is at the start of backward: everything every block saved,
    plus the gradient flowing back. With checkpointing each block keeps only its inputs, and the
    peak is while the first block is recomputed and back-propagated: all inputs plus one block's
    full activations."""
    shape = model.transformer
    width = compute_dtype_bytes(mixed_precision)
    double, single, outer = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    tokens = sequence_tokens(model, job)
    hidden = token_hidden(model, job)
    samples = job.samples_per_micro_step
    inputs = (
        job.max_sequence_length * shape.joint_attention_dim
        + image_tokens(job.resolution) * model.sequence_images * shape.in_channels
    ) * width
    embedders = outer * hidden + inputs
    if job.gradient_checkpointing:
        saved = shape.num_blocks * hidden * width
        working = largest_block_coefficient(model, width) * hidden
    else:
        saved = (shape.num_layers * double + shape.num_single_layers * single) * hidden
        working = 2 * hidden * width
    # Rotary tables (cos, sin in fp32) are shared by all blocks.
    rotary = 2 * tokens * shape.attention_head_dim * 4
    return {
        "activations_saved": int(samples * (saved + embedders) + rotary),
        "activations_working": int(samples * working),
    }


def largest_block_coefficient(model: ModelSize, width: int) -> float:
    double, single, _ = SAVED_BYTES_PER_TOKEN_HIDDEN[width]
    shape = model.transformer
    return max(double if shape.num_layers else 0.0, single if shape.num_single_layers else 0.0)


def inference_activation_bytes(model: ModelSize, job: JobShape, mixed_precision: str) -> int:
    """One image rendered without gradients: at most one block's activations are alive at a time."""
    width = compute_dtype_bytes(mixed_precision)
    return int(largest_block_coefficient(model, width) * token_hidden(model, job))


def trainable_params(model: ModelSize, training_type: str, lora_rank: int, targets: Sequence[str]) -> int:
    if training_type == "lora":
        return model.lora_params(lora_rank, targets)
    return model.transformer_params


def optimizer_state_bytes(optimizer: str) -> int:
    return OPTIMIZER_STATE_BYTES.get(normalise_optimizer_name(optimizer), 8)


def quantised_layer_bytes(in_features: int, out_features: int, precision: str) -> float:
    weights = in_features * out_features
    if precision == "fp8":
        return weights * FP8_BYTES_PER_PARAM + out_features * FP8_SCALE_BYTES_PER_OUTPUT
    return weights * NF4_BITS_PER_PARAM / 8 + NF4_TABLE_BYTES_PER_LAYER


def frozen_base_bytes(model: ModelSize, precision: str, width: int) -> dict[str, int]:
    """The frozen transformer as stored: quantised block Linears (with their scales), and everything
    else (biases, norms, embedders, the final layers) in the compute dtype."""
    if precision not in ("fp8", "nf4"):
        return {"frozen_weights": model.transformer_params * width}
    quantised_elements = 0
    quantised = 0.0
    for layer in model.linear_layers:
        if is_quantised_layer(layer.name):
            quantised_elements += layer.in_features * layer.out_features
            quantised += quantised_layer_bytes(layer.in_features, layer.out_features, precision)
    return {
        "frozen_weights_quantised": int(quantised),
        "frozen_weights_unquantised": (model.transformer_params - quantised_elements) * width,
    }


def frozen_block_bytes(model: ModelSize, precision: str, width: int) -> dict[str, float]:
    """Each transformer block's Linear weights and biases as the frozen base stores them, or as a full
    fine-tune trains them (bf16): what block swapping streams; the blocks' norms are a few vectors and left out."""
    blocks: dict[str, float] = {}
    for layer in model.linear_layers:
        if not is_quantised_layer(layer.name):
            continue
        bias = layer.out_features * width if layer.bias else 0
        if precision in ("fp8", "nf4"):
            stored = quantised_layer_bytes(layer.in_features, layer.out_features, precision) + bias
        else:
            stored = layer.in_features * layer.out_features * width + bias
        blocks[block_of(layer.name)] = blocks.get(block_of(layer.name), 0.0) + stored
    return blocks


def largest_quantised_layer_params(model: ModelSize) -> int:
    return max(
        (layer.in_features * layer.out_features for layer in model.linear_layers if is_quantised_layer(layer.name)),
        default=0,
    )


def _zero12_states(
    strategy: Strategy, trainable: int, weights: dict[str, int], n: int, width: int, state: int, on_cuda: bool,
    largest_parameter: int = 0,
) -> tuple[dict[str, int], dict[str, int]]:
    partitioned_state, _ = _state_bytes(width, state)
    device: dict[str, int] = dict(weights)
    host: dict[str, int] = {}
    if strategy.offload_optimizer == "none":
        if strategy.zero_stage == 1:
            device["gradients"] = trainable * width
            device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
        else:
            device["optimizer_states_partition"] = trainable * partitioned_state // n
    else:
        # DeepSpeed's own buffers as it allocates them (plan/host_buffers.py): pinned ones rounded up to a
        # power of two by PyTorch's caching host allocator (launch_files.py pins them on CUDA).
        allocations = zero12_offload_allocations(trainable, largest_parameter, n, width, state, pinned=on_cuda)
        for allocation in allocations:
            host[f"offload_{allocation.name}"] = host.get(f"offload_{allocation.name}", 0) + allocation.allocated_bytes
    # DeepSpeed allocates whole buckets: the CUDA allocator reserves them, while on the CPU only
    # the pages written (at most the trainable parameters) become resident. With overlap_comm
    # (CUDA only, see launch_files.py) the reduce bucket is double-buffered.
    if on_cuda:
        device["gradient_buckets"] = ds.ZERO2_REDUCE_BUCKET_ELEMENTS * width * 2
        if n > 1:
            device["allgather_bucket"] = ds.ZERO2_ALLGATHER_BUCKET_ELEMENTS * width
    else:
        device["gradient_buckets"] = min(trainable, ds.ZERO2_REDUCE_BUCKET_ELEMENTS) * width
    return device, host


def _state_bytes(width: int, state: int) -> tuple[int, int]:
    """(partitioned on the device, offloaded to the host) bytes per trainable parameter: 16-bit grads,
    fp32 grads, the fp32 master (only when training in 16 bits) and the optimizer state."""
    master = 4 if width == 2 else 0
    partitioned = width + 4 + master + state if width == 2 else 4 + state
    offloaded = 4 + master + state if width == 2 else 4 + state
    return partitioned, offloaded


def _frozen_placement(
    strategy: Strategy, model: ModelSize, trainable: int, width: int, processes: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of the weights outside ZeRO-3: the trainable ones in 16 bits, the frozen
    base as stored, whole on each GPU; or, block-swapped, its blocks in pinned host RAM and two of them on the
    GPU at a time (the one computing and the one prefetched, in the swapper's device slots), the rest of it
    (embedders, output) on the GPU;
    each process pins its own copy of the blocks. The fused full fine-tune swaps its trained bf16 blocks the
    same way (each written back to its pinned copy after its backward)."""
    frozen = frozen_base_bytes(model, strategy.base_precision, width) if strategy.training_type == "lora" else {}
    device = {"weights_16bit": trainable * width if strategy.training_type == "lora" else model.transformer_params * width}
    if not strategy.block_swap:
        device.update(frozen)
        return device, {}
    in_blocks = sum(sum(sizes) for sizes in block_tensor_bytes(model, strategy.base_precision, width).values())
    # Each block's tensors pinned in place at their own size (fluxbooth.pinned), streamed through
    # BLOCK_SWAP_DEVICE_SLOTS device buffers of the largest block's size, allocated once (train/blockswap.py).
    swapped = BLOCK_SWAP_DEVICE_SLOTS * max(block_store_sizes(model, strategy.base_precision, width).values(), default=0)
    pinned = processes * sum(block_store_bytes(model, strategy.base_precision, width).values())
    if strategy.training_type == "full":
        outside = device["weights_16bit"] - in_blocks
        return {"weights_outside_blocks": outside, "swapped_blocks": swapped}, {"trained_blocks_pinned": pinned}
    device["frozen_weights_outside_blocks"] = int(sum(frozen.values()) - in_blocks)
    device["swapped_blocks"] = swapped
    return device, {"frozen_blocks_pinned": pinned}


def adafactor_state_bytes(model: ModelSize) -> int:
    """transformers' Adafactor without a first moment (beta1 None, kohya's FLUX settings): a matrix keeps
    fp32 means of its squared gradient per row and per column, any other tensor (biases, norms) a full fp32
    second moment."""
    matrices = sum(layer.in_features * layer.out_features for layer in model.linear_layers)
    factors = sum(layer.in_features + layer.out_features for layer in model.linear_layers)
    return 4 * (factors + model.transformer_params - matrices)


def model_state_bytes(
    strategy: Strategy,
    model: ModelSize,
    trainable: int,
    processes: int,
    width: int,
    on_cuda: bool = True,
    state: int = 8,
    largest_parameter: int = 0,
    lora: tuple[int, Sequence[str]] = (0, ()),
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(device, host, disk) terms of the model states. DeepSpeed's estimators
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) without
    their 1.5x buffer factor — margins are applied once, in `fits` — extended to frozen weights
    (LoRA's base, quantised or not) and to NVMe. Device terms are per GPU, host and disk terms for the
    node. `state`: the optimizer's fp32 state bytes per trainable parameter (8 for Adam); `largest_parameter`:
    the elements of the largest trainable parameter (DeepSpeed's CPU offload sizes a pinned buffer by it);
    `lora`: the LoRA's rank and targets (ZeRO-3's parameter offload pins every parameter's partition)."""
    lora_rank, targets = lora
    n = processes
    weights, host = _frozen_placement(strategy, model, trainable, width, processes)
    disk: dict[str, int] = {}
    if strategy.fused_backward_pass:
        # Every weight in bf16 (no fp32 master copy), Adafactor's factored state, no gradient buffer.
        device = dict(weights)
        device["optimizer_states_factored"] = adafactor_state_bytes(model)
        device["fused_step_working"] = FUSED_STEP_BYTES_PER_PARAM * model.largest_layer_params
        return device, host, disk
    if not strategy.use_deepspeed:
        # Plain accelerate: fp32 trainable weights under autocast, fp32 grads, optimizer state; frozen
        # weights as stored.
        device = {key: value for key, value in weights.items() if key != "weights_16bit"}
        device["trainable_weights_grads_optimizer"] = trainable * (8 + state)
        return device, host, disk
    if strategy.zero_stage in (1, 2):
        device, offloaded = _zero12_states(strategy, trainable, weights, n, width, state, on_cuda, largest_parameter)
        return device, {**host, **offloaded}, disk
    partitioned_state, _ = _state_bytes(width, state)
    master = 4 if width == 2 else 0
    frozen = model.transformer_params if strategy.training_type == "lora" else 0
    device = {"largest_layer_gathered": 4 * model.largest_layer_params}
    # ZeRO-3: the largest layer is gathered (weights and grads, 16-bit) while it computes.
    reduce_bucket = ds.ZERO3_REDUCE_BUCKET_ELEMENTS if on_cuda else min(trainable, ds.ZERO3_REDUCE_BUCKET_ELEMENTS)
    prefetch = min(model.transformer_params, ds.ZERO3_PREFETCH_BUCKET_ELEMENTS)
    device["zero3_buckets"] = (reduce_bucket + prefetch) * width
    weights_16bit = (trainable + frozen) * width
    if strategy.offload_param == "none":
        device["weights_16bit_partition"] = weights_16bit // n
    elif strategy.offload_param == "cpu":
        numels = parameter_numels(model, strategy.training_type, lora_rank, targets)
        host["weights_16bit_offloaded"] = allocated_bytes(zero3_param_offload_allocations(numels, trainable, n, width, on_cuda))
    else:
        disk["weights_16bit_swapped"] = weights_16bit
        host["param_swap_buffers"] = (
            ds.PARAM_SWAP_BUFFER_COUNT * min(model.transformer_params, ds.PARAM_SWAP_BUFFER_ELEMENTS) * width
        )
        host["weights_16bit_kept_in_cpu"] = min(trainable + frozen, ds.PARAMS_KEPT_IN_CPU_ELEMENTS) * width
    if strategy.offload_optimizer == "none":
        device["optimizer_states_partition"] = trainable * (partitioned_state - width) // n
    elif strategy.offload_optimizer == "cpu":
        allocations = zero3_optimizer_offload_allocations(trainable, n, state, ds.ZERO3_SUB_GROUP_ELEMENTS, on_cuda)
        host["optimizer_states_offloaded"] = allocated_bytes(allocations)
    else:
        # ZeRO-Infinity swaps the fp32 master and optimizer states; fp32 gradients stay in host RAM.
        host["gradients_fp32"] = trainable * 4
        disk["optimizer_states_swapped"] = trainable * (master + state)
        # Pinned fp32 buffers of one sub-group each (launch_files.py: sub_group_size) for the master and state.
        host["optimizer_swap_buffers"] = ds.OPTIMIZER_SWAP_BUFFER_COUNT * min(trainable, ds.ZERO3_SUB_GROUP_ELEMENTS) * 4
    return device, host, disk


def ema_host_bytes(trainable: int, largest_parameter: int, width: int) -> dict[str, int]:
    """train/ema.py: an fp32 copy of every trained weight on the main process's CPU (exported beside them), and
    while it updates, one weight at a time copied to the host and cast to fp32 (the largest sets the peak)."""
    return {"ema_shadow": trainable * 4, "ema_update_working": largest_parameter * (width + 4)}


def cached_bytes(model: ModelSize, job: JobShape, width: int) -> int:
    """What the trainer caches: the VAE posterior's mean and std in fp32 of every instance sample in its
    shape and of every class image in each shape (prior preservation pairs them), and (upper bound: every
    image may carry its own caption) one prompt's T5 sequence and CLIP pooled embedding per image."""
    def latent_bytes(shape: tuple[int, int]) -> int:
        # With Kontext's pairs the control image's latents too (a bound: only their mean is kept).
        return 2 * 4 * image_tokens(shape) * model.transformer.in_channels * model.sequence_images

    latents = sum(samples * latent_bytes(shape) for shape, samples in job.training_mix)
    latents += job.num_class_images * sum(latent_bytes(shape) for shape, _ in job.training_mix)
    prompt = (job.max_sequence_length * model.text_encoder_2_hidden_size + model.transformer.pooled_projection_dim) * width
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
        in_flight = layer_being_quantised(model, strategy.base_precision, width) if strategy.quantised else model.largest_layer_params * width
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
    # A hand-built shape without targets gets its model family's (FLUX.2 names its layers differently from FLUX.1).
    targets = job.lora_targets or model.default_lora_targets
    trainable = trainable_params(model, strategy.training_type, job.lora_rank, targets)
    state = optimizer_state_bytes(job.optimizer)
    largest = largest_trainable_parameter(model, strategy.training_type, job.lora_rank, targets)
    device, host, disk = model_state_bytes(strategy, model, trainable, processes, width, not on_cpu, state, largest, (job.lora_rank, targets))
    device.update(activation_bytes(model, job, mixed_precision))
    if strategy.quantised:
        # Each quantised Linear is dequantised to the compute dtype for its matmul, forward and backward.
        device["dequantised_layer"] = 2 * largest_quantised_layer_params(model) * width
    fixed_host = _fixed_host(strategy, processes, on_cpu)
    if not on_cpu:
        device["cuda_context"] = CUDA_CONTEXT_GPU_BYTES
    # Cached embeddings and latents stay in host RAM for the whole run.
    host["cached_embeddings"] = processes * cached_bytes(model, job, width)
    if job.ema:
        host.update(ema_host_bytes(trainable, largest, width))

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
        # glibc raises its mmap threshold after large frees, so the buffers freed between steps
        # (activations, ZeRO-3's gathered parameters) stay in the heap: measured by bench/memory.py
        # as about the 16-bit weights once, twice under ZeRO-3.
        host["allocator_retention"] = (
            CPU_ALLOCATOR_RETENTION_ZERO3 if strategy.zero_stage == 3 else CPU_ALLOCATOR_RETENTION
        ) * model.transformer_params * width
        # Everything the GPU would hold lives in host RAM, next to the offloaded states.
        training_host = sum(host.values()) + sum(device.values())
        phase_gpu = dict.fromkeys(PHASES, 0)
        render_host = training_host - activations + inference
        export_host = training_host - activations + export_transient
    else:
        training_host = sum(host.values())
        weights_on_gpu = renders - inference
        phase_gpu = {
            "loading": weights_on_gpu - training_only_bytes(device) + layer_being_loaded(model, strategy, width),
            "caching": 0 if cache_on_cpu else encoders + CUDA_CONTEXT_GPU_BYTES,
            "class_images": renders if job.num_class_images else 0,
            "training": sum(device.values()),
            "validation": renders if job.validation_prompts else 0,
            "export": weights_on_gpu, "scoring": SCORING_GPU_BYTES if job.likeness else 0, "report": 0,
        }
        render_host = training_host
        export_host = training_host - pinned_blocks_bytes(host) + export_transient
    phase_host = {
        "loading": loading_host + (0 if on_cpu else host["cached_embeddings"]),
        "caching": processes * encoders + host["cached_embeddings"],
        "class_images": render_host if job.num_class_images else 0,
        "training": training_host,
        "validation": render_host if job.validation_prompts else 0,
        "export": export_host, "scoring": SCORING_HOST_BYTES,
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
    breakdown = {**{f"gpu.{k}": v for k, v in device.items()}, **{f"host.{k}": v for k, v in host.items()}}
    breakdown.update({f"host.{k}": v for k, v in fixed_host.items()})
    breakdown.update({f"host.phase_{k}": v for k, v in own_phase_host.items()})
    breakdown.update({f"disk.{k}": v for k, v in disk.items()})
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


# Phases the worker runs after the trainer process has exited.
AFTER_TRAINER_PHASES = frozenset({"scoring", "report"})


def _with_fixed_costs(phase_host: dict[str, float], fixed: float, job: JobShape) -> dict[str, float]:
    """The trainer's fixed costs count in every phase it runs; a phase the job skips costs nothing, and the
    report is drawn after the trainer has exited."""
    runs = {"class_images": job.num_class_images, "validation": job.validation_prompts, "scoring": job.likeness}
    return {
        name: 0 if not runs.get(name, True) else value + (0 if name in AFTER_TRAINER_PHASES else fixed)
        for name, value in phase_host.items()
    }


def pinned_blocks_bytes(host: dict[str, int]) -> int:
    """The block-swapped model's blocks in pinned host RAM: they are the model's own tensors, freed with it
    before the export reloads what was saved (train/export/stage.release_engine; metrics.alive_at_export)."""
    return host.get("frozen_blocks_pinned", 0) + host.get("trained_blocks_pinned", 0)


def training_only_bytes(device: dict[str, int]) -> int:
    """Device terms that exist only once training runs: optimizer partitions, gradients, buckets, the
    dequantised layer."""
    transient = ("optimizer_states_partition", "gradients", "gradient_buckets", "allgather_bucket", "zero3_buckets",
                 "trainable_weights_grads_optimizer", "dequantised_layer", "optimizer_states_factored", "fused_step_working")
    return sum(device.get(name, 0) for name in transient)


def layer_being_loaded(model: ModelSize, strategy: Strategy, width: int) -> int:
    """GPU bytes beyond the loaded weights while loading: one layer in the compute dtype on its way to the
    GPU, and for a quantised base the quantiser's working copies of it (it quantises on the GPU; block-swapped,
    on the host)."""
    if strategy.quantised and not strategy.block_swap:
        return layer_being_quantised(model, strategy.base_precision, width)
    return model.largest_layer_params * width


def layer_being_quantised(model: ModelSize, precision: str, width: int) -> int:
    """The largest layer's weight in the compute dtype plus the quantiser's working copies of it
    (QUANTISER_WORKING_BYTES_PER_PARAM), beyond the base as stored so far."""
    largest = largest_quantised_layer_params(model)
    return max(model.largest_layer_params * width, largest * (width + QUANTISER_WORKING_BYTES_PER_PARAM[precision]))


def _work_disk(exported: int, cached: int, trainable: int, width: int, state: int, job: JobShape) -> int:
    """Disk in the job directory: exported weights, the cache, and one resumable checkpoint at a time
    (16-bit weights, fp32 master and optimizer state of what trains); with keep_best_step the LoRA of every
    validation step too."""
    disk = exported * (1 + (job.validation_rounds_during_training if job.keep_best_step else 0)) + cached
    if job.checkpointing_steps:
        disk += trainable * (width + 4 + state)
    return disk
