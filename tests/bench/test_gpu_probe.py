"""bench/gpu_probe.py: its budget, its table, and its CPU dry run (the same code as the GPU call, at the `tiny` size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the device tool brings back at most from $OUT; the command's own log (probe.log) is one of them.
DEVICE_FILES_LIMIT = 8
DEVICE_CALL_SECONDS = 300
# The wheels' install on the lent machine, and the orchestrator's own start, before and between the sections.
OUTSIDE_THE_SECTIONS_SECONDS = 35


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_probe
        import gpu_probe_table

        yield {"probe": gpu_probe, "table": gpu_probe_table}
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_the_sections_budgets_leave_the_device_call_inside_five_minutes(bench: dict[str, ModuleType]) -> None:
    budgets = bench["probe"].SECTION_SECONDS["cuda"]
    assert list(budgets) == ["imports", "resident", "swapped", "render"]
    assert sum(budgets.values()) + OUTSIDE_THE_SECTIONS_SECONDS <= DEVICE_CALL_SECONDS


def test_the_probe_writes_room_for_the_commands_own_log(bench: dict[str, ModuleType]) -> None:
    assert len(bench["probe"].PROBE_FILES) + 1 <= DEVICE_FILES_LIMIT


def section(**fields: Any) -> dict[str, Any]:
    return {"exit": 0, "wall_seconds": 10.0, "budget": 60, **fields}


def test_a_swapped_run_is_set_against_the_planner_and_the_resident_losses(bench: dict[str, ModuleType]) -> None:
    gib = 2**30
    report = {
        "size": "h100",
        "device": "cuda",
        "allocator": "expandable_segments:True",
        "seconds": 200.0,
        "imports": section(ok=True, imports={"torch": "2.11.0"}, gpu="NVIDIA H100 80GB HBM3", memlock_soft=None),
        "resident": section(losses=[1.0, 0.5]),
        "swapped": section(
            losses=[1.0, 0.75],
            seconds_per_step=3.0,
            peak_reserved_bytes=18 * gib,
            planned={
                "card_bytes": 24 * gib,
                "seconds_per_step": 2.0,
                "training_gpu_bytes": 21 * gib,
                "cuda_context_bytes": 1 * gib,
            },
        ),
        "render": section(exit="timeout"),
    }
    table = bench["table"].render_table(report)
    assert (
        "| swapped | 0 (10.0 of 60 s) | 24.00 | 3 | 2 | 1.50 | - | 18.00 | - | 20.00 | 0.90 | "
        "losses 1, 0.75 (largest difference from resident 0.25) |"
    ) in table
    assert "| render | timeout (10.0 of 60 s) |" in table
    assert "`ulimit -l` unlimited" in table


def test_a_failed_import_check_names_the_import_and_skips_the_rest(
    bench: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = {"section": "imports", "ok": False, "imports": {"deepspeed": "FAILED ModuleNotFoundError: deepspeed"}}
    monkeypatch.setattr(bench["probe"], "run_section", lambda *_: {**failed, "exit": 1, "wall_seconds": 1.0})
    report = bench["probe"].measure("tiny", "cpu", tmp_path)
    assert [report[name]["exit"] for name in ("resident", "swapped", "render")] == [
        "skipped: the import check failed"
    ] * 3
    table = bench["table"].render_table({**report, "seconds": 1.0})
    assert "Import check: exit 1, FAILED (deepspeed: FAILED ModuleNotFoundError: deepspeed)" in table


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-probe") / "out"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(out.parent)),
        "PYTHONPATH": str(REPO / "src"),
        "DS_ACCELERATOR": "cpu",
    }
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_probe.py"), "--device", "cpu", "--size", "tiny", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return completed, out


@pytest.mark.slow
def test_the_dry_run_writes_its_three_files_and_prints_its_table_last(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    completed, out = dry_run
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["probe.json", "sections.log", "table.md"]
    table = (out / "table.md").read_text()
    assert completed.stdout.rstrip().endswith(table.rstrip())
    assert table.startswith("### GPU probe (bench/gpu_probe.py), size tiny, on none (CPU dry run")


@pytest.mark.slow
def test_the_dry_run_checks_the_imports_and_the_containers_limits(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = dry_run
    imports = json.loads((out / "probe.json").read_text())["imports"]
    assert imports["exit"] == 0 and imports["ok"] is True
    assert {"torch", "deepspeed", "diffusers", "fluxbooth.train.validation", "fluxbooth.plan"} <= set(
        imports["imports"]
    )
    assert "memlock_soft" in imports and isinstance(imports["dev_shm_bytes"], int)


@pytest.mark.slow
def test_the_dry_run_trains_swapped_exactly_as_resident_beside_the_planners_figures(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = dry_run
    report = json.loads((out / "probe.json").read_text())
    resident, swapped = report["resident"], report["swapped"]
    assert resident["exit"] == 0 and swapped["exit"] == 0
    assert len(resident["losses"]) == 2 and swapped["losses"] == resident["losses"]
    assert swapped["most_resident_blocks"] == 2
    for row in (resident, swapped):
        assert row["planned"]["seconds_per_step"] > 0 and row["planned"]["training_gpu_bytes"] > 0
    assert swapped["planned"]["card_bytes"] == 24 * 2**30
    assert "(largest difference from resident 0);" in (out / "table.md").read_text()


@pytest.mark.slow
def test_the_dry_run_renders_one_image_through_the_trainers_render_loop(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = dry_run
    render = json.loads((out / "probe.json").read_text())["render"]
    assert render["exit"] == 0, render.get("error")
    assert [image.split(" ")[0] for image in render["images"]] == ["validation_00.png"]
    assert render["planned"]["render_seconds"] > 0 and render["planned"]["validation_gpu_bytes"] > 0
