"""Base model resolution: a hub id becomes a local diffusers folder before the dataset is fetched.

Found in the standard Hugging Face cache, RunPod's cached models or the image; refused at once, naming
every place looked at, when it is nowhere and downloads are off; otherwise downloaded (pipeline files
only, after checking the disk) from a hub that speaks the real protocol over HTTP (tests/support/hub_server.py),
by the real huggingface_hub client.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.source import (
    PIPELINE_FILE_PATTERNS,
    download_base_model,
)
from tests.conftest import REPO_ROOT
from tests.support.http_fixtures import LocalHTTPServer
from tests.support.hub_server import HubFile, HubRepo, HubServer, folder_files
from tests.support.model_hub import (
    REPO_ID,
    SINGLE_FILE_CHECKPOINT,
    download,
    job_input,
    online,
    pipeline_repo,
    refusal,
    resolve,
    run,
)

GRANTED_TOKEN = "hf_granted_token_0123456789"
TEN_TIB = 10 * 1024**4


def pipeline_bytes(tiny_pipeline: Path) -> int:
    from huggingface_hub.utils import filter_repo_objects

    files = [hub_file.path for hub_file in folder_files(tiny_pipeline)]
    return sum(
        (tiny_pipeline / name).stat().st_size
        for name in filter_repo_objects(files, allow_patterns=list(PIPELINE_FILE_PATTERNS))
    )


def plant(hub: HubServer, cache_dir: str | Path, repo_id: str = REPO_ID, revision: str | None = None) -> Path:
    """Download the pipeline into a cache once, with the real client, as RunPod or a build step would."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(
        repo_id,
        revision=revision,
        cache_dir=cache_dir,
        endpoint=hub.endpoint,
        allow_patterns=list(PIPELINE_FILE_PATTERNS),
    )
    hub.requests.clear()
    return Path(folder)


# --------------------------------------------------------------------------------- found on the worker


