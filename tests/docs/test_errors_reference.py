"""docs/errors.md is what the error codes generate: every code has its meaning, who fixes it, its
`refresh_worker` and its `details` keys, and every `details` key the code raises is on the page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fluxbooth.contract.names import ERROR_CODES as TRAINER_CODES
from fluxbooth.errors import ErrorCode
from fluxbooth.errors_reference import CODE_DOCS, render_errors_page, undocumented_codes
from tests.conftest import REPO_ROOT


def test_docs_errors_md_is_what_the_error_codes_generate() -> None:
    assert (REPO_ROOT / "docs" / "errors.md").read_text() == render_errors_page(), (
        "docs/errors.md differs from the error codes: run `python -m fluxbooth.errors_reference --write`"
    )


def test_every_error_code_has_an_entry() -> None:
    assert undocumented_codes() == [], "add an entry for these codes in fluxbooth/errors_reference.py"


def _error_code(node: ast.AST) -> str | None:
    """`X` of a `FluxboothError(ErrorCode.X, ...)` call, else None."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FluxboothError" and node.args):
        return None
    code = node.args[0]
    if not (isinstance(code, ast.Attribute) and getattr(code.value, "id", None) == "ErrorCode"):
        return None
    return ErrorCode[code.attr].value


def _keys_built_by_name(function: ast.AST) -> dict[str, set[str]]:
    """The keys a function puts in each dict variable: `name = {"key": ...}` and `name["key"] = ...`."""
    keys: dict[str, set[str]] = {}
    for node in ast.walk(function):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            keys.setdefault(target.id, set()).update(k.value for k in value.keys if isinstance(k, ast.Constant))
        if (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and isinstance(target.slice, ast.Constant)
        ):
            keys.setdefault(target.value.id, set()).add(target.slice.value)
    return keys


def raised_details_keys(source: Path) -> set[tuple[str, str]]:
    """(code, key) for each `FluxboothError(ErrorCode.X, ..., details=...)` written in the source: a dict written
    in the call, or a variable whose keys the same function sets (`details = {...}`, `details["key"] = ...`)."""
    found = set()
    tree = ast.parse(source.read_text())
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    for scope in scopes:
        built = _keys_built_by_name(scope)
        for node in ast.walk(scope):
            code = _error_code(node)
            for keyword in node.keywords if code else ():
                if keyword.arg != "details":
                    continue
                if isinstance(keyword.value, ast.Dict):
                    found |= {(code, key.value) for key in keyword.value.keys if isinstance(key, ast.Constant)}
                elif isinstance(keyword.value, ast.Name):
                    found |= {(code, key) for key in built.get(keyword.value.id, ())}
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


def test_the_scan_sees_the_keys_of_a_details_variable(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "def fail(event):\n"
        '    details = {"exit_status": 1}\n'
        '    details["trainer_code"] = event\n'
        "    return FluxboothError(ErrorCode.TRAINER_FAILED, 'stopped', details=details)\n"
    )
    assert raised_details_keys(source) == {("trainer_failed", "exit_status"), ("trainer_failed", "trainer_code")}


def user_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", user_pages(), ids=lambda page: page.name)
def test_a_trainer_code_that_is_no_error_code_is_named_only_as_the_trainers_code(page: Path) -> None:
    """`missing_libaio`, `resume_failed`, ...: the caller sees `trainer_failed`, with the trainer's code as
    `details.trainer_code`, so a sentence naming one says so."""
    trainer_only = [code for code in TRAINER_CODES if code not in {error.value for error in ErrorCode}]
    sentences = re.split(r"(?<=[.;])\s", re.sub(r"\s*\n\s*", " ", page.read_text()))
    wrong = [
        sentence
        for sentence in sentences
        if any(f"`{code}`" in sentence for code in trainer_only)
        and not ("trainer_code" in sentence or "`trainer_failed`" in sentence)
    ]
    assert wrong == []
