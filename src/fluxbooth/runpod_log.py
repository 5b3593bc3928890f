"""What the runpod SDK's own logger may print: never a job's input or its result.

The SDK prints, at its default level (DEBUG, unless RUNPOD_LOG_LEVEL says otherwise), the whole local test
job ("Retrieved local job: ..."; its base64 dataset is a customer's photos), each handler output, and the
result again as `run_job` returns it ("run_job return: ..."), on a deployed worker and in local test mode; in
local test mode it prints the result a third time at INFO ("Job result: ..."; a trained job's presigned URLs).
Its logger is one object shared by every SDK module, so wrapping that object's `log` here (at start, never in
site-packages) keeps those lines out of every log whatever the level; the SDK's other lines pass unchanged.
What each level prints: docs/environment.md, "What RUNPOD_LOG_LEVEL prints".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# The SDK's messages that carry a job's input, output or progress (runpod/serverless/modules/rp_local.py,
# rp_job.py, rp_progress.py); a job queue's reply the SDK cannot parse is printed whole, and is a job.
JOB_BEARING_MARKERS = (
    "Retrieved local job:",
    "Handler output:",
    "run_job return:",
    "Response content is not valid JSON.",
    "Job result:",
    "Stream output:",
    "Generator output:",
    "Sending Progress Update:",
    "Progress Update Sent:",
)
WITHHELD = "(job input, output and progress are not logged)"
# A URL's query string is where a presigned URL keeps its signature.
URL_QUERY = re.compile(r"(https?://[^\s\"'?#]+)\?[^\s\"'#]*")


def without_url_queries(text: str) -> str:
    """`text` with every http(s) URL's query string cut, so that no presigned URL can be used from a log."""
    return URL_QUERY.sub(r"\1?[query not logged]", text)


def withholding(log: Callable[..., Any]) -> Callable[..., Any]:
    """The SDK logger's `log`, printing a job-bearing message as its first words only."""

    def log_without_jobs(message: Any, message_level: str = "INFO", job_id: str | None = None) -> Any:
        text = str(message)
        for marker in JOB_BEARING_MARKERS:
            if marker in text:
                text = text[: text.index(marker) + len(marker)] + " " + WITHHELD
                break
        return log(without_url_queries(text), message_level, job_id)

    return log_without_jobs


def keep_jobs_out_of_the_sdk_log() -> None:
    """Wrap the SDK's shared logger once (idempotent)."""
    from runpod.serverless.modules.rp_logger import RunPodLogger

    logger = RunPodLogger()
    if "log" not in vars(logger):
        logger.log = withholding(logger.log)
