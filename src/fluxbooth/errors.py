"""The worker's error contract: stable codes and the JSON shape the caller receives."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from fluxbooth.messages import MAX_MESSAGE_CHARS, whole_words


class ErrorCode(StrEnum):
    INVALID_INPUT = "invalid_input"
    INVALID_DATASET = "invalid_dataset"
    DOES_NOT_FIT = "does_not_fit"
    CUDA_OOM = "cuda_oom"
    HOST_OOM = "host_oom"
    TRAINER_FAILED = "trainer_failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    UPLOAD_FAILED = "upload_failed"
    INTERNAL = "internal"
    WORKER_UNFIT = "worker_unfit"  # the worker's start check failed: it answers every job with this


# Failures after which the GPU, the process table or host memory may be left in a bad state. Not `worker_unfit`:
# a fresh worker comes up from the same image and settings, so a restart would only add a cold start to each job.
CODES_THAT_REFRESH_WORKER = frozenset(
    {ErrorCode.CUDA_OOM, ErrorCode.HOST_OOM, ErrorCode.TRAINER_FAILED, ErrorCode.TIMEOUT, ErrorCode.INTERNAL}
)


class FluxboothError(Exception):
    """A failure the caller can act on. `message` names the field or file and says what to do."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        refresh_worker: bool | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.refresh_worker = self.code in CODES_THAT_REFRESH_WORKER if refresh_worker is None else refresh_worker
        self.details = details or {}

    def to_result(self) -> dict[str, Any]:
        # Every stage bounds what it names; this is the last word on the whole message's size.
        error: dict[str, Any] = {"code": self.code.value, "message": whole_words(self.message, MAX_MESSAGE_CHARS)}
        if self.details:
            error["details"] = self.details
        return {"error": error, "refresh_worker": self.refresh_worker}

    def __repr__(self) -> str:
        return f"FluxboothError({self.code.value!r}, {self.message!r})"


def error_for_the_wire(result: dict[str, Any]) -> dict[str, Any]:
    """The result as RunPod's API carries it: a failed job's `error` becomes one JSON string.

    The runpod SDK declares `error` a string: its local API server answers a dict there with HTTP 500, and
    RunPod's hosted API marks a job whose `error` is not a string COMPLETED with no output. The SDK also
    pops `refresh_worker` (it only stops the pod), so the string repeats it for the caller to read.
    A successful result passes through unchanged.
    """
    error = result.get("error")
    if not isinstance(error, dict):
        return result
    refresh_worker = bool(result.get("refresh_worker"))
    payload = {**error, "refresh_worker": refresh_worker}
    return {"error": json.dumps(payload, ensure_ascii=False, default=str), "refresh_worker": refresh_worker}
