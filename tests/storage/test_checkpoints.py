"""Checkpoints that outlive the worker: uploaded per model as the trainer makes them (COMPLETE last),
the latest complete one found, fetched and verified for `resume_from`. S3 is moto's server over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from botocore.client import BaseClient

from fluxbooth.contract.events import CheckpointEvent, StepEvent
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.settings import WorkerSettings
from fluxbooth.storage.checkpoints import (
    COMPLETE_MARKER,
    CheckpointUploader,
    StoredCheckpoint,
    download_checkpoint,
    find_resume_checkpoint,
    latest_complete_checkpoint,
    prune_checkpoints,
    upload_checkpoint,
)
from fluxbooth.storage.local import LocalStore
from fluxbooth.storage.protocol import ReadableStore
from fluxbooth.storage.s3 import S3Store
from fluxbooth.storage.stores import open_checkpoint_store
from tests.conftest import REPO_ROOT
from tests.support.checkpoint_folders import CHECKPOINT_FILES, build_checkpoint
from tests.support.s3server import InjectedFault, S3FaultProxy

MODEL = "sks-toy"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def s3_settings(env: dict[str, str], tmp_path: Path) -> WorkerSettings:
    return WorkerSettings.from_environ({**env, "FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs")})


def local_settings(tmp_path: Path) -> WorkerSettings:
    return WorkerSettings.from_environ({"FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs")})


def checkpoint_prefix(env: dict[str, str]) -> str:
    return f"{env['BUCKET_PREFIX']}/{MODEL}/checkpoints"


def keys_in(client: BaseClient, bucket: str, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listing.get("Contents", []))


def invalid_resume(resume_from: str, settings: WorkerSettings) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        find_resume_checkpoint(resume_from, settings, MODEL)
    return caught.value


def checkpoint_event(folder: Path, step: int) -> CheckpointEvent:
    return CheckpointEvent(step=step, path=str(folder))


# --- upload layout ---------------------------------------------------------------------------


def test_checkpoint_files_land_under_the_model_checkpoint_prefix_with_a_complete_index(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    folder = build_checkpoint(tmp_path / "job" / "checkpoints", step=2)
    store = open_checkpoint_store(s3_settings(s3_bucket_env, tmp_path), MODEL)

    uri = upload_checkpoint(store, folder, step=2)

    bucket, prefix = s3_bucket_env["BUCKET_NAME"], checkpoint_prefix(s3_bucket_env)
    assert uri == f"s3://{bucket}/{prefix}/checkpoint-2"
    expected = sorted(f"{prefix}/checkpoint-2/{name}" for name in [*CHECKPOINT_FILES, COMPLETE_MARKER])
    assert keys_in(s3_client, bucket, prefix) == expected
    marker = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/checkpoint-2/{COMPLETE_MARKER}")
    index = json.loads(marker["Body"].read())
    assert index["step"] == 2
    assert {entry["name"]: (entry["bytes"], entry["sha256"]) for entry in index["files"]} == {
        name: (size, sha256_of(folder / name)) for name, size in CHECKPOINT_FILES.items()
    }


def test_the_complete_marker_is_the_last_object_written(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    folder = build_checkpoint(tmp_path / "checkpoints", step=4)
    settings = s3_settings({**s3_bucket_env, "BUCKET_ENDPOINT_URL": s3_fault_proxy.url}, tmp_path)

    upload_checkpoint(open_checkpoint_store(settings, MODEL), folder, step=4)

    puts = [request.target for request in s3_fault_proxy.requests if request.operation == "PutObject"]
    assert len(puts) == len(CHECKPOINT_FILES) + 1
    assert puts[-1].endswith(f"/checkpoint-4/{COMPLETE_MARKER}")


def test_a_checkpoint_whose_upload_failed_midway_has_no_marker_and_is_never_latest(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    settings = s3_settings({**s3_bucket_env, "BUCKET_ENDPOINT_URL": s3_fault_proxy.url}, tmp_path)
    store = open_checkpoint_store(settings, MODEL)
    upload_checkpoint(store, build_checkpoint(tmp_path / "checkpoints", step=2), step=2)
    s3_fault_proxy.fail_always(
        lambda request: request.operation == "PutObject" and "optim_states" in request.target,
        InjectedFault(status=403, code="AccessDenied"),
    )

    with pytest.raises(FluxboothError) as caught:
        upload_checkpoint(store, build_checkpoint(tmp_path / "checkpoints", step=4), step=4)

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    s3_fault_proxy.rule = None
    assert "checkpoint-4" in store.list_folders()
    assert not store.exists(f"checkpoint-4/{COMPLETE_MARKER}")
    found = latest_complete_checkpoint(store)
    assert found is not None and found.step == 2


# --- the uploader the job drives from trainer events -------------------------------------------


def test_uploader_uploads_each_reported_checkpoint_in_order_even_after_the_trainer_pruned_it(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    checkpoint_root = tmp_path / "job" / "checkpoints"
    store = open_checkpoint_store(s3_settings(s3_bucket_env, tmp_path), MODEL)
    uploader = CheckpointUploader(store, checkpoint_root, staging_root=tmp_path / "job" / "checkpoint-uploads")

    for step in (2, 4):
        folder = build_checkpoint(checkpoint_root, step)
        uploader.on_trainer_event(checkpoint_event(folder, step))
        shutil.rmtree(folder)  # the trainer keeps only its newest checkpoints locally
    asyncio.run(uploader.finish())

    prefix = f"s3://{s3_bucket_env['BUCKET_NAME']}/{checkpoint_prefix(s3_bucket_env)}"
    assert uploader.uploaded == [f"{prefix}/checkpoint-2", f"{prefix}/checkpoint-4"]
    assert uploader.warnings == []
    found = latest_complete_checkpoint(store)
    assert found is not None and found.step == 4
    assert not any((tmp_path / "job" / "checkpoint-uploads").iterdir()), "upload snapshots were left behind"


def test_uploader_ignores_other_trainer_events(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    store = open_checkpoint_store(s3_settings(s3_bucket_env, tmp_path), MODEL)
    uploader = CheckpointUploader(store, tmp_path / "checkpoints", staging_root=tmp_path / "uploads")

    uploader.on_trainer_event(StepEvent(step=2, total=4, loss=0.5, lr=1e-4, seconds_per_step=0.1))
    asyncio.run(uploader.finish())

    assert (uploader.uploaded, uploader.warnings, store.list_folders()) == ([], [], [])


def test_a_failed_checkpoint_upload_is_a_warning_not_an_error(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    settings = s3_settings({**s3_bucket_env, "BUCKET_ENDPOINT_URL": s3_fault_proxy.url}, tmp_path)
    s3_fault_proxy.fail_always(
        lambda request: request.operation == "PutObject", InjectedFault(status=403, code="AccessDenied")
    )
    checkpoint_root = tmp_path / "checkpoints"
    uploader = CheckpointUploader(open_checkpoint_store(settings, MODEL), checkpoint_root, tmp_path / "uploads")

    uploader.on_trainer_event(checkpoint_event(build_checkpoint(checkpoint_root, 2), 2))
    asyncio.run(uploader.finish())

    assert uploader.uploaded == []
    assert len(uploader.warnings) == 1
    assert "checkpoint upload failed" in uploader.warnings[0] and "access denied" in uploader.warnings[0]
    assert s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"] not in uploader.warnings[0]


def test_uploader_refuses_a_reported_folder_outside_the_checkpoint_root(
    s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    store = open_checkpoint_store(s3_settings(s3_bucket_env, tmp_path), MODEL)
    uploader = CheckpointUploader(store, tmp_path / "job" / "checkpoints", staging_root=tmp_path / "uploads")
    elsewhere = build_checkpoint(tmp_path / "elsewhere", 2)

    uploader.on_trainer_event(checkpoint_event(elsewhere, 2))
    asyncio.run(uploader.finish())

    assert uploader.uploaded == [] and store.list_folders() == []
    assert "was not uploaded" in uploader.warnings[0]


# --- pruning -----------------------------------------------------------------------------------


@pytest.fixture(params=["s3", "local"])
def checkpoint_store(request: pytest.FixtureRequest, tmp_path: Path) -> ReadableStore:
    """The model's checkpoint store, in moto's bucket and in the local output directory."""
    if request.param == "s3":
        return open_checkpoint_store(s3_settings(request.getfixturevalue("s3_bucket_env"), tmp_path), MODEL)
    return open_checkpoint_store(local_settings(tmp_path), MODEL)


def stored_names(store: ReadableStore) -> list[str]:
    """Every stored object or file, relative to the store."""
    if isinstance(store, LocalStore):
        files = (path for path in store.directory.rglob("*") if path.is_file())
        return sorted(path.relative_to(store.directory).as_posix() for path in files)
    assert isinstance(store, S3Store)
    bucket, _, prefix = store.describe().removeprefix("s3://").partition("/")
    pages = store.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return sorted(item["Key"][len(prefix) + 1 :] for page in pages for item in page.get("Contents", []))


def store_complete(store: ReadableStore, step: int, made: Path) -> None:
    upload_checkpoint(store, build_checkpoint(made, step), step)


def store_incomplete(store: ReadableStore, step: int, made: Path) -> None:
    """What an upload cut short leaves: some files, no COMPLETE marker."""
    file = build_checkpoint(made, step) / "random_states_0.pkl"
    store.upload(file, f"checkpoint-{step}/random_states_0.pkl", sha256=sha256_of(file))


def complete_files(step: int) -> list[str]:
    return [f"checkpoint-{step}/{name}" for name in [*CHECKPOINT_FILES, COMPLETE_MARKER]]


def incomplete_files(step: int) -> list[str]:
    return [f"checkpoint-{step}/random_states_0.pkl"]


def test_pruning_keeps_the_newest_complete_checkpoints_by_step_number(
    checkpoint_store: ReadableStore, tmp_path: Path
) -> None:
    for step in (8, 9, 10):  # by name, "10" sorts before "8"
        store_complete(checkpoint_store, step, tmp_path / "made")

    deleted = prune_checkpoints(checkpoint_store, keep=2, just_uploaded=10)

    assert deleted == ["checkpoint-8"]
    assert stored_names(checkpoint_store) == sorted(complete_files(9) + complete_files(10))


def test_pruning_deletes_incomplete_uploads_below_the_newest_complete_checkpoint(
    checkpoint_store: ReadableStore, tmp_path: Path
) -> None:
    store_incomplete(checkpoint_store, 3, tmp_path / "made")
    store_complete(checkpoint_store, 4, tmp_path / "made")

    deleted = prune_checkpoints(checkpoint_store, keep=2, just_uploaded=4)

    assert deleted == ["checkpoint-3"]
    assert stored_names(checkpoint_store) == sorted(complete_files(4))


def test_pruning_keeps_an_incomplete_folder_above_the_newest_complete_checkpoint(
    checkpoint_store: ReadableStore, tmp_path: Path
) -> None:
    store_complete(checkpoint_store, 4, tmp_path / "made")
    store_incomplete(checkpoint_store, 6, tmp_path / "made")  # another job's upload, still running

    deleted = prune_checkpoints(checkpoint_store, keep=1, just_uploaded=4)

    assert deleted == []
    assert stored_names(checkpoint_store) == sorted(complete_files(4) + incomplete_files(6))


def test_keep_zero_deletes_nothing(checkpoint_store: ReadableStore, tmp_path: Path) -> None:
    store_incomplete(checkpoint_store, 1, tmp_path / "made")
    for step in (2, 4, 6):
        store_complete(checkpoint_store, step, tmp_path / "made")

    deleted = prune_checkpoints(checkpoint_store, keep=0, just_uploaded=6)

    assert deleted == []
    assert stored_names(checkpoint_store) == sorted(
        incomplete_files(1) + complete_files(2) + complete_files(4) + complete_files(6)
    )


def test_pruning_never_deletes_the_checkpoint_just_uploaded_even_when_newer_ones_exist(tmp_path: Path) -> None:
    store = open_checkpoint_store(local_settings(tmp_path), MODEL)
    for step in (6, 8, 4):  # a job resumed from an older checkpoint uploads step 4 last
        store_complete(store, step, tmp_path / "made")

    deleted = prune_checkpoints(store, keep=1, just_uploaded=4)

    assert deleted == ["checkpoint-6"]
    assert stored_names(store) == sorted(complete_files(4) + complete_files(8))


def test_pruning_leaves_folders_that_are_not_checkpoints(tmp_path: Path) -> None:
    store = open_checkpoint_store(local_settings(tmp_path), MODEL)
    store_complete(store, 2, tmp_path / "made")
    store_complete(store, 4, tmp_path / "made")
    notes = tmp_path / "made" / "notes.txt"
    notes.write_text("kept by hand")
    store.upload(notes, "checkpoint-best/notes.txt", sha256=sha256_of(notes))

    deleted = prune_checkpoints(store, keep=1, just_uploaded=4)

    assert deleted == ["checkpoint-2"]
    assert stored_names(store) == sorted([*complete_files(4), "checkpoint-best/notes.txt"])


def test_pruning_logs_each_deleted_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_checkpoint_store(local_settings(tmp_path), MODEL)
    store_incomplete(store, 1, tmp_path / "made")
    store_complete(store, 2, tmp_path / "made")
    store_complete(store, 4, tmp_path / "made")
    caplog.set_level(logging.INFO, logger="fluxbooth.storage.checkpoints")

    prune_checkpoints(store, keep=1, just_uploaded=4)

    assert [record.getMessage() for record in caplog.records if record.name == "fluxbooth.storage.checkpoints"] == [
        f"pruned incomplete checkpoint upload {store.describe()}/checkpoint-1 (1 objects)",
        f"pruned checkpoint {store.describe()}/checkpoint-2 ({len(CHECKPOINT_FILES) + 1} objects)",
    ]


def test_the_uploader_prunes_to_the_newest_checkpoints_after_each_upload(
    s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    checkpoint_root = tmp_path / "job" / "checkpoints"
    store = open_checkpoint_store(s3_settings(s3_bucket_env, tmp_path), MODEL)
    uploader = CheckpointUploader(store, checkpoint_root, staging_root=tmp_path / "job" / "uploads", keep=1)

    for step in (2, 4, 6):
        uploader.on_trainer_event(checkpoint_event(build_checkpoint(checkpoint_root, step), step))
    asyncio.run(uploader.finish())

    prefix = f"s3://{s3_bucket_env['BUCKET_NAME']}/{checkpoint_prefix(s3_bucket_env)}"
    assert uploader.uploaded == [f"{prefix}/checkpoint-{step}" for step in (2, 4, 6)]
    assert uploader.warnings == []
    assert stored_names(store) == sorted(complete_files(6))


def test_a_failed_prune_is_a_warning_and_the_old_checkpoint_stays(
    s3_bucket_env: dict[str, str], s3_fault_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    settings = s3_settings({**s3_bucket_env, "BUCKET_ENDPOINT_URL": s3_fault_proxy.url}, tmp_path)
    store = open_checkpoint_store(settings, MODEL)
    s3_fault_proxy.fail_always(
        lambda request: request.method == "POST" and "delete" in request.query,
        InjectedFault(status=403, code="AccessDenied"),
    )
    checkpoint_root = tmp_path / "checkpoints"
    uploader = CheckpointUploader(store, checkpoint_root, tmp_path / "uploads", keep=1)

    for step in (2, 4):
        uploader.on_trainer_event(checkpoint_event(build_checkpoint(checkpoint_root, step), step))
    asyncio.run(uploader.finish())

    assert len(uploader.uploaded) == 2
    assert len(s3_fault_proxy.faults_answered) == 1
    (warning,) = uploader.warnings
    assert warning.startswith("pruning old checkpoints after checkpoint 4 failed, they stay in storage: deleting ")
    assert "/checkpoint-2/ failed: access denied" in warning
    assert s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"] not in warning
    assert stored_names(store) == sorted(complete_files(2) + complete_files(4))


# --- latest ------------------------------------------------------------------------------------


def test_latest_is_the_highest_complete_step_by_number_not_by_name(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    settings = s3_settings(s3_bucket_env, tmp_path)
    store = open_checkpoint_store(settings, MODEL)
    for step in (9, 10):
        upload_checkpoint(store, build_checkpoint(tmp_path / "checkpoints", step), step)
    # A newer checkpoint whose upload never finished: files, no marker.
    unfinished = f"{checkpoint_prefix(s3_bucket_env)}/checkpoint-12/random_states_0.pkl"
    s3_client.put_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=unfinished, Body=b"x")

    found, warnings = find_resume_checkpoint("latest", settings, MODEL)

    assert found is not None and found.step == 10
    assert warnings == []


def test_latest_only_looks_at_the_requested_models_checkpoints(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    settings = s3_settings(s3_bucket_env, tmp_path)
    upload_checkpoint(open_checkpoint_store(settings, "another-model"), build_checkpoint(tmp_path / "c", 2), 2)

    found, warnings = find_resume_checkpoint("latest", settings, MODEL)

    assert found is None
    assert len(warnings) == 1 and "no complete checkpoint" in warnings[0] and "started at step 0" in warnings[0]


# --- resume_from URIs --------------------------------------------------------------------------


def test_an_s3_uri_in_the_configured_bucket_names_that_checkpoint(
    s3_bucket_env: dict[str, str], tmp_path: Path
) -> None:
    settings = s3_settings(s3_bucket_env, tmp_path)
    upload_checkpoint(open_checkpoint_store(settings, "older-model"), build_checkpoint(tmp_path / "c", 6), 6)
    uri = f"s3://{s3_bucket_env['BUCKET_NAME']}/{s3_bucket_env['BUCKET_PREFIX']}/older-model/checkpoints/checkpoint-6"

    found, warnings = find_resume_checkpoint(uri, settings, MODEL)

    assert found is not None and (found.step, found.uri, warnings) == (6, uri, [])


def test_an_s3_uri_in_another_bucket_is_invalid_input(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    other_bucket_uri = "s3://someone-elses-bucket/fluxbooth/m/checkpoints/checkpoint-2"

    error = invalid_resume(other_bucket_uri, s3_settings(s3_bucket_env, tmp_path))

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith("input.resume_from:")
    assert s3_bucket_env["BUCKET_NAME"] in error.message


def test_an_s3_uri_without_a_configured_bucket_is_invalid_input(tmp_path: Path) -> None:
    error = invalid_resume("s3://bucket/m/checkpoints/checkpoint-2", local_settings(tmp_path))

    assert error.code is ErrorCode.INVALID_INPUT
    assert "input.resume_from" in error.message and "BUCKET_NAME is unset" in error.message


def test_an_s3_uri_to_an_incomplete_checkpoint_is_invalid_input(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    key_prefix = f"{checkpoint_prefix(s3_bucket_env)}/checkpoint-8"
    s3_client.put_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=f"{key_prefix}/random_states_0.pkl", Body=b"x")

    error = invalid_resume(f"s3://{s3_bucket_env['BUCKET_NAME']}/{key_prefix}", s3_settings(s3_bucket_env, tmp_path))

    assert error.code is ErrorCode.INVALID_INPUT
    assert "input.resume_from" in error.message and "not a complete checkpoint" in error.message


@pytest.mark.parametrize(
    "resume_from",
    ["/tmp/checkpoint-2", "https://example.com/checkpoint-2", "s3://bucket/prefix/step-2", "checkpoint-2"],
)
def test_a_resume_from_that_is_neither_latest_nor_a_checkpoint_uri_is_invalid_input(
    resume_from: str, tmp_path: Path
) -> None:
    error = invalid_resume(resume_from, local_settings(tmp_path))

    assert error.code is ErrorCode.INVALID_INPUT
    assert "input.resume_from" in error.message and "checkpoint-<step>" in error.message


def test_a_file_uri_outside_the_output_dir_is_invalid_input(tmp_path: Path) -> None:
    outside = build_checkpoint(tmp_path / "elsewhere", 2)

    error = invalid_resume(outside.as_uri(), local_settings(tmp_path))

    assert error.code is ErrorCode.INVALID_INPUT
    assert "input.resume_from" in error.message and "output directory" in error.message


# --- download ----------------------------------------------------------------------------------


def test_download_reproduces_the_checkpoint_folder_byte_for_byte(s3_bucket_env: dict[str, str], tmp_path: Path) -> None:
    settings = s3_settings(s3_bucket_env, tmp_path)
    original = build_checkpoint(tmp_path / "made", 4)
    upload_checkpoint(open_checkpoint_store(settings, MODEL), original, 4)
    found, _ = find_resume_checkpoint("latest", settings, MODEL)
    assert found is not None

    local = download_checkpoint(found, tmp_path / "job" / "checkpoints")

    assert local == tmp_path / "job" / "checkpoints" / "checkpoint-4"
    downloaded = sorted(path.relative_to(local).as_posix() for path in local.rglob("*") if path.is_file())
    assert downloaded == sorted(CHECKPOINT_FILES)
    assert all(sha256_of(local / name) == sha256_of(original / name) for name in CHECKPOINT_FILES)


def test_download_refuses_a_file_altered_in_storage(
    s3_bucket_env: dict[str, str], s3_client: BaseClient, tmp_path: Path
) -> None:
    settings = s3_settings(s3_bucket_env, tmp_path)
    upload_checkpoint(open_checkpoint_store(settings, MODEL), build_checkpoint(tmp_path / "made", 4), 4)
    altered = f"{checkpoint_prefix(s3_bucket_env)}/checkpoint-4/random_states_0.pkl"
    s3_client.put_object(Bucket=s3_bucket_env["BUCKET_NAME"], Key=altered, Body=b"tampered")
    found, _ = find_resume_checkpoint("latest", settings, MODEL)
    assert found is not None

    with pytest.raises(FluxboothError) as caught:
        download_checkpoint(found, tmp_path / "job" / "checkpoints")

    assert caught.value.code is ErrorCode.UPLOAD_FAILED
    assert "random_states_0.pkl" in caught.value.message and "differs from its COMPLETE index" in caught.value.message


def test_without_a_bucket_checkpoints_go_to_the_output_dir_and_resume_from_a_file_uri(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)
    original = build_checkpoint(tmp_path / "made", 2)
    uri = upload_checkpoint(open_checkpoint_store(settings, MODEL), original, 2)
    stored_folder = tmp_path / "outputs" / MODEL / "checkpoints" / "checkpoint-2"
    assert uri == stored_folder.as_uri()
    assert (stored_folder / COMPLETE_MARKER).is_file()

    found, _ = find_resume_checkpoint(uri, settings, MODEL)
    assert isinstance(found, StoredCheckpoint) and found.step == 2
    local = download_checkpoint(found, tmp_path / "job" / "checkpoints")

    assert all(sha256_of(local / name) == sha256_of(original / name) for name in CHECKPOINT_FILES)


# --- end to end with the real trainer ----------------------------------------------------------


def demo_input(**overrides: Any) -> dict[str, Any]:
    return {**json.loads((REPO_ROOT / "test_input.json").read_text())["input"], **overrides}


@pytest.mark.slow
def test_a_resubmitted_job_resumes_from_the_latest_uploaded_checkpoint(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient
) -> None:
    from fluxbooth.job.run import run_job

    settings = WorkerSettings.from_environ({**worker_env, **s3_bucket_env})
    bucket, model_name = s3_bucket_env["BUCKET_NAME"], "sks-toy-resume"
    prefix = f"{s3_bucket_env['BUCKET_PREFIX']}/{model_name}/checkpoints"

    first = asyncio.run(
        run_job(demo_input(model_name=model_name, steps=4, checkpointing_steps=2), job_id="first", settings=settings)
    )
    assert "error" not in first, first
    # The trainer checkpoints after step 2 (not after the last step: the exported weights are that).
    assert first["checkpoints"] == [f"s3://{bucket}/{prefix}/checkpoint-2"]
    assert f"{prefix}/checkpoint-2/{COMPLETE_MARKER}" in keys_in(s3_client, bucket, prefix)

    progress: list[dict[str, Any]] = []
    second = asyncio.run(
        run_job(
            demo_input(model_name=model_name, steps=6, resume_from="latest"),
            job_id="second",
            settings=settings,
            progress=progress.append,
        )
    )
    assert "error" not in second, second
    assert second["metrics"]["resumed_from_step"] == 2
    assert second["metrics"]["steps"] == 6
    assert any(update.get("stage") == "resume" for update in progress)
    assert [update["step"] for update in progress if "step" in update][-1] == 6


@pytest.mark.slow
def test_a_job_keeps_only_the_newest_checkpoints_the_environment_asks_for(
    worker_env: dict[str, str], s3_bucket_env: dict[str, str], s3_client: BaseClient
) -> None:
    from fluxbooth.job.run import run_job

    settings = WorkerSettings.from_environ({**worker_env, **s3_bucket_env, "FLUXBOOTH_CHECKPOINTS_KEEP": "1"})
    bucket, model_name = s3_bucket_env["BUCKET_NAME"], "sks-toy-prune"
    prefix = f"{s3_bucket_env['BUCKET_PREFIX']}/{model_name}/checkpoints"

    result = asyncio.run(
        run_job(demo_input(model_name=model_name, steps=6, checkpointing_steps=2), job_id="pruned", settings=settings)
    )

    assert "error" not in result, result
    assert result["checkpoints"] == [f"s3://{bucket}/{prefix}/checkpoint-{step}" for step in (2, 4)]
    assert [warning for warning in result.get("warnings", []) if "checkpoint" in warning] == []
    stored_folders = {key.split("/")[len(prefix.split("/"))] for key in keys_in(s3_client, bucket, prefix)}
    assert stored_folders == {"checkpoint-4"}


def test_a_job_id_that_names_the_checkpoint_folder_cannot_write_into_it() -> None:
    from fluxbooth.job.attempts import safe_job_id

    assert safe_job_id("checkpoints") == "job-checkpoints"
