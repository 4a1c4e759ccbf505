"""Dependencies point one way: server -> foundationpose -> deploy_core."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_top_modules_of(path: Path) -> set[str]:
    """Top-level modules imported anywhere in ``path`` (lazy imports inside functions included)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _imported_top_modules(package: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        names |= _imported_top_modules_of(path)
    return names


def test_deploy_core_never_imports_the_algorithm_or_server() -> None:
    imported = _imported_top_modules("deploy_core")
    assert "foundationpose" not in imported
    assert "server" not in imported
    assert "engines" not in imported


def test_foundationpose_never_imports_the_server() -> None:
    assert "server" not in _imported_top_modules("foundationpose")


# The applications inside the package (demo, benchmarks, the evaluation command) sit above both and wire the
# engines in.
APPLICATIONS = ("foundationpose/demo", "foundationpose/bench", "foundationpose/evaluate/command_common.py")


def test_the_algorithm_never_imports_engines() -> None:
    """engines imports foundationpose (to export the networks); the reverse would close a cycle. The engine
    files are passed in (``load_networks(..., engine_files=engines.files.engine_files)``)."""
    offenders = []
    for path in (ROOT / "foundationpose").rglob("*.py"):
        if path.relative_to(ROOT).as_posix().startswith(APPLICATIONS):
            continue
        if "engines" in _imported_top_modules_of(path):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == []


def test_an_engine_backend_without_engine_files_is_refused_up_front() -> None:
    import pytest

    from foundationpose.networks import load_networks
    from foundationpose.runtime import RuntimeConfig

    with pytest.raises(ValueError, match=r"^backend 'onnxruntime' needs engine files: pass engine_files="):
        load_networks(RuntimeConfig(backend="onnxruntime"), "cpu")
