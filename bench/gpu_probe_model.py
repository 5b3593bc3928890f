"""What bench/gpu_probe_train.py's sections share: the transformer built on the device with random weights, a
step's inputs, the LoRA training steps, and the planner's figures for the same job and placement."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from gpu_probe_sizes import ProbeSize, model_size_of, transformer_config

LORA_RANK = 16
LEARNING_RATE = 1e-4
GIB = 2**30
# The card the block-swapped run emulates (torch.cuda.set_per_process_memory_fraction): the planner's 24 GiB tier.
SWAPPED_CARD_BYTES = 24 * GIB
# The dry run's planner figures are an H100's (a CPU has no row in the planner's GPU table).
DRY_RUN_GPU = ("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))


def build_transformer(size: ProbeSize, device: torch.device) -> Any:
    """A FLUX.1 transformer of `size`'s shape in bf16, built on `device` itself: its modules made on the meta
    device, their storage allocated on `device` (`to_empty`), then each module's own initialisation
    (`reset_parameters`) run there, from a fixed seed. Nothing passes through host RAM, and no fp32 copy is made
    (23.8 GB at FLUX.1-dev's size instead of 47.6)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**transformer_config(size))
    transformer.to(dtype=torch.bfloat16)
    transformer.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in transformer.modules():
            reset = getattr(module, "reset_parameters", None)
            if reset is not None and list(module.parameters(recurse=False)):
                reset()
    transformer.enable_gradient_checkpointing()
    transformer.train()
    return transformer


def add_lora(transformer: Any) -> None:
    """The trainer's LoRA set-up (train/model.add_lora_adapter), rank 16, from a fixed seed."""
    from fluxbooth.contract.trainer_config import LoraSettings
    from fluxbooth.train.model import add_lora_adapter

    torch.manual_seed(1)
    add_lora_adapter(transformer, LoraSettings(rank=LORA_RANK, alpha=float(LORA_RANK)))


def adapter_in_fp32(transformer: Any) -> None:
    """The trained adapter in fp32, its forward under bf16 autocast (`train_steps`): the trainer's LoRA without
    DeepSpeed (train/model.load_trainable_transformer, accelerate's native mixed precision)."""
    for parameter in transformer.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(torch.float32)


def make_inputs(size: ProbeSize, device: torch.device, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step's transformer inputs and flow-matching target, from a generator seeded by the step alone."""
    generator = torch.Generator().manual_seed(1000 + step)
    side = size.resolution // 16  # VAE (8x) then 2x2 packing
    tokens = side * side
    config = transformer_config(size)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    image_ids = (
        torch.stack((torch.zeros_like(rows), rows, columns), dim=-1).reshape(tokens, 3).to(device, torch.bfloat16)
    )
    inputs = {
        "hidden_states": normal(1, tokens, config["in_channels"]),
        "encoder_hidden_states": normal(1, size.text_tokens, config["joint_attention_dim"]),
        "pooled_projections": normal(1, config["pooled_projection_dim"]),
        "timestep": torch.rand(1, generator=generator).to(device, torch.bfloat16),
        "img_ids": image_ids,
        "txt_ids": torch.zeros(size.text_tokens, 3, device=device, dtype=torch.bfloat16),
        "guidance": torch.full((1,), 3.5, device=device, dtype=torch.float32),
    }
    return inputs, normal(1, tokens, config["in_channels"])


def train_steps(
    transformer: Any, optimizer: torch.optim.Optimizer, size: ProbeSize, device: torch.device, after_step: Any
) -> dict[str, Any]:
    """`size.steps` LoRA steps; `after_step()` runs after each optimizer step (the swapper's release). The
    losses, and the seconds per step of every step after the first (the first warms the kernels up)."""
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(size.steps):
        inputs, target = make_inputs(size, device, step)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = transformer(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_step()
        losses.append(float(loss.detach()))  # waits for the device: each step is timed whole
        if step == 0:
            started = time.perf_counter()
    timed = max(1, size.steps - 1)
    return {"losses": losses, "seconds_per_step": round((time.perf_counter() - started) / timed, 4)}


@dataclass(frozen=True)
class Machine:
    """What the planner reads of the machine the probe runs on (or, on the CPU, of the H100 it stands for)."""

    gpu_name: str
    gpu_memory_bytes: int
    compute_capability: tuple[int, int]
    host_memory_bytes: int
    disk_bytes: int
    cpu_count: int


def this_machine(device: torch.device) -> Machine:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        name, memory, capability = properties.name, properties.total_memory, (properties.major, properties.minor)
    else:
        name, memory, capability = DRY_RUN_GPU
    return Machine(
        gpu_name=name,
        gpu_memory_bytes=memory,
        compute_capability=capability,
        host_memory_bytes=psutil.virtual_memory().total,
        disk_bytes=shutil.disk_usage(os.getcwd()).total,
        cpu_count=os.cpu_count() or 1,
    )


def planned(size: ProbeSize, machine: Machine, *, swapped: bool) -> dict[str, Any]:
    """The planner's figures for this LoRA job (rank 16, bf16, gradient checkpointing, one prompt rendered at
    `size.render_steps`) in this placement: resident on the whole card, or block-swapped on a 24 GiB one.
    Step time from plan/timing.py as `evaluate_candidate` computes it, memory from `plan.estimate_memory`."""
    from fluxbooth.host.hardware import hypothetical_hardware
    from fluxbooth.plan import JobShape, Strategy, compute_dtype_bytes, estimate_memory
    from fluxbooth.plan.timing import mixed_seconds_per_step, render_seconds

    strategy = Strategy("lora", False, 0, "none", "none", block_swap=swapped)
    job = JobShape(
        training_type="lora",
        lora_rank=LORA_RANK,
        use_deepspeed=False,
        gradient_checkpointing=True,
        resolution=(size.resolution, size.resolution),
        max_sequence_length=size.text_tokens,
        validation_prompts=1,
        validation_inference_steps=size.render_steps,
    )
    hardware = hypothetical_hardware(
        gpus=1,
        gpu_memory_bytes=SWAPPED_CARD_BYTES if swapped else machine.gpu_memory_bytes,
        host_memory_bytes=machine.host_memory_bytes,
        disk_bytes=machine.disk_bytes,
        cpu_count=machine.cpu_count,
        gpu_name=machine.gpu_name,
        compute_capability=machine.compute_capability,
    )
    model = model_size_of(size)
    estimate = estimate_memory(strategy, model, job, hardware, "bf16")
    trainable = int(estimate.breakdown["trainable_params"])
    width = compute_dtype_bytes("bf16")
    return {
        "card_bytes": hardware.gpus[0].total_bytes,
        "seconds_per_step": mixed_seconds_per_step(strategy, model, job, hardware, trainable, width),
        "training_gpu_bytes": estimate.phase_gpu_bytes.get("training"),
        "validation_gpu_bytes": estimate.phase_gpu_bytes.get("validation"),
        "cuda_context_bytes": int(estimate.breakdown.get("gpu.cuda_context", 0)),
        "render_seconds": render_seconds(strategy, model, job, hardware, trainable, size.render_steps),
    }


def device_memory(device: torch.device) -> dict[str, Any]:
    """The allocator's peaks since its last reset, its retries, and NVML's used bytes for the whole card now."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "nvml_used_bytes": None, "retries": None}
    torch.cuda.synchronize(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        used: int | None = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # no NVML: the column says "-"
        used = None
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "nvml_used_bytes": used,
        "retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
    }


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
