"""The handler process stays small: importing handler.py loads none of the heavy ML libraries."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

HEAVY_MODULES = ("torch", "deepspeed", "diffusers", "transformers", "accelerate", "peft", "numpy")


def test_importing_the_handler_loads_no_heavy_library() -> None:
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import handler"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in completed.stderr.splitlines() if "|" in line}
    assert "handler" in imported and "runpod" in imported
    assert imported.isdisjoint(HEAVY_MODULES), sorted(imported & set(HEAVY_MODULES))
