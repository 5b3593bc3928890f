"""The user documentation stays true to the code: docs/request.md is what the request model generates, the
README stays short, and every relative link in the README and docs/ leads somewhere."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from fluxbooth.request.model import TrainingRequest
from fluxbooth.request.reference import fields_without_a_description, render_request_page
from tests.conftest import REPO_ROOT

README_MAX_LINES = 250
# [text](target) outside code; images too. Absolute URLs and mail links are not checked here.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def markdown_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in MARKDOWN_LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def test_docs_request_md_is_what_the_request_model_generates() -> None:
    assert (REPO_ROOT / "docs" / "request.md").read_text() == render_request_page(), (
        "docs/request.md differs from the request model: run `python -m fluxbooth.request.reference --write`"
    )


def test_every_request_field_has_a_description() -> None:
    assert fields_without_a_description() == [], "give these fields a description in fluxbooth/request/fields.py"


def test_the_request_page_lists_every_field_once() -> None:
    page = (REPO_ROOT / "docs" / "request.md").read_text()
    assert [name for name in TrainingRequest.model_fields if page.count(f"| `{name}` |") != 1] == []


def test_the_demo_is_a_lora_with_a_trigger_word_and_nothing_to_warn_about() -> None:
    demo = TrainingRequest.model_validate(json.loads((REPO_ROOT / "test_input.json").read_text())["input"])
    assert (demo.training_type, demo.trigger_word, demo.warnings()) == ("lora", "sks", [])


def test_the_readme_is_at_most_250_lines() -> None:
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO_ROOT)}: links that lead nowhere"


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [here](#title) `[not a link](nowhere.md)`\n")
    assert relative_links(page) == ["missing.md", "#title"]
    assert heading_anchors(page) == {"title"}