def test_a_hub_id_in_the_standard_hf_cache_resolves_offline_to_its_snapshot(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    snapshot = plant(hub, model_env["HF_HUB_CACHE"])

    model = resolve(model_env)

    assert (model.folder, model.pending) == (snapshot, None)
    assert hub.requests == []


def test_runpod_cached_models_are_found_even_without_refs(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    snapshot = plant(hub, model_env["FLUXBOOTH_RUNPOD_MODEL_CACHE"])
    shutil.rmtree(snapshot.parent.parent / "refs")  # RunPod's layout: models--org--name/snapshots/<commit>/

    assert resolve(model_env).folder == snapshot


def test_a_model_baked_into_the_image_as_a_cache_is_found(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    snapshot = plant(hub, model_env["FLUXBOOTH_BAKED_MODELS_DIR"])

    assert resolve(model_env).folder == snapshot


def test_a_model_baked_into_the_image_as_a_plain_org_name_folder_is_found(
    model_env: dict[str, str], tiny_pipeline: Path
) -> None:
    folder = Path(model_env["FLUXBOOTH_BAKED_MODELS_DIR"]) / REPO_ID
    shutil.copytree(tiny_pipeline, folder)

    assert resolve(model_env).folder == folder


def test_a_local_folder_still_resolves_to_itself(model_env: dict[str, str], tiny_pipeline: Path) -> None:
    assert resolve(model_env, str(tiny_pipeline)).folder == tiny_pipeline


# ----------------------------------------------------------------------------------------- revisions


def two_commit_repo(tiny_pipeline: Path) -> tuple[HubRepo, str, str]:
    """`v1` (also a tag) is the pipeline; `main` adds a file to the scheduler folder."""
    repo = HubRepo(REPO_ID)
    old = repo.add_commit(folder_files(tiny_pipeline), refs=("main", "v1"))
    new = repo.add_commit(folder_files(tiny_pipeline) + [HubFile("scheduler/notes.txt", b"retuned\n")])
    return repo, old, new


def test_a_pinned_revision_resolves_to_that_commit_by_tag_or_hash(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    repo, old, new = two_commit_repo(tiny_pipeline)
    hub.add_repo(repo)
    plant(hub, model_env["HF_HUB_CACHE"], revision="v1")
    plant(hub, model_env["HF_HUB_CACHE"])

    assert resolve(model_env, revision="v1").folder.name == old
    assert resolve(model_env, revision=old).folder.name == old
    assert resolve(model_env).folder.name == new


def test_a_pinned_revision_that_is_not_cached_is_refused_offline_naming_it(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    repo, old, new = two_commit_repo(tiny_pipeline)
    hub.add_repo(repo)
    plant(hub, model_env["HF_HUB_CACHE"])

    error = refusal(model_env, revision="v1")

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith(
        f"input.base_model: {REPO_ID} (revision v1) is not on this worker and downloads are off (HF_HUB_OFFLINE=1). "
        f"Looked in: {model_env['HF_HUB_CACHE']} (Hugging Face cache, HF_HUB_CACHE / HF_HOME: "
        "models--acme--tiny-flux has no complete snapshot of revision v1); "
    )


def test_a_revision_for_a_local_folder_is_refused(model_env: dict[str, str], tiny_pipeline: Path) -> None:
    error = refusal(model_env, str(tiny_pipeline), revision="v1")

    assert (error.code, error.message) == (
        ErrorCode.INVALID_INPUT,
        f"input.base_model_revision: pins a revision of a Hugging Face id, but the base model {tiny_pipeline} "
        "is not one; leave base_model_revision out",
    )


def test_a_pinned_revision_the_hub_does_not_have_is_refused(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))

    error = refusal(online(model_env), revision="v9")

    assert (error.code, error.message) == (
        ErrorCode.INVALID_INPUT,
        f"input.base_model_revision: {REPO_ID} has no revision 'v9' on the Hub ({hub.endpoint}/{REPO_ID}); give a "
        "branch, tag or commit hash that exists",
    )


# ------------------------------------------------------------------------------------- found nowhere


def test_a_hub_id_found_nowhere_offline_is_refused_before_the_dataset_is_fetched(
    model_env: dict[str, str], hub: HubServer, tmp_path: Path
) -> None:
    Path(model_env["HF_HUB_CACHE"]).mkdir(parents=True)
    env = {**model_env, "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1"}
    dataset_url = f"{hub.cdn_url}/datasets/sks-dog.zip"  # any request to it would be logged
    progress: list[dict[str, Any]] = []

    raw_input = {**job_input(base_model="acme/missing-flux"), "dataset_url": dataset_url}
    del raw_input["dataset"]

    result = run(env, raw_input, progress)

    baked = model_env["FLUXBOOTH_BAKED_MODELS_DIR"]
    assert result == {
        "error": {
            "code": "invalid_input",
            "message": (
                "input.base_model: acme/missing-flux is not on this worker and downloads are off (HF_HUB_OFFLINE=1). "
                f"Looked in: {model_env['HF_HUB_CACHE']} (Hugging Face cache, HF_HUB_CACHE / HF_HOME: no "
                "models--acme--missing-flux); "
                f"{model_env['FLUXBOOTH_RUNPOD_MODEL_CACHE']} (RunPod cached models, FLUXBOOTH_RUNPOD_MODEL_CACHE: no such folder); "
                f"{baked} (baked into the image, FLUXBOOTH_BAKED_MODELS_DIR: no such folder); "
                f"{baked}/acme/missing-flux (baked folder, FLUXBOOTH_BAKED_MODELS_DIR/org/name: no such folder). "
                "Provide it one of these ways: bake it into the image (`hf download acme/missing-flux --cache-dir "
                "/models`, FLUXBOOTH_BAKED_MODELS_DIR); select it as the endpoint's RunPod cached model (it appears "
                "under /runpod-volume/huggingface-cache/hub); put it on a network volume in the Hugging Face cache "
                "layout and point HF_HOME at it (HF_HOME=/runpod-volume/huggingface-cache); or let the worker "
                "download it once (unset HF_HUB_OFFLINE, and set HF_TOKEN for gated models)"
            ),
            "details": {
                "looked_in": [
                    model_env["HF_HUB_CACHE"],
                    model_env["FLUXBOOTH_RUNPOD_MODEL_CACHE"],
                    baked,
                    f"{baked}/acme/missing-flux",
                ]
            },
        },
        "refresh_worker": False,
    }
    assert [update["stage"] for update in progress] == ["plan"]
    assert hub.requests == [], "the dataset was fetched or the hub was asked"
    assert list((tmp_path / "work").iterdir()) == [], "the job left files (launch files, dataset) behind"


def test_the_endpoints_default_model_missing_offline_is_worker_unfit_naming_fluxbooth_base_model(
    model_env: dict[str, str],
) -> None:
    error = refusal(model_env, None)

    assert error.message.startswith(
        "base_model (the endpoint's default, FLUXBOOTH_BASE_MODEL): black-forest-labs/FLUX.1-dev is not on this "
        "worker and downloads are off (HF_HUB_OFFLINE=1). Looked in: "
    )
    assert error.message.endswith("(the endpoint's owner must fix this)")
    assert (error.code, error.refresh_worker) == (ErrorCode.WORKER_UNFIT, False)


def test_an_interrupted_download_is_not_taken_for_the_model(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    resolve(online(model_env))  # fetches the configs only, then the job stops before the weights

    error = refusal(model_env)

    assert (
        f"{model_env['HF_HUB_CACHE']} (Hugging Face cache, HF_HUB_CACHE / HF_HOME: models--acme--tiny-flux has no "
        "complete snapshot of revision main)" in error.message
    )


# -------------------------------------------------------------------------------------- downloading


def test_download_fetches_only_the_pipeline_files_reporting_bytes_and_a_second_job_reuses_them(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    env = online(model_env)
    total = pipeline_bytes(tiny_pipeline)

    model = resolve(env)
    assert model.pending is not None and model.pending.bytes_total == total
    assert (model.folder / "transformer" / "config.json").is_file()  # the planner sizes the model from it
    assert not list((model.folder / "transformer").glob("*.safetensors"))
    updates = download(model, env)

    assert updates[-1] == {"bytes_done": total, "bytes_total": total}
    assert [update["bytes_done"] for update in updates] == sorted(update["bytes_done"] for update in updates)
    assert not [path for path in hub.downloads() if path.endswith((SINGLE_FILE_CHECKPOINT, "README.md"))]
    assert not [request for request in hub.requests if SINGLE_FILE_CHECKPOINT in request.path]
    hub.requests.clear()

    again = resolve(env)

    assert (again.folder, again.pending) == (model.folder, None)
    assert hub.requests == []


def test_a_download_that_does_not_fit_on_the_disk_is_refused_before_any_file_is_fetched(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    from fluxbooth.host.hardware import free_disk_bytes
    from fluxbooth.messages import format_bytes

    repo = HubRepo(REPO_ID)
    shard = HubFile("transformer/diffusion_pytorch_model-00001-of-00002.safetensors", claimed_size=TEN_TIB)
    repo.add_commit(folder_files(tiny_pipeline) + [shard])
    hub.add_repo(repo)
    cache = Path(model_env["HF_HUB_CACHE"])
    needed = pipeline_bytes(tiny_pipeline) + TEN_TIB

    error = refusal(online(model_env))

    free = free_disk_bytes(cache)
    assert (error.code, error.refresh_worker, error.details) == (
        ErrorCode.DOES_NOT_FIT,
        False,
        {"needed_bytes": needed, "free_bytes": free},
    )
    assert error.message == (
        f"disk: downloading {REPO_ID} needs {format_bytes(needed)} (15 files) but only {format_bytes(free)} are "
        f"free under {cache}; free space there, point HF_HOME at a bigger volume, or provide the model another "
        "way (baked into the image, RunPod cached model)"
    )
    assert hub.downloads() == []


def test_a_download_and_the_training_run_on_the_same_disk_must_both_fit(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    from fluxbooth.messages import format_bytes
    from fluxbooth.models.source import ensure_room_to_download

    hub.add_repo(pipeline_repo(tiny_pipeline))
    model = resolve(online(model_env))
    assert model.pending is not None
    work_root = Path(model_env["FLUXBOOTH_WORK_DIR"])  # under tmp_path, like the cache: one disk
    ensure_room_to_download(model, 0, work_root)

    with pytest.raises(FluxboothError) as caught:
        ensure_room_to_download(model, 2**60, work_root)

    needed = model.pending.bytes_total + 2**60
    assert (caught.value.code, caught.value.details["needed_bytes"]) == (ErrorCode.DOES_NOT_FIT, needed)
    assert caught.value.message.startswith(
        f"disk: downloading {REPO_ID} (1.1 MiB) and then training (about {format_bytes(2**60)}: caches, checkpoints "
        f"and the exported weights) need {format_bytes(needed)} on the disk holding {model_env['HF_HUB_CACHE']}, "
        "but only "
    )


def test_a_gated_model_without_a_token_is_worker_unfit_naming_hf_token(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline, gated=True, granted_tokens=frozenset({GRANTED_TOKEN})))

    error = refusal(online(model_env))

    assert (error.code, error.refresh_worker, error.message) == (
        ErrorCode.WORKER_UNFIT,
        False,
        f"input.base_model: {REPO_ID} is a gated model and the worker has no Hugging Face token: accept its license "
        f"at {hub.endpoint}/{REPO_ID} with your account, then set HF_TOKEN (a read token of that account) on the "
        "endpoint (the endpoint's owner must fix this)",
    )
    assert hub.downloads() == []


def test_a_gated_model_with_a_token_that_was_not_granted_access_is_refused(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline, gated=True, granted_tokens=frozenset({GRANTED_TOKEN})))

    error = refusal(online(model_env, HF_TOKEN="hf_someone_else"))

    assert (error.code, error.message) == (
        ErrorCode.WORKER_UNFIT,
        f"input.base_model: the account of HF_TOKEN has no access to the gated model {REPO_ID}: accept its license at "
        f"{hub.endpoint}/{REPO_ID} with that account, or set HF_TOKEN to a token of an account that has (the "
        "endpoint's owner must fix this)",
    )


def test_a_gated_model_downloads_with_a_granted_token_which_never_leaves_the_hub(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline, gated=True, granted_tokens=frozenset({GRANTED_TOKEN})))
    env = online(model_env, HF_TOKEN=GRANTED_TOKEN)

    model = resolve(env)
    download(model, env)

    assert resolve(model_env).folder == model.folder
    assert all(request.with_token for request in hub.requests if request.server == "hub")
    assert [request for request in hub.requests if request.server == "cdn"]
    assert not any(request.with_token for request in hub.requests if request.server == "cdn")


def test_an_unknown_hub_id_is_refused(model_env: dict[str, str], hub: HubServer) -> None:
    error = refusal(online(model_env), "acme/no-such-flux")

    assert (error.code, error.message) == (
        ErrorCode.INVALID_INPUT,
        f"input.base_model: acme/no-such-flux was not found on the Hub ({hub.endpoint}/acme/no-such-flux); check the "
        "id, and set HF_TOKEN if the repository is private",
    )


def test_an_unreachable_hub_is_worker_unfit_and_keeps_the_worker(model_env: dict[str, str]) -> None:
    from tests.support.s3server import free_tcp_port

    error = refusal(online(model_env, HF_ENDPOINT=f"http://127.0.0.1:{free_tcp_port()}"))

    assert (error.code, error.refresh_worker) == (ErrorCode.WORKER_UNFIT, False)
    assert error.message.startswith(
        f"input.base_model: {REPO_ID} is not on this worker and the Hub at http://127.0.0.1:"
    )
    assert error.message.endswith("(the endpoint's owner must fix this)")


def test_the_deadline_stops_a_download_with_a_timeout_that_keeps_the_worker(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    env = online(model_env)
    model = resolve(env)

    with pytest.raises(FluxboothError) as caught:
        download(model, env, deadline_seconds=-1.0)

    assert (caught.value.code, caught.value.refresh_worker) == (ErrorCode.TIMEOUT, False)
    assert caught.value.message.startswith(
        f"base_model: downloading {REPO_ID} (1.1 MiB) stopped: the job's deadline was reached; the files finished so "
        f"far stay in {model_env['HF_HUB_CACHE']}."
    )


def test_a_cancelled_job_stops_its_download_and_reraises_the_cancellation(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    from fluxbooth.models.source import missing_pipeline_files

    hub.add_repo(pipeline_repo(tiny_pipeline))
    hub.cdn_delay_seconds = 2.0  # the weights are still in flight when the configs have arrived
    env = online(model_env)
    model = resolve(env)

    async def cancel_after_the_first_bytes() -> None:
        first_bytes = asyncio.Event()
        task = asyncio.ensure_future(
            download_base_model(model, env, lambda update: first_bytes.set(), 0.0, time.monotonic() + 120)
        )
        await first_bytes.wait()
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_after_the_first_bytes())

    assert "transformer/*.safetensors" in missing_pipeline_files(model.folder)


# ------------------------------------------------------------------------------------ through a job


def test_a_job_downloads_the_model_with_progress_and_the_next_job_asks_the_hub_nothing(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    env = online(model_env, PYTHONPATH=str(REPO_ROOT), FLUXBOOTH_TRAINER_MODULE="tests.support.fake_trainer_module")
    total = pipeline_bytes(tiny_pipeline)
    progress: list[dict[str, Any]] = []

    result = run(env, job_input(), progress)

    assert "error" not in result, result
    stages = [update["stage"] for update in progress]
    assert stages.index("plan") < stages.index("dataset") < stages.index("download") < stages.index("train")
    downloads = [update for update in progress if update["stage"] == "download"]
    assert downloads[0] == {"stage": "download", "bytes_done": 0, "bytes_total": total}
    assert downloads[-1] == {"stage": "download", "bytes_done": total, "bytes_total": total}
    assert "download" in result["metrics"]["seconds"]
    hub.requests.clear()
    progress.clear()

    second = run(env, job_input(), progress)

    assert "error" not in second, second
    assert "download" not in [update["stage"] for update in progress]
    assert hub.requests == []


@pytest.fixture(scope="module")
def tiny_kontext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fluxbooth.synthetic import build_pipeline, preset

    return build_pipeline(preset("tiny-kontext"), tmp_path_factory.mktemp("kontext") / "tiny-kontext")


def test_a_broken_validation_image_is_refused_before_the_base_model_is_downloaded(
    model_env: dict[str, str], hub: HubServer, tiny_kontext: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_kontext))
    progress: list[dict[str, Any]] = []
    raw_input = job_input(validation_prompts=["a photo of sks dog"], validation_images=["abc"])

    result = run(online(model_env), raw_input, progress)

    assert result["error"]["code"] == "invalid_input"
    assert result["error"]["message"].startswith("input.validation_images[0]: is not valid base64")
    assert "download" not in [update["stage"] for update in progress]
    assert not any(path.endswith(".safetensors") for path in hub.downloads()), hub.downloads()


def test_validation_images_for_a_flux1_hub_model_are_refused_before_anything_is_fetched(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path, http_server: LocalHTTPServer
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    progress: list[dict[str, Any]] = []
    image_url = http_server.add("/control.png", body=b"never fetched")
    raw_input = job_input(validation_prompts=["a photo of sks dog"], validation_images=[image_url])

    result = run(online(model_env), raw_input, progress)

    assert result["error"]["code"] == "invalid_input"
    assert result["error"]["message"].startswith("input.validation_images: FLUX.1 [dev], [schnell] and Krea [dev]")
    assert http_server.requests == []
    assert not any(path.endswith(".safetensors") for path in hub.downloads()), hub.downloads()


@pytest.mark.slow
def test_a_hub_id_planted_in_the_hf_cache_trains_offline_with_the_real_trainer(
    model_env: dict[str, str], hub: HubServer, tiny_pipeline: Path
) -> None:
    hub.add_repo(pipeline_repo(tiny_pipeline))
    plant(hub, model_env["HF_HUB_CACHE"])
    progress: list[dict[str, Any]] = []

    result = run(model_env, job_input(), progress)

    assert "error" not in result, result
    assert result["metrics"]["steps"] == 2
    assert "download" not in [update["stage"] for update in progress]
    assert hub.requests == []


# ---------------------------------------------------------------------------------------- the request


def test_base_model_revision_is_a_request_field_without_traversal() -> None:
    from fluxbooth.request.model import parse_request

    base = {
        "model_name": "m",
        "instance_prompt": "sks",
        "dataset_url": "https://example.com/d.zip",
        "base_model": REPO_ID,
    }
    assert parse_request({**base, "base_model_revision": "refs/pr/1"}).base_model_revision == "refs/pr/1"
    with pytest.raises(FluxboothError) as caught:
        parse_request({**base, "base_model_revision": "v1..v2"})
    assert (caught.value.code, caught.value.message) == (
        ErrorCode.INVALID_INPUT,
        "invalid request: input.base_model_revision: must not contain '..'",
    )
