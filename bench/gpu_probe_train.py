"""One section of bench/gpu_probe.py, in its own process (so that the probe can stop it at its time budget, and a
card cap set in one cannot touch the next):

- `imports`: torch, DeepSpeed, diffusers, peft and the project's trainer and planner imported; the GPU, driver
  and CUDA named; `ulimit -l` (RLIMIT_MEMLOCK, which caps what DeepSpeed and the swapper page-lock) and the size
  of /dev/shm (NCCL's shared-memory transport) recorded;
- `resident`: FLUX.1-dev built on the device with random weights, LoRA steps with the whole model on the card;
- `swapped`: the same with the blocks streamed from host RAM (train/blockswap.py) under a 24 GiB cap (the
  trainer's own FLUXBOOTH_CUDA_MEMORY_FRACTION, applied by train/session.limit_cuda_memory);
- `render`: one validation image through the trainer's render loop (train/validation.render_prompts) in the
  pipeline the mid-training renders build (FamilyOps.pipeline_on), the transformer resident.
Each training section and the render record the planner's figures for the same job and placement beside what
they measured. The record is rewritten after every stage: a section stopped at its budget leaves what it had.

Usage (by bench/gpu_probe.py): python bench/gpu_probe_train.py --section NAME --device cuda|cpu --size NAME --record FILE.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_probe_sizes import SIZES, ProbeSize  # noqa: E402

SECTIONS = ("imports", "resident", "swapped", "render")
# What the probe cannot run without; the others (peft, accelerate, transformers) are recorded too.
REQUIRED_IMPORTS = ("torch", "deepspeed", "diffusers", "fluxbooth.train.validation", "fluxbooth.plan")
RECORDED_IMPORTS = ("peft", "accelerate", "transformers", "pynvml")
RENDER_PROMPT = "a photo of sks dog"


class Record(dict[str, Any]):
    """The section's findings, written to `path` whenever a stage adds to them."""

    def __init__(self, path: Path, section: str) -> None:
        super().__init__(section=section)
        self.path = path

    def add(self, **values: Any) -> None:
        self.update(values)
        self.path.write_text(json.dumps(self, indent=1, default=str) + "\n")


def imports_section(record: Record, size: ProbeSize, device_type: str) -> None:
    """Each import's version or error, the container's limits, the GPU and its driver."""
    imported: dict[str, str] = {}
    for name in (*REQUIRED_IMPORTS, *RECORDED_IMPORTS):
        started = time.monotonic()
        try:
            module = importlib.import_module(name)
            imported[name] = f"{getattr(module, '__version__', 'ok')} ({time.monotonic() - started:.1f} s)"
        except Exception as error:  # recorded: the table names what could not load
            imported[name] = f"FAILED {type(error).__name__}: {str(error)[:200]}"
    record.add(imports=imported, ok=all(not imported[name].startswith("FAILED") for name in REQUIRED_IMPORTS))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        shm = os.statvfs("/dev/shm")
        shm_bytes: int | str = shm.f_blocks * shm.f_frsize
    except OSError as error:
        shm_bytes = f"unreadable ({error})"
    record.add(
        python=platform.python_version(),
        memlock_soft=None if soft == resource.RLIM_INFINITY else soft,
        memlock_hard=None if hard == resource.RLIM_INFINITY else hard,
        dev_shm_bytes=shm_bytes,
        cpu_count=os.cpu_count(),
    )
    record.add(**gpu_description(device_type))


