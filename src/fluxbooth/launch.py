"""Running the trainer: `accelerate launch` in its own process session, logs streamed and redacted,
progress events parsed, a deadline, cancellation, and the exit classified into error codes.

Killing "the trainer" means every process it started. For DeepSpeed, `accelerate launch` runs torch's
elastic agent, which starts each rank with `start_new_session=True`: the ranks and their children are
outside the launcher's process group, and once the launcher dies they are re-parented and no longer
look like ours. So each run puts a unique marker in the trainer's environment, which every process it
starts inherits, and finds its processes by that marker as well as by parentage (the technique of
Jenkins' ProcessTreeKiller); they are signalled by pid and by their own process groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil

from fluxbooth.launch_files import LaunchFiles, threads_per_process
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.contract.events import DoneEvent, ErrorEvent, StageEvent, StepEvent, TrainerEvent, event_payload, parse_event
from fluxbooth.hardware import format_bytes
from fluxbooth.plan import Plan
from fluxbooth.redaction import Redactor

LOG_TAIL_LINES = 200
ERROR_TAIL_LINES = 25
MESSAGE_TAIL_LINES = 5
KILL_GRACE_SECONDS = 10.0
KILL_WAIT_SECONDS = 5.0
EXIT_POLL_SECONDS = 0.5
# Environment variable carrying each run's marker; see the module docstring.
RUN_MARKER_ENV = "FLUXBOOTH_TRAINER_RUN"
# The trainer's scratch folder, inside its working directory (the job's), so its temp files go with the job.
TRAINER_TEMP_FOLDER = "tmp"
# asyncio's default line limit is 64 KiB; tracebacks with tensors printed can be longer.
STREAM_LINE_LIMIT = 4 * 1024 * 1024

CUDA_OOM_PATTERNS = (
    re.compile(r"CUDA out of memory", re.IGNORECASE),
    re.compile(r"torch\.(cuda\.)?OutOfMemoryError"),
    re.compile(r"CUDA error: out of memory", re.IGNORECASE),
    re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"),
    re.compile(r"cudaErrorMemoryAllocation"),
    re.compile(r"CUDNN_STATUS_(NOT_INITIALIZED|ALLOC_FAILED)"),
    re.compile(r"NCCL.*(out of memory|Cuda failure 2)", re.IGNORECASE),
)
DISK_FULL_PATTERNS = (
    re.compile(r"No space left on device"),
    re.compile(r"\[Errno 28\]"),
    re.compile(r"Disk quota exceeded"),
    # torch.save on a full disk names no errno: its zip writer reports the short write (seen on a full tmpfs:
    # "[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1110") or the failed one.
    re.compile(r"inline_container\.cc.*unexpected pos \d+ vs \d+"),
    re.compile(r"PytorchStreamWriter failed writing file"),
)
HOST_OOM_PATTERNS = (
    re.compile(r"DefaultCPUAllocator: (can't|not enough memory)", re.IGNORECASE),
    re.compile(r"Cannot allocate memory"),
    re.compile(r"exitcode\s*:\s*-9\b"),
    re.compile(r"Signal 9 \(SIGKILL\)"),
    re.compile(r"\bMemoryError\b"),
)
# torch's elastic agent announces a failed rank like this; what follows is the launcher's own
# traceback and summary, which says nothing about why the trainer failed.
ELASTIC_RANK_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+")
# Exit statuses of a process stopped by SIGTERM or SIGINT (as a signal, or as a shell reports it).
STOPPED_FROM_OUTSIDE_STATUSES = frozenset(
    {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}
)
KILLED_STATUSES = frozenset({-signal.SIGKILL, 128 + signal.SIGKILL})

logger = logging.getLogger(__name__)


@dataclass
class TrainerOutcome:
    returncode: int | None
    log_tail: list[str]
    done: DoneEvent | None = None
    error_event: ErrorEvent | None = None
    timed_out: bool = False
    last_step: StepEvent | None = None
    seconds: float = 0.0
    events: list[TrainerEvent] = field(default_factory=list)
    # The stage the trainer announced last: where a failure happened.
    last_stage: str | None = None


def trainer_command(
    files: LaunchFiles, plan: Plan, cpu_count: int, trainer_module: str = "fluxbooth.train"
) -> list[str]:
    """`accelerate launch` of the trainer module with exactly the files the worker wrote."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(files.accelerate_config),
        "--num_cpu_threads_per_process",
        str(threads_per_process(plan, cpu_count)),
        "-m",
        trainer_module,
        "--config",
        str(files.trainer_config),
    ]


