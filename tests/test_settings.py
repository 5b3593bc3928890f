"""Worker settings read from the environment: defaults, and refusals that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

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
