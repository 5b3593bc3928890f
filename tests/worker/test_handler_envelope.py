"""The job envelope: any JSON value as `id` or `input` gets the error contract (never an exception), ids become
safe folder names, and runs sharing an id on one work directory never delete each other's files."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.job.attempts import (
    MAX_SAFE_ID_CHARS,
    attempt_is_live,
    claim_attempt_dir,
    remove_stale_attempt_dirs,
    safe_job_id,
)
from handler import handler
from tests.conftest import REPO_ROOT

UNKNOWN_FIELD_INPUT = {"model_name": "sks-dog", "instance_prompt": "a photo of sks dog", "colour": "blue"}
UNKNOWN_FIELD_MESSAGE = "invalid request: input.colour: unknown field"


@pytest.fixture
def handler_env(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in worker_env.items():
        monkeypatch.setenv(name, value)
    return worker_env


def wire_error(result: dict[str, Any]) -> dict[str, Any]:
    """The error as a caller reads it from RunPod: `error` is a JSON string."""
    assert set(result) == {"error", "refresh_worker"}, result
    assert isinstance(result["error"], str)
    return json.loads(result["error"])


# --- any JSON value for `id` ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job_id",
    [7, 3.5, True, None, [1, "two"], {"nested": {"deeper": [None]}}, "", "../../etc/passwd", "x" * 1_000_000],
    ids=["int", "float", "bool", "null", "list", "object", "empty", "path", "huge"],
)
def test_any_json_id_gets_the_error_contract(handler_env: dict[str, str], job_id: object) -> None:
    result = asyncio.run(handler({"id": job_id, "input": UNKNOWN_FIELD_INPUT}))
    assert wire_error(result) == {"code": "invalid_input", "message": UNKNOWN_FIELD_MESSAGE, "refresh_worker": False}
    assert list(Path(handler_env["FLUXBOOTH_WORK_DIR"]).iterdir()) == []


# --- any JSON value for `input` ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_input", "type_name"),
    [
        (5, "int"),
        (2.5, "float"),
        (False, "bool"),
        ("train please", "str"),
        ("x" * 5_000_000, "str"),
        ([{"model_name": "a"}], "list"),
        (None, "NoneType"),
    ],
    ids=["int", "float", "bool", "string", "huge-string", "list", "null"],
)
def test_an_input_that_is_not_an_object_is_invalid_input(
    handler_env: dict[str, str], job_input: object, type_name: str
) -> None:
    result = asyncio.run(handler({"id": "envelope-1", "input": job_input}))
    assert wire_error(result) == {
        "code": "invalid_input",
        "message": f"input: expected a JSON object with the training fields, got {type_name}",
        "refresh_worker": False,
    }


def test_a_job_without_input_is_invalid_input(handler_env: dict[str, str]) -> None:
    result = asyncio.run(handler({"id": "envelope-2"}))
    assert wire_error(result)["message"] == "input: expected a JSON object with the training fields, got NoneType"


def test_a_job_that_is_not_an_object_is_invalid_input(handler_env: dict[str, str]) -> None:
    result = asyncio.run(handler(["id", "input"]))
    assert wire_error(result) == {
        "code": "invalid_input",
        "message": "job: expected a JSON object with `id` and `input`",
        "refresh_worker": False,
    }


def test_deeply_nested_input_is_invalid_input_naming_the_field(handler_env: dict[str, str]) -> None:
    nested: Any = "leaf"
    for _ in range(200):
        nested = {"inner": [nested]}
    result = asyncio.run(handler({"id": "envelope-3", "input": {"model_name": "sks", "resolution": nested}}))
    error = wire_error(result)
    assert error["code"] == "invalid_input"
    assert "input.resolution" in error["message"]
    assert len(error["message"]) < 2000


# --- ids become safe folder names -------------------------------------------------------------------


def test_a_plain_string_id_is_kept_as_it_is() -> None:
    assert safe_job_id("sync-9f2c_A") == "sync-9f2c_A"


def test_an_id_with_other_characters_is_cleaned_and_hashed() -> None:
    assert re.fullmatch(r"etc-passwd-[0-9a-f]{12}", safe_job_id("../../etc/passwd"))


def test_ids_that_clean_to_the_same_text_stay_apart() -> None:
    assert safe_job_id("a/b") != safe_job_id("a b") != safe_job_id("a-b")


def test_a_number_id_is_not_confused_with_the_same_string() -> None:
    assert re.fullmatch(r"7-[0-9a-f]{12}", safe_job_id(7))
    assert safe_job_id("7") == "7"


def test_a_huge_id_is_cut_to_the_limit_with_its_hash() -> None:
    safe = safe_job_id("x" * 1_000_000)
    assert len(safe) <= MAX_SAFE_ID_CHARS
    assert re.fullmatch(r"x+-[0-9a-f]{12}", safe)
    assert safe != safe_job_id("x" * 999_999)


@pytest.mark.parametrize("job_id", [None, ""])
def test_no_id_gets_a_random_one(job_id: str | None) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", safe_job_id(job_id))


def test_the_checkpoints_folder_name_is_never_a_job_id() -> None:
    assert safe_job_id("checkpoints") == "job-checkpoints"


# --- per-attempt directories ------------------------------------------------------------------------


def test_two_attempts_with_one_id_get_their_own_folders(tmp_path: Path) -> None:
    first, second = claim_attempt_dir(tmp_path, "same"), claim_attempt_dir(tmp_path, "same")
    try:
        assert first.path != second.path
        assert re.fullmatch(r"job-same-[0-9a-f]{12}", first.name)
        (second.path / "weights.bin").write_bytes(b"second's")
        first.remove()
        assert (second.path / "weights.bin").read_bytes() == b"second's"
    finally:
        second.remove()
    assert list(tmp_path.iterdir()) == []


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fluxbooth.job.attempts import claim_attempt_dir
    attempt = claim_attempt_dir(Path(sys.argv[1]), sys.argv[2])
    (attempt.path / "data.bin").write_bytes(b"live")
    print(attempt.name, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def live_attempt_in_another_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another worker process (same work directory, same job id) in the middle of its run."""
    work_root = tmp_path / "work"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(work_root), "shared-id"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        name = holder.stdout.readline().strip()
        assert name.startswith("job-shared-id-"), name
        yield holder, work_root / name
    finally:
        holder.kill()
        holder.wait()


