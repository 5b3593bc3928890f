"""docs/errors.md is what the error codes generate: every code has its meaning, who fixes it, its
`refresh_worker` and its `details` keys, and every `details` key the code raises is on the page."""

from __future__ import annotations

import ast
from pathlib import Path

from fluxbooth.errors import ErrorCode
from fluxbooth.errors_reference import CODE_DOCS, render_errors_page, undocumented_codes
from tests.conftest import REPO_ROOT


def test_docs_errors_md_is_what_the_error_codes_generate() -> None:
    assert (REPO_ROOT / "docs" / "errors.md").read_text() == render_errors_page(), (
        "docs/errors.md differs from the error codes: run `python -m fluxbooth.errors_reference --write`"
    )


def test_every_error_code_has_an_entry() -> None:
    assert undocumented_codes() == [], "add an entry for these codes in fluxbooth/errors_reference.py"


def raised_details_keys(source: Path) -> set[tuple[str, str]]:
    """(code, key) for each `FluxboothError(ErrorCode.X, ..., details={"key": ...})` written in the source."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FluxboothError" and node.args):
            continue
        code = node.args[0]
        if not (isinstance(code, ast.Attribute) and getattr(code.value, "id", None) == "ErrorCode"):
            continue
        for keyword in node.keywords:
            if keyword.arg == "details" and isinstance(keyword.value, ast.Dict):
                found |= {(ErrorCode[code.attr].value, key.value) for key in keyword.value.keys
                          if isinstance(key, ast.Constant)}
    return found


def test_every_details_key_the_code_raises_is_documented_for_its_code() -> None:
    raised = set().union(*(raised_details_keys(path) for path in (REPO_ROOT / "src" / "fluxbooth").rglob("*.py")))
    documented = {(code.value, key) for code, doc in CODE_DOCS.items() for key in doc.details}

    assert raised, "the scan found no details at all"
    assert sorted(raised - documented) == []


def test_the_scan_sees_a_details_key(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text('FluxboothError(ErrorCode.TIMEOUT, "late", details={"stage": "fetch"})\n')
    assert raised_details_keys(source) == {("timeout", "stage")}
