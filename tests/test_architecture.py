"""The house rules of `src/fluxbooth` that keep it readable: which package may import which, and sizes.

docs/architecture.md states these rules for people; these tests keep them true.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.support.import_graph import import_graph

ARCHITECTURE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
MAY_IMPORT_HEADING = "## What each package may import"

MAX_MODULE_LINES = 500
MAX_JOB_MODULE_LINES = 300
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400
# The worker's side of the house, which the trainer process must never load (it carries the pydantic request,
# the planner and the job's stages).
WORKER_ONLY = ("fluxbooth.plan", "fluxbooth.request", "fluxbooth.job")
PLANNER = ("fluxbooth.plan", "fluxbooth.sizing")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_import_graph_of_src_has_no_cycle(graph) -> None:
    assert graph.cycles() == []


def wing_of(module: str) -> str:
    """`fluxbooth.job.run` → "job"; a shared module at the top (`fluxbooth.errors`) is its own wing."""
    return module.split(".")[1] if "." in module else module


def may_import_table() -> dict[str, set[str]]:
    """docs/architecture.md's table: each wing (package or shared module) and the wings it may import."""
    section = ARCHITECTURE_PAGE.read_text(encoding="utf-8").split(MAY_IMPORT_HEADING, 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        allowed = set(re.findall(r"`(\w+)/?`", cells[-1]))
        for wing in re.findall(r"`(\w+)/?`", cells[0]):
            table[wing] = allowed
    return table


def test_the_architecture_page_lists_every_wing(graph) -> None:
    wings = {wing_of(module) for module in graph.files if module != "fluxbooth"}
    assert sorted(wings - may_import_table().keys()) == []


def test_every_import_between_wings_is_one_the_architecture_page_allows(graph) -> None:
    table = may_import_table()
    forbidden = sorted(
        f"{module} -> {target}"
        for module, targets in graph.edges.items()
        for target in targets
        if wing_of(module) != wing_of(target) and wing_of(target) not in table.get(wing_of(module), set())
    )
    assert forbidden == []


def test_the_graph_reads_function_level_imports_too(graph) -> None:
    # train/main.py defers the trainer's stages until the config is read: those imports are edges as well.
    assert "fluxbooth.train.loop" in graph.edges["fluxbooth.train.main"]


def test_the_contract_imports_nothing_of_fluxbooth_outside_itself(graph) -> None:
    outside = {
        module: sorted(target for target in targets if not target.startswith("fluxbooth.contract"))
        for module, targets in graph.edges.items()
        if module.startswith("fluxbooth.contract")
    }
    assert {module: targets for module, targets in outside.items() if targets} == {}


def test_the_contract_imports_only_the_standard_library(graph) -> None:
    third_party = {
        module: sorted(name for name in names if name not in sys.stdlib_module_names and name != "__future__")
        for module, names in graph.external.items()
        if module.startswith("fluxbooth.contract")
    }
    assert {module: names for module, names in third_party.items() if names} == {}


def test_no_module_outside_the_trainer_imports_it(graph) -> None:
    assert graph.importers_of("fluxbooth.train") == {}


def test_the_trainer_imports_neither_the_planner_nor_the_request_nor_the_job(graph) -> None:
    trainer = {module: targets for module, targets in graph.edges.items() if module.startswith("fluxbooth.train")}
    reached = {
        module: sorted(target for target in targets if target.startswith(WORKER_ONLY))
        for module, targets in trainer.items()
    }
    assert {module: targets for module, targets in reached.items() if targets} == {}


def test_the_worker_reaches_the_scoring_package_only_through_the_contracts_interface(graph) -> None:
    # Scoring loads dlib, torch and transformers in a process of its own; only `score`, the CLI command that runs
    # it in the user's process (deferred to its call), imports the package itself. Everyone else, the scoring
    # stage first, reads the interface in the contract.
    importers = graph.importers_of("fluxbooth.likeness")
    assert {module: sorted(targets) for module, targets in importers.items() if module != "fluxbooth.cli.score"} == {}
    assert "fluxbooth.contract.scoring" in graph.edges["fluxbooth.job.scoring_stage"]


def test_the_scoring_interface_imports_only_the_standard_library(graph) -> None:
    names = graph.external.get("fluxbooth.contract.scoring", set())
    assert sorted(name for name in names if name not in sys.stdlib_module_names and name != "__future__") == []
    assert graph.edges.get("fluxbooth.contract.scoring", frozenset()) <= {"fluxbooth.contract"}


def test_the_scoring_package_never_imports_the_trainer_or_the_job(graph) -> None:
    scoring = {module: targets for module, targets in graph.edges.items() if module.startswith("fluxbooth.likeness")}
    reached = {
        module: sorted(target for target in targets if target.startswith((*WORKER_ONLY, "fluxbooth.train")))
        for module, targets in scoring.items()
    }
    assert {module: targets for module, targets in reached.items() if targets} == {}


def reached_from(graph, prefixes: tuple[str, ...]) -> set[str]:
    """Every module the modules under `prefixes` import, directly or through others (themselves included)."""
    reached: set[str] = set()
    waiting = [module for module in graph.edges if module.startswith(prefixes)]
    while waiting:
        module = waiting.pop()
        if module not in reached:
            reached.add(module)
            waiting.extend(graph.edges.get(module, ()))
    return reached


def test_the_planner_reaches_neither_the_report_nor_the_scoring_package_nor_pillow(graph) -> None:
    # The planner times the scoring and the report from the budgets in contract/budgets.py, not from the stages.
    reached = reached_from(graph, PLANNER)
    assert sorted(module for module in reached if module.startswith(("fluxbooth.report", "fluxbooth.likeness"))) == []
    assert sorted(module for module in reached if "PIL" in graph.external.get(module, ())) == []


def test_only_the_trainers_launch_and_the_model_processes_use_the_supervisor(graph) -> None:
    # model_process runs the captioner and the scorer; trainer_failures reads the outcome the supervisor returns; the
    # supervisor itself knows none of the children it runs.
    assert set(graph.importers_of("fluxbooth.job.supervisor")) == {
        "fluxbooth.job.launch",
        "fluxbooth.job.model_process",
        "fluxbooth.job.trainer_failures",
    }
    assert sorted(target for target in graph.edges["fluxbooth.job.supervisor"] if target.startswith(WORKER_ONLY)) == []


def test_no_module_in_src_is_over_500_lines(graph) -> None:
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in graph.files.items()}
    assert {module: lines for module, lines in lengths.items() if lines > MAX_MODULE_LINES} == {}


