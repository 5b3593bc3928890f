"""The client's one host rule (issue 45, item 1): the host it decides on (may a key go there? are file:// artifacts
read?) is the host requests connects to. A URL that Python's urllib.parse reads as another host, or whose host
part holds a backslash, is refused before anything is sent; "this machine" is the name `localhost` and literal
addresses in 127.0.0.0/8 and ::1, never `*.localhost`.

The server is real: tests/support/runpod_api.py on 127.0.0.1, recording every Authorization header it receives.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fluxbooth.cli import main
from fluxbooth.client import ExitCode, Submission, submit
from fluxbooth.client.api import host_problem, is_loopback, key_may_go_to
from tests.support.runpod_api import API_KEY, ENDPOINT_ID, RunPodApi
from tests.support.submit_client import REQUEST


def submit_to(url: str, photos: Path, request_file: Path, out: Path, *extra: str) -> list[str]:
    return ["submit", str(photos), "--request", str(request_file), "--url", url, "--out", str(out), *extra]


WITH_KEY = ("--url-api-key-env", "LOCAL_KEY")


def test_a_backslash_before_the_at_sends_no_key_to_the_host_requests_connects_to(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # urllib.parse reads the host after the "@" (127.0.0.1, this machine); requests stops the host at the
    # backslash and connects to 0.0.0.0, not a loopback address, which on this machine reaches the stand-in.
    port = runpod_api.base_url.rsplit(":", 1)[1]
    url = f"http://0.0.0.0:{port}\\@127.0.0.1:{port}/v2/{ENDPOINT_ID}"
    command = submit_to(url, photos, request_file, tmp_path / "out", *WITH_KEY)
    assert main(command, environ={"LOCAL_KEY": API_KEY}, out=io.StringIO()) == ExitCode.USAGE
    assert runpod_api.authorizations == []
    assert runpod_api.runs == []
    assert capsys.readouterr().err == (
        f"error: --url {url!r}: its host part holds a backslash, which URL parsers read differently (requests "
        "would connect to '0.0.0.0', urllib.parse reads '127.0.0.1'); write the URL without it\n"
    )


def test_a_url_whose_host_the_parsers_disagree_on_is_refused_without_a_key_too(
    runpod_api: RunPodApi, photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without a key the same host decides whether file:// artifacts are read from this machine's disk.
    port = runpod_api.base_url.rsplit(":", 1)[1]
    url = f"http://0.0.0.0:{port}\\@127.0.0.1:{port}/v2/{ENDPOINT_ID}"
    command = submit_to(url, photos, request_file, tmp_path / "out")
    assert main(command, environ={}, out=io.StringIO()) == ExitCode.USAGE
    assert runpod_api.authorizations == []
    assert "its host part holds a backslash" in capsys.readouterr().err


def test_a_localhost_subdomain_gets_no_key_over_plain_http(
    photos: Path, request_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = submit_to("http://api.localhost:8000", photos, request_file, tmp_path / "out", *WITH_KEY)
    assert main(command, environ={"LOCAL_KEY": API_KEY}, out=io.StringIO()) == ExitCode.USAGE
    assert capsys.readouterr().err == (
        "error: --url http://api.localhost:8000: the key in LOCAL_KEY is sent only over https, or over http to "
        "this machine (localhost); use an https:// URL\n"
    )


def test_from_python_a_backslash_url_is_refused_before_anything_is_sent(
    runpod_api: RunPodApi, photos: Path, tmp_path: Path
) -> None:
    port = runpod_api.base_url.rsplit(":", 1)[1]
    url = f"http://0.0.0.0:{port}\\@127.0.0.1:{port}/v2/{ENDPOINT_ID}"
    outcome = submit(Submission(str(photos), REQUEST, tmp_path / "out", url, API_KEY), {}, io.StringIO())
    assert outcome.exit_code == ExitCode.USAGE
    assert outcome.message.startswith(f"{url}: its host part holds a backslash")
    assert runpod_api.authorizations == []


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://localhost:8000/", True),
        ("http://LOCALHOST:8000/", True),
        ("http://127.0.0.1:8000/", True),
        ("http://127.8.9.10:8000/", True),
        ("http://[::1]:8000/", True),
        ("http://api.localhost:8000/", False),
        ("http://localhost.:8000/", False),
        ("http://0.0.0.0:8000/", False),
        ("http://192.0.2.1:8000/", False),
        ("http://H\\@127.0.0.1:8000/", False),
        ("http://localhost\\@127.0.0.1:8000/", False),
        ("http://192.0.2.1\\@localhost:8000/", False),
    ],
)
def test_this_machine_is_localhost_and_literal_loopback_addresses_only(url: str, loopback: bool) -> None:
    assert is_loopback(url) is loopback


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://api.runpod.ai/v2/x", True),
        ("http://localhost:8000/", True),
        ("http://[::1]:8000/", True),
        ("http://192.0.2.1:8000/", False),
        ("http://api.localhost:8000/", False),
        ("http://H\\@127.0.0.1:8000/", False),
        ("https://H\\@api.runpod.ai/v2/x", False),
    ],
)
def test_a_key_goes_only_over_https_or_to_this_machine_as_requests_reads_the_url(url: str, allowed: bool) -> None:
    assert key_may_go_to(url) is allowed


@pytest.mark.parametrize(
    "url",
    ["http://localhost:8000/", "https://api.runpod.ai/v2/x", "http://[::1]:8000/", "http://caf\u00e9.example/"],
)
def test_a_url_every_parser_reads_alike_has_no_host_problem(url: str) -> None:
    assert host_problem(url) is None


def test_a_host_urllib_parse_reads_after_a_tab_is_a_host_problem() -> None:
    # urllib.parse drops the tab and reads 127.0.0.1.evil; requests refuses the host outright.
    assert host_problem("http://127.0.0.1\t.evil/") == "the HTTP library (requests) cannot read a host in it"
