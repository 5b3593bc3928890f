"""The GPU bench's own module (bench/gpu.py), imported as its tests read it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gpu() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("gpu")
    finally:
        sys.path.remove(str(BENCH))
