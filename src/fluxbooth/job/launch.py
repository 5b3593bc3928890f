"""Launching the trainer: `accelerate launch` of the trainer module with the files the worker wrote, run under the
supervisor (supervisor.py: its own session, output redacted and parsed, deadline, cancellation, the whole process
tree killed); trainer_failures.py classifies how it ended."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fluxbooth.contract.events import TrainerEvent
from fluxbooth.job.launch_files import LaunchFiles, threads_per_process
from fluxbooth.job.supervisor import ProcessOutcome, supervise
from fluxbooth.plan import Plan
from fluxbooth.redaction import Redactor

# Between SIGTERM and SIGKILL once the trainer is stopped (its deadline, cancellation): time for its ranks to exit.
KILL_GRACE_SECONDS = 10.0


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
) -> ProcessOutcome:
    """The trainer's `command` run under the supervisor to its end, the deadline or cancellation (which re-raises);
    no process it started outlives this call, and its temp files (in `cwd/tmp`) go with it."""
    return await supervise(
        command,
        env=env,
        cwd=cwd,
        deadline_seconds=deadline_seconds,
        redact=redact,
        on_event=on_event,
        log_path=log_path,
        kill_grace_seconds=kill_grace_seconds,
    )
