"""py-cpuinfo is asked once per trainer process, in the background, however often DeepSpeed asks."""

from __future__ import annotations

from typing import Any

import cpuinfo
import pytest

from fluxbooth.train.cpu_probe import CpuInfoProbe, ask_cpu_info_once


def test_deepspeeds_repeated_questions_start_one_real_cpuinfo_call(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cpuinfo.get_cpu_info
    calls = []

    def counted() -> dict[str, Any]:
        calls.append(1)
        return real()

    monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)
    ask_cpu_info_once()
    # How DeepSpeed's op builders and CPUAdam import it: at call time, from the package.
    from cpuinfo import get_cpu_info

    answers = [get_cpu_info() for _ in range(3)]
    assert len(calls) == 1
    assert answers[0]["arch"] == answers[2]["arch"] == real()["arch"]


def test_each_caller_gets_its_own_copy() -> None:
    probe = CpuInfoProbe(lambda: {"flags": ["avx2"]}).start()
    first = probe.answer()
    first["flags"].append("changed")
    assert probe.answer() == {"flags": ["avx2"]}


def test_a_failed_probe_raises_its_error_where_deepspeed_asks() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("cpuinfo.py exited with 1")

    probe = CpuInfoProbe(broken).start()
    with pytest.raises(RuntimeError, match="cpuinfo.py exited with 1"):
        probe.answer()
