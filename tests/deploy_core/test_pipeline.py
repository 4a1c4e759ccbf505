"""BaseAsyncPipeline: results, failures, backpressure, close/abort, broken loops, stats.

Concurrency is ordered with Events (Gate) and queue/pool states (wait_until), never sleeps.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import re
import threading
import time
from typing import Any

import pytest
import torch

import deploy_core.pipeline as pipeline_api
from deploy_core.errors import BrokenPipelineError, BusyError, ClosedError, DeadlineError
from deploy_core.memory import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from tests.deploy_core.test_pipeline_support import WAIT_S, Gate, Worker, fp_threads

NOTE = re.compile(r"^pipeline=p stage=(\w+) package_id=\d+( key=\S+)?$")


def add(n: int):
    def fn(pkg: Package) -> None:
        pkg.data = pkg.data + n
    return fn


def double(pkg: Package) -> None:
    pkg.data = pkg.data * 2


def fail_on(value: Any, exc_type: type[Exception] = ValueError):
    def fn(pkg: Package) -> None:
        if pkg.data == value:
            raise exc_type(f"bad value {pkg.data}")
    return fn


def make_pool(slots: int = 4) -> MemBufferPool:
    return MemBufferPool([BufferSpec("x", (4,), torch.float32)], slots=slots, device="cpu", name="test")


class Die(BaseException):
    """Escapes the per-package ``except Exception``: kills the stage loop (a stand-in for a bug)."""


def test_public_api_is_complete_and_sorted() -> None:
    assert pipeline_api.__all__ == sorted(pipeline_api.__all__)
    for name in pipeline_api.__all__:
        assert hasattr(pipeline_api, name)


def test_async_results_equal_sync_results() -> None:
    stages = [Stage("a", add(1)), Stage("b", double), Stage("c", add(-3))]
    with BaseAsyncPipeline(stages, name="p") as p:
        futures = [p.submit(i) for i in range(50)]
        async_results = [f.result(WAIT_S) for f in futures]
        sync_results = [p.run(i) for i in range(50)]
        assert p(7) == (7 + 1) * 2 - 3
    assert async_results == sync_results == [(i + 1) * 2 - 3 for i in range(50)]


def test_result_fn_and_key_reach_the_stages() -> None:
    seen: list[Any] = []

    def record(pkg: Package) -> None:
        seen.append((pkg.key, pkg.package_id > 0, pkg.lease is None))

    with BaseAsyncPipeline([Stage("a", record)], result_fn=lambda pkg: ("out", pkg.data)) as p:
        assert p.submit(5, key="s1").result(WAIT_S) == ("out", 5)
        assert p.run(6, key="s2") == ("out", 6)
    assert seen == [("s1", True, True), ("s2", True, True)]


def test_threads_are_named_daemons_and_gone_after_close() -> None:
    p = BaseAsyncPipeline([Stage("a", add(1)), Stage("b", add(1), workers=2)], name="p")
    assert fp_threads() == []
    p.start()
    threads = {t.name: t for t in threading.enumerate() if t.name.startswith("fp-")}
    assert sorted(threads) == ["fp-a", "fp-b-0", "fp-b-1"]
    assert all(t.daemon for t in threads.values())  # a stuck stage cannot keep the process alive
    assert p.submit(1).result(WAIT_S) == 3
    p.close()
    assert fp_threads() == []
    assert p.state == "closed"


def test_stage_exception_fails_only_its_package_and_pipeline_keeps_serving() -> None:
    stages = [Stage("a", add(0)), Stage("b", fail_on(3)), Stage("c", add(10))]
    pool = make_pool()
    with BaseAsyncPipeline(stages, pool=pool, name="p") as p:
        futures = [p.submit(i, key="k") for i in range(8)]
        cf.wait(futures, timeout=WAIT_S)
        exc = futures[3].exception()
        assert type(exc) is ValueError and str(exc) == "bad value 3"   # the original exception
        assert exc.pipeline_stage == "b"
        assert exc.__notes__ == [f"pipeline=p stage=b package_id={exc.pipeline_package_id} key=k"]
        assert [f.result() for i, f in enumerate(futures) if i != 3] == [i + 10 for i in range(8) if i != 3]
        assert p.submit(100).result(WAIT_S) == 110                       # still serving
        stats = p.stats()
        assert (stats.stage("b").errors, stats.stage("a").errors, stats.stage("c").count) == (1, 0, 8)
    assert pool.leased == 0


def test_sync_path_raises_the_same_type_with_the_same_note() -> None:
    with BaseAsyncPipeline([Stage("a", add(0)), Stage("b", fail_on(3))], name="p") as p:
        async_exc = p.submit(3).exception(WAIT_S)
        # pytest matches the message followed by the notes
        with pytest.raises(ValueError, match=r"^bad value 3\npipeline=p stage=b package_id=\d+$") as info:
            p.run(3)
    sync_exc = info.value
    assert type(sync_exc) is type(async_exc)
    assert sync_exc.pipeline_stage == async_exc.pipeline_stage == "b"
    assert NOTE.match(sync_exc.__notes__[0]) and NOTE.match(async_exc.__notes__[0])


def test_result_fn_failure_is_reported_as_its_own_stage() -> None:
    def boom(pkg: Package) -> Any:
        raise KeyError("missing")

    with BaseAsyncPipeline([Stage("a", add(0))], result_fn=boom, name="p") as p:
        exc = p.submit(1).exception(WAIT_S)
        assert isinstance(exc, KeyError) and exc.pipeline_stage == "result_fn"
        with pytest.raises(KeyError) as info:
            p.run(1)
        assert info.value.pipeline_stage == "result_fn"


def test_full_first_queue_blocks_submit_then_busy_error_with_timeout() -> None:
    gate = Gate()
    pool = make_pool(slots=8)
    p = BaseAsyncPipeline([Stage("gate", gate)], PipelineConfig(queue_capacity=2), pool=pool, name="p")
    first = p.submit(0)
    assert gate.entered.wait(WAIT_S)
    queued = [p.submit(1), p.submit(2)]                     # fills the queue (capacity 2)
    with pytest.raises(BusyError, match=r"^pipeline 'p' is full: no room within 0.02 s$"):
        p.submit(3, timeout=0.02)
    with pytest.raises(BusyError):
        p.submit(3, timeout=0)
    assert pool.leased == 3                                  # the rejected submits returned their lease
    blocked = Worker(lambda: p.submit(4))                    # no timeout: blocks (backpressure)
    assert p.queues()[0].wait_until(lambda s: s.waiting_put == 1, timeout=WAIT_S)
    gate.opened.set()
    blocked.join()
    results = [f.result(WAIT_S) for f in [first, *queued, blocked.value]]
    assert results == [0, 1, 2, 4]
    p.close()
    assert pool.leased == 0 and p.stats().in_flight == 0


def test_pool_bounds_packages_in_flight() -> None:
    gate = Gate()
    pool = make_pool(slots=2)
    with BaseAsyncPipeline([Stage("gate", gate)], PipelineConfig(queue_capacity=4), pool=pool) as p:
        futures = [p.submit(0), p.submit(1)]
        with pytest.raises(BusyError, match=r"^pool 'test': all 2 slots leased"):
            p.submit(2, timeout=0.02)
        assert pool.leased == 2
        gate.opened.set()
        assert [f.result(WAIT_S) for f in futures] == [0, 1]
    assert pool.leased == 0


def test_graceful_close_finishes_admitted_work_and_refuses_new() -> None:
    gate = Gate()
    pool = make_pool()
    p = BaseAsyncPipeline([Stage("gate", gate), Stage("b", add(1))], pool=pool, name="p")
    futures = [p.submit(i) for i in range(3)]
    assert gate.entered.wait(WAIT_S)
    closer = Worker(p.close)
    assert p.queues()[0].wait_until(lambda s: s.closed, timeout=WAIT_S)
    with pytest.raises(ClosedError, match=r"^pipeline 'p' is closed$"):
        p.submit(9)
    assert not any(f.done() for f in futures)
    gate.opened.set()
    closer.join()
    assert closer.error is None
    assert [f.result(0) for f in futures] == [1, 2, 3]
    assert pool.leased == 0 and p.stats().in_flight == 0


def test_close_wakes_blocked_producer_and_idle_consumers() -> None:
    gate = Gate()
    pool = make_pool(slots=8)
    p = BaseAsyncPipeline([Stage("gate", gate), Stage("idle", add(0))], PipelineConfig(queue_capacity=1),
                          pool=pool, name="p")
    first = p.submit(0)
    assert gate.entered.wait(WAIT_S)
    second = p.submit(1)                                     # fills the 1-slot queue
    producer = Worker(lambda: p.submit(2))                   # blocks: queue full
    assert p.queues()[0].wait_until(lambda s: s.waiting_put == 1, timeout=WAIT_S)
    assert p.queues()[1].wait_until(lambda s: s.waiting_get == 1, timeout=WAIT_S)  # "idle" waits for work
    closer = Worker(p.close)
    producer.join()
    assert isinstance(producer.error, ClosedError)           # never admitted
    gate.opened.set()
    closer.join()
    assert closer.error is None
    assert (first.result(0), second.result(0)) == (0, 1)
    assert pool.leased == 0


def test_abort_fails_every_pending_future_and_returns_leases() -> None:
    gate = Gate()
    pool = make_pool(slots=8)
    p = BaseAsyncPipeline([Stage("gate", gate), Stage("b", add(1))], PipelineConfig(queue_capacity=4),
                          pool=pool, name="p")
    held = p.submit(0)
    assert gate.entered.wait(WAIT_S)
    queued = [p.submit(i) for i in range(1, 5)]
    closer = Worker(lambda: p.close(abort=True))
    done, _ = cf.wait(queued, timeout=WAIT_S)               # queued ones fail at once...
    assert len(done) == 4
    for f in queued:
        assert isinstance(f.exception(0), ClosedError)
        assert str(f.exception(0)) == "pipeline 'p' was aborted"
    assert not held.done()                                  # ...the held one when its fn returns
    assert pool.leased == 1                                 # its buffers are still in use
    gate.opened.set()
    closer.join()
    assert isinstance(held.exception(WAIT_S), ClosedError)
    assert gate.seen == [0]
    assert pool.leased == 0 and p.stats().in_flight == 0
    with pytest.raises(ClosedError):
        p.submit(1)


def test_context_manager_aborts_on_error() -> None:
    gate = Gate()
    with pytest.raises(RuntimeError, match="^test body failed$"):
        with BaseAsyncPipeline([Stage("gate", gate)], name="p") as p:
            futures = [p.submit(i) for i in range(3)]
            assert gate.entered.wait(WAIT_S)
            gate.opened.set()  # let the held package finish; abort fails the rest
            raise RuntimeError("test body failed")
    assert all(f.done() for f in futures)
    assert p.state == "closed"


def test_after_close_every_operation_keeps_failing() -> None:
    p = BaseAsyncPipeline([Stage("a", add(1))], name="p")
    p.close()
    p.close()
    for _ in range(2):
        with pytest.raises(ClosedError, match=r"^pipeline 'p' is closed"):
            p.submit(1)
        with pytest.raises(ClosedError, match=r"^pipeline 'p' is closed"):
            p.run(1)
        with pytest.raises(ClosedError, match=r"^pipeline 'p' is closed"):
            p.start()


def test_caller_cancelled_future_is_skipped_and_its_lease_returned() -> None:
    gate = Gate()
    ran: list[int] = []
    pool = make_pool()
    with BaseAsyncPipeline([Stage("gate", gate), Stage("b", lambda pkg: ran.append(pkg.data))],
                           pool=pool) as p:
        first = p.submit(0)
        assert gate.entered.wait(WAIT_S)
        second = p.submit(1)
        assert second.cancel()
        gate.opened.set()
        assert first.result(WAIT_S) == 0
    assert second.cancelled()
    assert gate.seen == [0] and ran == [0]
    assert pool.leased == 0


def test_a_failed_package_settles_after_the_earlier_packages_of_its_key() -> None:
    gate = Gate()
    pool = make_pool()
    settled: list[str] = []
    with BaseAsyncPipeline([Stage("early", fail_on(2)), Stage("late", gate)], pool=pool, name="p") as p:
        first = p.submit(1, key="a")
        assert gate.entered.wait(WAIT_S)
        second = p.submit(2, key="a")                  # fails in "early" while "first" is parked in "late"
        other = p.submit(2, key="b")
        for name, f in (("first", first), ("second", second), ("other", other)):
            f.add_done_callback(lambda _f, name=name: settled.append(name))
        assert isinstance(other.exception(WAIT_S), ValueError)  # another key is not held back
        assert pool.wait_until(lambda s: s.leased == 1, WAIT_S)  # the failed package returned its slot at once
        assert not second.done()                        # ... but its future waits for "first"
        gate.opened.set()
        assert first.result(WAIT_S) == 1
        assert isinstance(second.exception(WAIT_S), ValueError)
    assert settled == ["other", "first", "second"]


def test_an_expired_package_is_dropped_at_the_next_stage_boundary_and_frees_its_slot() -> None:
    gate = Gate()
    ran: list[int] = []
    pool = make_pool(slots=2)
    with BaseAsyncPipeline([Stage("gate", gate), Stage("b", lambda pkg: ran.append(pkg.data))],
                           pool=pool, name="p") as p:
        first = p.submit(0)
        assert gate.entered.wait(WAIT_S)
        late = p.submit(1, deadline=time.monotonic())  # already past when "gate" frees up
        third = Worker(lambda: p.submit(2).result(WAIT_S))  # needs the slot "late" holds
        assert pool.wait_until(lambda s: s.waiting == 1, WAIT_S)
        gate.opened.set()
        assert first.result(WAIT_S) == 0
        with pytest.raises(DeadlineError, match=r"^pipeline 'p': package \d+ passed its deadline .* before "
                                                r"stage 'gate'; dropped$"):
            late.result(WAIT_S)
        assert third.join().value == 2
    assert gate.seen == [0, 2] and ran == [0, 2]
    assert pool.leased == 0 and isinstance(DeadlineError("x"), TimeoutError)


def test_a_stage_may_finish_the_package_itself() -> None:
    ran: list[int] = []

    def drop_odd(pkg: Package) -> None:
        if pkg.data % 2:
            pkg.finish(cancel=True)

    with BaseAsyncPipeline([Stage("drop", drop_odd), Stage("b", lambda pkg: ran.append(pkg.data))]) as p:
        futures = [p.submit(i) for i in range(4)]
        cf.wait(futures, timeout=WAIT_S)
        assert [f.cancelled() for f in futures] == [False, True, False, True]
        with pytest.raises(cf.CancelledError):
            p.run(1)
    assert ran == [0, 2]


def test_dead_stage_loop_breaks_the_pipeline(caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate()

    def dies_on_minus_one(pkg: Package) -> None:
        if pkg.data == -1:
            raise Die("bug in the stage loop")

    pool = make_pool(slots=8)
    p = BaseAsyncPipeline([Stage("a", dies_on_minus_one), Stage("gate", gate)], PipelineConfig(queue_capacity=2),
                          pool=pool, name="p")
    held = p.submit(0)
    assert gate.entered.wait(WAIT_S)
    queued = p.submit(1)
    assert p.queues()[1].wait_until(lambda s: s.size == 1, timeout=WAIT_S)
    with caplog.at_level(logging.ERROR, logger="deploy_core.pipeline"):
        killer = p.submit(-1)
        exc = killer.exception(WAIT_S)
    assert isinstance(exc, BrokenPipelineError)
    assert str(exc) == "pipeline 'p': stage 'a' loop died: Die('bug in the stage loop')"
    assert isinstance(exc.__cause__, Die)
    assert isinstance(queued.exception(WAIT_S), BrokenPipelineError)
    assert [r.getMessage() for r in caplog.records] == ["pipeline 'p': stage 'a' loop died; failing every "
                                                        "pending package"]
    assert p.state == "broken" and p.stats().state == "broken"
    for _ in range(2):
        with pytest.raises(BrokenPipelineError, match=r"^pipeline 'p': stage 'a' loop died"):
            p.submit(2)
    assert not held.done() and pool.leased == 1              # still inside the gate
    gate.opened.set()
    assert isinstance(held.exception(WAIT_S), BrokenPipelineError)
    p.close()
    assert pool.leased == 0 and p.stats().in_flight == 0
    with pytest.raises(ClosedError):
        p.submit(3)


def test_failing_setup_breaks_the_pipeline_at_start() -> None:
    def setup() -> None:
        raise OSError("no device")

    p = BaseAsyncPipeline([Stage("a", add(1)), Stage("b", add(1), setup=setup)], name="p")
    with pytest.raises(BrokenPipelineError, match=r"^pipeline 'p': stage 'b' loop died: OSError") as info:
        p.start()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(BrokenPipelineError):
        p.start()
    with pytest.raises(BrokenPipelineError):
        p.submit(1)
    p.close()


def test_setup_and_teardown_run_once_per_stage_thread() -> None:
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()

    def log(what: str):
        def fn() -> None:
            with lock:
                calls.append((what, threading.current_thread().name))
        return fn

    p = BaseAsyncPipeline([Stage("a", add(1), workers=2, setup=log("setup"), teardown=log("teardown"))])
    p.start()
    assert sorted(calls) == [("setup", "fp-a-0"), ("setup", "fp-a-1")]
    assert p.run(1) == 2                                     # the inline path sets up once, in this thread
    assert p.run(2) == 3
    p.close()
    me = threading.current_thread().name
    assert sorted(calls) == sorted([("setup", "fp-a-0"), ("setup", "fp-a-1"), ("setup", me),
                                    ("teardown", "fp-a-0"), ("teardown", "fp-a-1")])


def test_close_names_a_stuck_stage() -> None:
    gate = Gate()
    p = BaseAsyncPipeline([Stage("a", add(0)), Stage("stuck", gate)], name="p")
    held = p.submit(0)
    assert gate.entered.wait(WAIT_S)
    with pytest.raises(TimeoutError, match=r"^pipeline 'p': threads still running after 0.05 s: fp-stuck$"):
        p.close(timeout=0.05)
    gate.opened.set()
    assert isinstance(held.exception(WAIT_S), ClosedError)   # failed once its fn returned
    for t in threading.enumerate():
        if t.name.startswith("fp-"):
            t.join(WAIT_S)


def test_stats_have_sane_values() -> None:
    stages = [Stage("a", add(1)), Stage("b", fail_on(5)), Stage("c", add(1), workers=2, queue_capacity=3)]
    with BaseAsyncPipeline(stages, name="p") as p:
        assert p.stats().stage("a").count == 0
        futures = [p.submit(i) for i in range(20)]
        cf.wait(futures, timeout=WAIT_S)
        stats = p.stats()
    assert (stats.name, stats.state, stats.submitted, stats.in_flight) == ("p", "running", 20, 0)
    a, b, c = stats.stages
    assert (a.count, a.errors, b.count, b.errors, c.count, c.errors) == (20, 0, 20, 1, 19, 0)
    assert (c.workers, c.queue_capacity, a.queue_capacity, c.queue_depth) == (2, 3, 2, 0)
    for s in stats.stages:
        assert s.busy_ms_total > 0
        assert 0 <= s.wall_p50_ms <= s.wall_p90_ms <= s.busy_ms_total
        assert 0 <= s.queue_wait_p50_ms <= s.queue_wait_p90_ms
        assert s.gpu_p50_ms is None
    with pytest.raises(KeyError, match="no stage 'zz'"):
        stats.stage("zz")
    assert p.stats().state == "closed"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^a pipeline needs at least one stage$"):
        BaseAsyncPipeline([])
    with pytest.raises(ValueError, match=r"^stage names must be unique"):
        BaseAsyncPipeline([Stage("a", add(1)), Stage("a", add(1))])
    with pytest.raises(ValueError, match=r"^Stage name must be a non-empty string"):
        Stage("a b", add(1))
    with pytest.raises(ValueError, match=r"^Stage 'a': workers must be an int >= 1"):
        Stage("a", add(1), workers=0)
    with pytest.raises(ValueError, match=r"^queue_capacity must be an int >= 1"):
        PipelineConfig(queue_capacity=0)
    with pytest.raises(TypeError, match=r"^Stage 'a': fn must be callable"):
        Stage("a", 3)  # type: ignore[arg-type]


def test_package_finishes_exactly_once() -> None:
    released: list[int] = []

    class CountingLease:
        def release(self) -> None:
            released.append(1)

    pkg = Package("x", lease=CountingLease())
    assert pkg.finish("r") is True
    assert pkg.finish(error=ValueError()) is False
    assert pkg.finish(cancel=True) is False
    assert (pkg.future.result(0), released, pkg.done) == ("r", [1], True)
    with pytest.raises(ValueError, match="needs a result"):
        Package("y").finish()
