"""Every GPU a user page names (README.md, docs/*.md, .runpod/hub.json) is one `plan --runpod-gpu NAME` accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fluxbooth.plan.runpod_gpus import runpod_gpu
from tests.conftest import REPO_ROOT

# What reads as a GPU's name: RTX cards, data-centre letters and numbers (A100, H100 NVL, L40S, B200), with the
# variant words RunPod and NVIDIA add.
GPU_NAME = re.compile(
    r"\b(?:RTX (?:PRO )?\d{4}(?: Ada| Ti| SUPER)?|RTX A\d{4}|A\d{2,4}(?: PCIe| SXM)?|H\d{3}(?: PCIe| SXM| NVL)?"
    r"|L40S?|L4|B\d{3}|T4|V100)\b"
)
# Named on purpose though no RunPod serverless type: the card of a published FLUX timing (published_timings.md),
# in the planner's datasheet table for that reason.
NOT_RUNPOD_TYPES = {"T4"}


def user_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / ".runpod" / "hub.json"]


def unknown_gpu_names(text: str) -> list[str]:
    return sorted(
        {name for name in GPU_NAME.findall(text) if name not in NOT_RUNPOD_TYPES and runpod_gpu(name) is None}
    )


@pytest.mark.parametrize("page", user_pages(), ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_gpu_a_page_names_is_a_type_the_planner_knows(page: Path) -> None:
    assert unknown_gpu_names(page.read_text()) == []


def test_the_scan_sees_a_gpu_the_planner_does_not_know() -> None:
    assert unknown_gpu_names("| H100 PCIe | 80 GiB |, an H100 NVL, an RTX 4090 and an L40S") == [
        "H100 NVL",
        "H100 PCIe",
    ]
