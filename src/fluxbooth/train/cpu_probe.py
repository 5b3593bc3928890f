"""py-cpuinfo's answer, asked once per trainer process and early.

DeepSpeed asks `cpuinfo.get_cpu_info()` three times while it loads its CPU ops and builds CPUAdam or
CPULion, and every call starts a fresh `python cpuinfo.py --json` subprocess (1.2 s each on a 2-core
x86_64 CPU, bench/RESULTS.md). Asked once in a background thread while torch and diffusers import, the
answer is ready before DeepSpeed wants it, and every later call returns a copy of it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any


class CpuInfoProbe:
    """One background call of `ask`; `answer()` waits for it and hands out copies."""

    def __init__(self, ask: Callable[[], dict[str, Any]]) -> None:
        self._ask = ask
        self._answer: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cpuinfo-probe", daemon=True)

    def start(self) -> CpuInfoProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._answer = self._ask()
        except Exception as error:  # re-raised in the caller's thread, where DeepSpeed handles it
            self._error = error

    def answer(self) -> dict[str, Any]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return copy.deepcopy(self._answer)


def ask_cpu_info_once() -> None:
    """Starts the probe and points `cpuinfo.get_cpu_info` (where DeepSpeed imports it from at call time)
    at its answer. Nothing to do without py-cpuinfo (DeepSpeed then falls back to lscpu)."""
    try:
        # Optional (py-cpuinfo): imported here so that its absence only skips the probe.
        import cpuinfo
    except ImportError:
        return
    cpuinfo.get_cpu_info = CpuInfoProbe(cpuinfo.get_cpu_info).start().answer
