"""Library code reads no environment variables: configuration comes in through configs, CLIs read the
environment and build them (style guide, "Configs")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("deploy_core", "foundationpose", "engines")
# Entry points that may read the environment, and the one reason each library exception has.
ALLOWED = {
    "foundationpose/demo/cli.py",  # python -m foundationpose.demo
    "foundationpose/bench/e2e.py",  # python -m foundationpose.bench
    "deploy_core/timing.py",  # configure_timing_log_from_env: a helper the CLIs call, never the library
    "engines/files.py",  # default_engine_root: the XDG base-directory convention for the cache folder
}


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                return True
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ("environ", "getenv", "environb") for alias in node.names):
                return True
    return False


def test_library_modules_read_no_environment_variables() -> None:
    readers = sorted(
        path.relative_to(ROOT).as_posix()
        for package in LIBRARIES
        for path in (ROOT / package).rglob("*.py")
        if _reads_environment(ast.parse(path.read_text(encoding="utf-8")))
    )
    assert [p for p in readers if p not in ALLOWED] == []


def test_the_check_sees_both_spellings() -> None:
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')"))
    assert _reads_environment(ast.parse("from os import getenv"))
    assert not _reads_environment(ast.parse("import os\nx = os.path.join('a')"))
