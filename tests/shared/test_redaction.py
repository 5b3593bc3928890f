"""Secret values are masked the same way wherever text leaves the worker."""

from __future__ import annotations

import io
import logging

from fluxbooth.redaction import RedactingFilter, Redactor


def test_the_longest_secret_is_masked_first() -> None:
    redact = Redactor(["abcd", "abcdefgh"])
    assert redact("x abcdefgh y abcd") == "x [REDACTED] y [REDACTED]"


def test_values_shorter_than_four_characters_and_missing_ones_are_not_secrets() -> None:
    redact = Redactor(["abc", "", None])
    assert redact("abc abc") == "abc abc"


def test_a_result_tree_is_masked_everywhere_but_in_presigned_urls() -> None:
    redact = Redactor(["AKIAEXAMPLEKEY"])
    result = {
        "error": {"message": "denied for AKIAEXAMPLEKEY", "details": ["AKIAEXAMPLEKEY", 3]},
        "artifacts": [{"url": "https://s3/x?X-Amz-Credential=AKIAEXAMPLEKEY%2F", "key": "AKIAEXAMPLEKEY/x"}],
    }
    assert redact.tree(result) == {
        "error": {"message": "denied for [REDACTED]", "details": ["[REDACTED]", 3]},
        "artifacts": [{"url": "https://s3/x?X-Amz-Credential=AKIAEXAMPLEKEY%2F", "key": "[REDACTED]/x"}],
    }


def test_log_records_and_their_tracebacks_are_masked() -> None:
    written = io.StringIO()
    output = logging.StreamHandler(written)
    output.addFilter(RedactingFilter(Redactor(["s3cr3t-token"])))
    logger = logging.getLogger("test_redaction")
    logger.addHandler(output)
    try:
        try:
            raise RuntimeError("failed with s3cr3t-token")
        except RuntimeError:
            logger.exception("token %s", "s3cr3t-token")
    finally:
        logger.removeHandler(output)
    assert "s3cr3t-token" not in written.getvalue()
    assert written.getvalue().startswith("token [REDACTED]\n")
    assert "RuntimeError: failed with [REDACTED]" in written.getvalue()
