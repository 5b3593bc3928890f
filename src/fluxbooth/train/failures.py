"""Failures the trainer reports as an `error` event before exiting with a known status."""

from __future__ import annotations

from fluxbooth.contract.names import (
    ERROR_CODES,
    EXIT_CUDA_OOM,
    EXIT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_NAN_LOSS,
)

EXIT_STATUS_BY_CODE = {
    "invalid_config": EXIT_INVALID_CONFIG,
    "nan_loss": EXIT_NAN_LOSS,
    "cuda_oom": EXIT_CUDA_OOM,
}


class TrainerFailure(Exception):
    """A failure with a stable `code` (one of names.ERROR_CODES) and a message that says what to do."""

    def __init__(self, code: str, message: str, **details: object) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown trainer error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS_BY_CODE.get(self.code, EXIT_FAILED)
