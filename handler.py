"""RunPod serverless entry point for fluxbooth.

`python handler.py` starts the worker; the runpod SDK's local modes work as documented:
`python handler.py --test_input "$(cat test_input.json)"` and `python handler.py --rp_serve_api`.
This process never imports torch: the trainer runs in a subprocess.

The handler is async so the SDK can stop one job: it cancels the handler's task, `run_job` kills the
trainer's whole process tree and removes the job directory, and the CancelledError goes back up to
the SDK, as it requires. Every other ending is a result or an error dict, never an exception (the
SDK would send the traceback to the caller).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import IO, Any

import runpod

from fluxbooth.errors import ErrorCode, FluxboothError, error_for_the_wire
from fluxbooth.job.run import run_job
from fluxbooth.progress import ProgressBar, ProgressSink
from fluxbooth.redaction import RedactingFilter, Redactor
from fluxbooth.runpod_log import keep_jobs_out_of_the_sdk_log, without_url_queries
from fluxbooth.settings import SECRET_ENV_NAMES, WorkerSettings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def progress_sink_for(job: dict[str, Any]) -> ProgressSink:
    """RunPod's progress_update only has somewhere to go on RunPod itself; locally (`--test_input`,
    `--rp_serve_api`) progress is drawn on stderr."""
    if runs_locally():
        return ProgressBar.for_stream(sys.stderr)
    return lambda payload: runpod.serverless.progress_update(job, payload)


def runs_locally() -> bool:
    """True outside RunPod's job queue (`--test_input`, `--rp_serve_api`): no one receives progress_update."""
    return not os.environ.get("RUNPOD_WEBHOOK_POST_OUTPUT")


async def handler(job: object) -> dict[str, Any]:
    """One job in, its result out in RunPod's wire shape (`error` a JSON string, see `error_for_the_wire`)."""
    result = error_for_the_wire(await _result_for(job))
    if runs_locally():
        # The SDK's own "Job result" line is withheld (fluxbooth.runpod_log); this one, for the local test
        # mode's user, shows the result whole but for its URLs' query strings (a presigned URL's signature).
        logging.getLogger("fluxbooth.job.result").info(
            "result %s", without_url_queries(json.dumps(result, sort_keys=True))
        )
    return result


async def _result_for(job: object) -> dict[str, Any]:
    if not isinstance(job, dict):
        return FluxboothError(ErrorCode.INVALID_INPUT, "job: expected a JSON object with `id` and `input`").to_result()
    try:
        settings = WorkerSettings.from_environ()
    except ValueError as error:
        return FluxboothError(
            ErrorCode.WORKER_UNFIT, f"worker settings: {error}; fix the endpoint's environment variables"
        ).to_result()
    return await run_job(job.get("input"), job_id=job.get("id"), settings=settings, progress=progress_sink_for(job))


def one_job_at_a_time(current_concurrency: int) -> int:
    # A job owns the whole GPU and most of host RAM; two at once would only OOM each other.
    return 1


class StartCheck:
    """The worker's start check and what it found. Registered as a runpod SDK fitness check, which runs on RunPod
    only (not in the local test or API modes), before the worker takes a job; it never raises, so the SDK keeps the
    worker up instead of exiting (which would leave jobs queued until their TTL with the reason only in the log),
    and every job is answered `worker_unfit`, naming what failed, without `refresh_worker`: a replacement worker
    would start from the same image and settings, so a restart after every job only adds a cold start to each."""

    def __init__(self) -> None:
        self.failures: tuple[str, ...] = ()

    def run(self) -> None:
        self.failures = tuple(failed_start_checks())

    def unfit_result(self) -> dict[str, Any]:
        return FluxboothError(
            ErrorCode.WORKER_UNFIT,
            "this worker cannot train: " + " | ".join(self.failures) + "; fix the endpoint (its image, GPU type or "
            "environment variables) and send the job again",
        ).to_result()


def worker_config(start_check: StartCheck | None = None) -> dict[str, Any]:
    """What `runpod.serverless.start` gets: the handler, or, once `start_check` has found a failure, a handler
    that answers every job with it."""
    if start_check is None:
        return {"handler": handler, "concurrency_modifier": one_job_at_a_time}
    checked = start_check

    async def handler_after_start_check(job: object) -> dict[str, Any]:
        if checked.failures:
            return error_for_the_wire(checked.unfit_result())
        return await handler(job)

    return {"handler": handler_after_start_check, "concurrency_modifier": one_job_at_a_time}


def configure_logging(settings: WorkerSettings, stream: IO[str] | None = None, level: int = logging.INFO) -> None:
    output = logging.StreamHandler(stream)
    output.setFormatter(logging.Formatter(LOG_FORMAT))
    output.addFilter(RedactingFilter(Redactor(settings.secret_values)))
    logging.basicConfig(level=level, handlers=[output], force=True)


def failed_start_checks() -> list[str]:
    """The doctor's checks, once, before the worker takes its first job: each one that failed, as
    "<check>: <what is wrong>", every result logged."""
    from fluxbooth.job.doctor import FAIL, worker_start_checks

    results = worker_start_checks(os.environ)
    log = logging.getLogger("fluxbooth.start")
    for result in results:
        log.log(
            logging.ERROR if result.status == FAIL else logging.INFO,
            "%-5s %s: %s",
            result.status.upper(),
            result.name,
            result.detail,
        )
    failed = [f"{result.name}: {result.detail}" for result in results if result.status == FAIL]
    if failed:
        log.error("the worker cannot train; it answers every job with worker_unfit: %s", " | ".join(failed))
    return failed


def check_worker_at_start() -> None:
    """The start checks as one call that raises when one fails (for the image's own build checks)."""
    failed = failed_start_checks()
    if failed:
        raise RuntimeError("the worker cannot train: " + " | ".join(failed))


def settings_for_logging() -> WorkerSettings:
    """The worker's settings, or, when they do not parse (the start check reports that), just its secrets."""
    try:
        return WorkerSettings.from_environ()
    except ValueError:
        return WorkerSettings.from_environ({name: os.environ[name] for name in SECRET_ENV_NAMES if name in os.environ})


if __name__ == "__main__":
    configure_logging(settings_for_logging())
    keep_jobs_out_of_the_sdk_log()
    start_check = StartCheck()
    runpod.serverless.register_fitness_check(start_check.run)
    runpod.serverless.start(worker_config(start_check))
