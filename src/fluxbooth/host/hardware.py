"""What this worker really has: GPUs, the host memory the container may use, CPUs, disk.

No torch: GPUs are read with `nvidia-smi` (the handler process must stay light, and torch
would create a CUDA context). Host memory and CPUs come from host_limits (cgroup aware).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fluxbooth.host.container_limits import ASSUMED_CONTAINER_LIMITS, ContainerLimits, read_container_limits
from fluxbooth.host.limits import allowed_cpus, host_memory
from fluxbooth.messages import format_bytes

GIB = 1024**3
MIB = 1024**2

_NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,compute_cap,uuid"
_NVIDIA_SMI_TIMEOUT_SECONDS = 20


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None
    uuid: str | None = None  # "GPU-..." (nvidia-smi); CUDA_VISIBLE_DEVICES may name it instead of the index
    # The host link as NVML reports it (`pcie_link`): the block-swap time uses it instead of assuming x16.
    pcie_generation: int | None = None
    pcie_width: int | None = None

    @property
    def bf16_supported(self) -> bool:
        # bf16 tensor cores arrived with Ampere (sm_80); older cards emulate it slowly or not at all.
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compute_capability"] = (
            f"{self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else None
        )
        data["bf16_supported"] = self.bf16_supported
        return data


@dataclass(frozen=True)
class Hardware:
    """The machine as the planner sees it. `source` is "probe" or "hypothetical" (CLI flags)."""

    gpus: tuple[GpuInfo, ...]
    host_total_bytes: int
    host_available_bytes: int
    cpu_count: int
    work_dir: str
    disk_free_bytes: int
    nvme_path: str | None = None
    nvme_free_bytes: int | None = None
    cgroup_memory_limit_bytes: int | None = None
    source: str = "probe"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # RLIMIT_MEMLOCK and /dev/shm (host/container_limits.py): NVMe swap buffers are locked, NCCL uses /dev/shm.
    container: ContainerLimits = ASSUMED_CONTAINER_LIMITS

    @property
    def accelerator(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_memory_bytes(self) -> int:
        """Per-GPU memory a plan may use: the smallest card decides (0 without a GPU)."""
        return min((gpu.total_bytes for gpu in self.gpus), default=0)

    @property
    def gpu_free_bytes(self) -> int:
        return min((gpu.free_bytes for gpu in self.gpus), default=0)

    @property
    def bf16_supported(self) -> bool:
        return bool(self.gpus) and all(gpu.bf16_supported for gpu in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "accelerator": self.accelerator,
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "host_total_bytes": self.host_total_bytes,
            "host_available_bytes": self.host_available_bytes,
            "cgroup_memory_limit_bytes": self.cgroup_memory_limit_bytes,
            "cpu_count": self.cpu_count,
            "work_dir": self.work_dir,
            "disk_free_bytes": self.disk_free_bytes,
            "nvme_path": self.nvme_path,
            "nvme_free_bytes": self.nvme_free_bytes,
            "container_limits": self.container.to_dict(),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Byte sizes as people write them
# ---------------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """ "8GiB", "80 GB", "512MiB", "1.5TiB", "1234" → bytes. Raises ValueError with the text."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 8GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_size(text: str) -> int:
    """A size as a person types it, with its unit ("24GiB", "80GB", "512MiB", "1234B"): a bare number is
    refused, because "24" meaning 24 bytes (or 24 GB, or 24 GiB) is a guess either way."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*", text)
    if match:
        number = match.group(1)
        # A number this large was probably meant as bytes; anything smaller as GiB.
        suggestion = f"{number}B" if float(number) >= MIB else f"{number}GiB"
        raise ValueError(f"{text.strip()!r} has no unit; did you mean {suggestion}?")
    size = parse_bytes(text)
    if size <= 0:
        raise ValueError(f"{text.strip()!r} is not more than zero")
    return size


# ---------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------


# How CUDA reads CUDA_VISIBLE_DEVICES (CUDA C++ Programming Guide, "CUDA Environment Variables"; NVIDIA's MIG user
# guide, "CUDA Device Enumeration"; torch.cuda._parse_visible_devices, which mirrors the driver for its device count):
# - entries are indices or GPU-/MIG- UUIDs (or a unique prefix); the list's first entry says which kind it is, and
#   the devices from the first entry CUDA cannot use on are not visible ("0,2,-1,1" shows 0 and 2; "0,GPU-…" shows 0);
# - an index is read as strtoul reads it: its leading ASCII digits ("1gpu" is 1; "١" is no index at all);
# - a repeated device makes enumeration fail: no GPU is visible;
# - one process enumerates only one MIG instance: the first listed.
_ORDINAL = re.compile(r"\+?([0-9]+)")


def _visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it (see above): indices (as ASCII digits) or UUIDs, in order; None when
    every GPU is visible, [] when none is."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    entries = [item.strip() for item in raw.split(",")]
    prefix = next((kind for kind in ("GPU-", "MIG-") if entries[0].startswith(kind)), None)
    devices: list[str] = []
    for item in entries:
        ordinal = _ORDINAL.match(item)
        entry = (item if item.startswith(prefix) else None) if prefix else (str(int(ordinal[1])) if ordinal else None)
        if entry is None:
            break
        if entry in devices:
            return []
        devices.append(entry)
    return devices[:1] if prefix == "MIG-" else devices


def _names_gpu(entry: str, gpu: GpuInfo) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES entry names `gpu`: its index, or its UUID (CUDA accepts a unique prefix)."""
    if entry.isascii() and entry.isdigit():
        return int(entry) == gpu.index
    return gpu.uuid is not None and entry.startswith("GPU-") and gpu.uuid.startswith(entry)


