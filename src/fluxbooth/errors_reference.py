"""docs/errors.md, generated from the error codes (`ErrorCode`) so that it cannot drift from them.

Each code's `refresh_worker` is read from `CODES_THAT_REFRESH_WORKER`; its meaning, who fixes it, what to do
and its `details` keys are the entry below (one per code, this module their one owner).
`python -m fluxbooth.errors_reference --write` rewrites docs/errors.md; a test fails when the page differs
from what this module renders, when a code has no entry, or when the code raises a `details` key that its
entry does not list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fluxbooth.contract.names import ERROR_CODES as TRAINER_CODES
from fluxbooth.errors import CODES_THAT_REFRESH_WORKER, ErrorCode
from fluxbooth.request.reference import print_or_write_page

ERRORS_PAGE = Path("docs") / "errors.md"

CALLER = "the caller"
OWNER = "the endpoint's owner"


@dataclass(frozen=True)
class CodeDoc:
    when: str
    who_fixes: str
    what_to_do: str
    details: tuple[str, ...] = ()
    refresh_exceptions: str = ""  # when the code's usual `refresh_worker` does not hold


CODE_DOCS: dict[ErrorCode, CodeDoc] = {
    ErrorCode.INVALID_INPUT: CodeDoc(
        "a field is wrong or unknown, or the request names a base model that does not exist, is not a diffusers "
        "FLUX folder, or whose configs are not readable JSON",
        CALLER,
        "fix the field the message names",
        ("looked_in", "unmatched"),
    ),
    ErrorCode.INVALID_DATASET: CodeDoc(
        "the zip or a photo is unusable (undecodable, too large, a zip bomb, a strict dataset check)",
        CALLER,
        "fix or remove the file named",
        ("findings", "finding_count", "needed_bytes", "free_bytes", "exit_status", "log_tail", "trainer_code"),
    ),
    ErrorCode.DOES_NOT_FIT: CodeDoc(
        "no strategy fits this worker's GPU, host RAM, disk and deadline",
        f"{CALLER}, or {OWNER} (another card, a bigger disk)",
        "the message names the change: fewer steps, a smaller resolution, another card, a longer deadline",
        (
            "needed_bytes",
            "free_bytes",
            "plan_report",
            "gpu_memory_bytes",
            "host_available_bytes",
            "alternatives",
            "estimated_seconds",
            "deadline_seconds",
            "steps_that_fit",
            "timeout_that_fits",
            "phase_seconds",
            "exit_status",
            "log_tail",
            "trainer_code",
        ),
    ),
    ErrorCode.CUDA_OOM: CodeDoc(
        "the GPU ran out of memory although the plan fitted",
        CALLER,
        "a smaller `resolution` or `batch_size`, `base_precision` fp8 or nf4, or a bigger card; report it",
        ("exit_status", "log_tail", "trainer_code", "latest_checkpoint"),
    ),
    ErrorCode.HOST_OOM: CodeDoc(
        "the host ran out of RAM (the kernel killed the trainer)",
        f"{CALLER} or {OWNER}",
        "as for `cuda_oom`, or a worker with more RAM",
        ("exit_status", "log_tail", "trainer_code", "latest_checkpoint"),
    ),
    ErrorCode.TRAINER_FAILED: CodeDoc(
        "the trainer exited with an error",
        "whoever the log tail names; else report it",
        "read `details.log_tail`",
        ("exit_status", "log_tail", "trainer_code", "latest_checkpoint"),
    ),
    ErrorCode.TIMEOUT: CodeDoc(
        "the job's deadline passed: while fetching (`details.stage`) or in training, where the trainer stops at "
        "a step boundary and the weights so far and a checkpoint are stored",
        CALLER,
        'resubmit with `"resume_from": "latest"` and more time ([checkpoints.md](checkpoints.md))',
        (
            "stage",
            "step",
            "steps",
            "last_step",
            "artifacts",
            "checkpoints",
            "latest_checkpoint",
            "resume_from",
            "warnings",
            "deadline_seconds",
            "seconds_left",
            "stop_reserve_seconds",
        ),
        "false when the deadline passes before or at a step boundary (the worker is sound)",
    ),
    ErrorCode.CANCELLED: CodeDoc(
        "the job was cancelled", CALLER, "—", ("exit_status", "log_tail", "trainer_code", "latest_checkpoint")
    ),
    ErrorCode.UPLOAD_FAILED: CodeDoc(
        "the bucket refused or kept failing",
        OWNER,
        "check the `BUCKET_*` settings; `details.kept_at` says where the files wait",
        ("kept_at",),
    ),
    ErrorCode.INTERNAL: CodeDoc(
        "a bug in the worker",
        "the project",
        "report it with the worker's log",
        refresh_exceptions="false where the worker is known to be sound",
    ),
    ErrorCode.WORKER_UNFIT: CodeDoc(
        "the worker cannot train for a reason in its endpoint: its start check failed (no CUDA, DeepSpeed's ops "
        "missing, a broken setting such as no bucket; the worker stays up and answers every job with this at "
        "once), or the endpoint's default base model, its Hugging Face token, its model cache or its reach to "
        'the Hub fails a job (the message ends "the endpoint\'s owner must fix this")',
        OWNER,
        "fix what the message names in the endpoint (image, GPU type, environment) and send the job again",
        ("looked_in",),
        "false for a base model the endpoint cannot get (a fresh worker shares its settings)",
    ),
}

HEADER = """# Errors

