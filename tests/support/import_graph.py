"""The import graph of `src/fluxbooth`, read from every import statement (function-level ones included).

A module imports another when any `import` or `from ... import` in it names that module, a name inside it,
or a submodule of it. Read from the source with `ast`, so nothing is imported to draw it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "fluxbooth"


@dataclass(frozen=True)
class ImportGraph:
    """Modules of the package (dotted names) and, for each, the package modules it imports."""

    files: dict[str, Path]
    edges: dict[str, frozenset[str]]
    external: dict[str, frozenset[str]]

    def cycles(self) -> list[list[str]]:
        """Every strongly connected set of more than one module, each sorted (Tarjan's algorithm)."""
        return _strongly_connected(self.edges)

    def importers_of(self, prefix: str) -> dict[str, frozenset[str]]:
        """Modules outside `prefix` that import something under it, with what they import."""
        found: dict[str, frozenset[str]] = {}
        for module, targets in self.edges.items():
            if _within(module, prefix):
                continue
            inside = frozenset(target for target in targets if _within(target, prefix))
            if inside:
                found[module] = inside
        return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_files(root: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _owning_module(name: str, files: dict[str, Path]) -> str | None:
    """The longest package module that `name` (a module, or a name inside one) lies in."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: Path = SOURCE_ROOT) -> ImportGraph:
    """The graph of `root`'s package, with the top-level third-party modules each module imports."""
    files = _module_files(root)
    edges: dict[str, frozenset[str]] = {}
    external: dict[str, frozenset[str]] = {}
    for module, path in files.items():
        names = list(_imported_names(ast.parse(path.read_text(encoding="utf-8")), module, path.name == "__init__.py"))
        owners = {_owning_module(name, files) for name in names if _within(name, PACKAGE) or name == PACKAGE}
        edges[module] = frozenset(owner for owner in owners if owner and owner != module and owner != PACKAGE)
        external[module] = frozenset(name.split(".")[0] for name in names if name and not _within(name, PACKAGE))
    return ImportGraph(files=files, edges=edges, external=external)


def _strongly_connected(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found
