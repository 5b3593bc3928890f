"""The machine plan sizes for: hypothetical hardware described whole by flags (--gpus, --gpu-memory,
--host-memory, --cpus, --disk, --gpu-name) or filled in from a RunPod GPU type (--runpod-gpu), else this
machine probed."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import Hardware, hypothetical_hardware, probe_hardware
from fluxbooth.messages import short_name
from fluxbooth.plan.gpus import GPU_TABLE, gpu_spec
from fluxbooth.plan.runpod_gpus import RunpodGpu, preset_for, worker_flags
from fluxbooth.settings import WorkerSettings

# Hypothetical hardware is described whole, or not at all: nothing of this machine is mixed in.
HARDWARE_FLAGS = (
    ("--gpus", "gpus"),
    ("--gpu-memory", "gpu_memory"),
    ("--host-memory", "host_memory"),
    ("--cpus", "cpus"),
    ("--disk", "disk"),
)


def matched_gpu_name(typed: str) -> str:
    """The planner's name for a card as people type it ("4090", "rtx4090", "RTX 4090"); invalid_input
    listing the known cards when it matches none."""
    spec = gpu_spec(typed)
    if spec is None:
        known = ", ".join(row.name for _, row in GPU_TABLE)
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"--gpu-name '{short_name(typed)}' matches no card the planner knows ({known}); leave --gpu-name out to time "
            "the job as an unknown card",
        )
    return spec.name


def _hypothetical_hardware(arguments: argparse.Namespace) -> Hardware | None:
    """The machine the flags describe, or None without hardware flags; invalid_input when it is described
    only in part."""
    given = {flag: getattr(arguments, name) for flag, name in HARDWARE_FLAGS}
    if all(value is None for value in given.values()) and arguments.gpu_name is None:
        return None
    cpu_only = arguments.gpus == 0
    missing = [flag for flag, value in given.items() if value is None and not (cpu_only and flag == "--gpu-memory")]
    if missing:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"hypothetical hardware needs {', '.join(missing)} as well: give all of --gpus, --gpu-memory, "
            "--host-memory, --cpus and --disk (--gpus 0: no --gpu-memory), or none to plan for this machine; "
            "its own values are never mixed in",
        )
    if cpu_only and (arguments.gpu_memory is not None or arguments.gpu_name is not None):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT, "--gpus 0 describes a machine without a GPU: drop --gpu-memory and --gpu-name"
        )
    return hypothetical_hardware(
        gpus=arguments.gpus,
        gpu_memory_bytes=arguments.gpu_memory or 0,
        host_memory_bytes=arguments.host_memory,
        disk_bytes=arguments.disk,
        cpu_count=arguments.cpus,
        gpu_name=matched_gpu_name(arguments.gpu_name) if arguments.gpu_name else "hypothetical GPU",
        nvme_path=arguments.nvme_path,
    )


def hardware_from(arguments: argparse.Namespace, settings: WorkerSettings, environ: Mapping[str, str]) -> Hardware:
    hypothetical = _hypothetical_hardware(arguments)
    if hypothetical is not None:
        return hypothetical
    probe_env = dict(environ)
    if arguments.nvme_path:
        probe_env["FLUXBOOTH_NVME_PATH"] = arguments.nvme_path
    return probe_hardware(settings.work_root, probe_env)


def apply_runpod_preset(arguments: argparse.Namespace) -> RunpodGpu | None:
    """The RunPod GPU type --runpod-gpu names (plan.runpod_gpus), its machine filled into the hardware flags not
    given; None without the flag."""
    if arguments.runpod_gpu is None:
        return None
    gpu = preset_for(arguments.runpod_gpu, gpus_flag=arguments.gpus)
    for name, value in worker_flags(gpu).items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    return gpu