<!-- Generated by `python -m fluxbooth.errors_reference --write` from the error codes; do not edit by hand. -->

The handler never raises (the runpod SDK would send the traceback to the caller); every failure is one
error object: `code`, a `message` that names the field or file and says what to do, optional `details`
(the keys each code may carry are listed below) and `refresh_worker` (true: the worker asks RunPod to
replace it after this job, because the GPU, the process table or host memory may be left unhealthy).

**On the wire** (RunPod's API, the SDK's local API server), `error` is that object **as a JSON string**,
and the job is `FAILED`. RunPod's SDK declares `error` a string: its local API server answers an object
there with HTTP 500, and RunPod's hosted API marks such a job `COMPLETED` with no output (runpod-python
issue #299). The SDK also takes `refresh_worker` for itself (it stops the worker after the job), so the
string repeats it. A client reads `json.loads(reply["error"])` (the client, `python -m fluxbooth submit`, does, and prints the
code and message). The runpod SDK's local API server (`python handler.py --rp_serve_api`) answers:

```text
POST /runsync {"input": {"model_name": "sks-dog", "instance_prompt": "a photo of sks dog", "steps": "many"}}
HTTP 200
{
  "id": "test-10b4f252-d3c9-493d-a557-4c4ed19610bd",
  "status": "FAILED",
  "error": "{\\"code\\": \\"invalid_input\\", \\"message\\": \\"invalid request: input.steps: Input should be a valid integer\\", \\"refresh_worker\\": false}"
}
```

`/run` then `/status/<id>` answers the same. In process (`fluxbooth.job.run.run_job`,
`python -m fluxbooth train`) the error is the object itself:
`{"error": {"code": "...", "message": "...", "details": {...}}, "refresh_worker": false}`.

## Each code

| code | when | who fixes it | `refresh_worker` | what to do | `details` keys |
|---|---|---|---|---|---|
"""

TRAINER_CODE_NOTE = """
**`details.trainer_code`**, on an error that came from the trainer process, is the code the trainer itself
reported ({codes}). It is a detail, never the error's `code`, which is always one of the codes above: the
worker reads the trainer's code with its log (a trainer's `cuda_oom` is `cuda_oom`, its `invalid_dataset` is
`invalid_dataset`, a full disk is `does_not_fit`), and any other trainer code, `missing_libaio` among them,
reaches the caller as `trainer_failed`, its message naming the trainer's code: `trainer stopped (missing_libaio): ...`.
"""

FOOTER = """
The client (`python -m fluxbooth submit`) prints `job <id> failed: <code>: <message>`, the latest checkpoint
and the log tail when the error carries them, and exits with status 1. A `timeout` exits with status 4
instead: the client downloads the artifacts the worker kept (`details.artifacts`) into `--out` and, when
`details.resume_from` is `latest`, writes `resume-request.json` there and prints the `submit` command that
continues from the checkpoint.
"""


def _refresh(code: ErrorCode, doc: CodeDoc) -> str:
    usual = "true" if code in CODES_THAT_REFRESH_WORKER else "false"
    return f"{usual}; {doc.refresh_exceptions}" if doc.refresh_exceptions else usual


def _row(code: ErrorCode) -> str:
    doc = CODE_DOCS[code]
    details = ", ".join(f"`{key}`" for key in doc.details) or "—"
    cells = [f"`{code.value}`", doc.when, doc.who_fixes, _refresh(code, doc), doc.what_to_do, details]
    return "| " + " | ".join(cells) + " |"


def render_errors_page() -> str:
    """The whole of docs/errors.md."""
    rows = "\n".join(_row(code) for code in ErrorCode if code in CODE_DOCS)
    note = TRAINER_CODE_NOTE.format(codes=", ".join(f"`{code}`" for code in TRAINER_CODES))
    return HEADER + rows + "\n" + note + FOOTER


def undocumented_codes() -> list[str]:
    return [code.value for code in ErrorCode if code not in CODE_DOCS]


def main(argv: list[str] | None = None) -> int:
    return print_or_write_page("fluxbooth.errors_reference", __doc__, render_errors_page(), ERRORS_PAGE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
