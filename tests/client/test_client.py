"""`python -m fluxbooth submit` against RunPod's queue protocol: each terminal status ends the client with its
own exit code and message, Ctrl-C cancels through /cancel, progress is drawn, the execution policy follows
timeout_seconds, and bad input never reaches the endpoint.

The server here is tests/support/runpod_api.py, which speaks RunPod's public /run, /status and /cancel protocol: the real
api.runpod.ai cannot be reached from the tests. The runs against the runpod SDK's own local API server and a
real worker are in tests/client/test_client_worker.py.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from fluxbooth.cli import main
from fluxbooth.client import ClientError, ExitCode
from fluxbooth.client.dataset import RUNPOD_RUN_BODY_LIMIT_BYTES, fits_inline, pack_folder, read_photos
from tests.conftest import REPO_ROOT
from tests.support.factories import make_image
from tests.support.runpod_api import API_KEY, ENDPOINT_ID, RunPodApi
from tests.support.submit_client import REQUEST, artifact_for, default_sigint, run_submit, submit_command

CTRL_C_WAIT_SECONDS = 60


# --- each terminal status ---------------------------------------------------------------------------------


def test_completed_downloads_every_artifact_verified_and_exits_0(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lora = artifact_for(tmp_path, "pytorch_lora_weights.safetensors", b"lora-weights")
    sheet = artifact_for(tmp_path, "report/samples.png", b"png")
    runpod_api.script = [
        {"status": "IN_QUEUE"},
        {"status": "COMPLETED", "output": {"artifacts": [lora, sheet], "warnings": []}},
    ]
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.COMPLETED
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == b"lora-weights"
    assert (out / "report" / "samples.png").read_bytes() == b"png"
    assert json.loads((out / "result.json").read_text())["artifacts"] == [lora, sheet]
    assert "done: 2 file(s) in" in capsys.readouterr().err


def test_failed_prints_the_workers_code_and_message_and_exits_1(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    error = {
        "code": "does_not_fit",
        "message": "the plan needs 30 GiB of GPU memory; the worker has 24 GiB",
        "refresh_worker": False,
    }
    runpod_api.script = [{"status": "FAILED", "error": json.dumps(error)}]
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.FAILED
    assert "error: job job-1 failed: does_not_fit: the plan needs 30 GiB of GPU memory" in capsys.readouterr().err


def test_cancelled_elsewhere_exits_3(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runpod_api.script = [{"status": "IN_PROGRESS"}, {"status": "CANCELLED"}]
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.CANCELLED
    assert "error: job job-1 was cancelled" in capsys.readouterr().err


def test_timed_out_exits_4_and_says_which_timeout_to_raise(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runpod_api.script = [{"status": "IN_PROGRESS"}, {"status": "TIMED_OUT"}]
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.TIMED_OUT
    err = capsys.readouterr().err
    assert "error: job job-1 timed out" in err and "execution timeout" in err


def test_an_artifact_whose_sha256_does_not_match_is_not_kept_and_exits_5(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lora = {**artifact_for(tmp_path, "pytorch_lora_weights.safetensors", b"lora-weights"), "sha256": "0" * 64}
    runpod_api.script = [{"status": "COMPLETED", "output": {"artifacts": [lora]}}]
    out = tmp_path / "out"
    assert run_submit(runpod_api, photos, request_file, out) == ExitCode.DOWNLOAD
    assert "pytorch_lora_weights.safetensors: got 12 bytes with sha256" in capsys.readouterr().err
    assert not list(out.glob("pytorch_lora_weights*"))


def test_an_artifact_named_outside_the_folder_is_refused(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    escape = artifact_for(tmp_path, "escape.bin", b"x") | {"name": "../escape.bin"}
    runpod_api.script = [{"status": "COMPLETED", "output": {"artifacts": [escape]}}]
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.DOWNLOAD
    assert "'../escape.bin' outside the output folder" in capsys.readouterr().err


# --- what is sent, and what is shown ----------------------------------------------------------------------


def test_the_photos_travel_inline_as_a_zip_with_their_captions(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path
) -> None:
    run_submit(runpod_api, photos, request_file, tmp_path / "out")
    sent = runpod_api.runs[0]["input"]
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(sent["dataset"]))) as archive:
        assert sorted(archive.namelist()) == ["toy0.jpg", "toy0.txt", "toy1.jpg", "toy1.txt", "toy2.jpg"]
    assert {name: sent[name] for name in REQUEST} == REQUEST


def test_a_link_is_passed_on_as_dataset_url(runpod_api: RunPodApi, request_file: Path, tmp_path: Path) -> None:
    run_submit(runpod_api, "https://example.com/toy.zip", request_file, tmp_path / "out")
    assert runpod_api.runs[0]["input"]["dataset_url"] == "https://example.com/toy.zip"
    assert "dataset" not in runpod_api.runs[0]["input"]


def test_the_execution_timeout_is_timeout_seconds_plus_the_margin(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path
) -> None:
    run_submit(
        runpod_api,
        photos,
        request_file,
        tmp_path / "out",
        "--timeout-seconds",
        "1800",
        "--webhook",
        "https://example.com/hook",
    )
    assert runpod_api.runs[0]["policy"] == {"executionTimeout": (1800 + 300) * 1000}
    assert runpod_api.runs[0]["input"]["timeout_seconds"] == 1800
    assert runpod_api.runs[0]["webhook"] == "https://example.com/hook"


def test_without_timeout_seconds_the_endpoints_own_execution_timeout_applies(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path
) -> None:
    run_submit(runpod_api, photos, request_file, tmp_path / "out")
    assert "policy" not in runpod_api.runs[0]


def test_progress_payloads_are_drawn_as_the_local_bar_draws_them(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runpod_api.script = [
        {"status": "IN_QUEUE"},
        {"status": "IN_PROGRESS", "output": {"stage": "train", "step": 2, "total": 4, "loss": 0.25, "eta_seconds": 30}},
        {"status": "COMPLETED", "output": {"artifacts": []}},
    ]
    run_submit(runpod_api, photos, request_file, tmp_path / "out")
    err = capsys.readouterr().err
    assert "in queue\n" in err
    assert "] train  [############------------]  2/4  loss 0.2500  ETA 0:30" in err


# --- Ctrl-C ---------------------------------------------------------------------------------------------


def test_ctrl_c_cancels_the_job_through_cancel_and_exits_130(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path
) -> None:
    runpod_api.script = [{"status": "IN_PROGRESS", "output": {"stage": "train", "step": 1, "total": 100}}]
    command = [sys.executable, "-m", "fluxbooth", *submit_command(runpod_api, photos, request_file, tmp_path / "out")]
    env = {**os.environ, "RUNPOD_API_KEY": API_KEY, "PYTHONPATH": str(REPO_ROOT / "src")}
    with subprocess.Popen(
        command,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=default_sigint,
    ) as client:
        assert client.stderr is not None
        for line in client.stderr:
            if "submitted to" in line:
                break
        client.send_signal(signal.SIGINT)
        rest = client.stderr.read()
        assert client.wait(CTRL_C_WAIT_SECONDS) == ExitCode.INTERRUPTED
    assert runpod_api.cancels == ["job-1"]
    assert "Ctrl-C: cancelling job job-1 through /cancel" in rest
    assert "interrupted; job job-1 is CANCELLED" in rest


# --- the endpoint refuses, or is not there -----------------------------------------------------------------


def test_a_wrong_api_key_exits_6_naming_runpod_api_key(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_submit(runpod_api, photos, request_file, tmp_path / "out", environ={"RUNPOD_API_KEY": "rpa_WRONG"})
    assert code == ExitCode.API
    assert "refused the API key (HTTP 401): set RUNPOD_API_KEY" in capsys.readouterr().err


def test_a_wrong_endpoint_id_exits_6_naming_the_endpoint(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = submit_command(runpod_api, photos, request_file, tmp_path / "out")
    command[command.index("--url") + 1] = runpod_api.endpoint_url.replace(ENDPOINT_ID, "no-such-endpoint")
    assert main(command, environ={"RUNPOD_API_KEY": API_KEY}, out=io.StringIO()) == ExitCode.API
    assert "no-such-endpoint/run does not exist (HTTP 404): check the endpoint ID" in capsys.readouterr().err


def test_an_endpoint_without_an_api_key_is_refused_before_anything_is_sent(
    photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["submit", str(photos), "--request", str(request_file), "--endpoint", ENDPOINT_ID, "--out", str(tmp_path)]
    assert main(command, environ={}, out=io.StringIO()) == ExitCode.USAGE
    assert "error: --endpoint needs RUNPOD_API_KEY set to a RunPod API key" in capsys.readouterr().err


def test_retries_stay_for_runpods_api_and_are_short_for_this_machine() -> None:
    from fluxbooth.client.api import LOOPBACK_RETRY_DELAYS_SECONDS, RETRY_DELAYS_SECONDS, retry_delays

    assert retry_delays("https://api.runpod.ai/v2/abc123") == RETRY_DELAYS_SECONDS == (1, 2, 4, 8, 15, 30)
    assert retry_delays("http://127.0.0.1:8000") == retry_delays("http://localhost:8000") == (0.5, 1, 2)
    assert sum(LOOPBACK_RETRY_DELAYS_SECONDS) < 15


# --- bad input never reaches the endpoint ----------------------------------------------------------------


def test_a_folder_without_photos_exits_2_and_sends_nothing(
    runpod_api: RunPodApi, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    assert run_submit(runpod_api, empty, request_file, tmp_path / "out") == ExitCode.USAGE
    assert f"error: no photos in {empty}: put the images (" in capsys.readouterr().err
    assert runpod_api.runs == []


def test_a_missing_folder_exits_2(
    runpod_api: RunPodApi, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_submit(runpod_api, tmp_path / "nowhere", request_file, tmp_path / "out") == ExitCode.USAGE
    assert "nowhere does not exist: give a folder of photos, a .zip, or an https:// link" in capsys.readouterr().err


def test_a_file_that_is_not_a_zip_exits_2(
    runpod_api: RunPodApi, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photo = tmp_path / "one.jpg"
    make_image(photo)
    assert run_submit(runpod_api, photo, request_file, tmp_path / "out") == ExitCode.USAGE
    assert "one.jpg is not a zip file" in capsys.readouterr().err


def _read_photos_without_privileges(folder: Path) -> str:
    """read_photos in a forked child that cannot read `folder` (root drops to nobody: root reads anything)."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(reader)
        message = "read it"
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            read_photos(str(folder))
        except ClientError as error:
            message = f"{int(error.exit_code)} {error.message}"
        os.write(writer, message.encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        message = pipe.read()
    os.waitpid(child, 0)
    return message


def test_an_unreadable_folder_is_named_with_the_reason() -> None:
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o755)
        folder = Path(root) / "photos"
        folder.mkdir()
        make_image(folder / "toy.jpg")
        folder.chmod(0o000)
        try:
            assert (
                _read_photos_without_privileges(folder) == f"2 cannot read the photo folder {folder}: Permission denied"
            )
        finally:
            folder.chmod(0o755)


