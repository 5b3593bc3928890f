"""NF4 with double quantisation, fluxbooth's against bitsandbytes' (CPU backend): the block-absmax and
weight errors on Gaussian, heavy-tailed (Student-t) and outlier weights (tests/support/nf4_reference.py), and the
quantise time of each. Prints the markdown table of docs/quantisation.md.

Usage: .venv/bin/python bench/nf4_accuracy.py [--rows 3072 --columns 3072]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tests.support import nf4_reference  # noqa: E402


def timed(function: object, weight: torch.Tensor) -> tuple[nf4_reference.Nf4Errors, float]:
    started = time.perf_counter()
    errors, _ = function(weight)  # type: ignore[operator]
    return errors, time.perf_counter() - started


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--columns", type=int, default=3072)
    args = parser.parse_args(argv)
    import bitsandbytes

    print(
        f"{args.rows} x {args.columns} bf16 weights; torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads\n"
    )
    print(
        "| weights | absmax error, mean (ours / bnb) | absmax error, worst block | weight RMSE | quantise + dequantise s |"
    )
    print("|---|---|---|---|---|")
    for kind in nf4_reference.KINDS:
        weight = nf4_reference.sample_weight(kind, args.rows, args.columns)
        ours, our_seconds = timed(nf4_reference.ours, weight)
        reference, reference_seconds = timed(nf4_reference.bitsandbytes, weight)
        print(
            f"| {kind} | {ours.absmax_mean:.2%} / {reference.absmax_mean:.2%} | {ours.absmax_max:.2%} / "
            f"{reference.absmax_max:.2%} | {ours.weight_rmse:.2%} / {reference.weight_rmse:.2%} | "
            f"{our_seconds:.2f} / {reference_seconds:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
