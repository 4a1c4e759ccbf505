"""The committed measurement records (``benchmarks/records/<id>/``) and the fingerprint of the defaults they depend on.

A record is a folder of JSON files written by ``python tools/gpu_run.py record``: one report per command and
``summary.json``, which says where and how they were measured::

    {"record": "<id>", "created": "<UTC time>", "commit": "<sha>", "dirty": false,
     "machine": {"gpu": ..., "driver": ..., "gpus": N, "cpus": N},
     "versions": {"python": ..., "torch": ..., "cuda": ..., "triton": ..., "numpy": ...},
     "defaults_fingerprint": "<12 hex>", "defaults": {...},
     "parts": {"<part>": {"commit", "created", "defaults_fingerprint", "commands": [{"name", "rc", "seconds", "file"}]}}}

The defaults fingerprint is a hash of the defaults the figures depend on (the runtime, algorithm, service, validity,
session and recovery configs, the server's settings, and the defaults of the bench, training and evaluation
commands), so that a figure measured under other defaults is seen to be older. Each part stores the fingerprint of
the defaults its own figures depend on (``PART_DEFAULTS``: speed does not depend on the evaluation's settings). Docs cite a figure as a Markdown link whose
target is a record's file and whose title is the key path of the value, ``[2.06 ms](benchmarks/records/ID/bench.json
"headline.track_p50_ms")``; a title that starts with ``older:`` marks a figure whose record has another fingerprint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS_DIR = ROOT / "benchmarks" / "records"
SUMMARY = "summary.json"
SUMMARY_FIELDS = ("record", "created", "commit", "machine", "versions", "defaults_fingerprint", "parts")
MACHINE_FIELDS = ("gpu", "driver")
VERSION_FIELDS = ("python", "torch", "triton", "numpy")
# settings that say where a process runs or what it is called, not how fast or how well it works
_PLACE_SETTINGS = frozenset({"objects_dir", "host", "port", "api_key", "log_level", "docs", "weights", "out", "mesh",
                             "data", "profile", "compile_cache", "engine_dir"})

# [text](target "title") where target is a record file
CITATION = re.compile(r'\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]*benchmarks/records/[^)\s]+\.json) "(?P<title>[^"]+)"\)')


class RecordError(ValueError):
    """A record file that is missing, truncated or lacks a field; the message names the file."""


# ------------------------------------------------------------------------------------------------- the fingerprint


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _dataclass_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in _PLACE_SETTINGS:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _plain(f.default_factory())
    return out


def _parser_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {a.dest: _plain(a.default) for a in parser._actions  # noqa: SLF001 - argparse keeps them nowhere else
            if a.dest not in _PLACE_SETTINGS and a.dest != "help" and not a.required}


def defaults() -> dict[str, dict[str, Any]]:
    """Every default the recorded figures depend on, by owner (JSON-ready; the same on every machine)."""
    from foundationpose.bench.e2e import _parser as bench_parser
    from foundationpose.estimator import EstimatorConfig
    from foundationpose.evaluate.cli import build_parser as evaluate_parser
    from foundationpose.evaluate.cli import build_scenarios_parser
    from foundationpose.recovery import RecoveryConfig
    from foundationpose.runtime import RuntimeConfig
    from foundationpose.service.config import ServiceConfig
    from foundationpose.session_state import SessionConfig
    from foundationpose.train.cli import build_parser as train_parser
    from foundationpose.train.config import TrainConfig
    from foundationpose.validity import ValidityConfig
    from server.config import ServerConfig

    return {
        "runtime": _dataclass_defaults(RuntimeConfig), "estimator": _dataclass_defaults(EstimatorConfig),
        "service": _dataclass_defaults(ServiceConfig), "validity": _dataclass_defaults(ValidityConfig),
        "session": _dataclass_defaults(SessionConfig), "recovery": _dataclass_defaults(RecoveryConfig),
        "server": _dataclass_defaults(ServerConfig), "bench": _parser_defaults(bench_parser()),
        "train": _parser_defaults(train_parser()), "train_config": _dataclass_defaults(TrainConfig),
        "evaluate": _parser_defaults(evaluate_parser()),
        "evaluate_scenarios": _parser_defaults(build_scenarios_parser()),
    }


# the defaults each part's figures depend on: speed does not depend on how the evaluation or the training is run
_SPEED = ("runtime", "estimator", "service", "validity", "session", "recovery", "server", "bench")
PART_DEFAULTS = {"checks": _SPEED, "edge": _SPEED, "first-requests": _SPEED, "accuracy": None,  # None: all of them
                 "suite-tune": None, "suite-held-out": None, "training": None}


def defaults_fingerprint(groups: tuple[str, ...] | None = None, values: dict[str, dict[str, Any]] | None = None) -> str:
    """12 hex digits of the SHA-256 of :func:`defaults` (only ``groups`` of them, if given) as sorted JSON."""
    values = defaults() if values is None else values
    chosen = values if groups is None else {g: values[g] for g in groups}
    text = json.dumps(chosen, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def part_of(summary: dict[str, Any], file: str) -> str | None:
    """The part of a record that wrote ``file`` (None when no part lists it)."""
    for part, body in summary.get("parts", {}).items():
        if any(c.get("file") == file for c in body.get("commands", [])):
            return part
    return None


# ------------------------------------------------------------------------------------------------- reading records


def load_json(path: Path) -> Any:
    """The JSON of one record file; RecordError naming the file when it is missing or not whole JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecordError(f"{path}: not whole JSON (truncated?): {exc}") from exc


