"""Dependencies point one way: server -> foundationpose -> deploy_core."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_top_modules(package: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_deploy_core_never_imports_the_algorithm_or_server() -> None:
    imported = _imported_top_modules("deploy_core")
    assert "foundationpose" not in imported
    assert "server" not in imported
    assert "engines" not in imported


def test_foundationpose_never_imports_the_server() -> None:
    assert "server" not in _imported_top_modules("foundationpose")