def gpu_description(device_type: str) -> dict[str, Any]:
    import torch

    if device_type != "cuda":
        return {"gpu": f"none (CPU dry run, {platform.machine()})"}
    properties = torch.cuda.get_device_properties(0)
    described: dict[str, Any] = {
        "gpu": properties.name,
        "gpu_memory_bytes": properties.total_memory,
        "cuda": torch.version.cuda,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        described["driver"] = pynvml.nvmlSystemGetDriverVersion()
        described["pcie"] = (
            f"gen {pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)}"
        )
    except Exception as error:  # NVML missing: named, the rest still runs
        described["driver"] = f"unknown ({type(error).__name__})"
    return described


def training_section(record: Record, size: ProbeSize, device_type: str, *, swapped: bool) -> None:
    """LoRA steps at `size` resident, or block-swapped under the 24 GiB cap, against the planner's figures."""
    import torch
    from gpu_probe_model import (
        LEARNING_RATE,
        SWAPPED_CARD_BYTES,
        adapter_in_fp32,
        add_lora,
        build_transformer,
        device_memory,
        planned,
        reset_peaks,
        this_machine,
        train_steps,
    )

    from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
    from fluxbooth.train.blockswap import BlockSwapper, attach_swapper, flux_blocks, release_swapped_blocks
    from fluxbooth.train.model import trainable_parameters

    device = torch.device(device_type)
    record.add(planned=planned(size, this_machine(device), swapped=swapped))
    started = time.monotonic()
    transformer = build_transformer(size, device)
    add_lora(transformer)
    adapter_in_fp32(transformer)
    record.add(build_seconds=round(time.monotonic() - started, 1))
    swapper = None
    if swapped:
        started = time.monotonic()
        # The blocks' frozen tensors are copied from the device into page-locked host memory one at a time.
        swapper = BlockSwapper(flux_blocks(transformer), device)
        attach_swapper(transformer, swapper)
        swapper.place_the_rest(transformer)
        gc.collect()
        record.add(
            swapper_seconds=round(time.monotonic() - started, 1),
            host_bytes=swapper.host_bytes(),
            largest_block_bytes=swapper.largest_block_bytes(),
            card_cap=cap_the_card(device, SWAPPED_CARD_BYTES),
        )
    parameters = trainable_parameters(transformer)
    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, **OPTIMIZER_HYPERPARAMETERS["adamw"])
    record.add(trainable_params=sum(parameter.numel() for parameter in parameters))
    reset_peaks(device)
    trained = train_steps(transformer, optimizer, size, device, lambda: release_swapped_blocks(transformer))
    if swapper is not None:
        swapper.release()
        trained["most_resident_blocks"] = swapper.statistics.most_resident
    record.add(**trained, **device_memory(device))


def cap_the_card(device: Any, card_bytes: int) -> float | None:
    """The trainer's card emulation (FLUXBOOTH_CUDA_MEMORY_FRACTION through train/session.limit_cuda_memory),
    applied once the model is built and its blocks are in host RAM; the fraction applied (None on the CPU)."""
    import torch

    from fluxbooth.contract.environment import CUDA_MEMORY_FRACTION_ENV
    from fluxbooth.train.session import limit_cuda_memory

    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    fraction = card_bytes / torch.cuda.get_device_properties(device).total_memory
    return limit_cuda_memory({CUDA_MEMORY_FRACTION_ENV: f"{min(fraction, 1.0):.6f}"})


@dataclass(frozen=True)
class RenderAccelerator:
    device: Any


@dataclass(frozen=True)
class RenderBase:
    ops: Any


@dataclass(frozen=True)
class RenderSession:
    """What `render_prompts` reads of the trainer's session: its config, its device, the base's family ops."""

    config: Any
    accelerator: RenderAccelerator
    base: RenderBase


