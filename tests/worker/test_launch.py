"""launch.py, supervisor.py and trainer_failures.py: running the trainer in its own session, streaming, deadlines,
cancellation, classification."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fluxbooth.contract.events import StageEvent, StepEvent, TrainerEvent, format_event
from fluxbooth.errors import ErrorCode
from fluxbooth.job.launch import run_trainer, trainer_command
from fluxbooth.job.launch_files import LaunchFiles
from fluxbooth.job.supervisor import ProcessOutcome
from fluxbooth.job.trainer_failures import classify_outcome
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.plan import Plan
from fluxbooth.redaction import Redactor
from tests.conftest import REPO_ROOT
from tests.support.fake_trainer import fake_trainer_command

PLAN = Plan(
    accelerator="cuda",
    num_processes=1,
    training_type="full",
    use_deepspeed=True,
    zero_stage=2,
    offload_optimizer="cpu",
    offload_param="none",
    mixed_precision="bf16",
    gradient_checkpointing=True,
    optimizer="DeepSpeedCPUAdam",
    predicted_gpu_bytes=24 * 2**30,
    predicted_host_bytes=200 * 2**30,
    predicted_disk_bytes=0,
)


def run(
    command: list[str],
    tmp_path: Path,
    *,
    deadline: float = 60.0,
    env: dict[str, str] | None = None,
    secrets: tuple[str, ...] = (),
) -> tuple[ProcessOutcome, list[TrainerEvent]]:
    events: list[TrainerEvent] = []
    outcome = asyncio.run(
        run_trainer(
            command,
            env={"PATH": os.environ["PATH"], **(env or {})},
            cwd=tmp_path,
            deadline_seconds=deadline,
            redact=Redactor(secrets),
            on_event=events.append,
            log_path=tmp_path / "trainer.log",
        )
    )
    return outcome, events


def process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not reaped it yet.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_command_is_accelerate_launch_of_the_trainer_module_with_the_written_files(tmp_path: Path) -> None:
    files = LaunchFiles(tmp_path / "ds.json", tmp_path / "accelerate.yaml", tmp_path / "train.json")
    command = trainer_command(files, PLAN, cpu_count=8)
    assert command[1:] == [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "accelerate.yaml"),
        "--num_cpu_threads_per_process",
        "8",
        "-m",
        "fluxbooth.train",
        "--config",
        str(tmp_path / "train.json"),
    ]


def test_clean_run_forwards_every_event_and_is_not_an_error(tmp_path: Path) -> None:
    outcome, events = run(fake_trainer_command(tmp_path, "ok"), tmp_path)
    assert [event.KIND for event in events] == ["stage", "step", "step", "done"]
    assert outcome.returncode == 0
    assert outcome.last_step == StepEvent(step=2, total=2, loss=0.25, lr=1e-4, seconds_per_step=0.01)
    assert classify_outcome(outcome, PLAN, 60) is None


def test_crash_is_trainer_failed_with_exit_status_and_last_log_lines(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "crash"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.TRAINER_FAILED
    assert "exited with status 1 after step 2/2" in error.message
    assert "RuntimeError: something broke in the trainer" in error.message
    assert error.details["exit_status"] == 1
    assert error.refresh_worker is True


@pytest.mark.parametrize(
    "spelling",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "torch.cuda.OutOfMemoryError: CUDA out of memory.",
        "RuntimeError: CUDA error: out of memory",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "RuntimeError: cudaErrorMemoryAllocation",
    ],
)
def test_every_spelling_of_cuda_oom_is_cuda_oom_with_advice_from_the_plan(tmp_path: Path, spelling: str) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, f"cuda_oom:{spelling}"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.CUDA_OOM
    assert "ZeRO-2 keeps every transformer parameter on the GPU" in error.message


def test_sigkill_without_traceback_is_host_oom(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "sigkill"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert outcome.returncode == -9
    assert error is not None and error.code == ErrorCode.HOST_OOM
    assert "the plan predicted 200.0 GiB" in error.message


def test_cpu_allocator_failure_is_host_oom(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "host_oom_message"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.HOST_OOM


def test_nan_loss_event_is_trainer_failed_naming_the_cause(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "nan"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.TRAINER_FAILED
    assert error.message == "trainer stopped (nan_loss): loss became nan at step 3; lower learning_rate"


def test_exit_zero_without_weights_is_trainer_failed(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "silent_exit0"), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.TRAINER_FAILED
    assert "finished without reporting its weights" in error.message


def test_hang_past_the_deadline_is_timeout_and_kills_grandchildren(tmp_path: Path) -> None:
    outcome, _ = run(fake_trainer_command(tmp_path, "hang_with_grandchild"), tmp_path, deadline=3)
    error = classify_outcome(outcome, PLAN, 3)
    assert error is not None and error.code == ErrorCode.TIMEOUT
    assert "within the job deadline of 3 s after step 2/2" in error.message
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert not process_is_alive(grandchild)


def test_cancellation_kills_the_process_group_and_reraises(tmp_path: Path) -> None:
    command = fake_trainer_command(tmp_path, "hang_with_grandchild")

    async def cancel_soon() -> None:
        task = asyncio.create_task(
            run_trainer(
                command,
                env={"PATH": os.environ["PATH"]},
                cwd=tmp_path,
                deadline_seconds=600,
                redact=Redactor(()),
                on_event=lambda event: None,
            )
        )
        while not (tmp_path / "grandchild.pid").exists():
            await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_soon())
    assert not process_is_alive(int((tmp_path / "grandchild.pid").read_text()))


def test_secrets_are_redacted_from_the_log_tail_and_log_file(tmp_path: Path) -> None:
    canary = "canary-8f3e1d2c"
    outcome, _ = run(
        fake_trainer_command(tmp_path, "leak_secret:HF_TOKEN"), tmp_path, env={"HF_TOKEN": canary}, secrets=(canary,)
    )
    assert "token is [REDACTED]" in outcome.log_tail
    assert canary not in (tmp_path / "trainer.log").read_text()
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and canary not in error.message


TEMP_PROBE = (
    "import os, sys, tempfile; open(os.path.join(tempfile.gettempdir(), 'scratch'), 'w').close(); "
    "print(tempfile.gettempdir(), os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['TRITON_CACHE_DIR'])"
)


def test_the_trainer_writes_its_temp_files_inside_its_working_directory_and_they_go_with_the_run(
    tmp_path: Path,
) -> None:
    outcome, _ = run([sys.executable, "-c", TEMP_PROBE], tmp_path, env={"TMPDIR": "/tmp", "TRITON_CACHE_DIR": "/x"})
    temp_dir = tmp_path / "tmp"
    assert outcome.log_tail == [f"{temp_dir} {temp_dir}/torchinductor {temp_dir}/triton/cache"]
    assert not temp_dir.exists()


OSERROR_DISK_FULL = "OSError: [Errno 28] No space left on device"
TORCH_SAVE_DISK_FULL = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1110"


def disk_full_trainer(stage: str, report: str) -> list[str]:
    """A trainer that announces `stage`, then dies of a full disk, reporting it as `report`."""
    announce = format_event(StageEvent(stage=stage))
    return [sys.executable, "-c", f"import sys; print({announce!r}); print({report!r}); sys.exit(1)"]


@pytest.mark.parametrize("report", [OSERROR_DISK_FULL, TORCH_SAVE_DISK_FULL])
def test_a_full_disk_in_the_trainer_is_does_not_fit_naming_its_stage(tmp_path: Path, report: str) -> None:
    outcome, _ = run(disk_full_trainer("cache", report), tmp_path)
    error = classify_outcome(outcome, PLAN, 60)
    assert error is not None and error.code == ErrorCode.DOES_NOT_FIT
    assert error.message == (
        "disk: the disk filled up while the trainer was in its cache stage: the plan predicted 0 B for its caches, "
        "checkpoints and exported weights; free disk space or give the worker a bigger volume (FLUXBOOTH_WORK_DIR)"
    )


def test_a_log_file_on_a_full_disk_stops_and_the_run_goes_on(tmp_path: Path) -> None:
    events: list[TrainerEvent] = []
    outcome = asyncio.run(
        run_trainer(
            fake_trainer_command(tmp_path, "ok"),
            env={"PATH": os.environ["PATH"]},
            cwd=tmp_path,
            deadline_seconds=60,
            redact=Redactor(()),
            on_event=events.append,
            log_path=Path("/dev/full"),
        )
    )
    assert [event.KIND for event in events] == ["stage", "step", "step", "done"]
    assert classify_outcome(outcome, PLAN, 60) is None


@dataclass(frozen=True)
class LocalRun:
    """One real `python -m fluxbooth train` of the tiny model, with the worker's system temp dir its own."""

    completed: subprocess.CompletedProcess[str]
    temp_dir: Path
    temp_before: list[str]
    work_root: Path


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path) -> LocalRun:
    root = tmp_path_factory.mktemp("local-run")
    temp_dir, work_root = root / "system-temp", root / "work"
    temp_dir.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(root)),
        "TMPDIR": str(temp_dir),
        "FLUXBOOTH_WORK_DIR": str(work_root),
        "FLUXBOOTH_OUTPUT_DIR": str(root / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(model_cache_dir),
        "FLUXBOOTH_VOLUME_DIR": str(root / "no-volume"),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **{name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ},
    }
    # The shared tiny model is built first: building it is the model cache's business, not the job's.
    ensure_tiny_model(model_cache_dir)
    request = root / "request.json"
    request.write_text(json.dumps(json.loads((REPO_ROOT / "test_input.json").read_text())["input"]))
    temp_before = sorted(os.listdir(temp_dir))
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth", "train", str(request), "--job-id", "local-run"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return LocalRun(completed, temp_dir, temp_before, work_root)


