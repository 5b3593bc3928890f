"""The training half of bench/gpu_probe.py: block-swapped against resident training on a reduced-depth FLUX.1
at full width, run in its own process so that PYTORCH_CUDA_ALLOC_CONF (read once, when CUDA starts) can differ
between two such processes.

Three trainings, each resident twice (the second gives the resident run's own run-to-run difference), swapped
once, and on CUDA swapped once more with the GPU made to lag behind the CPU (`torch.cuda._sleep` queued before
every block, so the CPU runs ahead and queues block copies as far ahead as the swapper lets it):
- `lora`: rank-16 LoRA (the trainer's `add_lora_adapter`), torch AdamW, no DeepSpeed;
- `lora-zero2`: the same under DeepSpeed ZeRO-2 with torch's AdamW handed in (nothing compiled);
- `full-fused`: the full fine-tune with Adafactor fused into the backward pass (`FusedBackwardAdafactor`), the
  trained blocks swapped with `swap_trainable` and written back after every step (`release_swapped_blocks`).

Every run starts from the same seed (weights, LoRA init, inputs) and records its per-step losses, a checksum
of its trained weights, the allocator's peaks and retries, and the swapper's counts; the plan's training-phase
GPU charge for the same strategy comes from `fluxbooth.plan.estimate_memory`.

Usage (by bench/gpu_probe.py): python bench/gpu_probe_train.py --device cuda|cpu --size NAME --out FILE.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_probe_sizes import SIZES, ProbeSize, transformer_config  # noqa: E402

TRAININGS = ("lora", "lora-zero2", "full-fused")
LORA_RANK = 16
LEARNING_RATE = 1e-4
# The GPU's lag per block: longer than a block's copy at PCIe speed, so the CPU is always ahead of the GPU.
LAG_MILLISECONDS_PER_BLOCK = 20.0


@dataclass
class TrainingRun:
    training: str
    variant: str  # resident, resident-again, swapped, swapped-lagging
    losses: list[float] = field(default_factory=list)
    weights_checksum: float = 0.0
    seconds_per_step: float = 0.0
    # Beyond what earlier runs of the process left allocated (DeepSpeed may keep references to an engine).
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    left_by_earlier_runs_bytes: int | None = None
    alloc_retries: int | None = None
    most_resident_blocks: int | None = None
    largest_block_bytes: int | None = None
    predicted_training_gpu_bytes: int | None = None
    predicted_cuda_context_bytes: int | None = None
    error: str | None = None


def build_transformer(size: ProbeSize, device: torch.device, *, keep_on: torch.device | None = None) -> Any:
    """A FLUX.1 transformer of `size`'s shape, random weights from a fixed seed, bf16, built on `device` (the
    same weights for every run on one machine) and left on `keep_on` (default: `device`)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel(**transformer_config(size))
    transformer = transformer.to(device=keep_on or device, dtype=torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    transformer.enable_gradient_checkpointing()
    transformer.train()
    return transformer


def make_inputs(size: ProbeSize, device: torch.device, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step's transformer inputs and flow-matching target, from a generator seeded by the step alone."""
    generator = torch.Generator().manual_seed(1000 + step)
    side = size.resolution // 16  # VAE (8x) then 2x2 packing
    tokens = side * side
    config = transformer_config(size)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    image_ids = torch.stack((torch.zeros_like(rows), rows, columns), dim=-1).reshape(tokens, 3).to(device, torch.bfloat16)
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


def prepare(training: str, swapped: bool, size: ProbeSize, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """(transformer, the module to call, optimizer, swapper or None) for one run, set up as the trainer does."""
    from fluxbooth.train.blockswap import BlockSwapper, attach_swapper, flux_blocks
    from fluxbooth.train.model import add_lora_adapter, trainable_parameters
    from fluxbooth.contract.trainer_config import LoraSettings

    transformer = build_transformer(size, device, keep_on=torch.device("cpu") if swapped else device)
    if training != "full-fused":
        torch.manual_seed(1)
        add_lora_adapter(transformer, LoraSettings(rank=LORA_RANK, alpha=float(LORA_RANK)))
    swapper = None
    if swapped:
        swapper = BlockSwapper(flux_blocks(transformer), device, swap_trainable=training == "full-fused")
        attach_swapper(transformer, swapper)
        swapper.place_the_rest(transformer)
    parameters = trainable_parameters(transformer)
    if training == "full-fused":
        from fluxbooth.train.fused_adafactor import FusedBackwardAdafactor
        from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS

        optimizer = FusedBackwardAdafactor(parameters, lr=1e-5, seed=0, max_grad_norm=1.0, **OPTIMIZER_HYPERPARAMETERS["adafactor"])
        return transformer, transformer, optimizer, swapper
    from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS

    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, **OPTIMIZER_HYPERPARAMETERS["adamw"])
    if training == "lora":
        return transformer, transformer, optimizer, swapper
    engine = zero2_engine(transformer, optimizer, device)
    return transformer, engine, engine, swapper


def zero2_engine(transformer: Any, optimizer: Any, device: torch.device) -> Any:
    """DeepSpeed ZeRO-2 over one process with torch's AdamW handed in (no DeepSpeed op is compiled)."""
    import deepspeed

    from fluxbooth.contract import deepspeed_numbers as numbers

    if not torch.distributed.is_initialized():
        from deepspeed.accelerator import get_accelerator

        # A one-process group through a file store (a TCP rendezvous of one hung on the shared CPU machine);
        # DeepSpeed then finds the group initialised and uses it.
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        store = Path(tempfile.mkdtemp(prefix="gpu-probe-")) / "process-group"
        torch.distributed.init_process_group(
            get_accelerator().communication_backend_name(), init_method=f"file://{store}", rank=0, world_size=1
        )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2, "contiguous_gradients": True, "overlap_comm": device.type == "cuda", "reduce_scatter": True,
            "reduce_bucket_size": numbers.ZERO2_REDUCE_BUCKET_ELEMENTS, "allgather_bucket_size": numbers.ZERO2_ALLGATHER_BUCKET_ELEMENTS,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=transformer, optimizer=optimizer, config=config)
    return engine


def add_lag(transformer: Any, cycles: int) -> list[Any]:
    """A forward pre-hook on every block that queues `cycles` of GPU sleep: the GPU falls behind the CPU."""
    from fluxbooth.train.blockswap import flux_blocks

    return [block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(cycles)) for block in flux_blocks(transformer)]


