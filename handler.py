"""RunPod serverless entry point for fluxbooth.

`python handler.py` starts the worker; the runpod SDK's local modes work as documented:
`python handler.py --test_input "$(cat test_input.json)"` and `python handler.py --rp_serve_api`.
This process never imports torch: the trainer runs in a subprocess.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import runpod

from fluxbooth.job import run_job
from fluxbooth.settings import WorkerSettings


def progress_sink_for(job: dict[str, Any]) -> Any:
    """RunPod's progress_update only has somewhere to go on RunPod itself; locally we just log."""
    if not os.environ.get("RUNPOD_WEBHOOK_POST_OUTPUT"):
        return lambda payload: logging.getLogger("fluxbooth.progress").info("progress %s", payload)
    return lambda payload: runpod.serverless.progress_update(job, payload)


async def handler(job: dict[str, Any]) -> dict[str, Any]:
    return await run_job(
        job.get("input"),
        job_id=job.get("id"),
        settings=WorkerSettings.from_environ(),
        progress=progress_sink_for(job),
    )


def one_job_at_a_time(current_concurrency: int) -> int:
    # A job owns the whole GPU and most of host RAM; two at once would only OOM each other.
    return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runpod.serverless.start({"handler": handler, "concurrency_modifier": one_job_at_a_time})
