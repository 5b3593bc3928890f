"""bench/gpu.py: the GPU measurement's sequence, card emulation and records; its dry run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fluxbooth.host.hardware import GIB, probe_hardware
from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
H100_ROW = "0, NVIDIA H100 80GB HBM3, 81559, 81000, 9.0\n"


def fake_nvidia_smi(directory: Path, rows: str) -> Path:
    """The driver's query output for one H100 (no GPU here: the probe's own parser reads it)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    script.chmod(0o755)
    return script


def test_the_runs_cover_the_issue_in_order(gpu: ModuleType) -> None:
    names = [run.name for run in gpu.sequence(gpu.GPU_MODE)]
    precisions, has_field = gpu.request_precisions()
    assert has_field and precisions == ["bf16", "fp8", "nf4"]
    lora = [f"lora-r16-1024-{card}GiB-{p}" for card in (80, 48, 24, 16) for p in precisions]
    assert names == lora + [
        "lora-zero3-offload-8GiB-512",
        "full-zero2-offload-reduced",
        "end-of-job-24GiB",
        "end-of-job-16GiB",
        "learning-check-off",
        "learning-check-on",
        "klein4b-lora-r16-1024-24GiB",
        "klein4b-lora-r16-1024-16GiB",
        "klein4b-end-of-job-24GiB",
    ]


def test_every_call_with_its_cold_setup_fits_nine_minutes(gpu: ModuleType) -> None:
    runs = gpu.sequence(gpu.GPU_MODE)
    calls = sorted({run.call for run in runs})
    assert calls == list(range(1, gpu.call_count(gpu.GPU_MODE) + 1))
    for call in calls:
        in_call = [run for run in runs if run.call == call]
        assert gpu.call_seconds(in_call) <= gpu.CALL_BUDGET_SECONDS - gpu.SAFETY_SECONDS, call
    assert gpu.CALL_BUDGET_SECONDS <= 9 * 60 - 30


def test_a_call_counts_the_setup_of_what_its_runs_need_once(gpu: ModuleType) -> None:
    runs = {run.name: run for run in gpu.sequence(gpu.GPU_MODE)}
    klein = [runs["klein4b-lora-r16-1024-24GiB"], runs["klein4b-lora-r16-1024-16GiB"]]
    assert gpu.call_seconds(klein) == gpu.SETUP_SECONDS["ops"] + gpu.SETUP_SECONDS["klein"] + 240
    assert gpu.setup_needs(runs["full-zero2-offload-reduced"]) == {"ops", "reduced", "full"}
    assert klein[0].call == klein[1].call


def test_the_flux2_klein_4b_runs_train_on_24_and_16_gib_cards_and_end_a_job_on_24(gpu: ModuleType) -> None:
    runs = [run for run in gpu.sequence(gpu.GPU_MODE) if run.model == gpu.KLEIN]
    assert [(run.name, run.card_gib) for run in runs] == [
        ("klein4b-lora-r16-1024-24GiB", 24),
        ("klein4b-lora-r16-1024-16GiB", 16),
        ("klein4b-end-of-job-24GiB", 24),
    ]
    assert gpu.GPU_MODE.klein_preset == "flux2-klein-4b"
    assert runs[-1].fields["output_formats"] == ["diffusers", "comfyui"] and runs[-1].fields["validation_prompts"]


def test_lora_runs_send_the_precision_through_the_request(gpu: ModuleType) -> None:
    runs = {run.name: run for run in gpu.sequence(gpu.GPU_MODE)}
    assert runs["lora-r16-1024-16GiB-nf4"].fields == {
        "training_type": "lora",
        "lora_rank": 16,
        "resolution": 1024,
        "base_precision": "nf4",
    }
    assert (
        runs["learning-check-on"].fields["learning_check"] is True
        and "learning_check" not in runs["learning-check-off"].fields
    )


def test_a_precision_the_schema_lacks_goes_in_as_is_and_bf16_falls_back_to_the_default(gpu: ModuleType) -> None:
    assert gpu.precision_fields("bf16", schema_has_field=False) == {}
    assert gpu.precision_fields("fp8", schema_has_field=False) == {"base_precision": "fp8"}
    assert gpu.precision_fields("bf16", schema_has_field=True) == {"base_precision": "bf16"}