def render_section(record: Record, size: ProbeSize, device_type: str) -> None:
    """One image through train/validation.render_prompts, the pipeline built as the mid-training rounds build it,
    its seconds and peak against the planner's render time and validation-phase charge."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from gpu_probe_model import add_lora, build_transformer, device_memory, planned, reset_peaks, this_machine
    from gpu_probe_sizes import scheduler_config, transformer_config, vae_config

    from fluxbooth.train.validation import RenderTarget, render_prompts

    device = torch.device(device_type)
    record.add(planned=planned(size, this_machine(device), swapped=False))
    started = time.monotonic()
    transformer = build_transformer(size, device)
    add_lora(transformer)
    transformer.eval()
    torch.manual_seed(2)
    with torch.device(device):
        vae = AutoencoderKL(**vae_config(size)).to(torch.bfloat16)
    record.add(build_seconds=round(time.monotonic() - started, 1))
    work = Path(tempfile.mkdtemp(prefix="gpu-probe-render-"))
    state = render_state(size, device, work, transformer_config(size))
    pipeline = state.session.base.ops.pipeline_on(
        device, scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()), vae=vae, transformer=transformer
    )
    pipeline.set_progress_bar_config(disable=True)
    reset_peaks(device)
    started = time.monotonic()
    folder = work / "output" / "validation" / "probe"
    render_prompts(state, pipeline, RenderTarget(folder, 0, "validation_probe"), dtype=torch.bfloat16, writes=True)
    seconds = time.monotonic() - started
    images = sorted(folder.glob("*.png"))
    record.add(
        render_seconds=round(seconds, 2),
        images=[f"{path.name} ({path.stat().st_size} bytes)" for path in images],
        **device_memory(device),
    )


def render_state(size: ProbeSize, device: Any, work: Path, transformer: dict[str, Any]) -> Any:
    """A TrainerState holding what render_prompts reads: a trainer config of one validation prompt at the
    probe's size, the FLUX.1 family's ops (from a model_index.json), the prompt's embeddings (random)."""
    import diffusers
    import torch

    from fluxbooth.contract.buckets import Resolution
    from fluxbooth.contract.settings_groups import Memory, Optimisation, Prompts, Sampling, Validation
    from fluxbooth.contract.trainer_config import TrainerConfig
    from fluxbooth.train.base_model import ops_for
    from fluxbooth.train.state import CachedData, EncodedPrompts, TrainerState

    base = work / "base"
    base.mkdir(parents=True)
    (base / "model_index.json").write_text(
        json.dumps({"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__})
    )
    config = TrainerConfig(
        base_model=str(base),
        instance_dir=str(work / "instance"),
        class_dir=None,
        output_dir=str(work / "output"),
        cache_dir=str(work / "cache"),
        resolution=Resolution(fixed=(size.resolution, size.resolution)),
        training_type="lora",
        prompts=Prompts(instance_prompt=RENDER_PROMPT),
        optimisation=Optimisation(steps=1, learning_rate=1e-4, batch_size=1, gradient_accumulation_steps=1, seed=0),
        sampling=Sampling(
            max_sequence_length=size.text_tokens,
            validation_inference_steps=size.render_steps,
            validation_guidance_scale=3.5,
            class_image_inference_steps=size.render_steps,
        ),
        memory=Memory(
            mixed_precision="bf16",
            checkpoint_every=1,
            zero_stage=0,
            offload_optimizer="none",
            offload_param="none",
        ),
        validation=Validation(prompts=(RENDER_PROMPT,)),
    )
    generator = torch.Generator().manual_seed(3)
    embeddings = EncodedPrompts(
        prompts=[RENDER_PROMPT],
        prompt_embeds=torch.randn(1, size.text_tokens, transformer["joint_attention_dim"], generator=generator),
        pooled_prompt_embeds=torch.randn(1, transformer["pooled_projection_dim"], generator=generator),
    )
    session = RenderSession(config, RenderAccelerator(device), RenderBase(ops_for(base)))
    # The cache stage's other fields (the encoded image sets) are not read by a render.
    data = CachedData(instance_set=None, class_set=None, validation_prompts=embeddings, released_before_training=[])  # type: ignore[arg-type]
    return TrainerState(session=session, data=data)  # type: ignore[arg-type]


def run_section(section: str, record: Record, size: ProbeSize, device_type: str) -> None:
    runs: dict[str, Callable[[], None]] = {
        "imports": lambda: imports_section(record, size, device_type),
        "resident": lambda: training_section(record, size, device_type, swapped=False),
        "swapped": lambda: training_section(record, size, device_type, swapped=True),
        "render": lambda: render_section(record, size, device_type),
    }
    runs[section]()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one section of bench/gpu_probe.py")
    parser.add_argument("--section", choices=SECTIONS, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--record", type=Path, required=True)
    arguments = parser.parse_args(argv)
    record = Record(arguments.record, arguments.section)
    started = time.monotonic()
    try:
        run_section(arguments.section, record, SIZES[arguments.size], arguments.device)
    except Exception as error:  # recorded: the table shows the section's error, the next section still runs
        traceback.print_exc()
        record.add(error=f"{type(error).__name__}: {str(error)[:300]}")
    record.add(seconds=round(time.monotonic() - started, 1))
    return 1 if "error" in record or record.get("ok") is False else 0


if __name__ == "__main__":
    sys.exit(main())