def test_cleanup_keeps_the_folder_of_a_live_run(
    live_attempt_in_another_process: tuple[subprocess.Popen[str], Path],
) -> None:
    _, folder = live_attempt_in_another_process
    assert remove_stale_attempt_dirs(folder.parent) == []
    assert attempt_is_live(folder.parent, folder.name)
    assert (folder / "data.bin").read_bytes() == b"live"


def test_cleanup_removes_the_folder_once_its_run_is_gone(
    live_attempt_in_another_process: tuple[subprocess.Popen[str], Path],
) -> None:
    holder, folder = live_attempt_in_another_process
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert not attempt_is_live(folder.parent, folder.name)
    assert remove_stale_attempt_dirs(folder.parent) == [folder]
    assert not folder.exists()


def test_a_job_with_the_same_id_leaves_the_live_runs_files_alone(
    live_attempt_in_another_process: tuple[subprocess.Popen[str], Path],
    worker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, folder = live_attempt_in_another_process
    for name, value in {**worker_env, "FLUXBOOTH_WORK_DIR": str(folder.parent)}.items():
        monkeypatch.setenv(name, value)
    result = asyncio.run(handler({"id": "shared-id", "input": UNKNOWN_FIELD_INPUT}))
    assert wire_error(result)["code"] == "invalid_input"
    assert (folder / "data.bin").read_bytes() == b"live"
    assert sorted(path.name for path in folder.parent.iterdir()) == [folder.name]


def test_the_next_job_removes_a_dead_runs_folder(handler_env: dict[str, str]) -> None:
    work_root = Path(handler_env["FLUXBOOTH_WORK_DIR"])
    leftover = work_root / "job-crashed-0123456789ab"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "photo.png").write_bytes(b"customer data")
    asyncio.run(handler({"id": "next", "input": UNKNOWN_FIELD_INPUT}))
    assert list(work_root.iterdir()) == []