def load_summary(record: Path) -> dict[str, Any]:
    """A record's summary, checked for every field this module's docstring names."""
    path = record / SUMMARY
    summary = load_json(path)
    if not isinstance(summary, dict):
        raise RecordError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    for name in SUMMARY_FIELDS:
        if summary.get(name) in (None, "", {}):
            raise RecordError(f"{path}: missing field {name!r}")
    for group, names in (("machine", MACHINE_FIELDS), ("versions", VERSION_FIELDS)):
        for name in names:
            if not summary[group].get(name):
                raise RecordError(f"{path}: missing field {group}.{name}")
    return summary


def check_record(record: Path) -> dict[str, Any]:
    """Check a whole record folder: the summary's fields, and every JSON file it holds parses (each command the
    summary lists with a file has that file). Returns the summary."""
    summary = load_summary(record)
    for path in sorted(record.glob("*.json")):
        load_json(path)
    for part, body in summary["parts"].items():
        for command in body.get("commands", []):
            if command.get("file") and not (record / command["file"]).is_file():
                raise RecordError(f"{record / SUMMARY}: part {part!r} lists {command['file']}, which is missing")
    return summary


def records() -> Iterator[Path]:
    """The committed record folders, oldest name first."""
    if RECORDS_DIR.is_dir():
        yield from sorted(p for p in RECORDS_DIR.iterdir() if p.is_dir())


def value_at(data: Any, key_path: str, where: str = "") -> Any:
    """The value at a dotted key path (list items by index: ``track.sessions.1.frames_per_s``)."""
    value = data
    for part in key_path.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise RecordError(f"{where}: no value at {key_path!r} (stopped at {part!r})")
    return value


@dataclasses.dataclass(frozen=True)
class Citation:
    """One figure in a document: its text, the record file and the key path it cites, and whether it is marked
    as older (measured under other defaults)."""

    doc: Path
    line: int
    text: str
    file: Path
    key_path: str
    older: bool

    @property
    def record(self) -> Path:
        return self.file.parent


