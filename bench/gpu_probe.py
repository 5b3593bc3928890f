"""One short GPU call that gathers the memory evidence of issue 26 (docs/development/gpu-probe.md).

On a reduced-depth FLUX.1-dev at full width (bench/gpu_probe_sizes.py: 2 double and 4 single blocks at hidden
3072, 512², 4 steps), through the project's own swapper, quantiser and planner:
1. pinned bytes: every distinct tensor of one double and one single block pinned as torch pins it (the host
   allocator's `allocated_bytes`, its rounded size) against its stored size; the whole model's blocks pinned by
   `BlockSwapper`, and the process's RSS before, after the swapper is gone, and after the host cache is
   released (`torch._C._host_emptyCache`, where it exists);
2. host <-> device bandwidth, pinned and pageable;
3. fp8 and nf4 (train/quantize.py): the weights dequantised on the GPU against the CPU's, codes quantised on
   the GPU against the CPU's, milliseconds per layer on each;
4. swapped against resident training (LoRA, LoRA under ZeRO-2, the fused full fine-tune; also with the GPU
   lagging behind the CPU): losses and trained weights, peak allocated and reserved against the plan's charge,
   allocator retries; once per allocator setting (`ALLOCATOR_SETTINGS`), each in its own process
   (bench/gpu_probe_train.py).
It writes at most 8 files into --out and prints a short table last. `--device cpu` is its dry run: the same
code, at a CPU size, with what needs CUDA marked so.

Usage: python bench/gpu_probe.py --device cuda|cpu --out DIR [--size h100|cpu|tiny]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from gpu_probe_sizes import SIZES, ProbeSize  # noqa: E402
from gpu_probe_table import ALLOCATOR_SETTINGS, render_table  # noqa: E402

QUANTISED = ("fp8", "nf4")
# Each training process's share of the 8-minute call (two of them); on the CPU, of the dry run's 5 minutes (the
# first process trains all three, the second one: SECOND_SETTING_TRAININGS_ON_CPU).
TRAINING_TIMEOUT_SECONDS = {"cuda": (170, 170), "cpu": (190, 70)}
# On the CPU the allocator setting means nothing: the second process runs one training, to prove the path.
SECOND_SETTING_TRAININGS_ON_CPU = "lora"


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_pinned_bytes() -> int | None:
    """Bytes of pinned blocks the caching host allocator owns (rounded sizes), or None before CUDA."""
    statistics_of = getattr(torch.cuda, "host_memory_stats", None)  # torch 2.8 and later
    if statistics_of is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(statistics_of().get("allocated_bytes.current", 0))


def release_host_cache() -> bool:
    """Return cached pinned blocks to the driver; whether this torch can."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is None or not torch.cuda.is_available():
        return False
    release()
    return True


def environment(device: torch.device) -> dict[str, Any]:
    """The machine and every version a number depends on."""
    described: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()}
    for name in ("diffusers", "deepspeed", "peft", "accelerate", "transformers"):
        try:
            described[name] = __import__(name).__version__
        except Exception as error:  # recorded: the probe's rows say which part could not load
            described[name] = f"missing ({type(error).__name__})"
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        described.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory, cuda=torch.version.cuda)
        try:
            import pynvml

            pynvml.nvmlInit()
            described["driver"] = pynvml.nvmlSystemGetDriverVersion()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            described["pcie"] = f"gen {pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)}"
        except Exception as error:
            described["driver"] = f"unknown ({type(error).__name__})"
    else:
        described["gpu"] = f"none (CPU dry run, {platform.machine()})"
    return described


