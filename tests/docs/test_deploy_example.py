"""docs/deploy.md's example plan: it plans with the container disk the page advises, for the README's own
request, and the output the page shows is what the command prints."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

from fluxbooth.cli import main
from tests.conftest import REPO_ROOT

DEPLOY_PAGE = REPO_ROOT / "docs" / "deploy.md"


def advised_disk() -> str:
    """`80 GB` from "**Container disk:** 80 GB (...)", as the command writes it: `80GB`."""
    found = re.search(r"\*\*Container disk:\*\* (\d+) GB", DEPLOY_PAGE.read_text())
    assert found, "docs/deploy.md no longer states the container disk"
    return f"{found[1]}GB"


def example_command() -> list[str]:
    found = re.search(r"`(python -m fluxbooth plan [^`]+)`", DEPLOY_PAGE.read_text())
    assert found, "docs/deploy.md no longer shows a plan command"
    return shlex.split(found[1])


def shown_output() -> list[str]:
    """The lines of the text block that follows the plan command."""
    text = DEPLOY_PAGE.read_text()
    block = re.search(r"```text\n(.*?)```", text[text.index("python -m fluxbooth plan") :], re.S)
    assert block, "docs/deploy.md shows no output for its plan command"
    return [line.strip() for line in block[1].splitlines() if line.strip()]


def readme_request() -> str:
    found = re.search(r"```json\n(\{\"model_name\".*?\})\n```", (REPO_ROOT / "README.md").read_text())
    assert found, "the README's request.json is not found"
    return found[1]


def test_the_example_plans_with_the_disk_the_page_advises() -> None:
    command = example_command()
    assert command[command.index("--disk") + 1] == advised_disk()


def test_the_example_output_is_what_the_command_prints_for_the_readmes_request(tmp_path: Path) -> None:
    (tmp_path / "request.json").write_text(readme_request())
    command = example_command()
    arguments = [str(tmp_path / "request.json") if word == "request.json" else word for word in command[3:]]
    out = io.StringIO()

    assert main(arguments, environ={}, out=out) == 0
    printed = {re.sub(r"\s+", " ", line.strip()) for line in out.getvalue().splitlines()}
    missing = [line for line in shown_output() if re.sub(r"\s+", " ", line) not in printed]
    assert missing == []
