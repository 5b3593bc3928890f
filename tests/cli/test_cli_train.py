"""`python -m fluxbooth train request.json`: one job outside RunPod, artifacts in the local output directory."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fluxbooth.cli import main
from tests.conftest import REPO_ROOT


def test_an_invalid_request_prints_the_error_result_and_exits_1(worker_env: dict[str, str], tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"input": {"model_name": "x", "steps": 0}}))
    out = io.StringIO()
    assert main(["train", str(request)], environ=worker_env, out=out) == 1
    result = json.loads(out.getvalue())
    assert result["error"]["code"] == "invalid_input"
    assert "input.steps" in result["error"]["message"]
    assert result["refresh_worker"] is False


def test_a_request_file_that_is_not_json_is_a_usage_error(worker_env: dict[str, str], tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text("{not json")
    assert main(["train", str(request)], environ=worker_env, out=io.StringIO()) == 2


@pytest.mark.slow
def test_without_a_bucket_the_weights_land_in_the_local_output_directory(
    worker_env: dict[str, str], tmp_path: Path
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(json.loads((REPO_ROOT / "test_input.json").read_text())["input"]))
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth", "train", str(request), "--job-id", "cli-local"],
        cwd=tmp_path,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout)
    output_root = Path(worker_env["FLUXBOOTH_OUTPUT_DIR"]) / "sks-toy-demo" / "cli-local"
    for artifact in result["artifacts"]:
        path = Path(urlsplit(artifact["uri"]).path)
        assert path.is_relative_to(output_root)
        body = path.read_bytes()
        assert (len(body), hashlib.sha256(body).hexdigest()) == (artifact["bytes"], artifact["sha256"])
        assert artifact["url"] is None