def test_the_job_module_is_under_300_lines(graph) -> None:
    assert len(graph.files["fluxbooth.job.run"].read_text(encoding="utf-8").splitlines()) < MAX_JOB_MODULE_LINES


def test_no_function_is_over_80_lines_and_no_class_over_400(graph) -> None:
    too_long = []
    for module, path in graph.files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{module}.{node.name}: {lines} lines")
            elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"{module}.{node.name}: {lines} lines")
    assert too_long == []


def test_every_function_in_src_is_annotated(graph) -> None:
    unannotated = []
    for module, path in graph.files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is None:
                if node.name != "__init__":
                    unannotated.append(f"{module}.{node.name}")
    assert unannotated == []


TESTS_ROOT = Path(__file__).resolve().parent


def _test_modules_named(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The `tests....test_*` modules that the imports in `tree` (module `module`) name, itself left out."""
    here = module if is_package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            base = ".".join(anchor + ([node.module] if node.module else []))
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    found = set()
    for name in names:
        parts = name.split(".")
        first_test = next((index for index, part in enumerate(parts) if part.startswith("test_")), None)
        if parts[0] == "tests" and first_test is not None:
            found.add(".".join(parts[: first_test + 1]))
    return found - {module}


def test_the_test_import_reader_sees_every_form_of_import() -> None:
    source = (
        "import tests.a.test_b\nfrom tests.c import test_d\nfrom tests.e.test_f import helper\nfrom .test_g import x"
    )
    assert _test_modules_named(ast.parse(source), "tests.h.test_h", is_package=False) == {
        "tests.a.test_b",
        "tests.c.test_d",
        "tests.e.test_f",
        "tests.h.test_g",
    }


def test_no_module_under_tests_imports_a_test_module() -> None:
    # Shared helpers, constants and fixtures live in tests/support/ (fixtures registered in tests/conftest.py's
    # pytest_plugins), so no test module is another's library: a fixture imported by name is redefined where it is
    # used (ruff F811), and renaming or moving a test file breaks no other.
    importers = {}
    for path in sorted(TESTS_ROOT.rglob("*.py")):
        parts = ["tests", *path.relative_to(TESTS_ROOT).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        imported = _test_modules_named(ast.parse(path.read_text(encoding="utf-8")), module, is_package)
        if imported:
            importers[module] = sorted(imported)
    assert importers == {}
