"""docs/environment.md lists every environment variable the worker's code reads (src/ and handler.py), or the
variable is the platform's (an allow-list below, each with why) or internal (`FLUXBOOTH_INTERNAL_`, set and read
by fluxbooth itself, never by an operator)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO_ROOT

ENVIRONMENT_PAGE = REPO_ROOT / "docs" / "environment.md"
INTERNAL_PREFIX = "FLUXBOOTH_INTERNAL_"
# Read by the code, set by someone else: the page does not own them.
PLATFORM_VARIABLES = {
    # RunPod sets these on its workers: the job queue's result URL (absent in the SDK's local modes), its own key.
    "RUNPOD_WEBHOOK_POST_OUTPUT",
    "RUNPOD_AI_API_KEY",
    # AWS's own credential variables (boto3 reads them): the worker reads them only to redact their values.
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    # DeepSpeed's, which the worker sets for the trainer: the doctor reads back the environment it built.
    "DS_ACCELERATOR",
    # `accelerate launch` sets these in each trainer process.
    "RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ACCELERATE_USE_DEEPSPEED",
    # The operating system's and the CUDA runtime's.
    "HOME",
    "PATH",
    "XDG_CACHE_HOME",
    "CUDA_VISIBLE_DEVICES",
    # Hugging Face's older spellings of HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE, honoured as huggingface_hub does.
    "HUGGINGFACE_HUB_CACHE",
    "HUGGING_FACE_HUB_TOKEN",
    "TRANSFORMERS_OFFLINE",
}
ENVIRONMENT_NAMES = re.compile(r"^(?:[a-z_]+\.)*(?:[a-z_]*environ(?:\(\))?|[a-z_]*env)$")
VARIABLE_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")


def _constants(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level `NAME = "VALUE"` and `NAMES = ("A", "B")`: what a name used as a key may stand for."""
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            strings = (
                {value.value}
                if isinstance(value, ast.Constant) and isinstance(value.value, str)
                else {e.value for e in getattr(value, "elts", []) if isinstance(e, ast.Constant)}
            )
            found |= {target.id: strings for target in targets if isinstance(target, ast.Name) and strings}
    return found


def _project_constants(paths: list[Path]) -> dict[str, set[str]]:
    """Every module's constants, so that an imported one (`from ... import X_ENV`) resolves too."""
    merged: dict[str, set[str]] = {}
    for path in paths:
        for name, values in _constants(ast.parse(path.read_text())).items():
            merged.setdefault(name, set()).update(values)
    return merged


def _loop_values(tree: ast.Module, constants: dict[str, set[str]]) -> dict[str, set[str]]:
    """`for name in NAMES` (a loop or a comprehension): `name` stands for each of NAMES' strings."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.iter, ast.Name):
            if isinstance(node.target, ast.Name) and node.iter.id in constants:
                found.setdefault(node.target.id, set()).update(constants[node.iter.id])
    return found


def _names(key: ast.expr, known: dict[str, set[str]]) -> set[str]:
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return {key.value}
    if isinstance(key, ast.Name):
        return known.get(key.id, set())
    return set()


def _is_environment(node: ast.expr) -> bool:
    return bool(ENVIRONMENT_NAMES.match(ast.unparse(node)))


def _keys_read(node: ast.AST) -> Iterator[ast.expr]:
    """The key of each read: `env.get(KEY)`, `env[KEY]`, `KEY in env`, and the settings' readers, `_int(env, KEY)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        if _is_environment(node.func.value) and node.args:
            yield node.args[0]
    elif isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(node.args[0], ast.Name):
        if _is_environment(node.args[0]):
            yield node.args[1]
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environment(node.value):
        yield node.slice
    elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and _is_environment(node.comparators[0]):
        yield node.left


def variables_read(paths: list[Path], root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Each environment variable the code reads, with the files (relative to `root`) reading it."""
    constants = _project_constants(paths)
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        known = {**constants, **_constants(tree), **_loop_values(tree, constants)}
        for node in ast.walk(tree):
            for key in _keys_read(node):
                for name in _names(key, known):
                    if VARIABLE_NAME.match(name):
                        found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def worker_sources() -> list[Path]:
    return [*sorted((REPO_ROOT / "src" / "fluxbooth").rglob("*.py")), REPO_ROOT / "handler.py"]


def listed_variables() -> set[str]:
    """Every `NAME` in backquotes on the page."""
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", ENVIRONMENT_PAGE.read_text()))


def test_every_variable_the_code_reads_is_on_the_environment_page() -> None:
    read = variables_read(worker_sources())
    unlisted = {
        name: sorted(files)
        for name, files in read.items()
        if name not in listed_variables() and name not in PLATFORM_VARIABLES and not name.startswith(INTERNAL_PREFIX)
    }
    assert unlisted == {}


def test_every_platform_variable_on_the_allow_list_is_still_read() -> None:
    assert sorted(PLATFORM_VARIABLES - set(variables_read(worker_sources()))) == []


def test_the_scan_sees_each_way_of_reading(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "import os\n"
        'NAME_ENV = "FROM_A_CONSTANT"\n'
        'NAMES = ("IN_A_LOOP",)\n'
        "def read(env, settings, process):\n"
        '    os.environ.get("WITH_GET")\n'
        '    env["WITH_A_SUBSCRIPT"]\n'
        '    "WITH_IN" in settings.environ\n'
        '    _int(env, "WITH_A_READER", 2)\n'
        "    process.environ().get(NAME_ENV)\n"
        "    any(env.get(name) for name in NAMES)\n"
        '    other.get("NOT_AN_ENVIRONMENT")\n'
    )
    assert set(variables_read([source], tmp_path)) == {
        "FROM_A_CONSTANT",
        "IN_A_LOOP",
        "WITH_GET",
        "WITH_A_SUBSCRIPT",
        "WITH_IN",
        "WITH_A_READER",
    }
