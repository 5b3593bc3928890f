"""Worker settings read from the environment: defaults, and refusals that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from fluxbooth.job.doctor import FAIL, worker_start_checks
from fluxbooth.settings import WorkerSettings, mount_points, persistent_volume
from tests.conftest import mounted_tmpfs


def test_two_checkpoints_are_kept_by_default() -> None:
    assert WorkerSettings.from_environ({}).checkpoints_keep == 2


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("5", 5), (" 3 ", 3), ("", 2)])
def test_checkpoints_keep_is_read_from_the_environment(raw: str, expected: int) -> None:
    assert WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": raw}).checkpoints_keep == expected


@pytest.mark.parametrize("raw", ["two", "2.5", "1e3"])
def test_checkpoints_keep_that_is_not_a_whole_number_is_refused(raw: str) -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": raw})

    assert str(caught.value) == f"environment variable FLUXBOOTH_CHECKPOINTS_KEEP={raw!r} is not a whole number"


def test_a_negative_checkpoints_keep_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": "-1"})

    assert str(caught.value) == "environment variable FLUXBOOTH_CHECKPOINTS_KEEP='-1' must be 0 or more"


# --- the persistent volume: a mount, or the operator's explicit word; never a folder that merely exists ----


def test_a_volume_folder_that_is_only_a_folder_is_not_persistent(tmp_path: Path) -> None:
    # RunPod creates /runpod-volume/huggingface-cache for its cached models, and a download to HF_HOME
    # creates it too, on the container disk that dies with the worker.
    folder = tmp_path / "runpod-volume"
    folder.mkdir()

    assert WorkerSettings.from_environ({"FLUXBOOTH_VOLUME_DIR": str(folder)}).volume_dir is None


def test_a_file_system_mounted_at_the_volume_folder_is_persistent(tmp_path: Path) -> None:
    folder = tmp_path / "runpod-volume"
    folder.mkdir()
    with mounted_tmpfs(folder):
        assert WorkerSettings.from_environ({"FLUXBOOTH_VOLUME_DIR": str(folder)}).volume_dir == folder


def test_the_operator_can_declare_a_folder_persistent(tmp_path: Path) -> None:
    env = {"FLUXBOOTH_VOLUME_DIR": str(tmp_path), "FLUXBOOTH_VOLUME_PERSISTENT": "1"}

    assert WorkerSettings.from_environ(env).volume_dir == tmp_path


def test_the_operator_can_declare_a_mounted_folder_not_persistent(tmp_path: Path) -> None:
    env = {"FLUXBOOTH_VOLUME_DIR": str(tmp_path), "FLUXBOOTH_VOLUME_PERSISTENT": "0"}

    assert persistent_volume(env, is_mounted=lambda path: True) is None


def test_a_declared_volume_that_does_not_exist_is_none(tmp_path: Path) -> None:
    env = {"FLUXBOOTH_VOLUME_DIR": str(tmp_path / "absent"), "FLUXBOOTH_VOLUME_PERSISTENT": "1"}

    assert persistent_volume(env) is None


def test_the_volume_defaults_to_runpods_mount_point() -> None:
    asked: list[Path] = []

    persistent_volume({}, is_mounted=lambda path: asked.append(path) or False)

    assert asked == [Path("/runpod-volume")]


def test_mount_points_are_read_with_the_kernels_escapes_undone() -> None:
    mountinfo = (
        "36 35 98:0 / /runpod-volume rw,relatime - fuse.mfs mfs#x rw\n"
        "37 35 98:1 / /mnt/my\\040volume rw - ext4 /dev/vdb rw\n"
    )

    assert mount_points(mountinfo) == {"/runpod-volume", "/mnt/my volume"}


# ---- numbers that overflow, and deadlines that leave no time (issue 37, item 7) --------------------------

NUMERIC_VARIABLES = (
    "FLUXBOOTH_JOB_DEADLINE_SECONDS",
    "FLUXBOOTH_MAX_IMAGES",
    "FLUXBOOTH_MAX_IMAGE_ASPECT_RATIO",
    "FLUXBOOTH_PRICE_PER_HOUR",
    "FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND",
)


@pytest.mark.parametrize("raw", ["inf", "-inf", "1e400", "nan", "Infinity"])
@pytest.mark.parametrize("name", NUMERIC_VARIABLES)
def test_a_number_that_is_not_finite_is_refused_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({name: raw})

    assert str(caught.value) == f"environment variable {name}={raw!r} is not a finite number"


@pytest.mark.parametrize("raw", ["0", "-30", "0.5", "-1e400"])
def test_a_deadline_under_one_second_is_refused(raw: str) -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_JOB_DEADLINE_SECONDS": raw})

    expected = "is not a finite number" if raw == "-1e400" else "must be 1 second or more"
    assert str(caught.value) == f"environment variable FLUXBOOTH_JOB_DEADLINE_SECONDS={raw!r} {expected}"


def test_a_one_second_deadline_is_accepted() -> None:
    assert WorkerSettings.from_environ({"FLUXBOOTH_JOB_DEADLINE_SECONDS": "1"}).job_deadline_seconds == 1


def test_the_start_check_reports_an_overflowing_setting_as_its_one_failure() -> None:
    results = worker_start_checks({"FLUXBOOTH_MAX_IMAGES": "1e400"})

    assert [(result.name, result.status, result.detail) for result in results] == [
        (
            "worker settings",
            FAIL,
            "environment variable FLUXBOOTH_MAX_IMAGES='1e400' is not a finite number; fix the endpoint's environment "
            "variables",
        )
    ]
