"""`python -m fluxbooth submit` as a test runs it against the RunPod stand-in (tests/support/runpod_api.py): the
request file and the folder of photos it sends, the command line, and an artifact as a worker without a bucket
reports it.

The fixtures are registered in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import hashlib
import io
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli import main
from tests.support.factories import make_image
from tests.support.runpod_api import API_KEY, RunPodApi

REQUEST = {"model_name": "sks-toy", "instance_prompt": "a photo of sks toy", "steps": 4, "resolution": 64}


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """A folder of three photos, two with a caption beside them."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for index in range(3):
        make_image(folder / f"toy{index}.jpg", size=(96, 96), color=(40 * index, 90, 160))
    (folder / "toy0.txt").write_text("a photo of sks toy on a table")
    (folder / "toy1.txt").write_text("a photo of sks toy in the grass")
    return folder


@pytest.fixture
def request_file(tmp_path: Path) -> Path:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST))
    return path


def submit_command(api: RunPodApi, photos: Path | str, request_file: Path, out: Path, *extra: str) -> list[str]:
    """The stand-in wants RunPod's key, which --url sends only when --url-api-key-env names it."""
    return [
        "submit",
        str(photos),
        "--request",
        str(request_file),
        "--url",
        api.endpoint_url,
        "--url-api-key-env",
        "RUNPOD_API_KEY",
        "--out",
        str(out),
        "--poll-seconds",
        "0.05",
        *extra,
    ]


def run_submit(
    api: RunPodApi,
    photos: Path | str,
    request_file: Path,
    out: Path,
    *extra: str,
    environ: dict[str, str] | None = None,
) -> int:
    return main(
        submit_command(api, photos, request_file, out, *extra),
        environ={"RUNPOD_API_KEY": API_KEY} if environ is None else environ,
        out=io.StringIO(),
    )


def artifact_for(tmp_path: Path, name: str, content: bytes) -> dict[str, Any]:
    """An artifact as a worker without a bucket reports it: a file:// uri with its size and sha256."""
    stored = tmp_path / "worker-output" / name
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(content)
    return {
        "name": name,
        "uri": stored.as_uri(),
        "url": None,
        "bytes": len(content),
        "sha256": hashlib.sha256(content).hexdigest(),
    }


def default_sigint() -> None:
    """For a client started to be sent Ctrl-C (`preexec_fn`): SIGINT back to its default disposition. A test runner
    started in the background (`cmd &` in a script) ignores SIGINT, its children inherit that, and Python then
    installs no KeyboardInterrupt handler, so the client would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
