"""RunPod's serverless GPU types as planning presets: `python -m fluxbooth plan --runpod-gpu "RTX 4090"`.

Each preset is one GPU type a serverless endpoint can run on, with what a worker gets on it and what it costs.

Sources (read 2026-11-27 from RunPod's documentation repository, github.com/runpod/docs, as of its commit
a900806 of 2026-08-20):
- the GPU types a serverless endpoint can select, their GPU IDs (the name NVML reports) and memory:
  flash/configuration/gpu-types.mdx ("Available GPU types", `GpuType`) and references/gpu-types.mdx ("GPU types"
  and "GPU pools"); where the two differ on memory (RTX 4000 Ada: 16 or 20 GB) the GPU types reference and the
  card's datasheet (20 GB) win;
- the price per second of a flex worker (one that scales to zero): snippets/serverless-gpu-pricing-table.mdx,
  the table docs.runpod.io/serverless/pricing shows. It prices pools, not cards: every card of a row costs the
  row's price. RunPod publishes no serverless price for the RTX 5090 (pool ADA_32_PRO): its preset has none, and
  the quote then prices only with FLUXBOOTH_PRICE_PER_HOUR.
- which pool (the endpoint's and hub.json's `gpuIds`) holds which types: the runpod SDK's `GpuGroup` enum, whose
  members name their cards, and the pricing table's rows, which group the cards the same way. (RunPod's Flash page,
  flash/configuration/gpu-types.mdx, lists the A4500 under AMPERE_24 and the L4 under ADA_24; the SDK and the
  prices say AMPERE_16 and AMPERE_24. Its ADA_80_PRO holds only the H100 SXM, the one H100 serverless lists.)
- host RAM and vCPUs: RunPod does not publish what a serverless worker gets beside each card (the Pods pricing page
  lists per-GPU RAM and vCPUs for Pods only, and a worker's share varies by host). The presets assume the hosts
  bench/runpod_gpu_tiers.py has used for the README's tables, by GPU memory (`ASSUMED_HOSTS`): low rather than
  high, since host RAM decides only whether offloading fits and the vCPUs only an offloaded optimizer's speed.
  Give --host-memory and --cpus with --runpod-gpu to plan for a host you know.
- GPU memory: RunPod's figure in GB, read as GiB (the cards' memory is a power-of-two size; NVML reports a little
  less on some, e.g. 140.4 GiB on the H200).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import short_name

GIB = 1024**3
# The container disk a Hub deploy gets (.runpod/hub.json containerDiskInGb); --disk overrides it.
RUNPOD_CONTAINER_DISK_GB = 80
# Assumed host of a serverless worker by the card's memory in GiB (the smallest key at or above it): (RAM GiB, vCPUs).
ASSUMED_HOSTS = {
    16: (62, 8),
    24: (62, 8),
    32: (62, 8),
    48: (94, 8),
    80: (188, 16),
    96: (188, 16),
    141: (188, 16),
    180: (188, 16),
}


@dataclass(frozen=True)
class RunpodGpu:
    name: str  # as RunPod's GPU types reference displays it
    gpu_id: str  # RunPod's GPU ID, the name NVML reports
    memory_gib: int
    pool: str  # the serverless GPU pool (endpoint and hub.json gpuIds)
    price_per_second: float | None  # a flex worker, USD; None where RunPod publishes none
    aliases: tuple[str, ...] = ()

    @property
    def host_memory_gib(self) -> int:
        return assumed_host(self.memory_gib)[0]

    @property
    def vcpus(self) -> int:
        return assumed_host(self.memory_gib)[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpu_id": self.gpu_id,
            "pool": self.pool,
            "price_per_second": self.price_per_second,
            "assumed_host_memory_gib": self.host_memory_gib,
            "assumed_vcpus": self.vcpus,
        }


def assumed_host(memory_gib: int) -> tuple[int, int]:
    """(host RAM in GiB, vCPUs) assumed for a serverless worker with a card of `memory_gib`."""
    return ASSUMED_HOSTS[min(size for size in ASSUMED_HOSTS if size >= memory_gib)]


# Cheapest pool first; within a pool as RunPod lists the cards.
RUNPOD_GPUS: tuple[RunpodGpu, ...] = (
    RunpodGpu("RTX A4000", "NVIDIA RTX A4000", 16, "AMPERE_16", 0.00016, ("A4000",)),
    RunpodGpu("RTX A4500", "NVIDIA RTX A4500", 20, "AMPERE_16", 0.00016, ("A4500",)),
    RunpodGpu("RTX 4000 Ada", "NVIDIA RTX 4000 Ada Generation", 20, "AMPERE_16", 0.00016, ("RTX 4000",)),
    RunpodGpu("RTX 2000 Ada", "NVIDIA RTX 2000 Ada Generation", 16, "AMPERE_16", 0.00016, ("RTX 2000",)),
    RunpodGpu("L4", "NVIDIA L4", 24, "AMPERE_24", 0.00019),
    RunpodGpu("RTX A5000", "NVIDIA RTX A5000", 24, "AMPERE_24", 0.00019, ("A5000",)),
    RunpodGpu("RTX 3090", "NVIDIA GeForce RTX 3090", 24, "AMPERE_24", 0.00019, ("3090",)),
    RunpodGpu("RTX 4090", "NVIDIA GeForce RTX 4090", 24, "ADA_24", 0.00031, ("4090",)),
    RunpodGpu("RTX 5090", "NVIDIA GeForce RTX 5090", 32, "ADA_32_PRO", None, ("5090",)),
    RunpodGpu("RTX A6000", "NVIDIA RTX A6000", 48, "AMPERE_48", 0.00034, ("A6000",)),
    RunpodGpu("A40", "NVIDIA A40", 48, "AMPERE_48", 0.00034),
    RunpodGpu("L40", "NVIDIA L40", 48, "ADA_48_PRO", 0.00053),
    RunpodGpu("L40S", "NVIDIA L40S", 48, "ADA_48_PRO", 0.00053),
    RunpodGpu("RTX 6000 Ada", "NVIDIA RTX 6000 Ada Generation", 48, "ADA_48_PRO", 0.00053, ("6000 Ada",)),
    RunpodGpu("A100 PCIe", "NVIDIA A100 80GB PCIe", 80, "AMPERE_80", 0.00076),
    RunpodGpu("A100 SXM", "NVIDIA A100-SXM4-80GB", 80, "AMPERE_80", 0.00076, ("A100",)),
    RunpodGpu("H100 SXM", "NVIDIA H100 80GB HBM3", 80, "ADA_80_PRO", 0.00116, ("H100",)),
    RunpodGpu(
        "RTX PRO 6000",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        96,
        "BLACKWELL_96",
        0.00111,
        (
            "RTX PRO 6000 WK",
            "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
            "RTX PRO 6000 MaxQ",
            "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
            "PRO 6000",
        ),
    ),
    RunpodGpu("H200 SXM", "NVIDIA H200", 141, "HOPPER_141", 0.00155, ("H200",)),
    RunpodGpu("B200", "NVIDIA B200", 180, "BLACKWELL_180", 0.00240),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def runpod_gpu(typed: str) -> RunpodGpu | None:
    """The preset for a GPU type as RunPod names it ("RTX 4090"), by its GPU ID ("NVIDIA GeForce RTX 4090") or a
    short name ("4090", "h100"); case, spaces and dashes do not matter."""
    wanted = _key(typed)
    for gpu in RUNPOD_GPUS:
        if wanted in {_key(gpu.name), _key(gpu.gpu_id), *(_key(alias) for alias in gpu.aliases)}:
            return gpu
    return None


def pool_gpus(pool: str) -> tuple[RunpodGpu, ...]:
    """The types a serverless pool ID (`ADA_48_PRO`) holds; none for a pool the planner does not know."""
    return tuple(gpu for gpu in RUNPOD_GPUS if gpu.pool == pool)


def known_names() -> str:
    return ", ".join(gpu.name for gpu in RUNPOD_GPUS)


def preset_for(typed: str, *, gpus_flag: int | None = None) -> RunpodGpu:
    """`plan --runpod-gpu TYPE`'s preset; invalid_input listing the known types for an unknown one."""
    gpu = runpod_gpu(typed)
    if gpu is None:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"--runpod-gpu '{short_name(typed)}' is no RunPod serverless GPU type the planner knows; known: {known_names()} "
            "(--runpod-gpu list shows their numbers)",
        )
    if gpus_flag == 0:
        raise FluxboothError(ErrorCode.INVALID_INPUT, "--runpod-gpu describes a GPU worker: drop --gpus 0")
    return gpu


