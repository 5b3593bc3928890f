"""Run in its own process by tests/trainer/test_torch_optimizers.py: the tiny FLUX transformer fully fine-tuned through
`deepspeed.initialize` (DeepSpeed's CPU accelerator, ZeRO-2, fp32) for a few steps, once per implementation of each
optimizer the trainer runs:

- "deepspeed": the DeepSpeed JSON's optimizer block with the optimizer offloaded, as launch_files.py writes it for an
  offloaded plan (DeepSpeed's host C++ DeepSpeedCPUAdam / DeepSpeedCPULion steps);
- "torch": no block, not offloaded, the trainer's own optimizer handed to DeepSpeed as a client optimizer, as on a
  GPU plan (torch's fused AdamW, train/lion.py's Lion).

Same seed, same batches, same hyper-parameters (contract/names.py's table, a larger learning rate so the steps
show). Prints one JSON line: per optimizer, the class that stepped in each run, the largest difference between the
two runs' weights after the steps, how many weights differ by more than TOLERANCE times the largest weight, the
largest step either run took from the initial weights, and the largest weight.

Usage: python -m tests.support.optimizer_probe PIPELINE_FOLDER PORT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

STEPS = 3
LEARNING_RATE = 1e-3
OPTIMIZERS = ("adamw", "lion")
TOLERANCE = 1e-5


def batches(config: Any) -> list[dict[str, torch.Tensor]]:
    """STEPS different batches of random latents and text states for the transformer, the same in every run."""
    generator = torch.Generator().manual_seed(0)
    tokens, text_tokens = 16, 8
    return [
        {
            "hidden_states": torch.randn(1, tokens, config.in_channels, generator=generator),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, generator=generator),
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator),
            "timestep": torch.rand(1, generator=generator),
            "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(text_tokens, 3),
            "guidance": torch.tensor([3.5]),
        }
        for _ in range(STEPS)
    ]


def deepspeed_run(folder: Path, config: dict[str, Any], optimizer: Any) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The class that stepped, and all weights before and after the steps (flat)."""
    import deepspeed
    from diffusers import FluxTransformer2DModel

    from fluxbooth.train.optim import optimizer_class_name

    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_pretrained(str(folder), subfolder="transformer", torch_dtype=torch.float32)
    parameters = list(model.parameters())
    initial = torch.cat([parameter.detach().flatten() for parameter in parameters]).clone()
    engine, engine_optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameters, optimizer=optimizer(parameters) if optimizer else None, config=config
    )
    for batch in batches(engine.module.config):
        loss = engine(**batch).sample.square().mean()
        engine.backward(loss)
        engine.step()
    final = torch.cat([parameter.detach().flatten() for parameter in engine.module.parameters()])
    return optimizer_class_name(engine_optimizer), initial, final


def run_both(folder: Path, name: str) -> dict[str, Any]:
    from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
    from fluxbooth.job.launch_files import optimizer_section
    from fluxbooth.train.lion import Lion
    from tests.support.trainer_jobs import make_plan

    base = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}
    offloaded = make_plan(zero_stage=2, offload_optimizer="cpu")
    trainer = _trainer_config(name)
    block = optimizer_section(offloaded, trainer)
    assert block is not None
    deepspeed_config = {
        **base,
        "optimizer": block,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    hyperparameters = dict(OPTIMIZER_HYPERPARAMETERS[name])
    torch_optimizers = {
        "adamw": lambda parameters: torch.optim.AdamW(parameters, lr=LEARNING_RATE, fused=True, **hyperparameters),
        "lion": lambda parameters: Lion(parameters, lr=LEARNING_RATE, **hyperparameters),
    }
    deepspeed_class, initial, deepspeed_weights = deepspeed_run(folder, deepspeed_config, None)
    torch_class, _, torch_weights = deepspeed_run(
        folder, {**base, "zero_optimization": {"stage": 2}}, torch_optimizers[name]
    )
    difference = (deepspeed_weights - torch_weights).abs()
    return {
        "classes": {"deepspeed": deepspeed_class, "torch": torch_class},
        "max_abs_difference": float(difference.max()),
        "elements_beyond_tolerance": int((difference > TOLERANCE * initial.abs().max()).sum()),
        "largest_step": float(
            torch.maximum((deepspeed_weights - initial).abs(), (torch_weights - initial).abs()).max()
        ),
        "largest_weight": float(initial.abs().max()),
        "parameters": initial.numel(),
    }


def _trainer_config(name: str) -> Any:
    from tests.support.guide_job import GUIDE_TRAINER
    from tests.support.regroup import regrouped

    return regrouped(GUIDE_TRAINER, optimizer=name, learning_rate=LEARNING_RATE)


def main(argv: list[str]) -> int:
    folder, port = Path(argv[0]), argv[1]
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    print(json.dumps({name: run_both(folder, name) for name in OPTIMIZERS}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
