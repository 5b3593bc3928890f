"""The shapes bench/gpu_probe.py runs at: FLUX.1-dev's transformer (fluxbooth.synthetic.presets), fewer blocks.

- `h100`: full width (hidden 3072: 24 heads of 128), 2 double and 4 single blocks, 512², FLUX's 512 text
  tokens, 4 steps: every tensor has a real FLUX.1 shape, small enough for a cold H100 call;
- `cpu`: the plain CPU dry run: 2 heads (hidden 256), 1 double and 2 single blocks, 64², 2 steps;
- `tiny`: the test's: 2 heads (hidden 256), 1 and 1 blocks, 32², 2 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fluxbooth.sizing import ModelSize
from fluxbooth.synthetic.presets import preset


@dataclass(frozen=True)
class ProbeSize:
    name: str
    heads: int
    double_blocks: int
    single_blocks: int
    resolution: int
    text_tokens: int
    steps: int
    bandwidth_bytes: int  # the buffer timed host -> device and back


SIZES: dict[str, ProbeSize] = {
    "h100": ProbeSize("h100", heads=24, double_blocks=2, single_blocks=4, resolution=512, text_tokens=512, steps=4, bandwidth_bytes=1 << 30),
    "cpu": ProbeSize("cpu", heads=2, double_blocks=1, single_blocks=2, resolution=64, text_tokens=16, steps=2, bandwidth_bytes=64 << 20),
    "tiny": ProbeSize("tiny", heads=2, double_blocks=1, single_blocks=1, resolution=32, text_tokens=16, steps=2, bandwidth_bytes=8 << 20),
}


def transformer_config(size: ProbeSize) -> dict[str, Any]:
    """FLUX.1-dev's transformer config with `size`'s depth and head count (the head width stays 128)."""
    config = dict(preset("flux1-dev").with_layers(size.double_blocks, size.single_blocks).transformer)
    config["num_attention_heads"] = size.heads
    return config


def model_size_of(size: ProbeSize) -> ModelSize:
    """The planner's view of the probe's model (the text encoders and VAE are FLUX.1-dev's; the probe
    trains without them, and the training phase's GPU charge does not count them)."""
    from fluxbooth.sizing import model_size_from_configs

    full = preset("flux1-dev")
    assert full.text_encoder_2 is not None
    return model_size_from_configs(
        f"gpu-probe-{size.name}", transformer_config(size), full.text_encoder, full.text_encoder_2, full.vae, source="gpu_probe"
    )