def worker_flags(gpu: RunpodGpu) -> dict[str, Any]:
    """The hypothetical-hardware flags (argparse names) of one worker on `gpu`."""
    return {
        "gpus": 1,
        "gpu_memory": gpu.memory_gib * GIB,
        "host_memory": gpu.host_memory_gib * GIB,
        "cpus": gpu.vcpus,
        "disk": RUNPOD_CONTAINER_DISK_GB * 10**9,
        "gpu_name": gpu.gpu_id,
    }


def quote_price(
    gpu: RunpodGpu | None, endpoint_price_per_hour: float | None, gpus: int = 1
) -> tuple[float | None, str]:
    """The price per hour a quote uses and where it came from: the RunPod GPU type's for `gpus` cards (a worker
    with N cards is billed N times the card's rate), else the endpoint's (FLUXBOOTH_PRICE_PER_HOUR)."""
    if gpu is not None and gpu.price_per_second is not None:
        cards = f"{gpus} x {gpu.name}" if gpus > 1 else gpu.name
        return (
            gpu.price_per_second * 3600 * gpus,
            f"RunPod's flex price for {cards}, {gpu.price_per_second * gpus:g} USD/s",
        )
    return endpoint_price_per_hour, "FLUXBOOTH_PRICE_PER_HOUR"


def preset_list() -> list[dict[str, Any]]:
    """What `plan --runpod-gpu list --json` prints: every preset with its numbers."""
    return [{**gpu.to_dict(), "memory_gib": gpu.memory_gib, "aliases": list(gpu.aliases)} for gpu in RUNPOD_GPUS]


def preset_table() -> str:
    """What `plan --runpod-gpu list` prints: every preset with its numbers."""
    rows = [("GPU type", "GPU ID", "memory", "host RAM*", "vCPUs*", "pool", "USD/s (flex)")]
    for gpu in RUNPOD_GPUS:
        price = f"{gpu.price_per_second:.5f}" if gpu.price_per_second is not None else "not published"
        rows.append(
            (
                gpu.name,
                gpu.gpu_id,
                f"{gpu.memory_gib} GiB",
                f"{gpu.host_memory_gib} GiB",
                str(gpu.vcpus),
                gpu.pool,
                price,
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(
        "\n* assumed: RunPod does not publish a serverless worker's host RAM and vCPUs (see "
        "src/fluxbooth/plan/runpod_gpus.py); give --host-memory and --cpus to override. Prices: RunPod's serverless "
        "pricing, flex workers."
    )
    return "\n".join(lines) + "\n"
