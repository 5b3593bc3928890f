"""Running the trainer: `accelerate launch` in its own process session, logs streamed and redacted,
progress events parsed, a deadline, cancellation, and the exit classified into error codes.

Killing "the trainer" means every process it started. For DeepSpeed, `accelerate launch` runs torch's
elastic agent, which starts each rank with `start_new_session=True`: the ranks and their children are
outside the launcher's process group, and once the launcher dies they are re-parented and no longer
look like ours. So the launcher's descendants are tracked (psutil, polled while it runs) and signalled
by pid and by their own process groups, not only through the launcher's group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from fluxbooth.configs import LaunchFiles, threads_per_process
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.events import parse_event
from fluxbooth.plan import Plan

LOG_TAIL_LINES = 200
ERROR_TAIL_LINES = 25
MESSAGE_TAIL_LINES = 5
KILL_GRACE_SECONDS = 10.0
DESCENDANT_POLL_SECONDS = 0.5
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


class Redactor:
    """Replaces every secret value with a fixed mask; applied to every line before it goes anywhere."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first so a secret that contains another is masked whole; very short values
        # would mask ordinary text and cannot be meaningful credentials.
        self._secrets = sorted({value for value in secrets if value and len(value) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[REDACTED]")
        return text


@dataclass
class TrainerOutcome:
    returncode: int | None
    log_tail: list[str]
    done: dict[str, Any] | None = None
    error_event: dict[str, Any] | None = None
    timed_out: bool = False
    last_step: dict[str, Any] | None = None
    seconds: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)


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


def kill_process_group(process_group_id: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process_group_id, sig)


class DescendantTracker:
    """Every process started under `root_pid`, remembered even after it leaves the tree."""

    def __init__(self, root_pid: int) -> None:
        # psutil.Process remembers each process's start time, so a reused pid is never walked or signalled.
        self._root = psutil.Process(root_pid)
        self._known: dict[int, psutil.Process] = {}

    def refresh(self) -> None:
        for parent in [self._root, *self.alive()]:
            with contextlib.suppress(psutil.Error):
                if parent.is_running():
                    for child in parent.children(recursive=True):
                        self._known.setdefault(child.pid, child)

    def alive(self) -> list[psutil.Process]:
        return [
            process
            for process in self._known.values()
            if process.is_running() and _status(process) != psutil.STATUS_ZOMBIE
        ]

    def signal_all(self, sig: int) -> None:
        """`sig` to every live descendant and to each of their process groups (never our own)."""
        own_group = os.getpgid(0)
        groups = set()
        for process in self.alive():
            with contextlib.suppress(psutil.Error, OSError):
                groups.add(os.getpgid(process.pid))
                process.send_signal(sig)
        for group in groups - {own_group}:
            kill_process_group(group, sig)


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.Error:
        return psutil.STATUS_DEAD


async def _track_descendants(tracker: DescendantTracker) -> None:
    while True:
        tracker.refresh()
        await asyncio.sleep(DESCENDANT_POLL_SECONDS)


async def _terminate(process: asyncio.subprocess.Process, tracker: DescendantTracker, grace_seconds: float) -> None:
    """SIGTERM everything the launcher started, wait a grace period, then SIGKILL what is left."""
    tracker.refresh()
    kill_process_group(process.pid, signal.SIGTERM)
    tracker.signal_all(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_seconds)
    except asyncio.TimeoutError:
        pass
    _kill_everything(process, tracker)
    with contextlib.suppress(ProcessLookupError):
        await process.wait()


def _kill_everything(process: asyncio.subprocess.Process, tracker: DescendantTracker) -> None:
    tracker.refresh()
    kill_process_group(process.pid, signal.SIGKILL)
    tracker.signal_all(signal.SIGKILL)


async def run_trainer(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    deadline_seconds: float,
    redact: Redactor,
    on_event: Callable[[dict[str, Any]], None],
    log_path: Path | None = None,
    kill_grace_seconds: float = KILL_GRACE_SECONDS,
) -> TrainerOutcome:
    """Run `command` to completion, the deadline, or cancellation (which kills it and re-raises).

    Whatever the ending, no process it started outlives this call."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *command,
        env=dict(env),
        cwd=str(cwd),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        limit=STREAM_LINE_LIMIT,
    )
    tracker = DescendantTracker(process.pid)
    tracking = asyncio.create_task(_track_descendants(tracker))
    outcome = TrainerOutcome(returncode=None, log_tail=[])
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    log_file = log_path.open("a", encoding="utf-8") if log_path else None

    async def pump() -> None:
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
            if log_file:
                log_file.write(line + "\n")
                log_file.flush()
            if event is None:
                tail.append(line)
                logger.info("trainer | %s", line)
                continue
            outcome.events.append(event)
            if event["event"] == "step":
                outcome.last_step = event
            elif event["event"] == "done":
                outcome.done = event
            elif event["event"] == "error":
                outcome.error_event = event
                tail.append(line)
            logger.info("trainer event | %s", line[line.find("{") :])
            on_event(event)
        await process.wait()

    try:
        await asyncio.wait_for(pump(), timeout=max(1.0, deadline_seconds))
    except asyncio.TimeoutError:
        outcome.timed_out = True
        await _terminate(process, tracker, kill_grace_seconds)
    except BaseException:
        # Cancellation (or anything else): never leave the trainer running behind us.
        await _terminate(process, tracker, kill_grace_seconds)
        raise
    finally:
        tracking.cancel()
        if log_file:
            log_file.close()
    # The launcher has exited; its workers must not outlive it.
    _kill_everything(process, tracker)
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
    step = outcome.last_step or {}
    progress = f" after step {step.get('step')}/{step.get('total')}" if step else ""
    details: dict[str, Any] = {"exit_status": status, "log_tail": own_lines[-ERROR_TAIL_LINES:]}
    if outcome.timed_out:
        return FluxboothError(
            ErrorCode.TIMEOUT,
            f"training did not finish within the job deadline of {deadline_seconds:.0f} s{progress}; "
            "raise timeout_seconds (and the endpoint's execution timeout) or lower steps",
            details={"last_step": step},
        )
    event = outcome.error_event or {}
    trainer_code = str(event.get("code", ""))
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
    has_traceback = any("Traceback (most recent call last)" in line for line in own_lines)
    if _matches(HOST_OOM_PATTERNS, tail) or (status in KILLED_STATUSES and not has_traceback):
        return FluxboothError(
            ErrorCode.HOST_OOM,
            f"the trainer was killed{progress}, most likely by the kernel's out-of-memory killer: "
            f"host RAM ran out (the plan predicted {plan.predicted_host_bytes / 2**30:.1f} GiB); "
            "use a worker with more RAM, training_type lora, or offload nvme with zero_stage 3",
            details=details,
        )
    if event:
        message = event.get("message", "the trainer reported an error")
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