_MIG_LINE = re.compile(
    r"^\s+MIG\s+(?P<profile>\d+g\.(?P<gigabytes>\d+)gb)\s+Device\s+\d+:\s+\(UUID:\s*(?P<uuid>MIG-[^)\s]+)\)"
)
_GPU_LINE = re.compile(r"^GPU\s+(?P<index>\d+):")


def parse_mig_listing(text: str) -> dict[str, tuple[int, str, int]]:
    """`nvidia-smi -L`'s MIG instances: UUID -> (parent GPU index, profile, the profile's memory in bytes)."""
    instances: dict[str, tuple[int, str, int]] = {}
    parent = None
    for line in text.splitlines():
        if gpu := _GPU_LINE.match(line):
            parent = int(gpu.group("index"))
        elif (mig := _MIG_LINE.match(line)) and parent is not None:
            instances[mig.group("uuid")] = (parent, mig.group("profile"), int(mig.group("gigabytes")) * 1000**3)
    return instances


def _mig_gpu(entry: str, gpus: Sequence[GpuInfo], instances: Mapping[str, tuple[int, str, int]]) -> GpuInfo | None:
    """A MIG instance as the GPU it is to CUDA: its profile's memory, its parent's name and capability."""
    found = next((value for uuid, value in instances.items() if uuid.startswith(entry)), None)
    if found is None:
        return None
    parent_index, profile, memory = found
    parent = next((gpu for gpu in gpus if gpu.index == parent_index), None)
    return GpuInfo(
        index=parent_index,
        name=f"{parent.name if parent else 'GPU'} MIG {profile}",
        total_bytes=memory,
        free_bytes=memory,
        compute_capability=parent.compute_capability if parent else None,
        uuid=entry,
    )


def visible_gpus(gpus: Sequence[GpuInfo], visible: Sequence[str], mig_listing: str) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES's entries name, in its order (indices, GPU-... or MIG-... UUIDs)."""
    instances = parse_mig_listing(mig_listing) if any(entry.startswith("MIG-") for entry in visible) else {}
    chosen: list[GpuInfo] = []
    for entry in visible:
        named = (
            [_mig_gpu(entry, gpus, instances)]
            if entry.startswith("MIG-")
            else [gpu for gpu in gpus if _names_gpu(entry, gpu)]
        )
        if len(named) != 1 or named[0] is None:
            break  # as CUDA does: the devices from an entry it cannot use (unknown, an ambiguous prefix) are not visible
        if named[0] in chosen:
            return []  # two entries naming one GPU (its index and its UUID): CUDA's enumeration fails
        chosen.append(named[0])
    return chosen


