"""How the frozen base of a LoRA is stored, and which of its layers a quantised base stores quantised.

The planner sizes these layers and the trainer quantises them: one list for both. No torch here.
"""

from __future__ import annotations

# "bf16" means unquantised, in the compute dtype.
BASE_PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "nf4")
QUANTISED_PRECISIONS: tuple[str, ...] = ("fp8", "nf4")

# Only the Linear layers inside the transformer blocks are quantised. The embedders (time, text, guidance,
# context, x), norm_out and the final proj_out stay in the compute dtype: they are small (62 M of FLUX.1's
# 11.9 B parameters) and the first and last layers are the most sensitive to rounding.
QUANTISED_BLOCK_PREFIXES: tuple[str, ...] = ("transformer_blocks.", "single_transformer_blocks.")


def is_quantised_layer(module_name: str) -> bool:
    """Whether a quantised base stores this Linear quantised (its bias stays in the compute dtype)."""
    return module_name.startswith(QUANTISED_BLOCK_PREFIXES)


def block_of(module_name: str) -> str:
    """`transformer_blocks.3.attn.to_q` -> `transformer_blocks.3`; other modules are their own block."""
    parts = module_name.split(".")
    return ".".join(parts[:2]) if module_name.startswith(QUANTISED_BLOCK_PREFIXES) else parts[0]