def citations(doc: Path) -> Iterator[Citation]:
    """Every record citation in a Markdown file (outside inline code, where a citation is an example)."""
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        for m in CITATION.finditer(re.sub(r"`[^`]*`", "", line)):
            title = m["title"].strip()
            older = title.startswith("older:")
            key_path = title.removeprefix("older:").strip()
            yield Citation(doc, number, m["text"], (doc.parent / m["target"]).resolve(), key_path, older)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def shows(text: str, value: Any) -> bool:
    """Whether ``text`` shows ``value`` as rounded to the decimals it was written with (``2.06`` shows 2.059;
    ``3,016`` shows 3015.9; ``96%`` shows 0.96 as a share; ``1.94 mm`` shows 0.00194 in metres); a list value must
    show each item."""
    if isinstance(value, list):
        return all(shows(text, v) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value) in text
    for m in _NUMBER.finditer(text):
        written = m.group()
        decimals = len(written.split(".")[1]) if "." in written else 0
        shown = float(written.replace(",", ""))
        unit = text[m.end():].lstrip()
        scaled = (value * 100,) if unit.startswith("%") else (value * 1000,) if unit.startswith("mm") else ()
        for candidate in (*scaled, value):
            if abs(round(candidate, decimals) - shown) <= 10 ** -decimals * 0.5 + 1e-9:
                return True
    return False


# ------------------------------------------------------------------------------------------------- writing records


def junit_report(path: Path) -> dict[str, Any]:
    """A pytest ``--junitxml`` file as JSON: counts, and each failure and skip with its test id and message."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            skips.append({"test": test_id, "reason": (outcome.get("message") or "")[:300]})
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": test_id, "message": (outcome.get("message") or "")[:500]})
    return {**counts, "failures": failures, "skips": skips}


def machine_and_versions() -> tuple[dict[str, Any], dict[str, Any]]:
    """(machine, versions) of this process's host: GPU name, driver, GPU and CPU counts; Python, torch, CUDA,
    cuDNN, Triton and numpy versions."""
    import os
    import platform
    import subprocess

    import numpy
    import torch

    driver = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    cuda = torch.cuda.is_available()
    machine = {"gpu": torch.cuda.get_device_name(0) if cuda else "", "driver": driver,
               "gpus": torch.cuda.device_count() if cuda else 0, "cpus": os.cpu_count()}
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(), "triton": triton_version, "numpy": numpy.__version__}
    return machine, versions


def record_id(gpu: str, day: str) -> str:
    """``<day>-<gpu slug>``: ``2026-12-06-h100-80gb-hbm3`` for "NVIDIA H100 80GB HBM3"."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().removeprefix("nvidia").strip()).strip("-")
    return f"{day}-{slug or 'unknown-gpu'}"


def start_part(record: Path, part: str, commit: str) -> dict[str, Any]:
    """The record's summary with this part begun (machine and versions filled in for a new record; the part's
    defaults fingerprint, of the defaults its figures depend on, see ``PART_DEFAULTS``). Raises RecordError when the
    record was measured on another GPU: such a part belongs in a new record."""
    import time

    machine, versions = machine_and_versions()
    values = defaults()
    if (record / SUMMARY).exists():
        summary = load_json(record / SUMMARY)
        if summary.get("machine", {}).get("gpu") != machine["gpu"]:
            raise RecordError(f"{record / SUMMARY}: measured on {summary['machine'].get('gpu')!r}, this machine has "
                              f"{machine['gpu']!r}: write this part into a new record (--record DIR)")
    else:
        summary = {"record": record.name, "machine": machine, "parts": {}}
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary.update(created=created, commit=commit, versions=versions,
                   defaults_fingerprint=defaults_fingerprint(values=values), defaults=values)
    summary["parts"][part] = {"commit": commit, "created": created,
                              "defaults_fingerprint": defaults_fingerprint(PART_DEFAULTS[part], values),
                              "commands": []}
    return summary


def write_summary(record: Path, summary: dict[str, Any]) -> None:
    record.mkdir(parents=True, exist_ok=True)
    (record / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
