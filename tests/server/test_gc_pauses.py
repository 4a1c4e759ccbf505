"""``server.gc_pauses``: start-up's objects frozen out of Python's full collections, and every collection timed."""

from __future__ import annotations

import gc
import re
import threading

import pytest
from fastapi.testclient import TestClient

from server import create_app
from server.gc_pauses import GcPauses, freeze_startup_objects
from tests.server._helpers import READY_TIMEOUT_S, tiny_config, write_objects_dir


@pytest.fixture
def unfrozen():
    """gc.freeze is process-wide: whatever a test froze goes back to the collector afterwards."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def _in_generation_2(objects: list) -> int:
    """How many of ``objects`` the collector's oldest generation holds (what a full collection walks)."""
    ids = {id(o) for o in objects}
    return sum(id(o) in ids for o in gc.get_objects(generation=2))


def test_frozen_objects_leave_the_generation_full_collections_walk(unfrozen):
    keep = [{"n": i, "self": None} for i in range(50_000)]  # long-lived tracked objects, as a server's
    for d in keep:
        d["self"] = d  # each a cycle: only the cyclic collector could ever free them
    gc.collect()
    assert _in_generation_2(keep) == len(keep)  # walked by every full collection until frozen
    frozen, collect_ms = freeze_startup_objects()
    # (other threads of this process may free frozen objects meanwhile: the count only falls below ``frozen``)
    assert frozen >= len(keep) and len(keep) <= gc.get_freeze_count() <= frozen and collect_ms > 0
    gc.collect()
    assert _in_generation_2(keep) == 0  # in the permanent generation now: no collection walks them
    garbage = [{}]
    garbage[0]["me"] = garbage  # garbage made after the freeze is still collected
    del garbage
    assert gc.collect() >= 1


def test_collections_are_timed_by_generation_while_installed():
    pauses = GcPauses()
    pauses.install()
    try:
        before = [pauses.count(g) for g in (0, 1, 2)]
        gc.collect(0)
        gc.collect(2)
        assert pauses.count(0) >= before[0] + 1 and pauses.count(2) >= before[2] + 1
    finally:
        pauses.uninstall()
    counted = pauses.count(2)
    gc.collect(2)
    assert pauses.count(2) == counted  # uninstalled: no longer counted
    text = "\n".join(f"{f.name}{s[0]} {dict(s[1])} {s[2]}" for f in pauses.families() for s in f.samples)
    assert re.search(r"fp_gc_pause_seconds_count \{'generation': '2'\} [1-9]", text)
    assert re.search(r"fp_gc_pause_max_seconds \{'generation': '2'\} 0\.\d+", text)
    assert "fp_gc_frozen_objects {} " in text


@pytest.fixture
def collect_at_every_allocation():
    """A collection at (nearly) every allocation of a tracked object, as when one lands inside a reader."""
    saved = gc.get_threshold()
    gc.set_threshold(1)
    yield
    gc.set_threshold(*saved)


def test_a_collection_inside_a_reader_is_counted_instead_of_deadlocking(collect_at_every_allocation):
    """The callback runs at any allocation, also inside ``families()`` while it holds the lock (a ``/metrics``
    scrape): it must not wait for that lock. Before the fix this thread hung for good, and with it the event loop
    of the server scraped (CI saw a whole stream and a Ray Serve replica stop)."""
    pauses = GcPauses()
    pauses.install()
    scrapes: list[int] = []
    scraper = threading.Thread(
        target=lambda: scrapes.extend(len(pauses.families()) for _ in range(200)), daemon=True)
    try:
        scraper.start()
        scraper.join(timeout=30.0)
    finally:
        pauses.uninstall()
    assert not scraper.is_alive(), "a collection inside families() deadlocked on its own lock"
    assert scrapes == [3] * 200
    # the collections that ran inside a scrape were counted, not lost
    assert pauses.count(0) + pauses.count(1) + pauses.count(2) >= 200


def test_the_server_freezes_once_ready_and_reports_its_collections(tiny_estimator, tmp_path, unfrozen):
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False)
    app = create_app(config, estimator=tiny_estimator, owns_process=True)  # as python -m server runs it
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S)
        assert gc.get_freeze_count() > 1000  # the networks, the objects, the app
        gc.collect(2)
        metrics = client.get("/metrics").text
    frozen = float(re.search(r"^fp_gc_frozen_objects (\S+)$", metrics, re.MULTILINE).group(1))
    assert frozen > 1000  # (frozen objects that the stopped app dropped since have left the count)
    assert re.search(r'^fp_gc_pause_seconds_count\{generation="2"\} [1-9]', metrics, re.MULTILINE)
    assert re.search(r'^fp_gc_pause_seconds_bucket\{generation="0",le="\+Inf"\} [1-9]', metrics, re.MULTILINE)


def test_an_embedded_app_leaves_the_processs_collector_alone(tiny_estimator, tmp_path, unfrozen):
    """gc.freeze is process-wide: only an app that owns its process (python -m server, a Serve replica) freezes."""
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False), estimator=tiny_estimator)
    with TestClient(app):
        assert app.state.fp.wait_ready(READY_TIMEOUT_S)
        assert gc.get_freeze_count() == 0
