"""What the GPUs RunPod rents can do, from the vendors' datasheets, matched on the names NVML reports.

Each row: dense bf16 tensor-core peak (FLOP/s; datasheets that quote "with sparsity" are halved), memory
bandwidth (bytes/s) and the host link (PCIe generation x16, one direction). The planner turns the peak into
a sustained training rate with one efficiency factor (timing.py). An unknown name gets a conservative
default and a warning — never silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

TERA = 1e12
GB = 1e9
# PCIe x16, one direction, theoretical: gen3 16 GB/s, gen4 32 GB/s, gen5 64 GB/s (datasheets quote both directions).
PCIE3_X16 = 16 * GB
PCIE4_X16 = 32 * GB
PCIE5_X16 = 64 * GB
# One lane, one direction, by generation (x16 halves with each generation back; gen6 doubles gen5).
PCIE_LANE_BYTES_PER_SECOND = {
    1: 0.25 * GB,
    2: 0.5 * GB,
    3: PCIE3_X16 / 16,
    4: PCIE4_X16 / 16,
    5: PCIE5_X16 / 16,
    6: 8 * GB,
}


def pcie_link_bytes_per_second(generation: int, lanes: int) -> float | None:
    """A link's theoretical one-direction rate, or None for a generation this table does not know."""
    per_lane = PCIE_LANE_BYTES_PER_SECOND.get(generation)
    return None if per_lane is None or lanes <= 0 else per_lane * lanes


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float  # dense tensor-core peak
    memory_bytes_per_second: float
    pcie_bytes_per_second: float


# Matched on whole tokens of the NVML name (letters and digits), most specific first, so "L40S" is not
# "L40", "L4" is neither, and "RTX 6000 Ada Generation" is not "RTX A6000".
GPU_TABLE: tuple[tuple[tuple[str, ...], GpuSpec], ...] = (
    # NVIDIA RTX A4000 datasheet: tensor 153.4 TFLOPS (with sparsity), 448 GB/s, PCIe 4.0 x16.
    (("A4000",), GpuSpec("RTX A4000", 76.7 * TERA, 448 * GB, PCIE4_X16)),
    # NVIDIA RTX A4500 datasheet: tensor 189.2 TFLOPS (sparsity), 640 GB/s, PCIe 4.0 x16.
    (("A4500",), GpuSpec("RTX A4500", 94.6 * TERA, 640 * GB, PCIE4_X16)),
    # NVIDIA RTX A5000 datasheet: tensor 222.2 TFLOPS (sparsity), 768 GB/s, PCIe 4.0 x16.
    (("A5000",), GpuSpec("RTX A5000", 111.1 * TERA, 768 * GB, PCIE4_X16)),
    # NVIDIA RTX A6000 datasheet: tensor 309.7 TFLOPS (sparsity), 768 GB/s, PCIe 4.0 x16.
    (("A6000",), GpuSpec("RTX A6000", 154.8 * TERA, 768 * GB, PCIE4_X16)),
    # NVIDIA A40 datasheet: BF16 tensor 149.7 TFLOPS (299.4 with sparsity), 696 GB/s, PCIe 4.0 x16.
    (("A40",), GpuSpec("A40", 149.7 * TERA, 696 * GB, PCIE4_X16)),
    # NVIDIA L40S datasheet: BF16 tensor 362.05 TFLOPS (733 with sparsity), 864 GB/s, PCIe 4.0 x16.
    (("L40S",), GpuSpec("L40S", 362.05 * TERA, 864 * GB, PCIE4_X16)),
    # NVIDIA L40 datasheet: BF16 tensor 181.05 TFLOPS (362.1 with sparsity), 864 GB/s, PCIe 4.0 x16.
    (("L40",), GpuSpec("L40", 181.05 * TERA, 864 * GB, PCIE4_X16)),
    # NVIDIA L4 datasheet: BF16 tensor 242 TFLOPS with sparsity, 300 GB/s, PCIe 4.0 x16.
    (("L4",), GpuSpec("L4", 121 * TERA, 300 * GB, PCIE4_X16)),
    # NVIDIA T4 datasheet: no bf16 (Turing; the planner trains in fp16 there), mixed-precision FP16/FP32 tensor
    # 65 TFLOPS, 320 GB/s, PCIe 3.0 x16. In the table for the published FLUX QLoRA timing on a T4
    # (docs/published_timings.md); the peak stands in for the fp16 one.
    (("T4",), GpuSpec("T4", 65 * TERA, 320 * GB, PCIE3_X16)),
    # NVIDIA Ampere GA102 whitepaper (GeForce RTX 3090): BF16 tensor with FP32 accumulate 71 TFLOPS
    # (142 with sparsity), 936 GB/s, PCIe 4.0 x16.
    (("3090",), GpuSpec("GeForce RTX 3090", 71 * TERA, 936 * GB, PCIE4_X16)),
    # NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): BF16 tensor with FP32 accumulate
    # 165.2 TFLOPS (330.4 with sparsity), 1008 GB/s, PCIe 4.0 x16.
    (("4090",), GpuSpec("GeForce RTX 4090", 165.2 * TERA, 1008 * GB, PCIE4_X16)),
    # NVIDIA RTX Blackwell GPU architecture whitepaper (GeForce RTX 5090): FP16/BF16 tensor with FP32
    # accumulate 209.5 TFLOPS (419 with sparsity), 1792 GB/s, PCIe 5.0 x16.
    (("5090",), GpuSpec("GeForce RTX 5090", 209.5 * TERA, 1792 * GB, PCIE5_X16)),
    # NVIDIA RTX 2000 Ada Generation datasheet: tensor 191.9 TFLOPS (FP8 with sparsity: BF16 dense a quarter),
    # 224 GB/s, PCIe 4.0 x8 (half a x16 link).
    (("2000", "ADA"), GpuSpec("RTX 2000 Ada", 48.0 * TERA, 224 * GB, PCIE4_X16 / 2)),
    # NVIDIA RTX 4000 Ada Generation datasheet: tensor 327.6 TFLOPS (FP8 with sparsity), 360 GB/s, PCIe 4.0 x16.
    (("4000", "ADA"), GpuSpec("RTX 4000 Ada", 81.9 * TERA, 360 * GB, PCIE4_X16)),
    # NVIDIA RTX PRO 6000 Blackwell (Server, Workstation and Max-Q editions): AI 4000 TOPS (FP4 with sparsity:
    # BF16 dense an eighth), 1792 GB/s, PCIe 5.0 x16. The Max-Q edition runs at a lower power limit; its row errs fast.
    (("PRO", "6000"), GpuSpec("RTX PRO 6000", 500 * TERA, 1792 * GB, PCIE5_X16)),
    # NVIDIA RTX 6000 Ada Generation datasheet: 91.1 TFLOPS FP32, tensor BF16 364.2 TFLOPS dense
    # (728.5 with sparsity), 960 GB/s, PCIe 4.0 x16.
    (("6000", "ADA"), GpuSpec("RTX 6000 Ada", 364.2 * TERA, 960 * GB, PCIE4_X16)),
    # NVIDIA A100 datasheet: BF16 tensor 312 TFLOPS (624 with sparsity); 80GB PCIe 1935 GB/s,
    # 80GB SXM 2039 GB/s; PCIe 4.0 x16.
    (("A100", "PCIE"), GpuSpec("A100 PCIe", 312 * TERA, 1935 * GB, PCIE4_X16)),
    (("A100",), GpuSpec("A100 SXM", 312 * TERA, 2039 * GB, PCIE4_X16)),
    # NVIDIA H100 datasheet: BF16 tensor 1979 (SXM), 1671 (NVL), 1513 (PCIe) TFLOPS with sparsity;
    # 3.35, 3.9, 2.0 TB/s; PCIe 5.0 x16.
    (("H100", "NVL"), GpuSpec("H100 NVL", 835.5 * TERA, 3900 * GB, PCIE5_X16)),
    (("H100", "PCIE"), GpuSpec("H100 PCIe", 756.5 * TERA, 2000 * GB, PCIE5_X16)),
    (("H100",), GpuSpec("H100 SXM", 989.5 * TERA, 3350 * GB, PCIE5_X16)),
    # NVIDIA H200 datasheet: BF16 tensor 1979 (SXM) and 1671 (NVL) TFLOPS with sparsity, 4.8 TB/s,
    # PCIe 5.0 x16.
    (("H200", "NVL"), GpuSpec("H200 NVL", 835.5 * TERA, 4800 * GB, PCIE5_X16)),
    (("H200",), GpuSpec("H200 SXM", 989.5 * TERA, 4800 * GB, PCIE5_X16)),
    # NVIDIA HGX B200 datasheet: FP16/BF16 tensor 36 PFLOPS with sparsity for 8 GPUs (2.25 dense per GPU),
    # 64 TB/s for 8 GPUs; PCIe 5.0 x16 to the host.
    (("B200",), GpuSpec("B200", 2250 * TERA, 8000 * GB, PCIE5_X16)),
)

