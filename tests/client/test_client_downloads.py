"""Downloads that cannot be redirected on disk (issue 45, item 2): a link left where an artifact's partial file
goes is removed, never written through, and an artifact named like one of the client's own files in --out
(result.json, resume-request.json, a partial) is refused naming it, before anything is downloaded.

The server is real: tests/support/runpod_api.py on 127.0.0.1; the artifacts are file:// uris, as a local worker
without a bucket hands them out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fluxbooth.client import ExitCode
from fluxbooth.client.artifacts import download_artifact
from tests.support.runpod_api import RunPodApi
from tests.support.submit_client import artifact_for, run_submit


@pytest.mark.parametrize("victim_exists", [True, False], ids=["to-a-file", "dangling"])
def test_a_link_left_as_the_partial_file_is_removed_not_written_through(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, victim_exists: bool
) -> None:
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir()
    if victim_exists:
        victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.bin.part").symlink_to(victim)
    runpod_api.script = [
        {"status": "COMPLETED", "output": {"artifacts": [artifact_for(tmp_path, "lora.bin", b"lora")]}}
    ]
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.COMPLETED
    assert (victim.read_bytes() == b"precious") if victim_exists else not victim.exists()
    assert not (out / "lora.bin").is_symlink()
    assert (out / "lora.bin").read_bytes() == b"lora"
    assert sorted(path.name for path in out.iterdir()) == ["lora.bin", "result.json"]


def test_a_leftover_partial_file_is_replaced_by_the_download(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.bin.part").write_bytes(b"an earlier, longer, interrupted download")
    written = download_artifact(artifact_for(tmp_path, "lora.bin", b"lora"), out, allow_files=True)
    assert written.read_bytes() == b"lora"
    assert not (out / "lora.bin.part").exists()


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("result.json", "the file the client writes the result into"),
        ("./Result.JSON", "the file the client writes the result into"),
        ("resume-request.json", "the file the client writes a timed-out job's resubmission into"),
        (
            "lora.bin.part",
            "a name ending in .part, which the client downloads each artifact into before checking it",
        ),
    ],
    ids=["result", "result-other-case", "resume-request", "partial"],
)
def test_an_artifact_named_like_one_of_the_clients_own_files_is_refused_naming_it(
    runpod_api: RunPodApi,
    photos: Path,
    request_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    what: str,
) -> None:
    lora = artifact_for(tmp_path, "lora.bin", b"lora")
    clash = artifact_for(tmp_path, "clash.json", b'{"artifacts": []}') | {"name": name}
    runpod_api.script = [{"status": "COMPLETED", "output": {"artifacts": [lora, clash]}}]
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.DOWNLOAD
    assert capsys.readouterr().err.endswith(
        f"error: the result's artifacts[1] is named {name!r}, {what} in the output folder; not downloaded "
        "(the worker's answer is malformed)\n"
    )
    assert list(out.iterdir()) == []


def test_a_timed_out_job_keeps_its_resubmission_request_over_an_artifact_of_that_name(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clash = artifact_for(tmp_path, "resume-request.json", b'{"steps": 1}')
    error = {"code": "timeout", "message": "the job deadline came", "details": {"artifacts": [clash]}}
    runpod_api.script = [{"status": "FAILED", "error": json.dumps(error)}]
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.DOWNLOAD
    assert (
        "the result's error.details.artifacts[0] is named 'resume-request.json', the file the client writes a "
        "timed-out job's resubmission into in the output folder; not downloaded" in capsys.readouterr().err
    )
    assert list(out.iterdir()) == []