def trainer_temp_environment(temp_dir: Path) -> dict[str, str]:
    """Every variable that tells the trainer's libraries where to write scratch files, pointed into `temp_dir`.

    Python's tempfile (TMPDIR, and TEMP/TMP that it also reads) is where torch's elastic agent makes its
    per-run log folders (`torchelastic_*`) and its watchdog file, and where DeepSpeed probes whether its ops
    compile; inductor's and Triton's compile caches would otherwise go to `/tmp/torchinductor_<user>` and
    `~/.triton`. DeepSpeed's op build cache (TORCH_EXTENSIONS_DIR) stays where the caller put it: it is
    shared between jobs, holds no customer data, and takes minutes to rebuild."""
    return {
        "TMPDIR": str(temp_dir),
        "TEMP": str(temp_dir),
        "TMP": str(temp_dir),
        "TORCHINDUCTOR_CACHE_DIR": str(temp_dir / "torchinductor"),
        "TRITON_HOME": str(temp_dir / "triton"),
        "TRITON_CACHE_DIR": str(temp_dir / "triton" / "cache"),
    }


def kill_process_group(process_group_id: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process_group_id, sig)


class TrainerProcesses:
    """Every process of one trainer run: the launcher's descendants, and any process whose environment
    carries the run's marker (re-parented orphans in other sessions included)."""

    def __init__(self, launcher_pid: int, marker: str) -> None:
        # psutil.Process compares by pid and start time, so a reused pid is never walked or signalled.
        self._launcher: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):  # already exited and reaped: only the marker finds its children
            self._launcher = psutil.Process(launcher_pid)
        self._marker = marker
        self._signalled: set[psutil.Process] = set()

    def find(self) -> set[psutil.Process]:
        found: set[psutil.Process] = set()
        with contextlib.suppress(psutil.Error):
            if self._launcher is not None and self._launcher.is_running():
                found.update(self._launcher.children(recursive=True))
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.pid != os.getpid() and process.environ().get(RUN_MARKER_ENV) == self._marker:
                    found.add(process)
        return found

    def signal_all(self, sig: int) -> None:
        """`sig` to every process of the run, found now or signalled before, and to their process
        groups (never our own)."""
        self._signalled |= self.find()
        own_group = os.getpgid(0)
        groups = set()
        for process in self.still_alive():
            with contextlib.suppress(psutil.Error, OSError):
                groups.add(os.getpgid(process.pid))
                process.send_signal(sig)
        for group in groups - {own_group}:
            kill_process_group(group, sig)

    def still_alive(self) -> list[psutil.Process]:
        """The signalled processes that have not died yet (a zombie has died)."""
        return [process for process in self._signalled if _is_live(process)]


def _is_live(process: psutil.Process) -> bool:
    try:
        # is_running() also compares the start time: a reused pid is not our process.
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def _kill_leftovers_once_the_launcher_exits(
    process: asyncio.subprocess.Process, processes: TrainerProcesses
) -> None:
    """A process left behind by the launcher keeps the log pipe open, and (Python 3.11)
    `process.wait()` waits for the pipe as well as for the exit: the job would hang until its deadline."""
    while process.returncode is None:
        await asyncio.sleep(EXIT_POLL_SECONDS)
    await _kill_everything(process, processes)


