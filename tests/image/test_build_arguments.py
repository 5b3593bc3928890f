"""The image's build arguments as builder/fetch_model.py reads them (the Dockerfile passes them through as they
are): true/false flags in their usual spellings and nothing else, BASE_MODEL at BASE_MODEL_REVISION, and a value
beginning with `--` never read as an option. Run as the build runs it, a subprocess on the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, load_builder_module

fetch_model = load_builder_module("fetch_model")
SCRIPT = REPO_ROOT / "builder" / "fetch_model.py"


def build_step(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments, str(tmp_path / "models")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "YES", "on", "On"])
def test_a_flag_spelled_true_is_true(value: str) -> None:
    assert fetch_model.build_flag("SCORING_MODELS", value) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "No", "off", "OFF", ""])
def test_a_flag_spelled_false_is_false(value: str) -> None:
    assert fetch_model.build_flag("SCORING_MODELS", value) is False


@pytest.mark.parametrize("value", ["2", "maybe", "y", "enabled", "truee", "-1"])
def test_a_flag_spelled_otherwise_fails_the_build_naming_it(tmp_path: Path, value: str) -> None:
    step = build_step(tmp_path, f"--scoring-models={value}")
    assert (step.returncode, step.stderr) == (
        2,
        f"fetch_model.py: SCORING_MODELS={value!r}: use 1/0, true/false, yes/no or on/off\n",
    )


def test_no_base_model_and_scoring_models_off_bakes_nothing(tmp_path: Path) -> None:
    step = build_step(tmp_path, "--model=", "--revision=", "--scoring-models=no")
    assert (step.returncode, step.stdout, step.stderr) == (0, "", "")
    assert not (tmp_path / "models").exists()


def test_the_base_model_is_baked_at_its_revision() -> None:
    assert fetch_model.base_model_to_bake("black-forest-labs/FLUX.1-dev", "v1.0") == (
        "black-forest-labs/FLUX.1-dev",
        "v1.0",
    )


def test_an_unset_revision_bakes_the_default_branch() -> None:
    assert fetch_model.base_model_to_bake("black-forest-labs/FLUX.1-dev", "") == ("black-forest-labs/FLUX.1-dev", None)


@pytest.mark.parametrize("value", ["--scoring-models=1", "--help", "-h", "--revision=main"])
def test_a_base_model_beginning_with_a_dash_is_refused_not_read_as_an_option(tmp_path: Path, value: str) -> None:
    step = build_step(tmp_path, f"--model={value}")
    assert (step.returncode, step.stdout, step.stderr) == (
        2,
        "",
        f"fetch_model.py: BASE_MODEL={value!r}: expected a Hugging Face id, org/name\n",
    )


def test_a_revision_beginning_with_a_dash_is_refused(tmp_path: Path) -> None:
    step = build_step(tmp_path, "--model=org/name", "--revision=--help")
    assert (step.returncode, step.stderr) == (
        2,
        "fetch_model.py: BASE_MODEL_REVISION='--help': expected a branch, tag or commit of org/name\n",
    )


def test_a_revision_without_a_base_model_is_refused(tmp_path: Path) -> None:
    step = build_step(tmp_path, "--model=", "--revision=main")
    assert (step.returncode, step.stderr) == (
        2,
        "fetch_model.py: BASE_MODEL_REVISION='main' needs BASE_MODEL, the hub id to bake\n",
    )


def test_the_dockerfile_passes_the_build_arguments_through_as_values_of_their_options() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert 'python builder/fetch_model.py --model="$BASE_MODEL" --revision="$BASE_MODEL_REVISION" /models' in dockerfile
    assert 'python builder/fetch_model.py --scoring-models="$SCORING_MODELS" /models' in dockerfile
    assert 'ARG BASE_MODEL_REVISION=""' in dockerfile