def parse_nvidia_smi_csv(text: str) -> list[GpuInfo]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,memory.free,compute_cap
    --format=csv,noheader,nounits` (memory in MiB)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 4:
            continue
        index, name, total, free = parts[:4]
        capability = None
        if len(parts) >= 5 and re.fullmatch(r"\d+\.\d+", parts[4]):
            major, minor = parts[4].split(".")
            capability = (int(major), int(minor))
        uuid = parts[5] if len(parts) >= 6 and parts[5].startswith("GPU-") else None
        try:
            gpus.append(
                GpuInfo(
                    index=int(index),
                    name=name,
                    total_bytes=int(float(total) * MIB),
                    free_bytes=int(float(free) * MIB),
                    compute_capability=capability,
                    uuid=uuid,
                )
            )
        except ValueError:
            # "[N/A]" memory on MIG parents or broken drivers: such a GPU cannot be planned on.
            continue
    return gpus


def probe_gpus(environ: Mapping[str, str], nvidia_smi: str | None = None) -> tuple[list[GpuInfo], str | None]:
    """GPUs visible to this process, and a note when none could be read (why)."""
    executable = nvidia_smi or shutil.which("nvidia-smi", path=environ.get("PATH"))
    if not executable:
        return [], "nvidia-smi not found: no NVIDIA driver in this container"
    try:
        completed = subprocess.run(
            [executable, f"--query-gpu={_NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_SECONDS,
            check=False,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return [], f"nvidia-smi failed to run ({error.__class__.__name__})"
    if completed.returncode != 0:
        first_line = (completed.stderr or completed.stdout).strip().splitlines()[:1]
        return [], f"nvidia-smi exited {completed.returncode}: {first_line[0][:200] if first_line else ''}"
    gpus = parse_nvidia_smi_csv(completed.stdout)
    visible = _visible_devices(environ)
    if visible is not None:
        listing = (
            _run_quietly([executable, "-L"], environ) if any(entry.startswith("MIG-") for entry in visible) else ""
        )
        seen = len(gpus)
        gpus = visible_gpus(gpus, visible, listing)
        if seen and not gpus:
            shown = environ["CUDA_VISIBLE_DEVICES"][:80]
            return [], (
                f"CUDA_VISIBLE_DEVICES={shown!r} leaves CUDA none of the machine's {seen} GPUs (an empty, "
                "unknown or repeated entry); list each GPU once, by index or UUID"
            )
    return [with_pcie_link(gpu) for gpu in gpus], None


def _run_quietly(command: list[str], environ: Mapping[str, str]) -> str:
    """A command's stdout, or "" when it cannot run."""
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_SECONDS, check=False, env=dict(environ)
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return completed.stdout if completed.returncode == 0 else ""


def pcie_link(index: int) -> tuple[int, int] | None:
    """(generation, lanes) of GPU `index`'s host link through NVML (nvidia-ml-py), or None without it. The link
    the device and the system train to: an idle GPU drops its current link to a lower generation to save
    power, so the current reading is only the fallback."""
    try:
        import pynvml  # optional: nvidia-ml-py is installed only in the CUDA image
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            return int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)), int(
                pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
            )
        except pynvml.NVMLError:
            return int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)), int(
                pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            )
    except Exception:  # no driver, no such device, an SXM part without a PCIe reading: the datasheet decides
        return None


def with_pcie_link(gpu: GpuInfo) -> GpuInfo:
    link = pcie_link(gpu.index)
    return gpu if link is None else replace(gpu, pcie_generation=link[0], pcie_width=link[1])


# ---------------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------------


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    current = path.expanduser().absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    try:
        return shutil.disk_usage(current).free
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def nvme_root(environ: Mapping[str, str]) -> Path | None:
    """FLUXBOOTH_NVME_PATH: the fast local disk DeepSpeed may offload to (None when unset)."""
    raw = environ.get("FLUXBOOTH_NVME_PATH", "").strip()
    return Path(raw) if raw else None


GPU_MEMORY_OVERRIDE_ENV = "FLUXBOOTH_GPU_MEMORY_BYTES"


def with_emulated_gpu_memory(gpus: Sequence[GpuInfo], environ: Mapping[str, str]) -> tuple[list[GpuInfo], str | None]:
    """FLUXBOOTH_GPU_MEMORY_BYTES ("24GiB", or bytes): plan as if each GPU had at most this much memory.
    bench/gpu.py emulates smaller cards on a big one with it, beside the fraction of the card the trainer may
    allocate (CUDA_MEMORY_FRACTION_ENV, contract/environment.py); unset on real workers."""
    raw = environ.get(GPU_MEMORY_OVERRIDE_ENV, "").strip()
    if not raw or not gpus:
        return list(gpus), None
    try:
        cap = parse_bytes(raw)
    except ValueError as error:
        raise ValueError(f"{GPU_MEMORY_OVERRIDE_ENV}: {error}") from error
    capped = [replace(gpu, total_bytes=min(gpu.total_bytes, cap), free_bytes=min(gpu.free_bytes, cap)) for gpu in gpus]
    return capped, f"GPU memory capped at {format_bytes(cap)} by {GPU_MEMORY_OVERRIDE_ENV}"


def probe_hardware(
    work_dir: Path,
    environ: Mapping[str, str],
    *,
    root: Path = Path("/"),
    nvidia_smi: str | None = None,
    shm: Path = Path("/dev/shm"),
) -> Hardware:
    """Probe this machine. `environ` supplies CUDA_VISIBLE_DEVICES, PATH (to find nvidia-smi)
    and FLUXBOOTH_NVME_PATH (where DeepSpeed may offload to disk)."""
    notes: list[str] = []
    gpus, gpu_note = probe_gpus(environ, nvidia_smi)
    if gpu_note:
        notes.append(gpu_note)
    gpus, emulation_note = with_emulated_gpu_memory(gpus, environ)
    if emulation_note:
        notes.append(emulation_note)
    total, available, limit = host_memory(root)
    nvme_path = nvme_root(environ)
    return Hardware(
        gpus=tuple(gpus),
        host_total_bytes=total,
        host_available_bytes=available,
        cpu_count=allowed_cpus(root),
        work_dir=str(work_dir),
        disk_free_bytes=free_disk_bytes(work_dir),
        nvme_path=str(nvme_path) if nvme_path else None,
        nvme_free_bytes=free_disk_bytes(nvme_path) if nvme_path else None,
        cgroup_memory_limit_bytes=limit,
        source="probe",
        notes=tuple(notes),
        container=read_container_limits(root, shm),
    )


def hypothetical_hardware(
    *,
    gpus: int,
    gpu_memory_bytes: int,
    host_memory_bytes: int,
    disk_bytes: int,
    cpu_count: int = 16,
    gpu_name: str = "hypothetical GPU",
    compute_capability: tuple[int, int] = (9, 0),
    nvme_path: str | None = None,
    work_dir: str = "(hypothetical)",
) -> Hardware:
    """A machine described by numbers, for sizing an endpoint before deploying it."""
    cards = tuple(
        GpuInfo(
            index=index,
            name=gpu_name,
            total_bytes=gpu_memory_bytes,
            free_bytes=gpu_memory_bytes,
            compute_capability=compute_capability,
        )
        for index in range(gpus)
    )
    return Hardware(
        gpus=cards,
        host_total_bytes=host_memory_bytes,
        host_available_bytes=host_memory_bytes,
        cpu_count=cpu_count,
        work_dir=work_dir,
        disk_free_bytes=disk_bytes,
        nvme_path=nvme_path,
        nvme_free_bytes=disk_bytes if nvme_path else None,
        source="hypothetical",
        container=ASSUMED_CONTAINER_LIMITS,  # RunPod's normal container (see host/container_limits.py)
    )
