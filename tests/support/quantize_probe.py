"""Run in its own process by tests/trainer/test_quantize.py: a LoRA over a quantised tiny FLUX base through
`deepspeed.initialize` (DeepSpeed's CPU accelerator, ZeRO-2, bf16) and two optimizer steps, printing what
the quantised storage looked like before the engine started and after the steps, as one JSON line.

Usage: python -m tests.support.quantize_probe PIPELINE_FOLDER fp8|nf4 PORT
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def stored_quantised_state(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each quantised layer's buffers: name -> [dtype, sha256 of the bytes]."""
    from fluxbooth.train.quantize import QuantisedLinear

    state = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantisedLinear):
            for buffer_name, buffer in module.named_buffers(recurse=False):
                digest = hashlib.sha256(buffer.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                state[f"{name}.{buffer_name}"] = [str(buffer.dtype), digest]
    return state


def forward_inputs(config: Any) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens, text_tokens = 16, 8
    return {
        "hidden_states": torch.randn(1, tokens, config.in_channels, generator=generator).bfloat16(),
        "encoder_hidden_states": torch.randn(
            1, text_tokens, config.joint_attention_dim, generator=generator
        ).bfloat16(),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator).bfloat16(),
        "timestep": torch.tensor([0.5]).bfloat16(),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text_tokens, 3),
        "guidance": torch.tensor([3.5]).bfloat16(),
    }


def main(argv: list[str]) -> int:
    folder, precision, port = Path(argv[0]), argv[1], argv[2]
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    import deepspeed
    from peft import LoraConfig

    from fluxbooth.train.quantize import load_quantised_base, residency

    model = load_quantised_base(str(folder), precision, torch.device("cpu"), torch.bfloat16)
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_v", "proj_mlp"])
    )
    before = stored_quantised_state(model)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    lora_before = [parameter.detach().float().clone() for parameter in trainable]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=trainable,
        optimizer=torch.optim.AdamW(trainable, lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    )
    after_initialize = stored_quantised_state(engine.module)
    inputs = forward_inputs(engine.module.config)
    for _ in range(2):
        loss = engine(**inputs).sample.float().square().mean()
        engine.backward(loss)
        engine.step()
    lora_after = [parameter.detach().float() for parameter in trainable]
    print(
        json.dumps(
            {
                "before": before,
                "after_initialize": after_initialize,
                "after_steps": stored_quantised_state(engine.module),
                "residency": residency(engine.module),
                "lora_changed": any(not torch.equal(a, b) for a, b in zip(lora_before, lora_after, strict=True)),
                "loss": float(loss),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