def sleep_cycles_per_millisecond(device: torch.device) -> int:
    """How many `torch.cuda._sleep` cycles make one millisecond on this GPU (measured with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles / max(start.elapsed_time(end), 1e-3))


def train_steps(run: TrainingRun, size: ProbeSize, device: torch.device, lag_cycles: int) -> None:
    """Set up, reset the allocator's counters, train `size.steps` steps; fill `run`."""
    from fluxbooth.train.blockswap import release_swapped_blocks
    from fluxbooth.train.model import trainable_parameters

    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        run.left_by_earlier_runs_bytes = torch.cuda.memory_allocated()
    transformer, model, optimizer, swapper = prepare(run.training, run.variant.startswith("swapped"), size, device)
    hooks = add_lag(transformer, lag_cycles) if lag_cycles else []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None
    started = time.perf_counter()
    for step in range(size.steps):
        inputs, target = make_inputs(size, device, step)
        prediction = model(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
        if model is optimizer:  # the DeepSpeed engine
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        release_swapped_blocks(transformer)
        run.losses.append(float(loss.detach()))  # waits for the GPU: the lagging run's queue drains here
        if step == 0:
            started = time.perf_counter()
    run.seconds_per_step = (time.perf_counter() - started) / max(1, size.steps - 1)
    if swapper is not None:
        swapper.release()
        run.most_resident_blocks = swapper.statistics.most_resident
        run.largest_block_bytes = swapper.largest_block_bytes()
    if cuda:
        run.peak_allocated_bytes = torch.cuda.max_memory_allocated() - (run.left_by_earlier_runs_bytes or 0)
        run.peak_reserved_bytes = torch.cuda.max_memory_reserved()
        run.alloc_retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        run.weights_checksum = float(sum(parameter.detach().double().abs().sum().cpu() for parameter in trainable_parameters(transformer)))
    del transformer, model, optimizer, swapper
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def predicted_charge(run: TrainingRun, size: ProbeSize, device: torch.device) -> None:
    """The plan's training-phase GPU bytes (and its CUDA-context share) for the run's strategy and shape."""
    from fluxbooth.hardware import GIB, hypothetical_hardware
    from fluxbooth.plan import JobShape, Strategy, estimate_memory
    from gpu_probe_sizes import model_size_of

    swapped = run.variant.startswith("swapped")
    strategy = {
        "lora": Strategy("lora", False, 0, "none", "none", block_swap=swapped),
        "lora-zero2": Strategy("lora", True, 2, "none", "none", block_swap=swapped),
        "full-fused": Strategy("full", False, 0, "none", "none", block_swap=swapped, fused_backward_pass=True),
    }[run.training]
    job = JobShape(
        training_type=strategy.training_type, lora_rank=LORA_RANK, resolution=(size.resolution, size.resolution),
        max_sequence_length=size.text_tokens, optimizer="adafactor" if run.training == "full-fused" else "adamw",
    )
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * GIB
    hardware = hypothetical_hardware(gpus=1, gpu_memory_bytes=gpu_bytes, host_memory_bytes=128 * GIB, disk_bytes=64 * GIB)
    estimate = estimate_memory(strategy, model_size_of(size), job, hardware, "bf16")
    run.predicted_training_gpu_bytes = estimate.phase_gpu_bytes.get("training")
    run.predicted_cuda_context_bytes = estimate.breakdown.get("gpu.cuda_context", 0)


def variants(device: torch.device) -> tuple[str, ...]:
    # The CPU has no queue to fall behind on: the lagging run needs CUDA.
    return ("resident", "resident-again", "swapped", "swapped-lagging") if device.type == "cuda" else ("resident", "resident-again", "swapped")


def write_record(out: Path, runs: list[TrainingRun]) -> None:
    """The runs so far (rewritten after each: a process stopped at its deadline still leaves its rows)."""
    record = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "torch": torch.__version__, "runs": [asdict(run) for run in runs]}
    out.write_text(json.dumps(record, indent=1) + "\n")


def run_matrix(size: ProbeSize, device: torch.device, only: tuple[str, ...], out: Path) -> list[TrainingRun]:
    lag_cycles = int(LAG_MILLISECONDS_PER_BLOCK * sleep_cycles_per_millisecond(device)) if device.type == "cuda" else 0
    runs = []
    for training in only:
        for variant in variants(device):
            run = TrainingRun(training, variant)
            try:
                predicted_charge(run, size, device)
                train_steps(run, size, device, lag_cycles if variant == "swapped-lagging" else 0)
            except Exception as error:  # a failed run is a finding: recorded, the others still run
                run.error = f"{type(error).__name__}: {str(error)[:300]}"
            print(json.dumps(asdict(run)), flush=True)
            runs.append(run)
            write_record(out, runs)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench/gpu_probe.py's training matrix (one allocator setting)")
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trainings", default=",".join(TRAININGS))
    arguments = parser.parse_args(argv)
    device = torch.device(arguments.device)
    runs = run_matrix(SIZES[arguments.size], device, tuple(arguments.trainings.split(",")), arguments.out)
    return 0 if all(run.error is None for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