# An unknown card: an A4000-class guess (the slowest card in the table that FLUX LoRA fits), so a time
# estimate errs long rather than short.
UNKNOWN_GPU = GpuSpec("unknown GPU", 76.7 * TERA, 448 * GB, PCIE4_X16)


# Brand words people type glued to the model number ("rtx4090", "RTXA6000", "nvidiah100").
_BRAND_PREFIX = re.compile(r"^(?:NVIDIA|GEFORCE|TESLA|QUADRO|RTX)+(?=[A-Z]?[0-9])")
# A model number with its suffix glued on ("6000ADA"): the number and the suffix are tokens of their own.
_NUMBER_SUFFIX = re.compile(r"([0-9]+)([A-Z]+)")


def _tokens(name: str) -> set[str]:
    """The words of a GPU name as NVML reports it or as people type it: "NVIDIA GeForce RTX 4090",
    "RTX 4090", "rtx-4090", "rtx4090" and "4090" all hold the token "4090"."""
    tokens: set[str] = set()
    for word in re.split(r"[^A-Z0-9]+", name.upper()):
        if not word:
            continue
        model = _BRAND_PREFIX.sub("", word)
        tokens.update({word, model})
        if glued := _NUMBER_SUFFIX.fullmatch(model):
            tokens.update(glued.groups())
    return tokens


# Cached: the planner looks its card up for every candidate it prices; names come from NVML or a request.
@lru_cache(maxsize=1024)
def gpu_spec(nvml_name: str) -> GpuSpec | None:
    """The table row for a GPU name: as NVML reports it ("NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3")
    or as people type it ("4090", "rtx4090", "RTX 4090", "h100")."""
    tokens = _tokens(nvml_name)
    for keys, spec in GPU_TABLE:
        if all(key in tokens for key in keys):
            return spec
    return None
