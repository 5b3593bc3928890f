"""The op cache: DeepSpeed's JIT-built ops live in a folder keyed by what they are built with (venv, Python,
torch, DeepSpeed, compiler), so another checkout on the same venv finds them built and another environment never
loads them (issue 43, item 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fluxbooth.host.op_cache import (
    OP_CACHE_FOLDER,
    OpBuildKey,
    compiler_identity,
    op_build_key,
    op_cache_dir,
    unbuilt_ops,
)
from tests.support.op_folders import built

SRC = Path(__file__).resolve().parents[2] / "src"
KEY = OpBuildKey(
    python_prefix="/opt/venv",
    python_version="3.11",
    torch_version="2.9.1+cpu",
    deepspeed_version="0.18.0",
    compiler="/usr/bin/g++-12 g++-12 (Debian 12.2.0-14) 12.2.0",
)


@pytest.mark.parametrize(
    "changed",
    [
        {"torch_version": "2.10.0+cpu"},
        {"python_prefix": "/home/someone/other-checkout/.venv"},
        {"compiler": "/usr/bin/clang++-16 Debian clang version 16.0.6"},
        {"deepspeed_version": "0.18.1"},
        {"python_version": "3.12"},
    ],
    ids=lambda changed: next(iter(changed)),
)
def test_the_folder_changes_with_what_the_op_is_built_with(changed: dict[str, str]) -> None:
    assert replace(KEY, **changed).folder_name != KEY.folder_name


def test_the_folder_names_python_and_torch_and_is_the_same_for_the_same_key() -> None:
    assert KEY.folder_name.startswith("py3.11-torch2.9.1+cpu-")
    assert replace(KEY).folder_name == KEY.folder_name


def test_the_default_folder_is_under_the_cache_folder_keyed_by_this_environment(tmp_path: Path) -> None:
    environ = {"PATH": os.environ.get("PATH", "")}
    assert op_cache_dir(environ, tmp_path) == tmp_path / OP_CACHE_FOLDER / op_build_key(environ).folder_name


def test_an_explicit_torch_extensions_dir_is_used_as_it_is(tmp_path: Path) -> None:
    assert op_cache_dir({"TORCH_EXTENSIONS_DIR": "/opt/torch_extensions"}, tmp_path) == Path("/opt/torch_extensions")


def test_another_venv_prefix_is_another_key() -> None:
    environ = {"PATH": os.environ.get("PATH", "")}
    assert op_build_key(environ, prefix="/venvs/a") != op_build_key(environ, prefix="/venvs/b")


def fake_compiler(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True)
    compiler = folder / "c++"
    compiler.write_text(f"#!/bin/sh\necho '{version}'\necho 'Copyright'\n")
    compiler.chmod(0o755)
    return compiler


def test_the_compiler_is_known_by_its_path_and_its_version_line(tmp_path: Path) -> None:
    compiler = fake_compiler(tmp_path / "bin", "g++ (Fake) 13.1.0")
    assert compiler_identity({"CXX": str(compiler)}) == f"{compiler} g++ (Fake) 13.1.0"


def test_cxx_picks_the_compiler_and_with_it_the_key(tmp_path: Path) -> None:
    first = fake_compiler(tmp_path / "one", "g++ (Fake) 13.1.0")
    second = fake_compiler(tmp_path / "two", "g++ (Fake) 14.2.0")
    assert op_build_key({"CXX": str(first)}) != op_build_key({"CXX": str(second)})


def test_the_compiler_on_path_is_found_as_torch_would_find_it(tmp_path: Path) -> None:
    compiler = fake_compiler(tmp_path / "bin", "c++ (Fake) 12.0")
    assert compiler_identity({"PATH": str(tmp_path / "bin")}) == f"{compiler} c++ (Fake) 12.0"


def test_a_missing_compiler_is_named_as_missing(tmp_path: Path) -> None:
    assert compiler_identity({"CXX": "no-such-compiler", "PATH": str(tmp_path)}) == "no-such-compiler (not found)"


def folder_from(checkout: Path, cwd: Path) -> tuple[str, str]:
    """The default op folder a worker of `checkout` computes (and the fluxbooth it imported), run from `cwd`."""
    probe = (
        "import os, pathlib, fluxbooth; from fluxbooth.host.op_cache import op_cache_dir; "
        "print(op_cache_dir(os.environ, pathlib.Path('/cache'))); print(fluxbooth.__file__)"
    )
    environ = {key: value for key, value in os.environ.items() if key != "TORCH_EXTENSIONS_DIR"}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**environ, "PYTHONPATH": str(checkout)},
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    folder, package = result.stdout.splitlines()
    return folder, package


def test_another_checkout_on_the_same_venv_finds_the_same_folder(tmp_path: Path) -> None:
    other = tmp_path / "other-checkout" / "src"
    shutil.copytree(SRC / "fluxbooth", other / "fluxbooth", ignore=shutil.ignore_patterns("__pycache__"))

    here, here_package = folder_from(SRC, SRC.parent)
    there, there_package = folder_from(other, other.parent)

    assert there_package.startswith(str(other)) and not here_package.startswith(str(other))
    assert here == there
    assert here.startswith(f"/cache/{OP_CACHE_FOLDER}/py")


def test_an_op_not_built_in_the_folder_is_to_be_built(tmp_path: Path) -> None:
    assert unbuilt_ops(tmp_path, ["cpu_adam", "deepspeed_shm_comm"]) == ("cpu_adam", "deepspeed_shm_comm")


def test_an_op_built_in_the_folder_is_not(tmp_path: Path) -> None:
    assert unbuilt_ops(built(tmp_path, "cpu_adam"), ["cpu_adam", "deepspeed_shm_comm"]) == ("deepspeed_shm_comm",)


def test_a_build_left_half_done_is_still_to_be_built(tmp_path: Path) -> None:
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "build.ninja").write_text("")
    assert unbuilt_ops(tmp_path, ["cpu_adam"]) == ("cpu_adam",)


def test_no_launcher_names_an_ops_folder_of_its_own() -> None:
    # A test or bench that launches the trainer with a folder of its own builds every op again there (minutes on
    # two cores, past a launch's time limit); all of them take the folder from op_cache_dir.
    repo = SRC.parent
    spelled_out = [
        str(path.relative_to(repo))
        for folder in ("src", "tests", "bench", "builder")
        for path in sorted((repo / folder).rglob("*.py"))
        if '"fluxbooth" / "torch_extensions"' in path.read_text() and path != Path(__file__)
    ]
    assert spelled_out == []