def test_a_request_the_worker_would_refuse_exits_2_before_anything_is_sent(
    runpod_api: RunPodApi, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**REQUEST, "steps": "many"}))
    assert run_submit(runpod_api, photos, bad, tmp_path / "out") == ExitCode.USAGE
    assert "error: invalid request: input.steps: Input should be a valid integer" in capsys.readouterr().err
    assert runpod_api.runs == []


def test_a_request_file_that_carries_a_dataset_is_refused(
    runpod_api: RunPodApi, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_dataset = tmp_path / "with.json"
    with_dataset.write_text(json.dumps({"input": {**REQUEST, "dataset_url": "https://example.com/x.zip"}}))
    assert run_submit(runpod_api, photos, with_dataset, tmp_path / "out") == ExitCode.USAGE
    assert "holds dataset_url: leave the dataset out, the client sends PHOTOS" in capsys.readouterr().err


# --- the size rule -----------------------------------------------------------------------------------------


def test_a_zip_fits_inline_up_to_runpods_10_mb_body_once_base64_encoded() -> None:
    # 7.4 MB of zip is about 9.9 MB of base64: the largest that fits, with the request's other fields.
    assert fits_inline(REQUEST, b"\0" * 7_400_000, {})
    assert not fits_inline(REQUEST, b"\0" * 7_500_000, {})
    assert RUNPOD_RUN_BODY_LIMIT_BYTES == 10_000_000


def test_hidden_files_and_other_files_are_left_out_of_the_zip(photos: Path) -> None:
    (photos / ".DS_Store").write_bytes(b"mac")
    (photos / "notes.pdf").write_bytes(b"%PDF")
    with zipfile.ZipFile(io.BytesIO(pack_folder(photos))) as archive:
        assert ".DS_Store" not in archive.namelist() and "notes.pdf" not in archive.namelist()


def test_the_files_left_out_of_the_zip_are_named_in_the_output(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (photos / ".DS_Store").write_bytes(b"mac")
    (photos / "notes.pdf").write_bytes(b"%PDF")
    (photos / "class").mkdir()
    (photos / "class" / "brief.docx").write_bytes(b"PK")
    assert run_submit(runpod_api, photos, request_file, tmp_path / "out") == ExitCode.COMPLETED
    assert (
        "left out of the zip (only photos and .txt captions travel): class/brief.docx, notes.pdf, 1 hidden file(s)\n"
        in capsys.readouterr().err
    )
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(runpod_api.runs[0]["input"]["dataset"]))) as archive:
        assert sorted(archive.namelist()) == ["toy0.jpg", "toy0.txt", "toy1.jpg", "toy1.txt", "toy2.jpg"]


