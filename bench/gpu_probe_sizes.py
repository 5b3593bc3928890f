"""The shapes bench/gpu_probe.py runs at: FLUX.1-dev's transformer (fluxbooth.synthetic.presets) and VAE.

- `h100`: FLUX.1-dev itself: 19 double and 38 single blocks at hidden 3072 (24 heads of 128), 1024², FLUX's
  512 text tokens, 4 steps (the first one not timed), a 28-step render (FLUX.1-dev's sampling) through the
  full VAE;
- `cpu`: the plain CPU dry run: 2 heads (hidden 256), 1 double and 2 single blocks, 64², 2 steps, 2 render steps;
- `tiny`: the test's: 2 heads, 1 and 1 blocks, 32², 2 steps, 2 render steps through the tiny VAE.
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
    steps: int  # training steps per run; the first is the warm-up, not timed
    render_steps: int  # denoising steps of the one render
    full_vae: bool  # FLUX.1-dev's VAE, else fluxbooth.synthetic.tiny's


SIZES: dict[str, ProbeSize] = {
    "h100": ProbeSize(
        "h100",
        heads=24,
        double_blocks=19,
        single_blocks=38,
        resolution=1024,
        text_tokens=512,
        steps=4,
        render_steps=28,
        full_vae=True,
    ),
    "cpu": ProbeSize(
        "cpu",
        heads=2,
        double_blocks=1,
        single_blocks=2,
        resolution=64,
        text_tokens=16,
        steps=2,
        render_steps=2,
        full_vae=False,
    ),
    "tiny": ProbeSize(
        "tiny",
        heads=2,
        double_blocks=1,
        single_blocks=1,
        resolution=32,
        text_tokens=16,
        steps=2,
        render_steps=2,
        full_vae=False,
    ),
}


def transformer_config(size: ProbeSize) -> dict[str, Any]:
    """FLUX.1-dev's transformer config with `size`'s depth and head count (the head width stays 128)."""
    config = dict(preset("flux1-dev").with_layers(size.double_blocks, size.single_blocks).transformer)
    config["num_attention_heads"] = size.heads
    return config


def vae_config(size: ProbeSize) -> dict[str, Any]:
    """FLUX.1-dev's VAE at the GPU size; the tiny synthetic one (same latent channels) on the CPU."""
    if size.full_vae:
        return dict(preset("flux1-dev").vae)
    from fluxbooth.synthetic.tiny import VAE_CONFIG

    return dict(VAE_CONFIG)


def scheduler_config() -> dict[str, Any]:
    return dict(preset("flux1-dev").scheduler)


def model_size_of(size: ProbeSize) -> ModelSize:
    """The planner's view of the probe's model (the text encoders and VAE are FLUX.1-dev's; the probe
    trains without them, and the training phase's GPU charge does not count them)."""
    from fluxbooth.sizing import model_size_from_configs

    full = preset("flux1-dev")
    assert full.text_encoder_2 is not None
    return model_size_from_configs(
        f"gpu-probe-{size.name}",
        transformer_config(size),
        full.text_encoder,
        full.text_encoder_2,
        full.vae,
        source="gpu_probe",
    )
