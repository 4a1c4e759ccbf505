"""MicroBatcher: requests merged into batches, each future completed exactly once, in order."""

from __future__ import annotations

import threading
from concurrent.futures import wait

import pytest

from deploy_core.batching import MicroBatcher
from deploy_core.errors import BusyError, ClosedError
from deploy_core.pipeline import BaseAsyncPipeline, Package, Stage


def _square_all(pkg: Package) -> None:
    out = []
    for item in pkg.data:
        if item.data == "bad":
            out.append(ValueError("bad item"))
        else:
            out.append(item.data * item.data)
    pkg.data = out


def test_results_match_requests_and_batches_form() -> None:
    gate = threading.Event()
    entered = threading.Event()

    def gated(pkg: Package) -> None:
        entered.set()
        assert gate.wait(10), "test never opened the gate"

    pipeline = BaseAsyncPipeline([Stage("gate", gated), Stage("square", _square_all)], name="t")
    batcher = MicroBatcher(pipeline, max_batch=8, max_wait_s=0.0, name="t-batcher")
    try:
        first = batcher.submit(1)
        assert entered.wait(10)  # the first batch is parked in the gate: the rest pile up
        rest = [batcher.submit(i) for i in range(2, 20)]
        assert batcher._inbox.wait_until(lambda s: s.size <= 18, timeout=10)
        gate.set()
        futures = [first, *rest]
        wait(futures, timeout=20)
        assert [f.result() for f in futures] == [i * i for i in range(1, 20)]
        assert batcher.items == 19
        assert batcher.batches < 19  # requests were merged
    finally:
        gate.set()
        batcher.close()
        pipeline.close()


def test_idle_dispatch_sends_a_lone_request_at_once_and_batches_under_load() -> None:
    """max_wait_s is an hour: a lone request into an idle pipeline still completes (it never waited); while a
    batch is in flight the next requests wait for company and leave together when the batch is full."""
    gate = threading.Event()
    entered = threading.Event()

    def gated(pkg: Package) -> None:
        entered.set()
        assert gate.wait(10), "test never opened the gate"

    pipeline = BaseAsyncPipeline([Stage("gate", gated), Stage("square", _square_all)], name="t-idle")
    batcher = MicroBatcher(pipeline, max_batch=3, max_wait_s=3600.0, idle_dispatch=True, name="t-idle-batcher")
    try:
        gate.set()
        assert batcher.submit(4).result(timeout=10) == 16  # idle: no wait for company
        gate.clear()
        entered.clear()
        first = batcher.submit(5)
        assert entered.wait(10)  # in flight, parked in the gate
        rest = [batcher.submit(i) for i in (6, 7, 8)]  # wait for company: one batch once three are there
        assert batcher._inbox.wait_until(lambda s: s.size == 0, timeout=10)
        gate.set()
        assert [f.result(timeout=10) for f in (first, *rest)] == [25, 36, 49, 64]
        assert batcher.batches == 3 and batcher.items == 5
    finally:
        gate.set()
        batcher.close()
        pipeline.close()


def test_one_bad_item_fails_alone() -> None:
    pipeline = BaseAsyncPipeline([Stage("square", _square_all)], name="t2")
    batcher = MicroBatcher(pipeline, max_batch=4, max_wait_s=0.01)
    try:
        futures = [batcher.submit(x) for x in (2, "bad", 3)]
        wait(futures, timeout=20)
        assert futures[0].result() == 4 and futures[2].result() == 9
        with pytest.raises(ValueError, match="bad item"):
            futures[1].result()
    finally:
        batcher.close()
        pipeline.close()


def test_stage_failure_fails_the_whole_batch_with_the_original_error() -> None:
    def explode(pkg: Package) -> None:
        raise RuntimeError("render failed")

    pipeline = BaseAsyncPipeline([Stage("render", explode)], name="t3")
    batcher = MicroBatcher(pipeline, max_batch=4, max_wait_s=0.01)
    try:
        futures = [batcher.submit(i) for i in range(3)]
        wait(futures, timeout=20)
        for f in futures:
            with pytest.raises(RuntimeError, match="render failed"):
                f.result()
    finally:
        batcher.close()
        pipeline.close()


def test_full_inbox_raises_busy_and_close_refuses_and_cancels() -> None:
    gate = threading.Event()

    def gated(pkg: Package) -> None:
        assert gate.wait(10)
        pkg.data = [item.data for item in pkg.data]

    pipeline = BaseAsyncPipeline([Stage("gate", gated)], name="t4")
    batcher = MicroBatcher(pipeline, max_batch=1, max_wait_s=0.0, capacity=1)
    try:
        held = [batcher.submit(0)]
        # fill: one in the gate, one per queue slot, one in the collector, one in the inbox
        with pytest.raises(BusyError):
            for i in range(1, 50):
                held.append(batcher.submit(i, timeout=0.05))
        batcher.close(abort=True)
        with pytest.raises(ClosedError):
            batcher.submit(99)
        gate.set()
        wait(held, timeout=20)
        assert all(f.done() for f in held)
    finally:
        gate.set()
        batcher.close()
        pipeline.close()
