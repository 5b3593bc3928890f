"""Masking secret values: the one place that decides what a secret looks like once it has been removed.

Every text that leaves the worker passes through a `Redactor` built from the secrets it knows of: the
trainer's log lines, the worker's own log records (third-party libraries' included), results and error
messages, the doctor's findings and storage errors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

MASK = "[REDACTED]"
# Shorter values would mask ordinary text, and cannot be meaningful credentials.
MIN_SECRET_LENGTH = 4
# A SigV4 presigned URL must carry the access key ID (never the secret): masking it would break the URL.
UNREDACTED_KEYS = frozenset({"url"})


class Redactor:
    """Replaces every secret value with `MASK`."""

    def __init__(self, secrets: Iterable[str | None]) -> None:
        # Longest first so a secret that contains another is masked whole.
        self._secrets = sorted(
            {value for value in secrets if value and len(value) >= MIN_SECRET_LENGTH}, key=len, reverse=True
        )

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    def tree(self, value: Any) -> Any:
        """`value` (JSON-like: strings, lists, dicts) with every string masked, except under `UNREDACTED_KEYS`."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, list):
            return [self.tree(item) for item in value]
        if isinstance(value, dict):
            return {key: item if key in UNREDACTED_KEYS else self.tree(item) for key, item in value.items()}
        return value


class RedactingFilter(logging.Filter):
    """Masks secret values in every record a handler writes, third-party libraries' included:
    botocore's DEBUG log prints the SigV4 Authorization header, which names the access key ID."""

    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        return True
