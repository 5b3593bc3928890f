"""Run in its own process by tests/trainer/test_pinned_memory.py: the tiny FLUX transformer fully fine-tuned through
`deepspeed.initialize` (DeepSpeed's CPU accelerator, ZeRO-2, bf16, `offload_optimizer: cpu` with
`pin_memory: true`, as launch_files.py writes it on CUDA) for one step, printing the bytes of every tensor DeepSpeed
asked its accelerator to pin, in order, as one JSON line.

The CPU accelerator's `pin_memory` returns the tensor unpinned (CPU torch cannot page-lock); the probe wraps it
to record each request's size and then calls it, so DeepSpeed runs exactly as it does on the CPU.

Usage: python -m tests.support.pinned_probe PIPELINE_FOLDER PORT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str]) -> int:
    folder, port = Path(argv[0]), argv[1]
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from diffusers import FluxTransformer2DModel

    from tests.support.quantize_probe import forward_inputs

    requested: list[int] = []
    accelerator = get_accelerator()
    real_pin = accelerator.pin_memory

    def recording_pin(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        requested.append(tensor.numel() * tensor.element_size())
        return real_pin(tensor, *args, **kwargs)

    accelerator.pin_memory = recording_pin
    model = FluxTransformer2DModel.from_pretrained(str(folder), subfolder="transformer", torch_dtype=torch.bfloat16)
    model.enable_gradient_checkpointing()
    parameters = list(model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=parameters,
        optimizer=torch.optim.AdamW(parameters, lr=1e-4),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        },
    )
    loss = engine(**forward_inputs(engine.module.config)).sample.float().square().mean()
    engine.backward(loss)
    engine.step()
    print(json.dumps({"pinned_requests": requested, "parameters": sum(p.numel() for p in parameters)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
