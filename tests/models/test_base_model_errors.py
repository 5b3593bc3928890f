"""A base model that cannot be found or read is an error someone can act on, never `internal` (a bug): the
caller's `invalid_input` naming base_model for a model the request names, `worker_unfit` saying the endpoint's
owner must fix it for the endpoint's own settings (see also tests/models/test_model_source.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from tests.support.hub_server import HubServer
from tests.support.model_hub import download, job_input, online, pipeline_repo, refusal, resolve, run


def copy_of(tiny_pipeline: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_pipeline, folder)
    return folder


def test_a_local_folder_without_model_index_json_is_refused_naming_it(
    model_env: dict[str, str], tiny_pipeline: Path, tmp_path: Path
) -> None:
    folder = copy_of(tiny_pipeline, tmp_path)
    (folder / "model_index.json").unlink()

    error = refusal(model_env, str(folder))

    assert (error.code, error.refresh_worker, error.message) == (
        ErrorCode.INVALID_INPUT,
        False,
        f"input.base_model: {folder} is not a diffusers FLUX folder (missing model_index.json)",
    )


def test_a_local_folder_without_transformer_weights_is_refused_before_the_trainer_starts(
    model_env: dict[str, str], tiny_pipeline: Path, tmp_path: Path
) -> None:
    folder = copy_of(tiny_pipeline, tmp_path)
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.unlink()
    progress: list[dict[str, Any]] = []

    result = run(model_env, job_input(base_model=str(folder)), progress)

    assert result["error"] == {
        "code": "invalid_input",
        "message": f"input.base_model: {folder} is not a diffusers FLUX folder (missing transformer/*.safetensors)",
    }


def test_a_path_that_is_no_folder_is_refused_naming_it(model_env: dict[str, str], tmp_path: Path) -> None:
    error = refusal(model_env, str(tmp_path / "nowhere"))

    assert (error.code, error.message) == (
        ErrorCode.INVALID_INPUT,
        f"input.base_model: {tmp_path / 'nowhere'} is not a diffusers FLUX folder (missing the folder itself)",
    )


@pytest.mark.parametrize("config", ["model_index.json", "transformer/config.json", "vae/config.json"])
def test_a_model_config_that_is_not_json_is_invalid_input_naming_the_file(
    config: str, model_env: dict[str, str], tiny_pipeline: Path, tmp_path: Path
) -> None:
    folder = copy_of(tiny_pipeline, tmp_path)
    (folder / config).write_text("{not json")
    progress: list[dict[str, Any]] = []

    result = run(model_env, job_input(base_model=str(folder), dry_run=True), progress)

    assert result["error"] == {
        "code": "invalid_input",
        "message": f"base_model: {folder / config} is not readable JSON (JSONDecodeError); give a diffusers FLUX model",
    }


def test_a_hub_cache_that_cannot_be_a_folder_is_worker_unfit(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path, tmp_path: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = online(model_env, HF_HUB_CACHE=str(blocker / "hub"))

    with pytest.raises(FluxboothError) as caught:
        download(resolve(env), env)

    assert (caught.value.code, caught.value.refresh_worker) == (ErrorCode.WORKER_UNFIT, False)
    assert caught.value.message.endswith("(the endpoint's owner must fix this)")
