"""`python -m fluxbooth submit` against hostile or broken servers and inputs (issue 37, items 1-5): the key goes
only where the user sent it, nothing is written outside --out, no download writes more than its artifact states,
a malformed answer or request file is one line with its exit code, and a worker's `timeout` hands over what it
kept with the exact resubmission.

The servers are real: tests/support/runpod_api.py (RunPod's queue protocol) and tests/support/http_fixtures.py on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import requests

from fluxbooth.cli import main
from fluxbooth.client import ExitCode, Submission, submit
from fluxbooth.client.api import JobApi
from fluxbooth.client.artifacts import download_artifact
from fluxbooth.client.errors import ClientError
from fluxbooth.settings import DatasetLimits
from tests.support.http_fixtures import LocalHTTPServer
from tests.support.runpod_api import API_KEY, RunPodApi
from tests.support.submit_client import REQUEST, artifact_for, run_submit

# An address reserved for documentation (RFC 5737): never this machine, never routed.
FOREIGN_HOST = "192.0.2.1"


def url_command(api: RunPodApi, photos: Path, request_file: Path, out: Path, *extra: str) -> list[str]:
    """`submit` to the stand-in through --url, without naming a key for it."""
    return [
        "submit",
        str(photos),
        "--request",
        str(request_file),
        "--url",
        api.endpoint_url,
        "--out",
        str(out),
        "--poll-seconds",
        "0.05",
        *extra,
    ]


def completed_with(api: RunPodApi, output: Any) -> None:
    api.script = [{"status": "COMPLETED", "output": output}]


# --- 1. the key goes only where it was sent --------------------------------------------------------------------


def test_with_url_runpod_api_key_is_never_sent_to_that_server(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = url_command(runpod_api, photos, request_file, tmp_path / "out")
    assert main(command, environ={"RUNPOD_API_KEY": API_KEY}, out=io.StringIO()) == ExitCode.API
    assert runpod_api.authorizations == [None, None]  # the OpenAPI probe, then /run
    assert (
        "asks for an API key (HTTP 401) and none was sent: with --url the client sends a key only when "
        "--url-api-key-env names the variable holding it" in capsys.readouterr().err
    )


def test_url_api_key_env_sends_the_key_in_the_named_variable(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path
) -> None:
    command = url_command(runpod_api, photos, request_file, tmp_path / "out", "--url-api-key-env", "LOCAL_KEY")
    environ = {"LOCAL_KEY": API_KEY, "RUNPOD_API_KEY": "rpa_NOT_FOR_THIS_SERVER"}
    assert main(command, environ=environ, out=io.StringIO()) == ExitCode.COMPLETED
    # The first call is the probe for the server's OpenAPI description, which never carries a key.
    probe, *calls = runpod_api.authorizations
    assert probe is None and set(calls) == {f"Bearer {API_KEY}"}


def test_a_key_is_never_sent_over_plain_http_to_another_machine(
    photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = [
        "submit",
        str(photos),
        "--request",
        str(request_file),
        "--url",
        f"http://{FOREIGN_HOST}:8000",
        "--url-api-key-env",
        "RUNPOD_API_KEY",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(command, environ={"RUNPOD_API_KEY": API_KEY}, out=io.StringIO()) == ExitCode.USAGE
    assert (
        f"error: --url http://{FOREIGN_HOST}:8000: the key in RUNPOD_API_KEY is sent only over https, or over "
        "http to this machine (localhost)" in capsys.readouterr().err
    )


def test_from_python_a_key_with_a_plain_http_url_to_another_machine_is_refused_before_sending(
    photos: Path, tmp_path: Path
) -> None:
    submission = Submission(str(photos), REQUEST, tmp_path / "out", f"http://{FOREIGN_HOST}:8000/v2/x", API_KEY)
    outcome = submit(submission, {}, io.StringIO())
    assert outcome.exit_code == ExitCode.USAGE
    assert outcome.message.startswith(f"http://{FOREIGN_HOST}:8000/v2/x: an API key is sent only over https")


def test_an_endpoint_id_that_is_not_an_id_is_refused(
    photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = [
        "submit",
        str(photos),
        "--request",
        str(request_file),
        "--endpoint",
        "x/../../evil",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(command, environ={"RUNPOD_API_KEY": API_KEY}, out=io.StringIO()) == ExitCode.USAGE
    assert "error: --endpoint 'x/../../evil': an endpoint ID is letters, digits, - and _" in capsys.readouterr().err


# --- 2. nothing is written outside --out ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        (".", "outside the output folder"),
        ("report/..", "outside the output folder"),
        ("", "outside the output folder"),
        ("lora\0.safetensors", "with a NUL character"),
        ("x" * 300, "with a name longer than the file system's 255 bytes"),
        ("x" * 252, "with a name longer than the file system's 255 bytes"),  # its .part would be 257
        ("/".join(["d" * 200] * 25), "whose path is longer than the file system takes"),
    ],
    ids=["dot", "dotdot-inside", "empty", "nul", "too-long-name", "too-long-part", "too-long-path"],
)
def test_an_artifact_name_the_folder_cannot_hold_is_refused_and_nothing_is_written(
    runpod_api: RunPodApi,
    photos: Path,
    request_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    why: str,
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    completed_with(runpod_api, {"artifacts": [artifact_for(tmp_path, "lora.bin", b"lora") | {"name": name}]})
    assert run_submit(runpod_api, photos, request_file, runs / "out") == ExitCode.DOWNLOAD
    err = capsys.readouterr().err
    assert why in err and "not downloaded" in err
    assert sorted(path.name for path in runs.iterdir()) == ["out"]
    assert sorted(path.name for path in (runs / "out").iterdir()) == ["result.json"]


# --- 3. no download writes more than its artifact states ------------------------------------------------------


def test_a_server_that_streams_more_than_the_stated_bytes_is_stopped_there(
    runpod_api: RunPodApi,
    http_server: LocalHTTPServer,
    photos: Path,
    request_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    body = b"lora" + b"\0" * (8 * 1024 * 1024)
    url = http_server.add("/lora.bin", body=body, content_length=None)
    stated = {"name": "lora.bin", "url": url, "bytes": 4, "sha256": hashlib.sha256(b"lora").hexdigest()}
    completed_with(runpod_api, {"artifacts": [stated]})
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.DOWNLOAD
    assert (
        "downloading lora.bin failed: the source sent more than the 4 bytes the result states; stopped there"
        in capsys.readouterr().err
    )
    assert not list(out.glob("lora.bin*"))


def test_a_file_uri_to_dev_zero_is_refused_as_not_a_regular_file(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zeros = {"name": "lora.bin", "uri": "file:///dev/zero", "bytes": 4, "sha256": hashlib.sha256(b"\0" * 4).hexdigest()}
    completed_with(runpod_api, {"artifacts": [zeros]})
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.DOWNLOAD
    assert "downloading lora.bin failed: /dev/zero is not a regular file" in capsys.readouterr().err
    assert not list(out.glob("lora.bin*"))


def test_a_regular_file_longer_than_stated_is_read_only_to_the_stated_size(tmp_path: Path) -> None:
    artifact = artifact_for(tmp_path, "lora.bin", b"lora-and-more")
    stated = artifact | {"bytes": 4, "sha256": hashlib.sha256(b"lora").hexdigest()}
    with pytest.raises(ClientError, match="sent more than the 4 bytes the result states") as raised:
        download_artifact(stated, tmp_path / "out", allow_files=True)
    assert raised.value.exit_code == ExitCode.DOWNLOAD


def test_a_file_uri_is_not_read_for_a_worker_on_another_machine(tmp_path: Path) -> None:
    artifact = artifact_for(tmp_path, "lora.bin", b"lora")
    with pytest.raises(ClientError, match="it is a file:// uri, read only from a worker on this machine") as raised:
        download_artifact(artifact, tmp_path / "out", allow_files=False)
    assert raised.value.exit_code == ExitCode.DOWNLOAD
    assert not (tmp_path / "out" / "lora.bin").exists()


# --- 4. malformed answers and request files: one line and the exit code ---------------------------------------


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (
            {"artifacts": ["lora.safetensors"]},
            "the result's artifacts[0] is str, not an object with name, bytes and sha256",
        ),
        ({"artifacts": {"name": "lora"}}, "the result's artifacts is dict, not a list"),
        (
            {"artifacts": [{"name": "lora.bin", "uri": "file:///etc/hostname"}]},
            "the result's artifacts[0] ('lora.bin') states no size in bytes; not downloaded",
        ),
        (
            {"artifacts": [{"name": "lora.bin", "bytes": 4, "uri": "file:///etc/hostname"}]},
            "the result's artifacts[0] ('lora.bin') states no sha256; not downloaded",
        ),
        (["lora.safetensors"], "job job-1 completed, but its result is list, not an object with artifacts"),
    ],
    ids=["strings", "not-a-list", "no-bytes", "no-sha256", "output-a-list"],
)
def test_a_malformed_result_exits_5_with_one_line(
    runpod_api: RunPodApi,
    photos: Path,
    request_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    output: Any,
    message: str,
) -> None:
    completed_with(runpod_api, output)
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.DOWNLOAD
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_a_request_file_that_is_not_utf8_exits_2_with_one_line(
    runpod_api: RunPodApi, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "request.json"
    latin.write_bytes('{"model_name": "caf\u00e9"}'.encode("latin-1"))
    assert run_submit(runpod_api, photos, latin, tmp_path / "out") == ExitCode.USAGE
    assert capsys.readouterr().err == f"error: request file {latin}: not UTF-8 text (byte 19); save it as UTF-8 JSON\n"
    assert runpod_api.runs == []


def test_a_request_file_nested_100000_deep_exits_2_with_one_line(
    runpod_api: RunPodApi, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "request.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert run_submit(runpod_api, photos, deep, tmp_path / "out") == ExitCode.USAGE
    assert capsys.readouterr().err == f"error: request file {deep}: nested 100,000 levels deep, over the bound of 64\n"


def test_a_photo_folder_over_the_workers_image_cap_is_refused_before_anything_is_sent(
    runpod_api: RunPodApi, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The cap is counted from the names, before any photo is read: empty files are enough.
    folder = tmp_path / "many"
    folder.mkdir()
    cap = DatasetLimits().max_images
    for index in range(cap + 1):
        (folder / f"photo{index:04d}.jpg").touch()
    assert run_submit(runpod_api, folder, request_file, tmp_path / "out") == ExitCode.USAGE
    assert (
        f"error: {folder} holds {cap + 1} photos; the worker accepts at most {cap} (FLUXBOOTH_MAX_IMAGES)"
        in capsys.readouterr().err
    )
    assert runpod_api.runs == []


def test_an_answer_nested_100000_deep_is_an_api_error_not_a_traceback(http_server: LocalHTTPServer) -> None:
    url = http_server.add("/status/job-1", body=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ClientError, match="answered with something other than a JSON object") as raised:
        JobApi(http_server.url(""))._reply(url, requests.get(url, timeout=10))
    assert raised.value.exit_code == ExitCode.API


# --- 5. a worker's timeout hands over what it kept ------------------------------------------------------------


def timeout_error(artifacts: list[dict[str, Any]], resume_from: str | None) -> str:
    """The worker's `timeout` (fluxbooth.job.deadline.stopped_for_deadline) as RunPod carries it: a JSON string."""
    return json.dumps(
        {
            "code": "timeout",
            "refresh_worker": False,
            "message": "the job deadline of 600 s came at step 300/1000: the weights trained so far are stored",
            "details": {
                "step": 300,
                "steps": 1000,
                "artifacts": artifacts,
                "latest_checkpoint": "s3://b/ckpt/300",
                "checkpoints": ["s3://b/ckpt/300"],
                "resume_from": resume_from,
                "warnings": [],
            },
        }
    )


