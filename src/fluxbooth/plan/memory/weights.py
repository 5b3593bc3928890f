"""The weights as stored and the optimizer's state per weight: the trained parameters, the frozen base (quantised
or not, whole or per block) and the quantiser's working copies (docs/memory.md, "Quantised bases"). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from fluxbooth.contract.names import normalise_optimizer_name
from fluxbooth.contract.precision import block_of, is_quantised_layer
from fluxbooth.sizing import ModelSize

# ---- Quantised bases (docs/memory.md, "Quantised bases"). --------------------------------------
# fp8 (e4m3): one byte per weight plus one fp32 scale per output channel.
FP8_BYTES_PER_PARAM = 1.0
FP8_SCALE_BYTES_PER_OUTPUT = 4
# NF4 with double quantisation (bitsandbytes): 4 bits per weight, an 8-bit absmax per 64-weight block and
# one fp32 constant per 256 absmax values: 8/64 + 32/(64*256) = 0.127 bit per weight on top of the 4; each
# layer also keeps its two fp32 lookup tables (16 NF4 values, 256 dynamic-map values).
NF4_BITS_PER_PARAM = 4 + 8 / 64 + 32 / (64 * 256)
NF4_TABLE_BYTES_PER_LAYER = 4 * (16 + 256)
# The quantiser's working copies of the layer it is quantising, per weight of that layer, beyond its bf16
# weight and its stored result (fluxbooth.train.quantize, docs/memory.md "Quantised bases"): fp8 holds an
# fp32 copy and the fp32 copy divided by the row scales (4 + 4) when the e4m3 codes are cast; nf4 holds the
# padded fp32 copy, the copy divided by the block absmax (4 + 4) and torch.bucketize's int64 indices (8).
# Measured on the 3072x12288 layer (RSS peak of one quantised_linear call): 8.0 and 15.5 B above the stored.
QUANTISER_WORKING_BYTES_PER_PARAM = {"fp8": 8, "nf4": 16}

# fp32 optimizer state per trainable parameter, besides the master weights: Adam's m and v; one buffer for
# Adagrad's sum, Lion's and SGD's momentum; Adafactor keeps a full second moment on ZeRO's flat partitions.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adagrad": 4, "lion": 4, "sgd": 4, "adafactor": 4}
# The fused pass (Strategy.fused_backward_pass) steps one parameter at a time inside the backward pass: that
# parameter's bf16 gradient (2 bytes per element), then its fp32 working copies while transformers' Adafactor
# steps it: the weight, the gradient, the update and the factored estimate it is built from (4 x 4 bytes),
# counted from train/fused_adafactor.py and Adafactor.step. The largest layer sets the peak.
FUSED_STEP_BYTES_PER_PARAM = 2 + 16


def trainable_params(model: ModelSize, training_type: str, lora_rank: int, targets: Sequence[str]) -> int:
    if training_type == "lora":
        return model.lora_params(lora_rank, targets)
    return model.transformer_params


def optimizer_state_bytes(optimizer: str) -> int:
    return OPTIMIZER_STATE_BYTES.get(normalise_optimizer_name(optimizer), 8)


def quantised_layer_bytes(in_features: int, out_features: int, precision: str) -> float:
    weights = in_features * out_features
    if precision == "fp8":
        return weights * FP8_BYTES_PER_PARAM + out_features * FP8_SCALE_BYTES_PER_OUTPUT
    return weights * NF4_BITS_PER_PARAM / 8 + NF4_TABLE_BYTES_PER_LAYER


def frozen_base_bytes(model: ModelSize, precision: str, width: int) -> dict[str, int]:
    """The frozen transformer as stored: quantised block Linears (with their scales), and everything
    else (biases, norms, embedders, the final layers) in the compute dtype."""
    return dict(_frozen_base_bytes(model, precision, width))


# Cached: the planner prices thousands of candidates over one model, and these walk every Linear.
@lru_cache(maxsize=64)
def _frozen_base_bytes(model: ModelSize, precision: str, width: int) -> dict[str, int]:
    if precision not in ("fp8", "nf4"):
        return {"frozen_weights": model.transformer_params * width}
    quantised_elements = 0
    quantised = 0.0
    for layer in model.linear_layers:
        if is_quantised_layer(layer.name):
            quantised_elements += layer.in_features * layer.out_features
            quantised += quantised_layer_bytes(layer.in_features, layer.out_features, precision)
    return {
        "frozen_weights_quantised": int(quantised),
        "frozen_weights_unquantised": (model.transformer_params - quantised_elements) * width,
    }


def frozen_block_bytes(model: ModelSize, precision: str, width: int) -> dict[str, float]:
    """Each transformer block's Linear weights and biases as the frozen base stores them, or as a full
    fine-tune trains them (bf16): what block swapping streams; the blocks' norms are a few vectors and left out."""
    return dict(_frozen_block_bytes(model, precision, width))


@lru_cache(maxsize=64)
def _frozen_block_bytes(model: ModelSize, precision: str, width: int) -> dict[str, float]:
    blocks: dict[str, float] = {}
    for layer in model.linear_layers:
        if not is_quantised_layer(layer.name):
            continue
        bias = layer.out_features * width if layer.bias else 0
        if precision in ("fp8", "nf4"):
            stored = quantised_layer_bytes(layer.in_features, layer.out_features, precision) + bias
        else:
            stored = layer.in_features * layer.out_features * width + bias
        blocks[block_of(layer.name)] = blocks.get(block_of(layer.name), 0.0) + stored
    return blocks


@lru_cache(maxsize=64)
def largest_quantised_layer_params(model: ModelSize) -> int:
    return max(
        (layer.in_features * layer.out_features for layer in model.linear_layers if is_quantised_layer(layer.name)),
        default=0,
    )


def adafactor_state_bytes(model: ModelSize) -> int:
    """transformers' Adafactor without a first moment (beta1 None, kohya's FLUX settings): a matrix keeps
    fp32 means of its squared gradient per row and per column, any other tensor (biases, norms) a full fp32
    second moment."""
    matrices = sum(layer.in_features * layer.out_features for layer in model.linear_layers)
    factors = sum(layer.in_features + layer.out_features for layer in model.linear_layers)
    return 4 * (factors + model.transformer_params - matrices)


def layer_being_quantised(model: ModelSize, precision: str, width: int) -> int:
    """The largest layer's weight in the compute dtype plus the quantiser's working copies of it
    (QUANTISER_WORKING_BYTES_PER_PARAM), beyond the base as stored so far."""
    largest = largest_quantised_layer_params(model)
    return max(model.largest_layer_params * width, largest * (width + QUANTISER_WORKING_BYTES_PER_PARAM[precision]))
