"""Choosing how a job runs: ZeRO stage, offload targets, precision, training type.

The `Plan` dataclass is shared with configs.py and the result contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Offload = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class Plan:
    accelerator: Literal["cuda", "cpu"]
    num_processes: int
    training_type: Literal["full", "lora"]
    use_deepspeed: bool
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    mixed_precision: Literal["bf16", "fp16", "no"]
    gradient_checkpointing: bool
    optimizer: str
    predicted_gpu_bytes: int
    predicted_host_bytes: int
    predicted_disk_bytes: int
    nvme_path: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["warnings"] = list(self.warnings)
        return data
