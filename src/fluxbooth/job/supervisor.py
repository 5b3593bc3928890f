"""Supervising a child process and every process it starts: its own session, its output streamed, redacted,
logged and parsed for the contract's events, a deadline, cancellation, a temp folder of its own, and the whole tree
killed however it ends. The trainer's launch (launch.py) and the scoring stage (scoring_stage.py) run through it.

Killing "the child" means every process it started. For DeepSpeed, `accelerate launch` runs torch's elastic agent,
which starts each rank with `start_new_session=True`: the ranks and their children are outside the launcher's
process group, and once the launcher dies they are re-parented and no longer look like ours. So each run puts a
unique marker in the child's environment, which every process it starts inherits, and finds its processes by that
marker as well as by parentage (the technique of Jenkins' ProcessTreeKiller); they are signalled by pid and by
their own process groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from fluxbooth.contract.events import DoneEvent, ErrorEvent, StageEvent, StepEvent, TrainerEvent, parse_event
from fluxbooth.redaction import Redactor

LOG_TAIL_LINES = 200
KILL_WAIT_SECONDS = 5.0
EXIT_POLL_SECONDS = 0.5
# Environment variable carrying each run's marker; see the module docstring. Set and read by the worker only,
# hence the internal prefix (docs/environment.md lists what an operator may set).
RUN_MARKER_ENV = "FLUXBOOTH_INTERNAL_TRAINER_RUN"
# The child's scratch folder, inside its working directory (the job's), so its temp files go with the job.
TEMP_FOLDER = "tmp"
# asyncio's default line limit is 64 KiB; tracebacks with tensors printed can be longer.
STREAM_LINE_LIMIT = 4 * 1024 * 1024

logger = logging.getLogger(__name__)


@dataclass
class ProcessOutcome:
    returncode: int | None
    log_tail: list[str]
    done: DoneEvent | None = None
    error_event: ErrorEvent | None = None
    timed_out: bool = False
    last_step: StepEvent | None = None
    seconds: float = 0.0
    events: list[TrainerEvent] = field(default_factory=list)
    # The stage the child announced last: where a failure happened.
    last_stage: str | None = None


def temp_environment(temp_dir: Path) -> dict[str, str]:
    """Every variable that tells the child's libraries where to write scratch files, pointed into `temp_dir`.

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


class ProcessTree:
    """Every process of one supervised run: the launcher's descendants, and any process whose environment
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
        live: bool = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        return live
    except psutil.Error:
        return False


async def _kill_leftovers_once_the_launcher_exits(process: asyncio.subprocess.Process, processes: ProcessTree) -> None:
    """A process left behind by the launcher keeps the log pipe open, and (Python 3.11)
    `process.wait()` waits for the pipe as well as for the exit: the job would hang until its deadline."""
    while process.returncode is None:
        await asyncio.sleep(EXIT_POLL_SECONDS)
    await _kill_everything(process, processes)


async def _wait_at_most(process: asyncio.subprocess.Process, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(process.wait(), seconds)


async def _terminate(process: asyncio.subprocess.Process, processes: ProcessTree, grace_seconds: float) -> None:
    """SIGTERM everything the launcher started, wait a grace period, then SIGKILL what is left."""
    # Find the processes before signalling any: an exiting process can no longer be recognised.
    processes.signal_all(signal.SIGTERM)
    kill_process_group(process.pid, signal.SIGTERM)
    await _wait_at_most(process, grace_seconds)
    await _kill_everything(process, processes)
    # Bounded too: a process that escaped the search could hold the log pipe open for ever.
    await _wait_at_most(process, grace_seconds)


async def _kill_everything(process: asyncio.subprocess.Process, processes: ProcessTree) -> None:
    processes.signal_all(signal.SIGKILL)
    kill_process_group(process.pid, signal.SIGKILL)
    # SIGKILL takes effect asynchronously; wait (bounded: a process in uninterruptible sleep dies late).
    give_up = time.monotonic() + KILL_WAIT_SECONDS
    while processes.still_alive() and time.monotonic() < give_up:
        await asyncio.sleep(0.01)


def _append_to_log(log_file: TextIO | None, line: str) -> TextIO | None:
    """Append `line` to the job's log file; on a full disk stop writing it (the tail in memory stays):
    the child's own failure is what the job must report, not the log's."""
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
    outcome: ProcessOutcome,
    tail: deque[str],
    redact: Redactor,
    on_event: Callable[[TrainerEvent], None],
    log_file: TextIO | None,
) -> None:
    """Every line the child prints, redacted: events to `on_event` and `outcome`, the rest to the log.

    Logged as "trainer | ..." and "trainer event | ..." whichever child it is: bench/ reads the trainer's events
    from the worker's log by that prefix."""
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


async def supervise(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    deadline_seconds: float,
    redact: Redactor,
    on_event: Callable[[TrainerEvent], None],
    log_path: Path | None = None,
    kill_grace_seconds: float,
) -> ProcessOutcome:
    """Run `command` to completion, the deadline, or cancellation (which kills it and re-raises); once stopped,
    its processes have `kill_grace_seconds` between SIGTERM and SIGKILL.

    Whatever the ending, no process it started outlives this call, and its temp files (all kept in
    `cwd/tmp`, see `temp_environment`) are removed."""
    started = time.monotonic()
    marker = uuid.uuid4().hex
    temp_dir = cwd / TEMP_FOLDER
    temp_dir.mkdir(parents=True, exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        *command,
        env={**env, **temp_environment(temp_dir), RUN_MARKER_ENV: marker},
        cwd=str(cwd),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        limit=STREAM_LINE_LIMIT,
    )
    processes = ProcessTree(process.pid, marker)
    watching = asyncio.create_task(_kill_leftovers_once_the_launcher_exits(process, processes))
    outcome = ProcessOutcome(returncode=None, log_tail=[])
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    log_file = log_path.open("a", encoding="utf-8") if log_path else None
    reading = _read_output(process, outcome, tail, redact, on_event, log_file)
    try:
        await asyncio.wait_for(reading, timeout=max(1.0, deadline_seconds))
    except TimeoutError:
        outcome.timed_out = True
        await _terminate(process, processes, kill_grace_seconds)
    except BaseException:
        # Cancellation (or anything else): never leave the child running behind us, even if the
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
