"""The trainer's failure taxonomy: a finished trainer run classified into the job's error codes, with the advice
each failure (the GPU's memory, the host's, the disk) comes with."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from fluxbooth.contract.events import DoneEvent, WarningEvent, event_payload, exported_artifacts
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.supervisor import ProcessOutcome
from fluxbooth.messages import format_bytes
from fluxbooth.plan import Plan

ERROR_TAIL_LINES = 25
MESSAGE_TAIL_LINES = 5
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
STOPPED_FROM_OUTSIDE_STATUSES = frozenset({-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT})
KILLED_STATUSES = frozenset({-signal.SIGKILL, 128 + signal.SIGKILL})


def _matches(patterns: Iterable[re.Pattern[str]], lines: Iterable[str]) -> bool:
    return any(pattern.search(line) for pattern in patterns for line in lines)


def cuda_oom_advice(plan: Plan) -> str:
    if plan.zero_stage < 3 and plan.training_type == "full":
        return (
            "ZeRO-2 keeps every transformer parameter on the GPU; use zero_stage 3 with offload cpu, "
            "training_type lora, or a GPU with more memory"
        )
    if plan.offload_param == "none":
        return (
            "set offload to cpu (ZeRO-3 parameter offload), lower resolution or batch_size, or use training_type lora"
        )
    return "lower resolution or batch_size, keep gradient_checkpointing on, or use a GPU with more memory"


def trainer_exit_status(outcome: ProcessOutcome) -> int | None:
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


def classify_outcome(outcome: ProcessOutcome, plan: Plan, deadline_seconds: float) -> FluxboothError | None:
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


def kept_after_export(outcome: ProcessOutcome, failure: FluxboothError) -> ProcessOutcome | None:
    """A trainer that failed after its export stage reported every file written and verified (a LoRA's final
    renders run after it) as a finished run: a `done` with those artifacts, and a warning event that says what
    failed. None when it exported nothing, or when the container is stopping (a cancelled job keeps nothing)."""
    artifacts = exported_artifacts(outcome.events)
    if not artifacts or failure.code is ErrorCode.CANCELLED:
        return None
    step = outcome.last_step
    metrics = {
        "steps": step.total if step else None,
        "final_loss": step.loss if step else None,
        "failed_after_export": failure.code.value,
    }
    # Killed as the export ends, the trainer announced no later stage.
    later = outcome.last_stage not in (None, "export")
    where = f", in its {outcome.last_stage} stage" if later else ""
    reason = failure.message.splitlines()[0]
    warning = WarningEvent(
        f"the trainer failed after exporting the weights{where} ({failure.code.value}: {reason}); the exported "
        "weights are kept and uploaded, without the final validation renders"
    )
    return replace(outcome, done=DoneEvent(metrics=metrics, artifacts=artifacts), events=[*outcome.events, warning])
