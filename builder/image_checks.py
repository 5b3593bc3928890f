"""Checks the image build runs on its torch: `python builder/image_checks.py variant|torch VARIANT`.

`variant VARIANT` fails the build at its first step unless VARIANT is one the Dockerfile knows.
`torch VARIANT` imports the installed torch and fails the build unless it is the build that
requirements-torch-VARIANT.txt pins: the same version and local label (`2.13.0+cu130`, `2.13.0+cpu`), CUDA
13.0 with kernels for every GPU generation RunPod rents for `cuda`, no CUDA at all for `cpu`. A wrong
wheel then fails here, at build time, instead of the first job on a GPU.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

VARIANTS = ("cuda", "cpu")
# Ampere (A100; A40, A6000, RTX 3090), Ada (L4, L40S, RTX 4090), Hopper (H100, H200), Blackwell (B200; RTX 5090).
RUNPOD_GPU_ARCHITECTURES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
_TORCH_PIN = re.compile(r"^torch==(?P<version>[0-9.]+)\+(?P<label>\w+)$")


def requirements_file(variant: str, root: Path) -> Path:
    return root / f"requirements-torch-{variant}.txt"


def pinned_torch(requirements: str) -> str:
    """The `torch==X+label` pin of a requirements file, as `X+label`."""
    pins = [match for line in requirements.splitlines() if (match := _TORCH_PIN.match(line.strip()))]
    if len(pins) != 1:
        raise ValueError(f"expected one torch==X+label line, found {len(pins)}")
    return f"{pins[0]['version']}+{pins[0]['label']}"


def cuda_version_of_label(label: str) -> str | None:
    """`cu130` -> `13.0`, `cu126` -> `12.6`; `cpu` -> None."""
    if label == "cpu":
        return None
    match = re.fullmatch(r"cu(?P<major>\d+)(?P<minor>\d)", label)
    if match is None:
        raise ValueError(f"unknown torch build label {label!r}")
    return f"{match['major']}.{match['minor']}"


def torch_problems(pinned: str, installed: str, cuda: str | None, architectures: list[str]) -> list[str]:
    """What is wrong with an installed torch (version, its CUDA version, its kernels) against the pin."""
    problems = []
    if installed != pinned:
        problems.append(f"torch {installed} is installed, the pin is {pinned}")
    expected_cuda = cuda_version_of_label(pinned.partition("+")[2])
    if cuda != expected_cuda:
        problems.append(f"torch's CUDA is {cuda}, expected {expected_cuda}")
    if expected_cuda is not None:
        missing = [arch for arch in RUNPOD_GPU_ARCHITECTURES if arch not in architectures]
        if missing:
            problems.append(f"torch has no kernels for {', '.join(missing)} (has {', '.join(architectures)})")
    return problems


def check_installed_torch(variant: str, root: Path) -> list[str]:
    import torch

    pinned = pinned_torch(requirements_file(variant, root).read_text())
    architectures = torch.cuda.get_arch_list() if torch.version.cuda else []
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, kernels {architectures}")
    return torch_problems(pinned, torch.__version__, torch.version.cuda, architectures)


def main(arguments: list[str], root: Path) -> int:
    if len(arguments) != 2 or arguments[0] not in ("variant", "torch"):
        print("usage: image_checks.py variant|torch VARIANT", file=sys.stderr)
        return 2
    command, variant = arguments
    if variant not in VARIANTS:
        print(f"TORCH_VARIANT must be one of {', '.join(VARIANTS)}, not {variant!r}", file=sys.stderr)
        return 1
    if command == "torch":
        problems = check_installed_torch(variant, root)
        if problems:
            print("wrong torch in the image: " + "; ".join(problems), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], Path.cwd()))
