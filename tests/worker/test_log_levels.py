"""What each RUNPOD_LOG_LEVEL prints for one job, as docs/environment.md states it: the SDK's lines for the level,
each copy of the job or its result withheld. In the SDK's local test mode (`python handler.py --test_input ...`)
the result is printed exactly once, in the worker's own `result` line, whatever the level; on a deployed worker
(the SDK's `run_job`, as its worker loop runs a job from RunPod's queue) it is never printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.runpod_log import WITHHELD
from tests.conftest import REPO_ROOT
from tests.support.factories import make_dataset_zip, to_base64

ENVIRONMENT_PAGE = REPO_ROOT / "docs" / "environment.md"
RUN_TIMEOUT_SECONDS = 300
SIGNATURE = "X-Amz-Signature=canary0123456789abcdef"
# The SDK's lines ("LEVEL  | ..."), in order, for a job that completes; the SDK's default, unset, is DEBUG.
INFO_LINES = [
    "INFO   | test_input set, using test_input as job input.",
    "INFO   | levels | Started.",
    "INFO   | Job levels completed successfully.",
    f"INFO   | Job result: {WITHHELD}",
    "INFO   | Local testing complete, exiting.",
]
DEBUG_LINES = [
    "DEBUG  | Registered fitness check: run",
    INFO_LINES[0],
    f"DEBUG  | Retrieved local job: {WITHHELD}",
    INFO_LINES[1],
    f"DEBUG  | levels | Handler output: {WITHHELD}",
    f"DEBUG  | levels | run_job return: {WITHHELD}",
    *INFO_LINES[2:],
]
SDK_LINES = {None: DEBUG_LINES, "DEBUG": DEBUG_LINES, "INFO": INFO_LINES, "WARN": [], "ERROR": []}
# On a deployed worker (RUNPOD_ENDPOINT_ID set) the SDK prints JSON lines: (level, message) for the job's lines.
DEPLOYED_LINES = {
    "DEBUG": [("INFO", "Started."), ("DEBUG", f"Handler output: {WITHHELD}"), ("DEBUG", f"run_job return: {WITHHELD}")],
    "INFO": [("INFO", "Started.")],
    "WARN": [],
    "ERROR": [],
}
SDK_LINE = re.compile(r"^(?:TRACE|DEBUG|INFO|WARN|ERROR) +\| ")


def dry_run_job() -> dict[str, Any]:
    """A job that completes without a trainer, whose dataset and one presigned-looking URL are recognisable."""
    return {
        "id": "levels",
        "input": {
            "model_name": "sks-levels",
            "base_model": "fluxbooth/tiny-flux",
            "dataset": to_base64(make_dataset_zip(3, size=(80, 80))),
            "instance_prompt": "a photo of sks dog",
            "steps": 2,
            "resolution": 64,
            "dry_run": True,
            "validation_prompts": ["a sks dog on a beach"],
            "validation_images": [f"https://bucket.s3.amazonaws.com/pose.png?{SIGNATURE}"],
        },
    }


def run_python(env: dict[str, str], level: str | None, *arguments: str) -> list[str]:
    """The lines `python ARGUMENTS` prints (stdout and stderr) in this checkout at `level`; it must exit 0."""
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    env = {**env, "RUNPOD_LOG_LEVEL": level} if level else {k: v for k, v in env.items() if k != "RUNPOD_LOG_LEVEL"}
    finished = subprocess.run(
        [sys.executable, *arguments],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
        check=False,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return (finished.stdout + finished.stderr).splitlines()


def local_test_mode(env: dict[str, str], level: str | None, job: dict[str, Any]) -> list[str]:
    """The lines `python handler.py --test_input` prints (stdout and stderr) at `level`."""
    return run_python(env, level, "handler.py", "--test_input", json.dumps(job))


@pytest.fixture
def level_env(worker_env: dict[str, str], tiny_model: Path) -> dict[str, str]:
    return worker_env


@pytest.mark.parametrize("level", [None, "DEBUG", "INFO", "WARN", "ERROR"])
def test_local_test_mode_prints_the_sdks_lines_for_its_level_and_the_result_once(
    level_env: dict[str, str], level: str | None
) -> None:
    job = dry_run_job()
    lines = local_test_mode(level_env, level, job)

    assert [line for line in lines if SDK_LINE.match(line)] == SDK_LINES[level]
    results = [line for line in lines if "sks-levels" in line]
    assert len(results) == 1 and " INFO fluxbooth.job.result: result {" in results[0], results
    printed = "\n".join(lines)
    assert SIGNATURE not in printed
    dataset = job["input"]["dataset"]
    assert dataset[len(dataset) // 2 :][:100] not in printed


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARN", "ERROR"])
def test_a_deployed_worker_prints_the_sdks_lines_for_its_level_and_never_the_result(
    level_env: dict[str, str], level: str, tmp_path: Path
) -> None:
    job = dry_run_job()
    runpod = {
        "RUNPOD_POD_ID": "worker-1",
        "RUNPOD_ENDPOINT_ID": "endpoint-1",
        "RUNPOD_WEBHOOK_POST_OUTPUT": "http://127.0.0.1:9/job-done/worker-1/$ID",
        "FLUXBOOTH_ALLOW_LOCAL_OUTPUT": "1",
    }
    result_path = tmp_path / "result.json"
    lines = run_python(
        {**level_env, **runpod}, level, "-m", "tests.support.deployed_job", json.dumps(job), str(result_path)
    )

    sdk = [json.loads(line) for line in lines if line.startswith('{"requestId"')]
    assert [(line["level"], line["message"]) for line in sdk] == DEPLOYED_LINES[level]
    assert json.loads(result_path.read_text())["output"]["model_name"] == "sks-levels"
    printed = "\n".join(lines)
    assert "sks-levels" not in printed and SIGNATURE not in printed


def test_the_environment_page_shows_what_local_test_mode_prints_at_debug() -> None:
    """The page's example, the SDK's lines at DEBUG, is the list above."""
    text = ENVIRONMENT_PAGE.read_text()
    section = text[text.index("## What `RUNPOD_LOG_LEVEL` prints") :]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/environment.md shows no local test mode output"
    shown = [line for line in block[1].splitlines() if SDK_LINE.match(line)]
    assert shown == [line.replace("levels", "local_test") for line in DEBUG_LINES]
