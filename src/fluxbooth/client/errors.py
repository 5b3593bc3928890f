"""The client's exit codes (one per way a submission ends) and the error that carries one."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """`python -m fluxbooth submit` exits with one of these; scripts branch on them."""

    COMPLETED = 0  # the job completed and every artifact was downloaded and verified
    FAILED = 1  # the job ended FAILED (the worker's error code and message are printed)
    USAGE = 2  # bad input found before anything was submitted (no photos, bad request file, ...)
    CANCELLED = 3  # the job ended CANCELLED (cancelled elsewhere, e.g. in the console)
    TIMED_OUT = 4  # RunPod ended the job at the endpoint's or the policy's execution timeout
    DOWNLOAD = 5  # the job completed but an artifact could not be fetched or its sha256 did not match
    API = 6  # the endpoint could not be reached or refused the call (wrong ID, wrong key, ...)
    INTERRUPTED = 130  # Ctrl-C: the job was cancelled through /cancel where the server has one (128 + SIGINT)


class ClientError(Exception):
    """A submission that cannot go on: the message says what happened and what to do."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