def test_a_smaller_card_is_emulated_for_the_planner_and_the_trainer(gpu: ModuleType, tmp_path: Path) -> None:
    spec = next(run for run in gpu.sequence(gpu.GPU_MODE) if run.name == "end-of-job-24GiB")
    env = gpu.run_environment({"PATH": "/bin"}, tmp_path, spec, real_gpu_bytes=80 * GIB)
    assert env["FLUXBOOTH_GPU_MEMORY_BYTES"] == str(24 * GIB)
    assert env["FLUXBOOTH_CUDA_MEMORY_FRACTION"] == "0.300000"
    assert env["FLUXBOOTH_WORK_DIR"] == str(tmp_path / "jobs")


def test_the_whole_card_is_not_capped(gpu: ModuleType, tmp_path: Path) -> None:
    spec = next(run for run in gpu.sequence(gpu.GPU_MODE) if run.name == "lora-r16-1024-80GiB-bf16")
    env = gpu.run_environment({}, tmp_path, spec, real_gpu_bytes=80 * GIB)
    assert env["FLUXBOOTH_GPU_MEMORY_BYTES"] == str(80 * GIB)
    assert "FLUXBOOTH_CUDA_MEMORY_FRACTION" not in env
    assert "FLUXBOOTH_GPU_MEMORY_BYTES" not in gpu.run_environment({}, tmp_path, spec, real_gpu_bytes=None)


def test_probe_plans_for_the_emulated_card(tmp_path: Path) -> None:
    script = fake_nvidia_smi(tmp_path / "bin", H100_ROW)
    hardware = probe_hardware(tmp_path, {"FLUXBOOTH_GPU_MEMORY_BYTES": "24GiB"}, nvidia_smi=str(script))
    assert hardware.gpu_memory_bytes == 24 * GIB and hardware.gpu_free_bytes == 24 * GIB
    assert "GPU memory capped at 24.0 GiB by FLUXBOOTH_GPU_MEMORY_BYTES" in hardware.notes


def test_probe_never_raises_the_memory_of_a_card(tmp_path: Path) -> None:
    script = fake_nvidia_smi(tmp_path / "bin", H100_ROW)
    hardware = probe_hardware(tmp_path, {"FLUXBOOTH_GPU_MEMORY_BYTES": "200GiB"}, nvidia_smi=str(script))
    assert hardware.gpu_memory_bytes == 81559 * 1024**2


def test_probe_names_the_variable_when_its_value_is_not_a_size(tmp_path: Path) -> None:
    script = fake_nvidia_smi(tmp_path / "bin", H100_ROW)
    with pytest.raises(ValueError, match="^FLUXBOOTH_GPU_MEMORY_BYTES: 'lots' is not a size"):
        probe_hardware(tmp_path, {"FLUXBOOTH_GPU_MEMORY_BYTES": "lots"}, nvidia_smi=str(script))


def results_row(run: str, gpu: str, value: str) -> str:
    from gpu_results import COLUMNS

    return "| " + " | ".join([run, gpu, *[value] * (len(COLUMNS) - 2)]) + " |"


def test_a_merged_row_replaces_the_same_run_on_the_same_gpu_and_keeps_the_others(gpu: ModuleType) -> None:
    from gpu_results import merge_into, table_rows

    first = merge_into(
        "# results\n", [results_row("a", "NVIDIA H100 80GB HBM3", "1"), results_row("b", "NVIDIA H100 80GB HBM3", "1")]
    )
    second = merge_into(
        first + "\n## later section\n",
        [results_row("a", "NVIDIA H100 80GB HBM3", "2"), results_row("a", "NVIDIA H200", "3")],
    )
    rows = table_rows(second)
    assert rows == [
        results_row("a", "NVIDIA H100 80GB HBM3", "2"),
        results_row("b", "NVIDIA H100 80GB HBM3", "1"),
        results_row("a", "NVIDIA H200", "3"),
    ]
    assert second.startswith("# results\n") and second.rstrip().endswith("## later section")
    assert second.count("<!-- gpu:begin -->") == 1


def test_merging_into_the_note_of_a_section_keeps_its_place(gpu: ModuleType) -> None:
    from gpu_results import merge_into, table_rows

    text = "before\n<!-- gpu:begin -->\n### GPU\n\nNot measured yet.\n<!-- gpu:end -->\nafter\n"
    merged = merge_into(text, [results_row("a", "CPU", "1")])
    assert merged.startswith("before\n<!-- gpu:begin -->") and merged.endswith("<!-- gpu:end -->\nafter\n")
    assert table_rows(merged) == [results_row("a", "CPU", "1")]


