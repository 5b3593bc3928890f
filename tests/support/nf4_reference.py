"""Weights that stress NF4's double quantisation, and its errors measured for ours and for bitsandbytes'
(tests/trainer/test_quantize_bnb.py asserts on them; bench/nf4_accuracy.py prints them for docs/quantisation.md).

Three kinds, all at FLUX's weight scale (standard deviation 0.02), in bf16:
- `gaussian`: the case QLoRA's NormalFloat is built for;
- `student_t`: heavy-tailed (3 degrees of freedom), so the block absmax values spread widely;
- `outlier`: Gaussian with one 4.0 in every tenth group of 16,384 weights (one group of 256 block absmax
  values), so one absmax in such a group is ~80x the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_SCALE = 0.02
STUDENT_T_DEGREES = 3
OUTLIER_VALUE = 4.0
OUTLIER_EVERY = 10 * 16384
KINDS = ("gaussian", "student_t", "outlier")


def sample_weight(kind: str, rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, columns, generator=generator)
    if kind == "student_t":
        # t = z / sqrt(chi2_k / k), chi2_k a sum of k squared standard normals.
        chi_square = torch.randn(rows, columns, STUDENT_T_DEGREES, generator=generator).square().sum(dim=-1)
        normal = normal / (chi_square / STUDENT_T_DEGREES).sqrt()
    weight = normal * WEIGHT_SCALE
    if kind == "outlier":
        weight.view(-1)[::OUTLIER_EVERY] = OUTLIER_VALUE
    return weight.bfloat16()


@dataclass(frozen=True)
class Nf4Errors:
    """Relative errors of one NF4 quantisation of a weight."""

    absmax_mean: float  # mean over blocks of |absmax' - absmax| / absmax
    absmax_max: float  # the worst block
    weight_rmse: float  # RMS(W' - W) / RMS(W)


def nf4_errors(weight: torch.Tensor, dequantised: torch.Tensor, block_absmax: torch.Tensor) -> Nf4Errors:
    exact = weight.float().reshape(-1, 64).abs().amax(dim=1)
    absmax_error = (block_absmax.float() - exact).abs() / exact
    difference = dequantised.float() - weight.float()
    return Nf4Errors(
        absmax_mean=float(absmax_error.mean()),
        absmax_max=float(absmax_error.max()),
        weight_rmse=float(difference.square().mean().sqrt() / weight.float().square().mean().sqrt()),
    )


def ours(weight: torch.Tensor) -> tuple[Nf4Errors, torch.Tensor]:
    """(errors, packed 4-bit codes) of fluxbooth's Nf4Linear."""
    from fluxbooth.train.quantize import Nf4Linear

    layer = Nf4Linear(weight, None)
    return nf4_errors(weight, layer.dequantise(torch.float32), layer.block_absmax()), layer.weight.reshape(-1)


def bitsandbytes(weight: torch.Tensor) -> tuple[Nf4Errors, torch.Tensor]:
    """(errors, packed 4-bit codes) of bitsandbytes' `quantize_4bit(nf4, blocksize 64, compress_statistics)`."""
    import bitsandbytes.functional as bnb

    codes, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    block_absmax = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
    dequantised = bnb.dequantize_4bit(codes, state).float()
    return nf4_errors(weight, dequantised, block_absmax), codes.reshape(-1)
