"""The tests the README and docs/ cite as proof, and a pytest plugin that fails a run in which one of them was
skipped: a skipped test proves nothing, so a run that skips a cited test has not shown what the text claims.
It fails the run where FLUXBOOTH_REQUIRE_CITED_TESTS=1 (CI, which installs what every cited test needs); a
developer's run without root, libaio or buildah lists the skipped citations and still passes.

Registered from tests/conftest.py. Under pytest-xdist it runs in the controller, which receives every worker's
reports; a run that selects only some tests checks only those it ran.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# `test_x.py::test_y`, `tests/worker/test_x.py::test_y[param]`, or `::test_y` after a file cited earlier on the line.
_CITED_TEST = re.compile(r"`(?:tests/(?:\w+/)*)?((test_\w+\.py)?::(test_\w+))(\[[^\]`]*\])?`")
# A test file cited on its own: `tests/worker/test_x.py`, `tests/worker/test_x.py -k name`.
_CITED_FILE = re.compile(r"`tests/(?:\w+/)*(test_\w+\.py)[^`]*`")


def documents(root: Path = REPO_ROOT) -> list[Path]:
    """The texts people read: the README and docs/, its development/ pages (the test table, the evidence) included."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def cited_tests(texts: Iterable[str]) -> list[tuple[str, str]]:
    """(file, test) pairs; a bare `::test_x` refers to the file cited before it on the same line."""
    pairs: list[tuple[str, str]] = []
    for text in texts:
        for line in text.splitlines():
            current_file = ""
            for match in _CITED_TEST.finditer(line):
                current_file = match.group(2) or current_file
                pairs.append((current_file, match.group(3)))
    return pairs


def cited_files(texts: Iterable[str]) -> list[str]:
    return [match.group(1) for text in texts for match in _CITED_FILE.finditer(text)]


def cited_in_documents(root: Path = REPO_ROOT) -> set[tuple[str, str]]:
    return set(cited_tests(path.read_text() for path in documents(root)))


def file_and_test(nodeid: str) -> tuple[str, str]:
    """`tests/test_x.py::test_y[param]` → ("test_x.py", "test_y")."""
    path, _, rest = nodeid.partition("::")
    return Path(path).name, rest.split("[", 1)[0].split("::")[-1]


class CitedTestsMustRun:
    """Records the cited tests that were skipped (or xfailed) in this run, and fails the run if any were."""

    def __init__(self, cited: set[tuple[str, str]], required: bool) -> None:
        self.cited = cited
        self.required = required
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and file_and_test(report.nodeid) in self.cited:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append(f"{report.nodeid}: {reason}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.required and self.skipped and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.skipped:
            return
        verdict = "the run fails" if self.required else "set FLUXBOOTH_REQUIRE_CITED_TESTS=1 to fail the run"
        terminalreporter.write_sep("=", f"tests the README or docs/ cite as proof were skipped: {verdict}", red=True)
        for line in self.skipped:
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its reports reach the controller, which checks them
    required = os.environ.get("FLUXBOOTH_REQUIRE_CITED_TESTS") == "1"
    config.pluginmanager.register(CitedTestsMustRun(cited_in_documents(), required), "fluxbooth-cited-tests-must-run")
