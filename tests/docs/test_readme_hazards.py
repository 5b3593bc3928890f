"""The README and docs/ cite tests as proof: every cited test exists, and a run that skips one fails
(tests/support/readme_citations.py, registered in conftest)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.readme_citations import REPO_ROOT, cited_files, cited_tests, documents, file_and_test


def test_the_hazard_table_cites_its_tests() -> None:
    assert len(cited_tests([(REPO_ROOT / "docs" / "development" / "hazards.md").read_text()])) > 50


def test_the_development_pages_are_among_the_documents_checked() -> None:
    assert REPO_ROOT / "docs" / "development" / "hazards.md" in documents()


def cited_test_files() -> dict[str, Path]:
    """Every test file by its name: citations name the file, the folder is the package it tests (names are unique)."""
    return {path.name: path for path in (REPO_ROOT / "tests").rglob("test_*.py")}


def test_every_test_the_readme_and_docs_cite_exists() -> None:
    pairs = cited_tests(path.read_text() for path in documents())
    files = cited_test_files()
    missing = [
        f"{file}::{name}"
        for file, name in pairs
        if file not in files or not re.search(rf"def {name}\(", files[file].read_text())
    ]
    assert missing == []


def test_every_test_file_the_readme_and_docs_cite_exists() -> None:
    files = cited_files(path.read_text() for path in documents())
    assert [name for name in files if name not in cited_test_files()] == []


def test_a_bare_citation_belongs_to_the_file_cited_before_it_on_the_line() -> None:
    line = "| zip bombs | `test_dataset.py::test_a`, `::test_b[x]`; `tests/worker/test_fault_matrix.py::test_c` |"
    assert cited_tests([line]) == [
        ("test_dataset.py", "test_a"),
        ("test_dataset.py", "test_b"),
        ("test_fault_matrix.py", "test_c"),
    ]


def test_a_parametrised_node_is_the_test_it_belongs_to() -> None:
    assert file_and_test("tests/cli/test_cli.py::test_sizes[--gpu-memory]") == ("test_cli.py", "test_sizes")


PROJECT_CONFTEST = """
import os
from tests_plugin import CitedTestsMustRun

def pytest_configure(config):
    required = os.environ.get("FLUXBOOTH_REQUIRE_CITED_TESTS") == "1"
    config.pluginmanager.register(CitedTestsMustRun({("test_demo.py", "test_cited")}, required), "cited")
"""
DEMO_TESTS = """
import os, pytest

def test_cited():
    if os.environ.get("SKIP_CITED") == "1":
        pytest.skip("the environment lacks what this test needs")

def test_not_cited():
    pytest.skip("nobody cites this one")
"""


def run_demo_project(tmp_path: Path, skip_cited: bool, required: bool = True) -> subprocess.CompletedProcess[str]:
    """A small pytest project whose plugin cites test_demo.py::test_cited, run in a fresh pytest."""
    (tmp_path / "tests_plugin.py").write_text((REPO_ROOT / "tests" / "support" / "readme_citations.py").read_text())
    (tmp_path / "conftest.py").write_text(PROJECT_CONFTEST)
    (tmp_path / "test_demo.py").write_text(DEMO_TESTS)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "addopts=",
            "-q",
            "test_demo.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "SKIP_CITED": "1" if skip_cited else "0",
            "PYTHONPATH": str(tmp_path),
            "FLUXBOOTH_REQUIRE_CITED_TESTS": "1" if required else "0",
        },
    )


def test_a_run_that_skips_a_cited_test_fails_naming_it(tmp_path: Path) -> None:
    completed = run_demo_project(tmp_path, skip_cited=True)
    assert completed.returncode == 1
    assert "tests the README or docs/ cite as proof were skipped: the run fails" in completed.stdout
    assert "test_demo.py::test_cited: Skipped: the environment lacks what this test needs" in completed.stdout


def test_a_run_that_skips_only_uncited_tests_passes(tmp_path: Path) -> None:
    completed = run_demo_project(tmp_path, skip_cited=False)
    assert completed.returncode == 0, completed.stdout
    assert "cite as proof" not in completed.stdout


def test_outside_ci_a_skipped_cited_test_is_listed_but_does_not_fail_the_run(tmp_path: Path) -> None:
    # A developer's machine without root, libaio or buildah (FLUXBOOTH_REQUIRE_CITED_TESTS unset).
    completed = run_demo_project(tmp_path, skip_cited=True, required=False)
    assert completed.returncode == 0, completed.stdout
    assert "cite as proof were skipped: set FLUXBOOTH_REQUIRE_CITED_TESTS=1 to fail the run" in completed.stdout