def block_tensors(size: ProbeSize, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """One tensor of every distinct (shape, dtype) in the first double and first single block, bf16."""
    from fluxbooth.train.blockswap import flux_blocks
    from gpu_probe_train import build_transformer

    transformer = build_transformer(size, device, keep_on=torch.device("cpu"))
    blocks = flux_blocks(transformer)
    seen: dict[tuple[Any, ...], tuple[str, torch.Tensor]] = {}
    for prefix, block in (("double", blocks[0]), ("single", blocks[size.double_blocks])):
        for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
            seen.setdefault((tuple(tensor.shape), tensor.dtype), (f"{prefix}.{name}", tensor.detach()))
    return list(seen.values())


def pinned_per_tensor(size: ProbeSize, device: torch.device) -> list[dict[str, Any]]:
    """Each distinct block tensor pinned as `Tensor.pin_memory` does, the host allocator's bytes for it."""
    rows = []
    for name, tensor in block_tensors(size, device):
        stored = tensor.numel() * tensor.element_size()
        row: dict[str, Any] = {"tensor": name, "shape": list(tensor.shape), "stored_bytes": stored, "pinned_bytes": None}
        if device.type == "cuda":
            release_host_cache()
            before = host_pinned_bytes() or 0
            pinned = tensor.pin_memory()
            row["pinned_bytes"] = (host_pinned_bytes() or 0) - before
            del pinned
        rows.append(row)
    release_host_cache()
    return rows


def swapper_host_memory(size: ProbeSize, device: torch.device) -> dict[str, Any]:
    """The model's blocks handed to BlockSwapper (pinned on CUDA): stored bytes, pinned bytes, RSS at each stage.
    After mem-core's merge, the planner's host charge for the same blocks goes beside `stored_bytes` here."""
    from fluxbooth.train.blockswap import BlockSwapper, flux_blocks
    from gpu_probe_train import build_transformer

    gc.collect()
    release_host_cache()
    pinned_before = host_pinned_bytes() or 0
    transformer = build_transformer(size, device, keep_on=torch.device("cpu"))
    result: dict[str, Any] = {"rss_model_built": rss_bytes()}
    transformer.requires_grad_(False)  # a LoRA's frozen base: the swapper takes (and pins) every block tensor
    swapper = BlockSwapper(flux_blocks(transformer), device)
    gc.collect()
    result.update(stored_bytes=swapper.host_bytes(), largest_block_bytes=swapper.largest_block_bytes(), rss_swapper=rss_bytes())
    pinned = host_pinned_bytes()
    result["pinned_bytes"] = None if pinned is None else pinned - pinned_before
    swapper.detach()
    del swapper, transformer
    gc.collect()
    result["rss_freed"] = rss_bytes()
    result["host_cache_released"] = release_host_cache()
    result["rss_released"] = rss_bytes()
    return result


def bandwidth(size: ProbeSize, device: torch.device) -> dict[str, Any]:
    """GB/s host -> device (pinned and pageable) and device -> host (pinned): the median of 5 copies."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    count = size.bandwidth_bytes
    pinned = torch.empty(count, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(count, dtype=torch.uint8)
    on_device = torch.empty(count, dtype=torch.uint8, device=device)

    def gigabytes_per_second(copy: Any) -> float:
        seconds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        return round(count / statistics.median(seconds) / 1e9, 2)

    result = {
        "bytes": count,
        "h2d_pinned": gigabytes_per_second(lambda: on_device.copy_(pinned, non_blocking=True)),
        "d2h_pinned": gigabytes_per_second(lambda: pinned.copy_(on_device, non_blocking=True)),
        "h2d_pageable": gigabytes_per_second(lambda: on_device.copy_(pageable)),
    }
    del pinned, pageable, on_device
    torch.cuda.empty_cache()
    release_host_cache()
    return result


def milliseconds(action: Any, device: torch.device, repeats: int) -> float:
    synchronize(device)
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        synchronize(device)
        timings.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(timings), 3)


def quantised_layers(size: ProbeSize, device: torch.device) -> list[dict[str, Any]]:
    """Each distinct quantised Linear shape of the blocks, fp8 and nf4: GPU against CPU, ms per layer."""
    from fluxbooth.train.quantize import quantised_linear

    shapes = sorted({tuple(tensor.shape) for name, tensor in block_tensors(size, device) if tensor.dim() == 2 and name.endswith("weight")})
    rows = []
    generator = torch.Generator().manual_seed(7)
    for shape in shapes:
        weight = (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)
        for precision in QUANTISED:
            on_cpu = quantised_linear(precision, weight, None)
            reference = on_cpu.dequantise(torch.bfloat16)
            moved = copy.deepcopy(on_cpu).to(device)
            dequantised = moved.dequantise(torch.bfloat16).cpu()
            quantised_there = quantised_linear(precision, weight.to(device), None)
            codes_differ = sum(
                int((mine.cpu() != theirs).sum()) for mine, theirs in zip(quantised_there.buffers(), on_cpu.buffers(), strict=True)
            )
            rows.append({
                "shape": list(shape), "precision": precision,
                "dequantised_equal": bool(torch.equal(dequantised, reference)),
                "max_abs_difference": float((dequantised.float() - reference.float()).abs().max()),
                "codes_differing": codes_differ, "codes_total": sum(buffer.numel() for buffer in on_cpu.buffers()),
                "ms_device": milliseconds(lambda layer=moved: layer.dequantise(torch.bfloat16), device, repeats=5 if device.type == "cuda" else 2),
                "ms_cpu": milliseconds(lambda layer=on_cpu: layer.dequantise(torch.bfloat16), torch.device("cpu"), repeats=2),
            })
            del on_cpu, moved, quantised_there
    return rows


# DeepSpeed on the CPU accelerator loads (and first compiles) its shared-memory communication op when its process
# group starts. Loaded here, outside the training processes' time limits: a process killed while compiling would
# leave the extension cache's lock behind, and every later DeepSpeed start on the machine would wait on it.
LOAD_CPU_COMMUNICATION_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def cpu_environment(env: dict[str, str]) -> dict[str, str]:
    """The dry run's DeepSpeed settings: the CPU accelerator and the project's extension cache."""
    env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for CUDA
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "fluxbooth" / "torch_extensions"))
    return env


def training(size: ProbeSize, device: torch.device, out: Path) -> dict[str, Any]:
    """bench/gpu_probe_train.py once per allocator setting, each in its own process (CUDA reads the setting once)."""
    results: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this process's cached blocks are not the training processes' to compete with
    else:
        subprocess.run([sys.executable, "-c", LOAD_CPU_COMMUNICATION_OP], env=cpu_environment(dict(os.environ)), capture_output=True, check=False)
    for position, (label, setting) in enumerate(ALLOCATOR_SETTINGS.items()):
        record = out / f"train-{label}.json"
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": setting, "PYTHONUNBUFFERED": "1"}
        if device.type == "cpu":
            env = cpu_environment(env)
        command = [sys.executable, str(BENCH / "gpu_probe_train.py"), "--device", device.type, "--size", size.name, "--out", str(record)]
        if device.type == "cpu" and position > 0:
            command += ["--trainings", SECOND_SETTING_TRAININGS_ON_CPU]
        started = time.monotonic()
        with (out / f"train-{label}.log").open("w") as log:
            try:
                completed = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=TRAINING_TIMEOUT_SECONDS[device.type][position], check=False)
                exit_status: int | str = completed.returncode
            except subprocess.TimeoutExpired:
                exit_status = "timeout"
        loaded = json.loads(record.read_text()) if record.is_file() else {"runs": []}
        results[label] = {**loaded, "exit": exit_status, "seconds": round(time.monotonic() - started, 1)}
    return results


def measure(size: ProbeSize, device: torch.device, out: Path) -> dict[str, Any]:
    """Every section, each timed; a section that fails records its error and the others still run."""
    report: dict[str, Any] = {"size": size.name, "device": device.type, "environment": environment(device), "seconds": {}}
    sections = {
        "pinned_per_tensor": lambda: pinned_per_tensor(size, device),
        "swapper_host": lambda: swapper_host_memory(size, device),
        "bandwidth": lambda: bandwidth(size, device),
        "quantised": lambda: quantised_layers(size, device),
        "training": lambda: training(size, device, out),
    }
    for name, section in sections.items():
        started = time.monotonic()
        try:
            report[name] = section()
        except Exception as error:  # recorded, the probe goes on: one broken section must not cost the call
            report[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        report["seconds"][name] = round(time.monotonic() - started, 1)
        print(f"probe: {name} in {report['seconds'][name]} s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="at most 8 files are written here")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: h100 on cuda, cpu on the CPU")
    arguments = parser.parse_args(argv)
    if arguments.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    size = SIZES[arguments.size or ("h100" if arguments.device == "cuda" else "cpu")]
    device = torch.device(arguments.device)
    out = arguments.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = measure(size, device, out)
    report["seconds"]["total"] = round(time.monotonic() - started, 1)
    (out / "probe.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = render_table(report)
    (out / "table.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