def test_trainer_events_are_read_from_the_worker_log_and_the_raw_marker(gpu: ModuleType) -> None:
    from gpu_runner import parse_trainer_event

    logged = (
        '2026-11-23 06:00:00,000 INFO fluxbooth.job.supervisor: trainer event | {"event": "stage", "stage": "train"}'
    )
    assert parse_trainer_event(logged) == {"event": "stage", "stage": "train"}
    assert parse_trainer_event('FLUXBOOTH_EVENT {"event": "step", "step": 1}') == {"event": "step", "step": 1}
    assert parse_trainer_event("trainer | loading shards") is None


def test_step_time_is_the_median_after_the_first_step(gpu: ModuleType) -> None:
    from gpu_runner import EventLog

    events = EventLog()
    assert events.take({"event": "stage", "stage": "train"}) == "train"
    assert events.take({"event": "stage", "stage": "train", "status": "resumed"}) is None
    for seconds in (9.0, 1.0, 3.0, 2.0):
        events.take({"event": "step", "seconds_per_step": seconds})
    assert events.median_step() == 2.0
    events.close()
    assert set(events.phase_seconds) == {"worker", "train"}


def test_reduced_depth_keeps_the_full_fine_tunes_host_state_under_forty_percent(gpu: ModuleType) -> None:
    double, single = gpu.reduced_layers(128 * GIB, gpu.GPU_MODE)
    assert single == 2 * double
    parameters = 0.1e9 + double * 340e6 + single * 142e6
    assert 20 * parameters <= 0.4 * 128 * GIB < 20 * (parameters + 340e6 + 2 * 142e6)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    root = tmp_path_factory.mktemp("bench-gpu")
    results = root / "RESULTS.md"
    results.write_text("# earlier results\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(root)),
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(WorkerSettings.from_environ(os.environ))),
        "PYTHONUNBUFFERED": "1",
    }
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu.py"),
            "--dry-run",
            "--out",
            str(root / "out"),
            "--work",
            str(root / "work"),
            "--results",
            str(results),
            "--budget-seconds",
            "1500",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return completed, root / "out", results


@pytest.mark.slow
def test_dry_run_trains_validates_and_exports_through_the_worker(
    dry_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    completed, out, _ = dry_run
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    record = json.loads((out / "gpu-runs.jsonl").read_text().splitlines()[0])
    assert record["name"] == "end-of-job-24GiB" and record["exit_status"] == 0 and record["outcome"] == "ok"
    assert {"load", "cache", "train", "export", "validate"} <= set(record["phase_seconds"])
    assert record["seconds_per_step"] > 0 and record["host_peak"] > 0
    assert record["plan"]["training_type"] == "lora" and record["plan"]["predicted_host_bytes"] > 0


@pytest.mark.slow
def test_dry_run_trains_the_flux2_klein_run_on_tiny_klein(
    dry_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    _, out, _ = dry_run
    records = [json.loads(line) for line in (out / "gpu-runs.jsonl").read_text().splitlines()]
    klein = next(record for record in records if record["name"] == "klein4b-end-of-job-24GiB")
    assert (klein["exit_status"], klein["outcome"]) == (0, "ok")
    assert {"cache", "train", "export", "validate"} <= set(klein["phase_seconds"])
    assert "=== build-tiny-flux2-klein:" in (out / "setup.log").read_text()


@pytest.mark.slow
def test_dry_run_appends_its_table_and_keeps_what_was_there(
    dry_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    _, _, results = dry_run
    text = results.read_text()
    assert text.startswith("# earlier results\n")
    assert "### GPU: the worker on a full-size synthetic FLUX.1-dev (bench/gpu.py)" in text
    rows = [line for line in text.splitlines() if line.startswith("| end-of-job-24GiB | CPU |")]
    assert len(rows) == 1 and "DeepSpeed 0.19.8" in rows[0] and "| 0 ok |" in rows[0]


@pytest.mark.slow
def test_dry_run_keeps_every_log_in_four_files(dry_run: tuple[subprocess.CompletedProcess[str], Path, Path]) -> None:
    _, out, _ = dry_run
    assert sorted(path.name for path in out.iterdir()) == ["gpu-runs.jsonl", "runs.log", "setup.log", "table.md"]
    runs = (out / "runs.log").read_text()
    assert "=== run end-of-job-24GiB" in runs and "--- plan.json ---" in runs and "trainer event |" in runs
    assert "=== build-tiny:" in (out / "setup.log").read_text()
