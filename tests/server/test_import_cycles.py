"""No import cycles: the repository's import graph, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts, at module level or inside a function (a late import hides a cycle, it does not remove
it); only those under ``if TYPE_CHECKING:`` are left out (they never run). ``from a import b`` is an edge to the
module ``a.b`` when there is one, else to ``a``. A cycle is a strongly connected component of more than one module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deploy_core", "engines", "foundationpose", "server", "tools")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` of the repository's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    def deepest(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                return candidate
            parts.pop()
        return None

    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = deepest(alias.name)
            if target is not None:
                found.add(target)
        return found
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    for alias in node.names:
        target = deepest(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else deepest(base)
        if target is not None:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = set()
        for node in _imports(tree):
            graph[name] |= _targets(name, path, node, modules)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return found


def test_the_checker_finds_a_cycle_and_reads_relative_and_late_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import server.state\n"
                     "def f():\n    from . import errors\n")
    modules = {"server": ROOT / "server/__init__.py", "server.errors": ROOT / "server/errors.py",
               "server.state": ROOT / "server/state.py", "server.app": ROOT / "server/app.py"}
    targets = set().union(*(_targets("server.app", ROOT / "server/app.py", node, modules) for node in _imports(tree)))
    assert targets == {"server.errors"}  # the late relative import counts, the TYPE_CHECKING one does not


@pytest.mark.slow
def test_the_server_has_no_import_cycle():
    graph = import_graph()
    assert "server.state" in graph and graph["server.app"]  # the graph was read
    server_cycles = [c for c in cycles(graph) if any(m == "server" or m.startswith("server.") for m in c)]
    assert server_cycles == []


@pytest.mark.slow
def test_the_repository_has_no_import_cycle():
    assert cycles(import_graph()) == []