async def _wait_at_most(process: asyncio.subprocess.Process, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(process.wait(), seconds)


async def _terminate(process: asyncio.subprocess.Process, processes: TrainerProcesses, grace_seconds: float) -> None:
    """SIGTERM everything the launcher started, wait a grace period, then SIGKILL what is left."""
    # Find the processes before signalling any: an exiting process can no longer be recognised.
    processes.signal_all(signal.SIGTERM)
    kill_process_group(process.pid, signal.SIGTERM)
    await _wait_at_most(process, grace_seconds)
    await _kill_everything(process, processes)
    # Bounded too: a process that escaped the search could hold the log pipe open for ever.
    await _wait_at_most(process, grace_seconds)


async def _kill_everything(process: asyncio.subprocess.Process, processes: TrainerProcesses) -> None:
    processes.signal_all(signal.SIGKILL)
    kill_process_group(process.pid, signal.SIGKILL)
    # SIGKILL takes effect asynchronously; wait (bounded: a process in uninterruptible sleep dies late).
    give_up = time.monotonic() + KILL_WAIT_SECONDS
    while processes.still_alive() and time.monotonic() < give_up:
        await asyncio.sleep(0.01)


def _append_to_log(log_file: TextIO | None, line: str) -> TextIO | None:
    """Append `line` to the job's log file; on a full disk stop writing it (the tail in memory stays):
    the trainer's own failure is what the job must report, not the log's."""
    if log_file is None:
        return None
    try:
        log_file.write(line + "\n")
        log_file.flush()
        return log_file
    except OSError as error:
        logger.warning("the trainer log %s stopped: %s", log_file.name, error.strerror or error)
        with contextlib.suppress(OSError):
            log_file.close()
        return None


async def _read_output(
    process: asyncio.subprocess.Process,
    outcome: TrainerOutcome,
    tail: deque[str],
    redact: Redactor,
    on_event: Callable[[TrainerEvent], None],
    log_file: TextIO | None,
) -> None:
    """Every line the trainer prints, redacted: events to `on_event` and `outcome`, the rest to the log."""
    assert process.stdout is not None
    while True:
        try:
            raw = await process.stdout.readline()
        except ValueError:
            # A line longer than the limit: drop what was buffered and carry on.
            raw = b"[line too long, dropped]\n"
        if not raw:
            break
        line = redact(raw.decode("utf-8", errors="replace").rstrip("\n"))
        event = parse_event(line)
        log_file = _append_to_log(log_file, line)
        if event is None:
            tail.append(line)
            logger.info("trainer | %s", line)
            continue
        outcome.events.append(event)
        if isinstance(event, StageEvent):
            outcome.last_stage = event.stage
        elif isinstance(event, StepEvent):
            outcome.last_step = event
        elif isinstance(event, DoneEvent):
            outcome.done = event
        elif isinstance(event, ErrorEvent):
            outcome.error_event = event
            tail.append(line)
        logger.info("trainer event | %s", line[line.find("{") :])
        on_event(event)
    await process.wait()


async def run_trainer(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    deadline_seconds: float,
    redact: Redactor,
    on_event: Callable[[TrainerEvent], None],
    log_path: Path | None = None,
    kill_grace_seconds: float = KILL_GRACE_SECONDS,
) -> TrainerOutcome:
    """Run `command` to completion, the deadline, or cancellation (which kills it and re-raises).

    Whatever the ending, no process it started outlives this call, and its temp files (all kept in
    `cwd/tmp`, see `trainer_temp_environment`) are removed."""
    started = time.monotonic()
    marker = uuid.uuid4().hex
    temp_dir = cwd / TRAINER_TEMP_FOLDER
    temp_dir.mkdir(parents=True, exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        *command,
        env={**env, **trainer_temp_environment(temp_dir), RUN_MARKER_ENV: marker},
        cwd=str(cwd),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        limit=STREAM_LINE_LIMIT,
    )
    processes = TrainerProcesses(process.pid, marker)
    watching = asyncio.create_task(_kill_leftovers_once_the_launcher_exits(process, processes))
    outcome = TrainerOutcome(returncode=None, log_tail=[])
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    log_file = log_path.open("a", encoding="utf-8") if log_path else None
    reading = _read_output(process, outcome, tail, redact, on_event, log_file)
    try:
        await asyncio.wait_for(reading, timeout=max(1.0, deadline_seconds))
    except asyncio.TimeoutError:
        outcome.timed_out = True
        await _terminate(process, processes, kill_grace_seconds)
    except BaseException:
        # Cancellation (or anything else): never leave the trainer running behind us, even if the
        # caller cancels again while we wait.
        await asyncio.shield(_terminate(process, processes, kill_grace_seconds))
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    finally:
        watching.cancel()
        if log_file:
            with contextlib.suppress(OSError):  # a full disk: what was written stays
                log_file.close()
    # The launcher has exited; its workers must not outlive it.
    await _kill_everything(process, processes)
    # Only now that every process of the run is dead: nothing can write there any more.
    shutil.rmtree(temp_dir, ignore_errors=True)
    outcome.returncode = process.returncode
    outcome.log_tail = list(tail)
    outcome.seconds = time.monotonic() - started
    return outcome


def _matches(patterns: Iterable[re.Pattern[str]], lines: Iterable[str]) -> bool:
    return any(pattern.search(line) for pattern in patterns for line in lines)


def cuda_oom_advice(plan: Plan) -> str:
    if plan.zero_stage < 3 and plan.training_type == "full":
        return (
            "ZeRO-2 keeps every transformer parameter on the GPU; use zero_stage 3 with offload cpu, "
            "training_type lora, or a GPU with more memory"
        )
    if plan.offload_param == "none":
        return "set offload to cpu (ZeRO-3 parameter offload), lower resolution or batch_size, or use training_type lora"
    return "lower resolution or batch_size, keep gradient_checkpointing on, or use a GPU with more memory"


def trainer_exit_status(outcome: TrainerOutcome) -> int | None:
    """The trainer's own exit status: the failed rank's as the elastic agent reports it, else the launcher's."""
    for line in outcome.log_tail:
        match = ELASTIC_RANK_FAILED.search(line)
        if match:
            return int(match.group(1))
    return outcome.returncode


def trainer_lines(tail: list[str]) -> list[str]:
    """The log tail without the launcher's epilogue (its traceback and failure summary)."""
    for index, line in enumerate(tail):
        if ELASTIC_RANK_FAILED.search(line):
            return tail[:index]
    return tail


def classify_outcome(outcome: TrainerOutcome, plan: Plan, deadline_seconds: float) -> FluxboothError | None:
    """None for a clean finish; otherwise the coded error the caller receives."""
    tail = outcome.log_tail
    own_lines = trainer_lines(tail)
    status = trainer_exit_status(outcome)
    step = event_payload(outcome.last_step) if outcome.last_step else {}
    progress = f" after step {step.get('step')}/{step.get('total')}" if step else ""
    details: dict[str, Any] = {"exit_status": status, "log_tail": own_lines[-ERROR_TAIL_LINES:]}
    if outcome.timed_out:
        return FluxboothError(
            ErrorCode.TIMEOUT,
            f"training did not finish within the job deadline of {deadline_seconds:.0f} s{progress}; "
            "raise timeout_seconds (and the endpoint's execution timeout) or lower steps",
            details={"last_step": step},
        )
    event = outcome.error_event
    trainer_code = event.code if event else ""
    if trainer_code:
        details["trainer_code"] = trainer_code
    if not event and outcome.returncode == 0 and outcome.done is not None:
        return None
    if trainer_code == "cuda_oom" or _matches(CUDA_OOM_PATTERNS, tail):
        return FluxboothError(
            ErrorCode.CUDA_OOM,
            f"the GPU ran out of memory{progress} (plan: ZeRO-{plan.zero_stage}, "
            f"optimizer offload {plan.offload_optimizer}, parameter offload {plan.offload_param}, "
            f"{plan.training_type}); {cuda_oom_advice(plan)}",
            details=details,
        )
    if _matches(DISK_FULL_PATTERNS, tail):
        stage = f" in its {outcome.last_stage} stage" if outcome.last_stage else ""
        return FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: the disk filled up while the trainer was{stage}{progress}: the plan predicted "
            f"{format_bytes(plan.predicted_disk_bytes)} for its caches, checkpoints and exported weights; free disk "
            "space or give the worker a bigger volume (FLUXBOOTH_WORK_DIR)",
            details=details,
        )
    has_traceback = any("Traceback (most recent call last)" in line for line in own_lines)
    if _matches(HOST_OOM_PATTERNS, tail) or (status in KILLED_STATUSES and not has_traceback):
        return FluxboothError(
            ErrorCode.HOST_OOM,
            f"the trainer was killed{progress}, most likely by the kernel's out-of-memory killer: "
            f"host RAM ran out (the plan predicted {format_bytes(plan.predicted_host_bytes)}); "
            "use a worker with more RAM, training_type lora, or offload nvme with zero_stage 3",
            details=details,
        )
    if event:
        message = event.message or "the trainer reported an error"
        # The trainer checks the images again as it loads them; what it refuses is the dataset's fault.
        code = ErrorCode.INVALID_DATASET if trainer_code == "invalid_dataset" else ErrorCode.TRAINER_FAILED
        return FluxboothError(code, f"trainer stopped ({trainer_code or 'error'}): {message}", details=details)
    if status in STOPPED_FROM_OUTSIDE_STATUSES:
        # Not the worker's doing (its own deadline and cancellation never get here): the container
        # is shutting down, or someone stopped the process by hand.
        return FluxboothError(
            ErrorCode.CANCELLED,
            f"the trainer was stopped from outside the worker (exit status {status}){progress}, "
            "typically because the container is shutting down; run the job again",
            details=details,
        )
    last_lines = "\n".join(own_lines[-MESSAGE_TAIL_LINES:])
    ending = "finished without reporting its weights" if status == 0 else f"exited with status {status}"
    return FluxboothError(
        ErrorCode.TRAINER_FAILED,
        f"the trainer {ending}{progress}. Last log lines:\n{last_lines}",
        details=details,
    )