def test_more_than_ten_files_left_out_are_named_ten_and_counted(photos: Path) -> None:
    from fluxbooth.client.dataset import left_out_line

    for index in range(12):
        (photos / f"scan{index:02d}.pdf").write_bytes(b"%PDF")
    line = left_out_line(read_photos(str(photos)))
    assert line == (
        "left out of the zip (only photos and .txt captions travel): "
        + ", ".join(f"scan{index:02d}.pdf" for index in range(10))
        + ", and 2 more"
    )


# --- /status and the two kinds of server -------------------------------------------------------------------


def test_runpods_status_is_asked_again_after_a_read_timeout(runpod_api: RunPodApi) -> None:
    from fluxbooth.client.api import JobApi

    runpod_api.script = [{"status": "COMPLETED", "output": {"artifacts": []}}]
    runpod_api.first_status_delay_seconds = 1.0
    api = JobApi(
        runpod_api.endpoint_url, API_KEY, status_answers_at_once=True, call_timeout_seconds=0.3, sleep=lambda _: None
    )
    job_id = api.run(b'{"input": {}}')["id"]
    assert api.status(job_id)["status"] == "COMPLETED"
    assert runpod_api.status_calls == [job_id, job_id]


def test_a_local_servers_status_is_never_sent_twice(runpod_api: RunPodApi) -> None:
    # The runpod SDK's local API server runs the job inside /status: a second /status would run it again.
    from fluxbooth.client.api import JobApi

    runpod_api.first_status_delay_seconds = 1.0
    api = JobApi(runpod_api.endpoint_url, API_KEY, status_timeout_seconds=0.3, sleep=lambda _: None)
    job_id = api.run(b'{"input": {}}')["id"]
    with pytest.raises(ClientError, match=r"/status/job-1 gave no answer within 0.3 s") as raised:
        api.status(job_id)
    assert raised.value.exit_code == ExitCode.API
    assert runpod_api.status_calls == [job_id]


def test_endpoint_submissions_use_runpods_api_and_its_status_rule(
    photos: Path, request_file: Path, tmp_path: Path
) -> None:
    from fluxbooth.cli import build_parser
    from fluxbooth.client.command import submission_from

    arguments = build_parser().parse_args(
        ["submit", str(photos), "--request", str(request_file), "--endpoint", "abc123", "--out", str(tmp_path)]
    )
    submission = submission_from(arguments, {"RUNPOD_API_KEY": API_KEY})
    assert (submission.base_url, submission.api_key, submission.status_answers_at_once) == (
        "https://api.runpod.ai/v2/abc123",
        API_KEY,
        True,
    )
