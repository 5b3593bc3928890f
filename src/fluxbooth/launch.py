"""Running the trainer: `accelerate launch` in its own process session, logs streamed and redacted,
progress events parsed, a deadline, cancellation, and the exit classified into error codes."""

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

from fluxbooth.configs import LaunchFiles, threads_per_process
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.events import parse_event
from fluxbooth.plan import Plan

LOG_TAIL_LINES = 200
ERROR_TAIL_LINES = 25
MESSAGE_TAIL_LINES = 5
KILL_GRACE_SECONDS = 10.0
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


async def _terminate(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the whole group, wait a grace period, then SIGKILL it (grandchildren included)."""
    kill_process_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), KILL_GRACE_SECONDS)
    except asyncio.TimeoutError:
        pass
    kill_process_group(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        await process.wait()


async def run_trainer(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    deadline_seconds: float,
    redact: Redactor,
    on_event: Callable[[dict[str, Any]], None],
    log_path: Path | None = None,
) -> TrainerOutcome:
    """Run `command` to completion, the deadline, or cancellation (which kills it and re-raises)."""
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
        await _terminate(process)
    except BaseException:
        # Cancellation (or anything else): never leave the trainer running behind us.
        await _terminate(process)
        raise
    finally:
        if log_file:
            log_file.close()
    # The launcher has exited; its workers must not outlive it.
    kill_process_group(process.pid, signal.SIGKILL)
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


def classify_outcome(outcome: TrainerOutcome, plan: Plan, deadline_seconds: float) -> FluxboothError | None:
    """None for a clean finish; otherwise the coded error the caller receives."""
    tail = outcome.log_tail
    last_lines = "\n".join(tail[-MESSAGE_TAIL_LINES:])
    step = outcome.last_step or {}
    progress = f" after step {step.get('step')}/{step.get('total')}" if step else ""
    if outcome.timed_out:
        return FluxboothError(
            ErrorCode.TIMEOUT,
            f"training did not finish within the job deadline of {deadline_seconds:.0f} s{progress}; "
            "raise timeout_seconds (and the endpoint's execution timeout) or lower steps",
            details={"last_step": step},
        )
    if outcome.error_event is not None:
        code = outcome.error_event.get("code", "trainer_error")
        message = outcome.error_event.get("message", "the trainer reported an error")
        return FluxboothError(
            ErrorCode.TRAINER_FAILED,
            f"trainer stopped ({code}): {message}",
            details={"trainer_code": code, "exit_status": outcome.returncode, "log_tail": tail[-ERROR_TAIL_LINES:]},
        )
    if outcome.returncode == 0 and outcome.done is not None:
        return None
    if _matches(CUDA_OOM_PATTERNS, tail):
        return FluxboothError(
            ErrorCode.CUDA_OOM,
            f"the GPU ran out of memory{progress} (plan: ZeRO-{plan.zero_stage}, "
            f"optimizer offload {plan.offload_optimizer}, parameter offload {plan.offload_param}, "
            f"{plan.training_type}); {cuda_oom_advice(plan)}",
            details={"exit_status": outcome.returncode, "log_tail": tail[-ERROR_TAIL_LINES:]},
        )
    killed = outcome.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    has_traceback = any("Traceback (most recent call last)" in line for line in tail)
    if _matches(HOST_OOM_PATTERNS, tail) or (killed and not has_traceback):
        return FluxboothError(
            ErrorCode.HOST_OOM,
            f"the trainer was killed{progress}, most likely by the kernel's out-of-memory killer: "
            f"host RAM ran out (the plan predicted {plan.predicted_host_bytes / 2**30:.1f} GiB); "
            "use a worker with more RAM, training_type lora, or offload nvme with zero_stage 3",
            details={"exit_status": outcome.returncode, "log_tail": tail[-ERROR_TAIL_LINES:]},
        )
    status = "finished without reporting its weights" if outcome.returncode == 0 else f"exited with status {outcome.returncode}"
    return FluxboothError(
        ErrorCode.TRAINER_FAILED,
        f"the trainer {status}{progress}. Last log lines:\n{last_lines}",
        details={"exit_status": outcome.returncode, "log_tail": tail[-ERROR_TAIL_LINES:]},
    )