# A progress line as fluxbooth.progress writes it: `[m:ss] stage ...`.
PROGRESS_LINE = re.compile(r"^\[\d+:\d\d\] \S")


@pytest.mark.slow
def test_a_real_launch_leaves_nothing_in_the_system_temp_dir_and_removes_its_job_dir(local_run: LocalRun) -> None:
    assert sorted(os.listdir(local_run.temp_dir)) == local_run.temp_before
    assert os.listdir(local_run.work_root) == []


@pytest.mark.slow
def test_a_real_launch_shows_every_stage_and_the_step_bar_on_stderr(local_run: LocalRun) -> None:
    lines = [line.split("] ", 1)[1] for line in local_run.completed.stderr.splitlines() if PROGRESS_LINE.match(line)]
    stages = [line.split()[0] for line in lines]
    order = ["plan", "dataset", "launch", "load", "cache", "train", "save", "export", "upload"]
    assert [stage for index, stage in enumerate(stages) if stage in order and stage not in stages[:index]] == order
    bars = [line for line in lines if re.fullmatch(r"train  \[[#-]{24}\]  \d/8  loss \d+\.\d{4}  ETA \d+:\d\d", line)]
    assert re.fullmatch(r"train  \[#{24}\]  8/8  loss \d+\.\d{4}  ETA 0:00", bars[-1])
