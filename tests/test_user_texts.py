"""Texts users read (--help) cite no "spec" section: users do not have it. Spec citations belong in comments
and docstrings only (issue 12, item 18; the OpenAPI page is checked in tests/server/test_api_ops.py)."""

from __future__ import annotations

import importlib
import re

import pytest

SPEC = re.compile(r"\bspec\b|§", re.IGNORECASE)
# modules whose docstring's first paragraph (or first line) is their --help description
DESCRIBED_BY_DOCSTRING = ["engines.export", "engines.build", "engines.bench", "foundationpose.bench.e2e",
                          "foundationpose.bench.filters", "foundationpose.bench.render_parity"]


@pytest.mark.parametrize("module", DESCRIBED_BY_DOCSTRING)
def test_cli_descriptions_cite_no_spec(module):
    doc = importlib.import_module(module).__doc__
    assert not SPEC.search(doc.split("\n\n")[0]), doc.split("\n\n")[0]


def test_server_and_demo_help_cite_no_spec():
    from foundationpose.demo.cli import build_parser as demo_parser
    from server.cli import build_parser as server_parser

    for parser in (server_parser({}), demo_parser()):
        text = parser.format_help()
        assert not SPEC.search(text), SPEC.search(text)

