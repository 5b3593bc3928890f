"""Whole jobs under hostile input and faults: every ending is a coded error dict from `run_job`, nothing
is left behind (files, processes), and no secret leaks.

Trainer faults run the REAL `accelerate launch` (DeepSpeed, torch's elastic agent) of a fault-injecting
stand-in trainer, `tests.support.fake_trainer_module`, chosen by the job's `instance_prompt` ("... fault:crash").
Those tests are marked slow: each launch costs a few seconds on CPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from botocore.client import BaseClient

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job import planned as planned_job
from fluxbooth.job import run as job_module
from fluxbooth.job.deadline import trainer_deadline
from fluxbooth.job.launch import run_trainer
from fluxbooth.job.planned import PlannedJob
from fluxbooth.job.run import run_job
from fluxbooth.messages import format_bytes
from fluxbooth.redaction import Redactor
from fluxbooth.settings import SECRET_ENV_NAMES, WorkerSettings
from fluxbooth.storage.upload import UNUPLOADED_DIR_NAME
from tests.support.checkpoint_folders import build_checkpoint
from tests.support.factories import make_dataset_zip, make_image, make_zip, to_base64
from tests.support.fake_trainer_jobs import SEED, files_left_under, job_input, process_is_running, trainer_lines
from tests.support.fake_trainer_module import (
    CMDLINE_LINE_PREFIX,
    ENV_LINE_PREFIX,
    WEIGHTS_FILE,
    reported_pids,
    weights_bytes,
)
from tests.support.s3server import free_tcp_port

HANG_DEADLINE_SECONDS = "15"
# The trainer may see these (gated hub downloads); the worker still masks them in everything it emits.
SECRETS_THE_TRAINER_MAY_SEE = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
PR_SET_CHILD_SUBREAPER = 36


# --- building jobs -------------------------------------------------------------------------------


@pytest.fixture()
def no_teardown_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung trainer is killed at the deadline whatever the stop reserves; without this, the 30 s kept for
    accelerate's and DeepSpeed's teardown would make a deadline short enough for a quick test refuse to launch."""
    monkeypatch.setattr(planned_job, "TRAINER_TEARDOWN_SECONDS", 0.0)