def test_a_timeout_downloads_what_the_worker_kept_and_prints_the_resubmission(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lora = artifact_for(tmp_path, "pytorch_lora_weights.safetensors", b"weights-at-step-300")
    runpod_api.script = [{"status": "FAILED", "error": timeout_error([lora], "latest")}]
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.TIMED_OUT
    err = capsys.readouterr().err
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == b"weights-at-step-300"
    assert "job job-1 timed out; the worker kept 1 artifact(s): downloading them into" in err
    assert f"the 1 artifact(s) the worker kept are in {out}, each sha256 verified" in err
    resume = out / "resume-request.json"
    assert json.loads(resume.read_text()) == {**REQUEST, "resume_from": "latest"}
    assert (
        'resubmit with "resume_from": "latest" (and more time):\n'
        f"  python -m fluxbooth submit {photos} --request {resume} --url {runpod_api.endpoint_url} "
        f"--url-api-key-env RUNPOD_API_KEY --out {out}\n"
    ) in err


def test_a_timeout_without_a_checkpoint_exits_4_without_a_resubmission(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runpod_api.script = [{"status": "FAILED", "error": timeout_error([], None)}]
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.TIMED_OUT
    err = capsys.readouterr().err
    assert "error: job job-1 timed out on the worker: timeout: the job deadline of 600 s came at step 300/1000" in err
    assert "resume_from" not in err
