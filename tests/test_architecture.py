"""The house rules of `src/fluxbooth` that keep it readable: which package may import which, and sizes.

docs/architecture.md states these rules for people; these tests keep them true.
"""

from __future__ import annotations

import ast
import sys

import pytest

from tests.import_graph import import_graph

MAX_MODULE_LINES = 600
MAX_JOB_MODULE_LINES = 300
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 400
# The worker's side of the house, which the trainer process must never load (it carries the pydantic request,
# the planner and the job's stages).
WORKER_ONLY = ("fluxbooth.plan", "fluxbooth.request", "fluxbooth.job")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_import_graph_of_src_has_no_cycle(graph) -> None:
    assert graph.cycles() == []


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


def test_the_worker_reaches_the_scoring_package_only_through_its_interface(graph) -> None:
    # Scoring loads dlib, torch and transformers in a process of its own; only `score`, the CLI command that runs
    # it in the user's process (deferred to its call), imports the rest.
    beyond_interface = {
        module: sorted(target for target in targets if target not in ("fluxbooth.likeness", "fluxbooth.likeness.interface"))
        for module, targets in graph.importers_of("fluxbooth.likeness").items()
        if module != "fluxbooth.cli.score"
    }
    assert {module: targets for module, targets in beyond_interface.items() if targets} == {}


def test_the_scoring_interface_imports_only_the_standard_library(graph) -> None:
    names = graph.external.get("fluxbooth.likeness.interface", set())
    assert sorted(name for name in names if name not in sys.stdlib_module_names and name != "__future__") == []
    assert graph.edges.get("fluxbooth.likeness.interface", frozenset()) <= {"fluxbooth.likeness"}


def test_the_scoring_package_never_imports_the_trainer_or_the_job(graph) -> None:
    scoring = {module: targets for module, targets in graph.edges.items() if module.startswith("fluxbooth.likeness")}
    reached = {module: sorted(target for target in targets if target.startswith((*WORKER_ONLY, "fluxbooth.train")))
               for module, targets in scoring.items()}
    assert {module: targets for module, targets in reached.items() if targets} == {}


def test_no_module_in_src_is_over_600_lines(graph) -> None:
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in graph.files.items()}
    assert {module: lines for module, lines in lengths.items() if lines > MAX_MODULE_LINES} == {}


def test_the_job_module_is_under_300_lines(graph) -> None:
    assert len(graph.files["fluxbooth.job"].read_text(encoding="utf-8").splitlines()) < MAX_JOB_MODULE_LINES


def test_no_function_is_over_100_lines_and_no_class_over_400(graph) -> None:
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
