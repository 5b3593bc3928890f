"""The build's check of its torch: `python builder/image_checks.py torch`.

Imports the installed torch and fails the build unless it is the one requirements-torch-cuda.txt means:
torch 2.13.0 built for CUDA 13.x with kernels for every GPU generation RunPod rents. A CPU-only wheel (a pip
configuration offering a local `2.13.0+cpu`) or a wheel for another CUDA then fails here, at build time,
instead of the first job on a GPU. tests/image/test_image.py runs the same check inside the built image.
"""

from __future__ import annotations

import re
import sys

TORCH_VERSION = "2.13.0"
CUDA_MAJOR = "13"
# Ampere (A100; A40, A6000, RTX 3090), Ada (L4, L40S, RTX 4090), Hopper (H100, H200), Blackwell (B200; RTX 5090).
RUNPOD_GPU_ARCHITECTURES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
_ARCH = re.compile(r"sm_(?P<major>\d+?)(?P<minor>\d)[a-z]?")


def runs_on(architecture: str, kernels: list[str]) -> bool:
    """Whether kernels built for `kernels` run on a GPU of `architecture`: a cubin for sm_XY runs on every GPU
    of the same major X and a minor at least Y (CUDA's binary compatibility), so torch's sm_86 kernels serve
    Ada's sm_89, which PyPI's torch does not build for separately."""
    wanted = _ARCH.fullmatch(architecture)
    assert wanted is not None
    for kernel in kernels:
        built = _ARCH.fullmatch(kernel)
        if built and built["major"] == wanted["major"] and int(built["minor"]) <= int(wanted["minor"]):
            return True
    return False


def torch_problems(installed: str, cuda: str | None, architectures: list[str]) -> list[str]:
    """What is wrong with an installed torch (its version, its CUDA version, its kernels)."""
    problems = []
    release, _, label = installed.partition("+")
    if release != TORCH_VERSION or label == "cpu":
        problems.append(f"torch {installed} is installed, expected {TORCH_VERSION} built for CUDA {CUDA_MAJOR}.x")
    if cuda is None or cuda.split(".")[0] != CUDA_MAJOR:
        problems.append(f"torch's CUDA is {cuda}, expected {CUDA_MAJOR}.x")
    missing = [arch for arch in RUNPOD_GPU_ARCHITECTURES if not runs_on(arch, architectures)]
    if missing:
        problems.append(f"torch has no kernels for {', '.join(missing)} (has {', '.join(architectures) or 'none'})")
    return problems


def check_installed_torch() -> list[str]:
    import torch

    architectures = torch.cuda.get_arch_list() if torch.version.cuda else []
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, kernels {architectures}")
    return torch_problems(torch.__version__, torch.version.cuda, architectures)


def main(arguments: list[str]) -> int:
    if arguments != ["torch"]:
        print("usage: image_checks.py torch", file=sys.stderr)
        return 2
    problems = check_installed_torch()
    if problems:
        print("wrong torch in the image: " + "; ".join(problems), file=sys.stderr)
        return 1
    print("torch OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
