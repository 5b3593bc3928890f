"""How big a FLUX pipeline is, computed from its configs without loading any weights.

The family (fluxbooth.models.families) decides which formulas apply, one module per family: `flux1` (FLUX.1 and
FLUX.1 Kontext) and `flux2` (FLUX.2 [dev] and [klein]), over the family-neutral `core` (ModelSize, the VAE,
the layer-name rules that LoRA targets and quantised bases follow); `lookup` sizes a base model by hub id
(its published configs, fluxbooth.models.published_configs) or from a local folder's configs.

Parameter counts are analytic: each formula mirrors the layer layout of the diffusers / transformers class
that the config instantiates; the tests check every formula against `sum(p.numel())` of the real classes
built on the meta device.

No torch here: this runs in the handler process. The names below are the package's interface.
"""

from fluxbooth.sizing.core import (
    LinearLayer,
    ModelSize,
    TransformerShape,
    linear_module_names,
    linear_stream,
    lora_target_suffixes,
    matches_lora_target,
    norm_params_per_module,
    transformer_params,
    unmatched_lora_targets,
    vae_params,
)
from fluxbooth.sizing.flux1 import model_size_from_configs
from fluxbooth.sizing.flux2 import flux2_model_size
from fluxbooth.sizing.lookup import FLUX_DEV_NAME, FLUX_SCHNELL_NAME, PRESET_OF_MODEL, model_size

__all__ = [
    "FLUX_DEV_NAME",
    "FLUX_SCHNELL_NAME",
    "PRESET_OF_MODEL",
    "LinearLayer",
    "ModelSize",
    "TransformerShape",
    "flux2_model_size",
    "linear_module_names",
    "linear_stream",
    "lora_target_suffixes",
    "matches_lora_target",
    "model_size",
    "model_size_from_configs",
    "norm_params_per_module",
    "transformer_params",
    "unmatched_lora_targets",
    "vae_params",
]
