"""One job through the runpod SDK's `run_job`, as a deployed worker's loop runs it, in this process's environment:
the worker's logging and the SDK logger's wrapping as `python handler.py` sets them up, without the worker loop
and its start check (which add nothing to what a job's lines are). `python -m tests.support.deployed_job JOB`
prints what such a worker prints for the job and writes the result to the file RESULT."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from runpod.serverless.modules.rp_job import run_job

import handler
from fluxbooth.runpod_log import keep_jobs_out_of_the_sdk_log


def main(job_json: str, result_path: str) -> int:
    handler.configure_logging(handler.settings_for_logging())
    keep_jobs_out_of_the_sdk_log()
    result = asyncio.run(run_job(handler.worker_config()["handler"], json.loads(job_json)))
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
