"""MicroBatcher: requests merged into batches, each future completed exactly once, in order."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest
import torch

from deploy_core.batching import BatcherStats, MicroBatcher
from deploy_core.errors import BrokenPipelineError, BusyError, ClosedError, DeadlineError
from deploy_core.memory import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, Stage
from tests.deploy_core.test_pipeline_support import WAIT_S, Gate


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


def test_a_hold_keeps_requests_submitted_one_by_one_in_one_batch_until_released() -> None:
    """An idle pipeline with idle_dispatch would take the first request alone; held, the three requests submitted
    one after another leave as one batch once the hold is released. A hold never released lapses by itself."""
    sizes: list[int] = []

    def record(pkg: Package) -> None:
        sizes.append(len(pkg.data))

    pipeline = BaseAsyncPipeline([Stage("record", record), Stage("square", _square_all)], name="t-hold")
    batcher = MicroBatcher(pipeline, max_batch=8, max_wait_s=0.0, idle_dispatch=True, name="t-hold-batcher")
    try:
        release = batcher.hold(3600.0)
        futures = [batcher.submit(i) for i in (2, 3, 4)]
        assert batcher._inbox.wait_until(lambda s: s.size == 0, timeout=WAIT_S)  # the collector holds all three
        release()
        release()  # idempotent
        assert [f.result(timeout=WAIT_S) for f in futures] == [4, 9, 16]
        assert sizes == [3] and batcher.batches == 1
        batcher.hold(0.0)  # lapses at once: a request is never stalled by a hold nobody releases
        assert batcher.submit(5).result(timeout=WAIT_S) == 25
        assert sizes == [3, 1]
    finally:
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


def _gated_pipeline(name: str, slots: int = 1) -> tuple[BaseAsyncPipeline, MemBufferPool, Gate, list[int]]:
    """gate -> record -> square, with a pool of ``slots`` slots."""
    gate, ran = Gate(), []

    def record(pkg: Package) -> None:
        ran.extend(item.data for item in pkg.data)

    pool = MemBufferPool([BufferSpec("x", (1,), torch.float32)], slots=slots, device="cpu", name=name)
    stages = [Stage("gate", gate), Stage("record", record), Stage("square", _square_all)]
    return BaseAsyncPipeline(stages, pool=pool, name=name), pool, gate, ran


def test_full_pipeline_parks_the_collector_until_a_batch_completes() -> None:
    pipeline, pool, gate, _ = _gated_pipeline("t5")
    batcher = MicroBatcher(pipeline, max_batch=1, max_wait_s=0.0, name="t5-batcher")
    try:
        first = batcher.submit(2)
        assert gate.entered.wait(WAIT_S)
        second = batcher.submit(3)                 # no slot: the collector blocks on its own condition
        assert batcher.wait_until(lambda s: s.blocked, WAIT_S)
        assert pool.stats().timeouts == 1          # one refused try, then no polling
        gate.opened.set()
        assert (first.result(WAIT_S), second.result(WAIT_S)) == (4, 9)
        assert pool.stats().timeouts == 1          # woken by the completion: the retry got the slot
        assert batcher.stats() == BatcherStats("t5-batcher", "running", 0, 0, 2, 2, 0, False)
    finally:
        gate.opened.set()
        batcher.close()
        pipeline.close()


def test_a_batch_nobody_waits_for_is_dropped_and_frees_its_slot() -> None:
    pipeline, pool, gate, ran = _gated_pipeline("t6")
    batcher = MicroBatcher(pipeline, max_batch=1, max_wait_s=0.0, name="t6-batcher")
    try:
        abandoned = batcher.submit(2)
        assert gate.entered.wait(WAIT_S)
        later = batcher.submit(3)
        assert batcher.wait_until(lambda s: s.blocked, WAIT_S)
        assert abandoned.cancel()                  # the client left: its batch is cancelled in the pipeline
        expired = batcher.submit(4, deadline=time.monotonic())  # past before it joins a batch
        gate.opened.set()
        assert later.result(WAIT_S) == 9
        with pytest.raises(DeadlineError, match=r"^t6-batcher: the request passed its deadline .* before it "
                                                r"joined a batch$"):
            expired.result(WAIT_S)
        assert abandoned.cancelled()
    finally:
        gate.opened.set()
        batcher.close()
        pipeline.close()
    assert ran == [3] and pool.leased == 0      # the abandoned batch never reached "record"
    assert batcher.stats().dropped == 1


class Die(BaseException):
    """Escapes every ``except Exception``: a stand-in for a bug in the collector's path."""


class DyingPipeline(BaseAsyncPipeline):
    """A real pipeline whose admission raises ``Die`` for one payload (fault injection)."""

    def submit(self, data, key=None, timeout=None, **kwargs):  # type: ignore[no-untyped-def]
        if any(item.data == "die" for item in data):
            raise Die("collector bug")
        return super().submit(data, key, timeout, **kwargs)


def test_a_dead_collector_fails_every_waiter_and_breaks_the_batcher(caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate()
    pipeline = DyingPipeline([Stage("gate", gate), Stage("square", _square_all)], name="t7")
    batcher = MicroBatcher(pipeline, max_batch=1, max_wait_s=0.0, name="t7-batcher")
    try:
        first = batcher.submit(2)
        assert gate.entered.wait(WAIT_S)            # the collector is free again; "die" kills it
        doomed = [batcher.submit("die"), batcher.submit(5)]
        assert batcher.wait_until(lambda s: s.state == "broken", WAIT_S)
        for f in doomed:
            with pytest.raises(BrokenPipelineError, match=r"^t7-batcher: the batch collector died: Die"):
                f.result(WAIT_S)
            assert isinstance(f.exception().__cause__, Die)
        for _ in range(2):                          # and keeps refusing
            with pytest.raises(BrokenPipelineError, match=r"^t7-batcher: the batch collector died"):
                batcher.submit(6)
        gate.opened.set()
        assert first.result(WAIT_S) == 4            # a batch already in the pipeline still completes
    finally:
        gate.opened.set()
        batcher.close()
        pipeline.close()
    assert "batch collector died" in caplog.text
