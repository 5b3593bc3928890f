"""Randomly initialised FLUX.1-architecture pipelines in the diffusers layout, built offline and seeded.

Presets (`fluxbooth.synthetic.presets`):
- `tiny`: fluxbooth.synthetic.tiny's pipeline (a few hundred KB; `python -m fluxbooth.synthetic.tiny` stays its entry point);
- `scaled`: the tiny encoders with the bench's ~70 M-parameter transformer;
- `flux1-dev`, `flux1-schnell`: full size, the real repositories' configs (11.9 B transformer, T5-XXL
  encoder, CLIP-L, VAE) with random weights and offline tokenizers of the real vocabulary sizes.

`python -m fluxbooth.synthetic --preset NAME OUT` builds one; `--count` prints each component's
parameter count without allocating weights. Large components are written one safetensors shard at a
time (`fluxbooth.synthetic.build`), so a machine with less memory than the model can build it.
"""

from fluxbooth.synthetic.build import build_pipeline, count_parameters
from fluxbooth.synthetic.presets import PRESET_NAMES, Preset, preset

__all__ = ["PRESET_NAMES", "Preset", "build_pipeline", "count_parameters", "preset"]
