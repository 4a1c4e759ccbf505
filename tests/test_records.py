"""Figures are measured, not remembered: every committed record is whole, every figure that README.md and docs/ show
is a citation of a record that holds it, measured under the defaults the code has now (or marked as older), and no
performance figure stands in those documents without its record (``tools/records.py`` says how a citation looks).

The dated findings of docs/benchmarks.md (its section "What was tried, what won") are A/B results measured before
records existed; that section says so and is not scanned for uncited figures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import records

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FINDINGS_HEADING = "## What was tried, what won"
# a performance figure: a number with a unit of time, rate or memory (a line's budgets, limits and defaults excepted)
PERF_FIGURE = re.compile(r"\d[\d,.]*\s?(?:ms|µs|frames/s|tracks/s|registers/s|requests/s|TFLOP/s|GiB)\b(?!=)"
                         r"|\d[\d,.]*\s?mm (?:mean )?ADD|\d[\d.]*\s?% (?:register )?success")
NOT_A_MEASUREMENT = re.compile(r"budget|target|limit|at most|at least|up to|default|timeout|goal|<=|>=|≤|≥|"
                               r"reserved|interval|every \d", re.IGNORECASE)
# what is not a figure: citations, inline code, and the load a figure was measured under ("+ 5 registers/s")
NOT_FIGURES = [records.CITATION, re.compile(r"`[^`]*`"), re.compile(r"(?:\+|offering|with)\s?\d+ registers/s")]


def _figures_part(line: str) -> str:
    for pattern in NOT_FIGURES:
        line = pattern.sub("", line)
    return line


def _scanned_lines(doc: Path) -> list[tuple[int, str]]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    if doc.name == "benchmarks.md" and FINDINGS_HEADING in lines:
        lines = lines[:lines.index(FINDINGS_HEADING)]
    out, fenced = [], False
    for number, line in enumerate(lines, start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def test_records_exist_and_each_is_whole() -> None:
    found = list(records.records())
    assert found, f"no record under {records.RECORDS_DIR}"
    for record in found:
        summary = records.check_record(record)
        assert summary["record"] == record.name
        for part, body in summary["parts"].items():
            assert part in records.PART_DEFAULTS and body["defaults_fingerprint"], (record, part)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_cited_figure_is_what_its_record_holds_under_todays_defaults(doc: Path) -> None:
    fingerprints = {part: records.defaults_fingerprint(groups) for part, groups in records.PART_DEFAULTS.items()}
    for c in records.citations(doc):
        where = f"{doc.name}:{c.line} [{c.text}]"
        assert c.file.is_file(), f"{where}: cites {c.file}, which does not exist"
        summary = records.load_summary(c.record)
        value = records.value_at(records.load_json(c.file), c.key_path, where=f"{where} in {c.file.name}")
        assert records.shows(c.text, value), f"{where}: the record holds {value!r} at {c.key_path!r}"
        part = records.part_of(summary, c.file.name)
        assert part is not None, f"{where}: no part of {c.record.name}/summary.json lists {c.file.name}"
        if not c.older:
            assert summary["parts"][part]["defaults_fingerprint"] == fingerprints[part], (
                f"{where}: {c.record.name} measured part {part!r} under other defaults than the code's now: "
                f"measure again (python tools/gpu_run.py record --part {part}) or mark the figure as older "
                f"(title \"older: {c.key_path}\")")


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_no_performance_figure_without_its_record(doc: Path) -> None:
    uncited = [f"{doc.name}:{number}: {line.strip()[:120]}" for number, line in _scanned_lines(doc)
               if PERF_FIGURE.search(_figures_part(line)) and not NOT_A_MEASUREMENT.search(_figures_part(line))]
    assert not uncited, "figures without a record citation:\n" + "\n".join(uncited)


def test_the_readme_figures_table_cites_a_record_on_every_row() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not set(line) <= set("|- :")][1:]
    assert rows
    for row in rows:
        assert records.CITATION.search(row), f"README figures row without a record: {row}"


# -- the checks themselves ------------------------------------------------------------------------------------------


def _tiny_record(tmp_path: Path) -> Path:
    record = tmp_path / "2026-01-01-test-gpu"
    record.mkdir(parents=True)
    summary = {"record": record.name, "created": "2026-01-01T00:00:00Z", "commit": "abc",
               "machine": {"gpu": "Test GPU", "driver": "1.0"},
               "versions": {"python": "3.12", "torch": "2.11", "triton": "3.6", "numpy": "2.5"},
               "defaults_fingerprint": "0" * 12,
               "parts": {"checks": {"defaults_fingerprint": "0" * 12,
                                    "commands": [{"name": "bench", "rc": 0, "file": "bench.json"}]}}}
    (record / "summary.json").write_text(json.dumps(summary))
    (record / "bench.json").write_text(json.dumps({"headline": {"track_p50_ms": 2.059}}))
    return record


def test_a_truncated_report_or_a_missing_field_fails_naming_the_file(tmp_path: Path) -> None:
    record = _tiny_record(tmp_path)
    assert records.check_record(record)["record"] == record.name
    (record / "bench.json").write_text('{"headline": {"track_p50_ms": 2.0')
    with pytest.raises(records.RecordError, match=r"bench\.json: not whole JSON"):
        records.check_record(record)
    record = _tiny_record(tmp_path / "b")
    summary = json.loads((record / "summary.json").read_text())
    del summary["versions"]["triton"]
    (record / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(records.RecordError, match=r"summary\.json: missing field versions\.triton"):
        records.check_record(record)
    (record / "summary.json").write_text(json.dumps({**summary, "versions": {}, "commit": ""}))
    with pytest.raises(records.RecordError, match=r"summary\.json: missing field 'commit'"):
        records.check_record(record)


def test_a_listed_report_that_is_missing_fails(tmp_path: Path) -> None:
    record = _tiny_record(tmp_path)
    (record / "bench.json").unlink()
    with pytest.raises(records.RecordError, match=r"lists bench\.json, which is missing"):
        records.check_record(record)


def test_a_citation_is_read_with_its_key_and_shown_value(tmp_path: Path) -> None:
    record = _tiny_record(tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(f'| track | [2.06 ms]({record.name}/bench.json "headline.track_p50_ms") |\n'
                   f'old: [2.1 ms]({record.name}/bench.json "older: headline.track_p50_ms")\n'
                   "no record here: [text](other.md)\n".replace(record.name, f"benchmarks/records/{record.name}"))
    (tmp_path / "benchmarks" / "records").mkdir(parents=True)
    record.rename(tmp_path / "benchmarks" / "records" / record.name)
    found = list(records.citations(doc))
    assert [(c.line, c.text, c.key_path, c.older) for c in found] == [
        (1, "2.06 ms", "headline.track_p50_ms", False), (2, "2.1 ms", "headline.track_p50_ms", True)]
    value = records.value_at(records.load_json(found[0].file), found[0].key_path)
    assert records.shows(found[0].text, value) and records.shows(found[1].text, value)
    assert not records.shows("2.07 ms", value) and not records.shows("2 ms", 2.6)
    with pytest.raises(records.RecordError, match=r"no value at 'headline.track_p90_ms'"):
        records.value_at(records.load_json(found[0].file), "headline.track_p90_ms")


@pytest.mark.parametrize(("text", "value", "shown"), [
    ("3,016 frames/s", 3015.9, True), ("3,015 frames/s", 3015.9, False), ("100%", 1.0, True),
    ("97%", 0.966, True), ("0 failed", 0, True), ("1 failed", 0, False), ("96.6 ms", 96.603, True),
    ("p99 22.8 ms", 22.787, True), ("22.7 ms", 22.787, False), ("1.94 mm", 0.0019409, True),
    ("1.9 mm", 0.0019409, True), ("2.94 mm", 0.0019409, False),
])
def test_a_figure_shows_its_value_as_rounded_in_the_text(text: str, value: float, shown: bool) -> None:
    assert records.shows(text, value) is shown


def test_changing_a_default_changes_the_fingerprint_of_the_parts_that_depend_on_it() -> None:
    values = records.defaults()
    speed = records.PART_DEFAULTS["checks"]
    base = records.defaults_fingerprint(speed, values)
    changed = json.loads(json.dumps(values))
    changed["estimator"]["register_iterations"] += 1
    assert records.defaults_fingerprint(speed, changed) != base
    evaluation_only = json.loads(json.dumps(values))
    evaluation_only["evaluate_scenarios"]["frames"] = -1
    assert records.defaults_fingerprint(speed, evaluation_only) == base
    assert records.defaults_fingerprint(None, evaluation_only) != records.defaults_fingerprint(None, values)
