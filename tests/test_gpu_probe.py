"""bench/gpu_probe.py: its verdicts, and its CPU dry run (the same code as the GPU call, at the `tiny` size)."""

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

REPO = Path(__file__).resolve().parent.parent
EXPECTED_FILES = ["probe.json", "table.md", "train-expandable.json", "train-expandable.log", "train-max-split.json", "train-max-split.log"]


@pytest.fixture(scope="module")
def table() -> Iterator[ModuleType]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_probe_table

        yield gpu_probe_table
    finally:
        sys.path.remove(str(REPO / "bench"))


def run(variant: str, losses: list[float], checksum: float = 10.0, **fields: Any) -> dict[str, Any]:
    return {"training": "lora", "variant": variant, "losses": losses, "weights_checksum": checksum, "error": None, **fields}


def test_a_swapped_run_within_the_resident_runs_own_difference_is_equal(table: ModuleType) -> None:
    verdicts = table.compare_to_resident([
        run("resident", [1.0, 0.9]), run("resident-again", [1.0, 0.902], 10.5), run("swapped", [1.0, 0.901], 10.2),
    ])
    assert verdicts[("lora", "swapped")]["verdict"] == "equal"
    assert verdicts[("lora", "swapped")]["loss_tolerance"] == pytest.approx(0.002)


def test_a_swapped_run_beyond_the_resident_runs_own_difference_differs(table: ModuleType) -> None:
    verdicts = table.compare_to_resident([run("resident", [1.0, 0.9]), run("resident-again", [1.0, 0.9]), run("swapped", [1.0, 0.95])])
    assert verdicts[("lora", "swapped")]["verdict"] == "DIFFERS"
    changed_weights = table.compare_to_resident([run("resident", [1.0]), run("resident-again", [1.0]), run("swapped", [1.0], 11.0)])
    assert changed_weights[("lora", "swapped")]["verdict"] == "DIFFERS"


def test_a_failed_run_is_an_error_not_a_verdict(table: ModuleType) -> None:
    failed = run("swapped", [], error="OutOfMemoryError: CUDA out of memory")
    verdicts = table.compare_to_resident([run("resident", [1.0]), run("resident-again", [1.0]), failed])
    assert verdicts[("lora", "swapped")] == {"verdict": "error"}


def test_the_lagging_run_counts_its_extra_peak_in_blocks(table: ModuleType) -> None:
    runs = [
        run("swapped", [1.0], peak_allocated_bytes=10 * 2**20, largest_block_bytes=2 * 2**20),
        run("swapped-lagging", [1.0], peak_allocated_bytes=16 * 2**20, largest_block_bytes=2 * 2**20),
    ]
    assert table.extra_blocks(runs, "lora") == "+3.0"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-probe") / "out"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(out.parent)),
        "PYTHONPATH": str(REPO / "src"),
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "fluxbooth" / "torch_extensions"),
    }
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_probe.py"), "--device", "cpu", "--size", "tiny", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    return completed, out


@pytest.mark.slow
def test_the_dry_run_writes_its_six_files_and_prints_its_table_last(dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    completed, out = dry_run
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == EXPECTED_FILES
    table = (out / "table.md").read_text()
    assert completed.stdout.rstrip().endswith(table.rstrip())
    assert table.startswith("### GPU probe (bench/gpu_probe.py), size tiny, on none (CPU dry run")


@pytest.mark.slow
def test_the_dry_run_trains_swapped_exactly_as_resident(dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = dry_run
    report = json.loads((out / "probe.json").read_text())
    runs = report["training"]["expandable"]["runs"]
    assert [(item["training"], item["variant"]) for item in runs] == [
        (training, variant) for training in ("lora", "lora-zero2", "full-fused") for variant in ("resident", "resident-again", "swapped")
    ]
    assert all(item["error"] is None and len(item["losses"]) == 2 for item in runs)
    table = (out / "table.md").read_text()
    for training in ("lora", "lora-zero2", "full-fused"):
        assert f"| expandable (exit 0) | {training} | swapped | equal | 0 (0) |" in table
    assert [item["training"] for item in report["training"]["max-split"]["runs"]] == ["lora"] * 3


@pytest.mark.slow
def test_the_dry_run_dequantises_fp8_and_nf4_alike_on_both_devices(dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = dry_run
    rows = json.loads((out / "probe.json").read_text())["quantised"]
    assert {row["precision"] for row in rows} == {"fp8", "nf4"}
    assert all(row["dequantised_equal"] and row["codes_differing"] == 0 for row in rows)


@pytest.mark.slow
def test_the_dry_run_marks_what_needs_cuda(dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = dry_run
    report = json.loads((out / "probe.json").read_text())
    assert report["bandwidth"] == {"skipped": "needs CUDA"}
    assert report["pinned_per_tensor"] and all(row["pinned_bytes"] is None for row in report["pinned_per_tensor"])
    assert report["swapper_host"]["stored_bytes"] > 0 and report["swapper_host"]["host_cache_released"] is False
    assert "Bandwidth: needs CUDA." in (out / "table.md").read_text()