def run(
    env: dict[str, str], raw_input: Any, job_id: str = "job-1", progress: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    settings = WorkerSettings.from_environ(env)
    sink = progress.append if progress is not None else None
    return asyncio.run(run_job(raw_input, job_id=job_id, settings=settings, progress=sink))


def assert_error(result: dict[str, Any], code: ErrorCode, fragment: str, *, refresh_worker: bool) -> None:
    assert set(result) == {"error", "refresh_worker"}, result
    assert result["error"]["code"] == code.value, result["error"]
    assert fragment in result["error"]["message"], result["error"]["message"]
    assert result["refresh_worker"] is refresh_worker


# --- 1. every failure kind is a coded error dict, never an exception ------------------------------


@pytest.mark.parametrize(
    ("raw_input", "fragment"),
    [
        (None, "input: expected a JSON object with the training fields, got NoneType"),
        ({**job_input(), "colour": "blue"}, "input.colour: unknown field"),
        ({**job_input(), "steps": "2000"}, "input.steps:"),
        (job_input(with_prior_preservation=True), "input.class_prompt: required when input.with_prior_preservation"),
        (job_input(model_name="../../etc"), "input.model_name:"),
    ],
    ids=["not-an-object", "unknown-field", "string-number", "prior-without-class-prompt", "path-in-model-name"],
)
def test_a_bad_request_is_invalid_input_and_writes_nothing(
    fake_env: dict[str, str], tmp_path: Path, raw_input: Any, fragment: str
) -> None:
    result = run(fake_env, raw_input)
    assert_error(result, ErrorCode.INVALID_INPUT, fragment, refresh_worker=False)
    assert files_left_under(tmp_path / "work") == []


def test_a_file_that_is_not_a_zip_is_invalid_dataset(fake_env: dict[str, str], tmp_path: Path) -> None:
    result = run(fake_env, job_input(dataset=to_base64(b"these bytes are not a zip archive at all")))
    assert_error(result, ErrorCode.INVALID_DATASET, "dataset:", refresh_worker=False)
    assert files_left_under(tmp_path / "work") == []


def test_a_zip_slip_member_is_refused_and_nothing_lands_outside_the_job(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    archive = make_zip(
        [(f"photo{index}.png", make_image("PNG", size=(96, 96))) for index in range(3)]
        + [("../../escaped.png", make_image("PNG", size=(96, 96)))]
    )
    result = run(fake_env, job_input(dataset=to_base64(archive)))
    assert_error(result, ErrorCode.INVALID_DATASET, "escaped.png", refresh_worker=False)
    assert not list(tmp_path.rglob("escaped.png"))
    assert files_left_under(tmp_path / "work") == []


def test_nvme_offload_without_an_offload_path_is_does_not_fit(fake_env: dict[str, str]) -> None:
    result = run(fake_env, job_input(zero_stage=3, offload="nvme"))
    assert_error(result, ErrorCode.DOES_NOT_FIT, "set FLUXBOOTH_NVME_PATH", refresh_worker=False)


def test_an_unusable_work_directory_is_internal_naming_the_setting(fake_env: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run({**fake_env, "FLUXBOOTH_WORK_DIR": str(blocker / "work")}, job_input())
    assert_error(
        result, ErrorCode.INTERNAL, f"the work directory {blocker / 'work'} cannot be used", refresh_worker=True
    )
    assert "set FLUXBOOTH_WORK_DIR to a writable directory" in result["error"]["message"]


def test_an_unexpected_exception_is_internal_with_secrets_masked(
    fake_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    canary = f"canary-hf-{uuid.uuid4().hex}"

    def broken_writer(*args: Any, **kwargs: Any) -> None:
        # A bug nobody foresaw, whose message happens to carry a secret.
        raise RuntimeError(f"cannot write the launch files with token {canary}")

    monkeypatch.setattr(job_module, "write_launch_files", broken_writer)
    caplog.set_level(logging.INFO)
    result = run({**fake_env, "HF_TOKEN": canary}, job_input())
    assert_error(
        result,
        ErrorCode.INTERNAL,
        "internal error (RuntimeError): cannot write the launch files with token [REDACTED]",
        refresh_worker=True,
    )
    assert canary not in caplog.text
    assert files_left_under(tmp_path / "work") == []


# --- 5. disk ------------------------------------------------------------------------------------


def test_too_little_disk_for_the_plan_is_does_not_fit_before_the_dataset_is_read(
    fake_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=1000))
    result = run(fake_env, job_input())
    assert_error(result, ErrorCode.DOES_NOT_FIT, f"disk at {tmp_path / 'work' / 'job-job-1'}-", refresh_worker=False)
    message = result["error"]["message"]
    assert ", has 1000 B. No strategy fits; free disk space at " in message
    assert message.endswith(" or point FLUXBOOTH_WORK_DIR at a larger volume")
    assert files_left_under(tmp_path / "work") == []


def test_too_little_disk_for_the_dataset_is_does_not_fit_before_extraction(
    fake_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_disk_usage = shutil.disk_usage
    # Enough for the tiny model's plan (about 40 MiB: cached embeddings for the dataset cap), not for the
    # dataset plus its 64 MiB reserve.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=50 * 1024**2))
    result = run(fake_env, job_input())
    assert_error(result, ErrorCode.DOES_NOT_FIT, "disk: storing the dataset needs about", refresh_worker=False)
    assert f"are free under {tmp_path / 'work'}" in result["error"]["message"]
    assert files_left_under(tmp_path / "work") == []


def fill_disk_once_written(monkeypatch: pytest.MonkeyPatch, work_root: Path, pattern: str, free_bytes: int) -> None:
    """The disk reports `free_bytes` free as soon as a file matching `pattern` exists under `work_root`."""
    real_disk_usage = shutil.disk_usage

    def disk_usage(path: str | os.PathLike[str]) -> Any:
        usage = real_disk_usage(path)
        return usage._replace(free=free_bytes) if any(work_root.glob(pattern)) else usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_disk_filled_by_the_dataset_is_does_not_fit_before_training(
    fake_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    work_root = tmp_path / "work"
    left_after_unpacking = 100_000
    fill_disk_once_written(monkeypatch, work_root, "job-*/data/instance/*.png", left_after_unpacking)
    caplog.set_level(logging.INFO)
    result = run(fake_env, job_input())

    assert_error(result, ErrorCode.DOES_NOT_FIT, "disk: training needs about", refresh_worker=False)
    needed = result["error"]["details"]["needed_bytes"]
    assert needed > left_after_unpacking
    assert f"training needs about {format_bytes(needed)}" in result["error"]["message"]
    assert f"only {format_bytes(left_after_unpacking)} are free under {work_root}" in result["error"]["message"]
    assert trainer_lines(caplog) == [], "the trainer was launched"
    assert files_left_under(work_root) == []


def test_disk_filled_by_the_checkpoint_to_resume_from_is_does_not_fit_before_training(
    fake_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from fluxbooth.storage.checkpoints import open_checkpoint_store, upload_checkpoint

    settings = WorkerSettings.from_environ(fake_env)
    stored = upload_checkpoint(open_checkpoint_store(settings, "sks-dog"), build_checkpoint(tmp_path / "made", 2), 2)
    work_root = tmp_path / "work"
    fill_disk_once_written(monkeypatch, work_root, "job-*/checkpoints/checkpoint-2/pytorch_model/*.pt", 100_000)
    caplog.set_level(logging.INFO)
    result = run(fake_env, job_input(resume_from=stored))

    assert_error(result, ErrorCode.DOES_NOT_FIT, "disk: training needs about", refresh_worker=False)
    assert trainer_lines(caplog) == [], "the trainer was launched"
    assert files_left_under(work_root) == []


# --- 2. deadline ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_deadline_used_up_before_training_is_timeout() -> None:
    # The planner counts every phase, so a deadline it accepts is used up before the launch only when a stage
    # before it (a slow download, a resumed checkpoint) overran its estimate: the launch step then refuses.
    planned = PlannedJob(
        spec=None,
        model=None,
        size=None,
        hardware=None,
        plan=None,
        deadline=60.0,  # type: ignore[arg-type]
        started=time.monotonic() - 60.0,
        resume_checkpoint=None,
        warnings=[],
    )
    with pytest.raises(FluxboothError) as refused:
        trainer_deadline(planned)
    assert (refused.value.code, refused.value.message) == (
        ErrorCode.TIMEOUT,
        "the job deadline of 60 s was used up before training began; raise timeout_seconds "
        "(or FLUXBOOTH_JOB_DEADLINE_SECONDS on the endpoint)",
    )


def test_a_run_the_planner_expects_to_overrun_the_environment_deadline_is_refused_up_front(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    result = run({**fake_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "60"}, job_input(steps=100_000))
    assert_error(result, ErrorCode.DOES_NOT_FIT, "beyond the job deadline", refresh_worker=False)
    assert files_left_under(tmp_path / "work") == []


@pytest.mark.slow
def test_the_request_timeout_overrides_the_environment_deadline(fake_env: dict[str, str]) -> None:
    result = run({**fake_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "1"}, job_input(timeout_seconds=120))
    assert "error" not in result, result


@pytest.mark.slow
def test_a_hang_past_the_deadline_is_timeout_and_leaves_no_process(
    fake_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture, no_teardown_reserve: None
) -> None:
    caplog.set_level(logging.INFO)
    result = run({**fake_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": HANG_DEADLINE_SECONDS}, job_input("x fault:hang"))
    assert_error(
        result,
        ErrorCode.TIMEOUT,
        f"did not finish within the job deadline of {HANG_DEADLINE_SECONDS} s after step 2/4",
        refresh_worker=True,
    )
    pids = reported_pids(trainer_lines(caplog))
    assert set(pids) == {"launcher", "trainer", "grandchild"}
    assert [pid for pid in pids.values() if process_is_running(pid)] == []
    assert files_left_under(tmp_path / "work") == []


@pytest.mark.slow
def test_a_hang_that_ignores_sigterm_is_killed_outside_the_launchers_process_group(
    fake_env: dict[str, str], caplog: pytest.LogCaptureFixture, no_teardown_reserve: None
) -> None:
    # torch's elastic agent starts the trainer in a session of its own, beyond the launcher's group;
    # here the trainer and its child also ignore SIGTERM, so only the worker's own SIGKILL can end them.
    caplog.set_level(logging.INFO)
    result = run(
        {**fake_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": HANG_DEADLINE_SECONDS},
        job_input("x fault:hang fault:ignore_sigterm"),
    )
    assert_error(result, ErrorCode.TIMEOUT, "did not finish within the job deadline", refresh_worker=True)
    pids = reported_pids(trainer_lines(caplog))
    assert set(pids) == {"launcher", "trainer", "grandchild"}
    assert [pid for pid in pids.values() if process_is_running(pid)] == []


STUBBORN_LAUNCHER = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
print("stubborn pids: launcher=%d rank=%d" % (os.getpid(), rank.pid), flush=True)
time.sleep(3600)
"""


def test_run_trainer_kills_descendants_in_other_sessions_when_sigterm_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_LAUNCHER)
    caplog.set_level(logging.INFO, logger="fluxbooth.job.supervisor")
    outcome = asyncio.run(
        run_trainer(
            [sys.executable, str(script)],
            env={"PATH": os.environ["PATH"]},
            cwd=tmp_path,
            deadline_seconds=2,
            redact=Redactor(()),
            on_event=lambda event: None,
            kill_grace_seconds=0.5,
        )
    )
    assert outcome.timed_out
    reported = next(line for line in trainer_lines(caplog) if "stubborn pids:" in line)
    pids = {
        name: int(value) for name, value in (item.split("=") for item in reported.split("stubborn pids:")[1].split())
    }
    assert set(pids) == {"launcher", "rank"}
    assert [pid for pid in pids.values() if process_is_running(pid)] == []


ORPHANING_LAUNCHER = r"""
import os, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
print("orphaning pids: launcher=%d rank=%d" % (os.getpid(), rank.pid), flush=True)
"""


def test_a_launcher_that_exits_leaving_a_child_is_not_waited_on_until_the_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The orphan inherits the log pipe; without killing it the pipe never closes.
    script = tmp_path / "orphaning.py"
    script.write_text(ORPHANING_LAUNCHER)
    caplog.set_level(logging.INFO, logger="fluxbooth.job.supervisor")
    outcome = asyncio.run(
        run_trainer(
            [sys.executable, str(script)],
            env={"PATH": os.environ["PATH"]},
            cwd=tmp_path,
            deadline_seconds=120,
            redact=Redactor(()),
            on_event=lambda event: None,
        )
    )
    assert (outcome.timed_out, outcome.returncode) == (False, 0)
    assert outcome.seconds < 30
    reported = next(line for line in trainer_lines(caplog) if "orphaning pids:" in line)
    rank = int(reported.rsplit("rank=", 1)[1])
    assert not process_is_running(rank)


# --- trainer faults, through the real accelerate launch -------------------------------------------


@pytest.mark.slow
def test_a_successful_job_stores_the_exported_weights_and_removes_the_job_dir(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    progress: list[dict[str, Any]] = []
    result = run(fake_env, job_input(), job_id="ok-1", progress=progress)
    assert "error" not in result, result
    stored = tmp_path / "outputs" / "sks-dog" / "ok-1" / WEIGHTS_FILE
    assert stored.read_bytes() == weights_bytes(SEED)
    weights = next(artifact for artifact in result["artifacts"] if artifact["name"] == WEIGHTS_FILE)
    assert (weights["uri"], weights["sha256"]) == (stored.as_uri(), hashlib.sha256(weights_bytes(SEED)).hexdigest())
    assert result["metrics"]["optimizer"] == "FakeAdam"
    assert {"plan", "dataset", "train", "upload"} <= {update["stage"] for update in progress}
    assert files_left_under(tmp_path / "work") == []


TRAINER_FAULTS = [
    ("fault:crash", ErrorCode.TRAINER_FAILED, "the trainer exited with status 1 after step 2/4", True),
    ("fault:cuda_oom", ErrorCode.CUDA_OOM, "the GPU ran out of memory after step 2/4", True),
    ("fault:sigkill", ErrorCode.HOST_OOM, "most likely by the kernel's out-of-memory killer", True),
    ("fault:nan", ErrorCode.TRAINER_FAILED, "trainer stopped (nan_loss): loss became nan at step 3", True),
    ("fault:sigterm", ErrorCode.CANCELLED, "the trainer was stopped from outside the worker (exit status -15)", False),
    (
        "fault:bad_weights",
        ErrorCode.TRAINER_FAILED,
        "diffusion_pytorch_model.safetensors is not valid safetensors",
        True,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "code", "fragment", "refresh"), TRAINER_FAULTS, ids=[row[0] for row in TRAINER_FAULTS]
)
def test_a_trainer_fault_is_a_coded_error(
    fake_env: dict[str, str], tmp_path: Path, fault: str, code: ErrorCode, fragment: str, refresh: bool
) -> None:
    result = run(fake_env, job_input(f"a photo of sks dog {fault}"))
    assert_error(result, code, fragment, refresh_worker=refresh)
    assert files_left_under(tmp_path / "work") == []


@pytest.mark.slow
def test_a_crash_reports_the_trainers_own_last_lines_and_exit_status(fake_env: dict[str, str]) -> None:
    result = run(fake_env, job_input("x fault:crash"))
    error = result["error"]
    # The trainer's traceback, not the launcher's ChildFailedError epilogue that follows it.
    assert error["message"].endswith("RuntimeError: the fake trainer crashed on purpose")
    assert error["details"]["exit_status"] == 1
    assert "RuntimeError: the fake trainer crashed on purpose" in error["details"]["log_tail"]
    assert not any("ChildFailedError" in line for line in error["details"]["log_tail"])


# --- 4. upload faults ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_missing_bucket_without_a_volume_is_upload_failed_saying_nothing_was_kept(
    fake_env: dict[str, str], s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    missing = f"fluxbooth-missing-{uuid.uuid4().hex[:12]}"
    result = run({**fake_env, **s3_bucket_env, "BUCKET_NAME": missing}, job_input())
    assert_error(result, ErrorCode.UPLOAD_FAILED, f"bucket {missing!r} does not exist", refresh_worker=False)
    assert (
        "No persistent volume is mounted (FLUXBOOTH_VOLUME_DIR), so the weights could not be kept"
        in result["error"]["message"]
    )
    assert files_left_under(tmp_path / "work") == []


@pytest.mark.slow
def test_a_bucket_that_is_down_keeps_the_weights_on_the_volume_and_says_where(
    fake_env: dict[str, str], s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    volume = tmp_path / "runpod-volume"
    volume.mkdir()
    env = {
        **fake_env,
        **s3_bucket_env,
        "BUCKET_ENDPOINT_URL": f"http://127.0.0.1:{free_tcp_port()}",
        "FLUXBOOTH_VOLUME_DIR": str(volume),
        "FLUXBOOTH_VOLUME_PERSISTENT": "1",
    }
    result = run(env, job_input(), job_id="down-1")

    kept = volume / UNUPLOADED_DIR_NAME / "sks-dog" / "down-1"
    assert_error(result, ErrorCode.UPLOAD_FAILED, "cannot connect to the storage endpoint", refresh_worker=False)
    assert f"The trained weights were kept at {kept} on the persistent volume" in result["error"]["message"]
    assert result["error"]["details"]["kept_at"] == str(kept)
    # The artifacts keep their layout under the kept folder: transformer/ stays a loadable diffusers folder
    # beside the training report.
    assert (kept / WEIGHTS_FILE).read_bytes() == weights_bytes(SEED)
    assert json.loads((kept / "transformer" / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    assert (kept / "report" / "history.json").is_file()
    assert files_left_under(tmp_path / "work") == []


@pytest.mark.slow
def test_a_missing_bucket_with_a_volume_keeps_the_weights_there(
    fake_env: dict[str, str], s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    volume = tmp_path / "runpod-volume"
    volume.mkdir()
    env = {
        **fake_env,
        **s3_bucket_env,
        "BUCKET_NAME": f"fluxbooth-missing-{uuid.uuid4().hex[:12]}",
        "FLUXBOOTH_VOLUME_DIR": str(volume),
        "FLUXBOOTH_VOLUME_PERSISTENT": "1",
    }
    result = run(env, job_input(), job_id="missing-1")
    kept = volume / UNUPLOADED_DIR_NAME / "sks-dog" / "missing-1"
    assert_error(result, ErrorCode.UPLOAD_FAILED, f"were kept at {kept}", refresh_worker=False)
    assert (kept / WEIGHTS_FILE).read_bytes() == weights_bytes(SEED)


# --- 6. secrets ----------------------------------------------------------------------------------


@pytest.fixture
def canaries() -> dict[str, str]:
    """A unique value for every secret variable (moto takes any bucket credentials, canaries included)."""
    token = uuid.uuid4().hex[:10]
    return {name: f"canary-{name.lower()}-{token}" for name in SECRET_ENV_NAMES}


def emitted_log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the worker writes at its configured level (INFO), plus fluxbooth's own DEBUG lines."""
    return [
        record.getMessage() + ("\n" + record.exc_text if record.exc_text else "")
        for record in caplog.records
        if record.levelno >= logging.INFO or record.name.startswith("fluxbooth")
    ]


def printed_by_the_trainer(log_lines: list[str], prefix: str) -> list[str]:
    """The trainer's own lines starting with `prefix`, as the worker logged them."""
    marker = f"trainer | {prefix}"
    return [line.removeprefix(marker) for line in log_lines if line.startswith(marker)]


def printed_trainer_environment(log_lines: list[str]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in printed_by_the_trainer(log_lines, ENV_LINE_PREFIX))


def assert_trainer_saw_no_storage_or_platform_secret(log_lines: list[str]) -> None:
    environment = printed_trainer_environment(log_lines)
    assert environment, "the fake trainer printed no environment"
    assert set(environment) & set(SECRET_ENV_NAMES) == SECRETS_THE_TRAINER_MAY_SEE
    assert {environment[name] for name in SECRETS_THE_TRAINER_MAY_SEE} == {"[REDACTED]"}
    command_lines = printed_by_the_trainer(log_lines, CMDLINE_LINE_PREFIX)
    assert len(command_lines) == 2 and all("tests.support.fake_trainer_module" in line for line in command_lines)
    # Nothing on a command line needed masking: no secret was ever there.
    assert not any("[REDACTED]" in line for line in command_lines)


@pytest.mark.slow
def test_secrets_reach_no_command_line_log_or_result_in_a_successful_upload(
    fake_env: dict[str, str], s3_bucket_env: dict[str, str], canaries: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="fluxbooth")
    progress: list[dict[str, Any]] = []
    result = run(
        {**fake_env, **s3_bucket_env, **canaries},
        job_input("x fault:print_env fault:print_cmdline fault:leak_hf_token"),
        progress=progress,
    )
    assert "error" not in result, result

    log_lines = emitted_log_lines(caplog)
    assert_trainer_saw_no_storage_or_platform_secret(log_lines)
    assert any(line.endswith("fake-trainer HF_TOKEN is [REDACTED]") for line in log_lines)
    # A SigV4 presigned URL must carry the access key ID (never the secret); `url` is the one field
    # the worker leaves unmasked, and the key ID appears nowhere else.
    urls = [artifact.pop("url") for artifact in result["artifacts"]]
    assert urls and all(f"X-Amz-Credential={canaries['BUCKET_ACCESS_KEY_ID']}%2F" in url for url in urls)
    other_canaries = [value for name, value in canaries.items() if name != "BUCKET_ACCESS_KEY_ID"]
    assert not [value for value in other_canaries for url in urls if value in url]
    emitted = json.dumps(result) + "\n".join(log_lines) + json.dumps(progress)
    assert [name for name, value in canaries.items() if value in emitted] == []


@pytest.mark.slow
def test_secrets_reach_no_command_line_log_or_error_in_a_failed_run(
    fake_env: dict[str, str], s3_bucket_env: dict[str, str], canaries: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="fluxbooth")
    result = run(
        {**fake_env, **s3_bucket_env, **canaries},
        job_input("x fault:print_env fault:print_cmdline fault:leak_hf_token fault:crash"),
    )
    assert_error(result, ErrorCode.TRAINER_FAILED, "the trainer exited with status 1", refresh_worker=True)

    log_lines = emitted_log_lines(caplog)
    assert_trainer_saw_no_storage_or_platform_secret(log_lines)
    emitted = json.dumps(result) + "\n".join(log_lines)
    assert [name for name, value in canaries.items() if value in emitted] == []


# --- 7. worker reuse -----------------------------------------------------------------------------


@pytest.fixture
def orphans_come_home() -> Iterator[None]:
    """Make this test process the child subreaper for the test: a process the worker leaves behind is
    re-parented here instead of to init, so comparing our descendants before and after sees it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.fail(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def live_descendants() -> set[tuple[int, float]]:
    """(pid, start time) of every live descendant; zombies re-parented to us are reaped on the way."""
    live = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                if process.ppid() == os.getpid():
                    os.waitpid(process.pid, os.WNOHANG)
                continue
            live.add((process.pid, process.create_time()))
        except (psutil.NoSuchProcess, ChildProcessError):
            continue
    return live


@pytest.mark.slow
def test_twenty_mixed_jobs_back_to_back_leave_nothing_behind(
    fake_env: dict[str, str],
    s3_bucket_env: dict[str, str],
    s3_client: BaseClient,
    tmp_path: Path,
    orphans_come_home: None,
    no_teardown_reserve: None,
) -> None:
    work_root = tmp_path / "work"
    hang_env = {**fake_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": HANG_DEADLINE_SECONDS}
    bucket_env = {**fake_env, **s3_bucket_env}
    missing_bucket_env = {**bucket_env, "BUCKET_NAME": f"fluxbooth-missing-{uuid.uuid4().hex[:12]}"}
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    broken_work_env = {**fake_env, "FLUXBOOTH_WORK_DIR": str(blocker / "work")}
    slip = make_zip(
        [(f"photo{index}.png", make_image("PNG", size=(96, 96))) for index in range(3)]
        + [("../escaped.png", make_image("PNG", size=(96, 96)))]
    )
    jobs: list[tuple[dict[str, str], Any, str | None, str]] = [
        (fake_env, job_input(), None, ""),
        (fake_env, {**job_input(), "colour": "blue"}, "invalid_input", "input.colour: unknown field"),
        (fake_env, job_input("x fault:crash"), "trainer_failed", "exited with status 1"),
        (fake_env, job_input(dataset=to_base64(b"not a zip")), "invalid_dataset", "dataset:"),
        (fake_env, job_input("x fault:cuda_oom"), "cuda_oom", "the GPU ran out of memory"),
        (bucket_env, job_input(), None, ""),
        (fake_env, job_input("x fault:sigkill"), "host_oom", "out-of-memory killer"),
        (fake_env, job_input("x fault:nan"), "trainer_failed", "trainer stopped (nan_loss)"),
        (hang_env, job_input("x fault:hang"), "timeout", "did not finish within the job deadline"),
        (missing_bucket_env, job_input(), "upload_failed", "does not exist"),
        (fake_env, job_input(zero_stage=3, offload="nvme"), "does_not_fit", "FLUXBOOTH_NVME_PATH"),
        (fake_env, job_input("x fault:sigterm"), "cancelled", "stopped from outside the worker"),
        (fake_env, job_input(with_prior_preservation=True), "invalid_input", "input.class_prompt"),
        (broken_work_env, job_input(), "internal", "cannot be used"),
        (fake_env, job_input(dataset=to_base64(slip)), "invalid_dataset", "escaped.png"),
        (fake_env, "not an object", "invalid_input", "expected a JSON object"),
        (fake_env, job_input(dataset=to_base64(make_dataset_zip(1))), "invalid_dataset", "dataset:"),
        (fake_env, job_input("x fault:bad_weights"), "trainer_failed", "is not valid safetensors"),
        (fake_env, job_input(model_name="a/b"), "invalid_input", "input.model_name"),
        (bucket_env, job_input(), None, ""),
    ]
    before = live_descendants()

    outcomes = []
    for index, (env, raw_input, _, _) in enumerate(jobs):
        result = run(env, raw_input, job_id=f"reuse-{index}")
        outcomes.append((result.get("error", {}).get("code"), result.get("error", {}).get("message", "")))
        assert files_left_under(work_root) == [], f"job {index} left files behind"

    assert [code for code, _ in outcomes] == [code for _, _, code, _ in jobs]
    assert all(fragment in message for (_, message), (_, _, _, fragment) in zip(outcomes, jobs, strict=True))
    assert live_descendants() == before, "a job left a process behind"
    assert not list(tmp_path.rglob("escaped.png"))
    listed = s3_client.list_objects_v2(Bucket=s3_bucket_env["BUCKET_NAME"])["Contents"]
    weights = [item["Key"] for item in listed if "/transformer/" in item["Key"]]
    assert len(weights) == 4, "two successful uploads of two weight files each"
    assert {key.rsplit("/", 1)[1] for key in weights} == {"config.json", "diffusion_pytorch_model.safetensors"}
