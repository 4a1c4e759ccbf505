"""A first stage that runs in the submitting thread (``Stage(in_submitter=True)``): the same guarantees as a stage
thread (results, failures of one package, deadlines, cancellation, close and abort, leases returned), one hand-off
fewer."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from deploy_core.errors import ClosedError, DeadlineError
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from tests.deploy_core.test_pipeline import add, double, fail_on, make_pool
from tests.deploy_core.test_pipeline_support import WAIT_S, Gate, Worker


def _pipeline(first, *, pool=None, capacity: int = 4) -> BaseAsyncPipeline:
    return BaseAsyncPipeline([Stage("first", first, in_submitter=True), Stage("second", double)],
                             PipelineConfig(queue_capacity=capacity), pool=pool, name="p")


def test_the_first_stage_runs_in_the_submitting_thread_and_results_equal_the_threaded_pipeline() -> None:
    threads: list[str] = []

    def first(pkg: Package) -> None:
        threads.append(threading.current_thread().name)
        pkg.data += 1

    with _pipeline(first) as p, BaseAsyncPipeline([Stage("plus", add(1)), Stage("times", double)],
                                                  name="q") as q:
        futures = [p.submit(i, key="k") for i in range(6)]
        assert [f.result(WAIT_S) for f in futures] == [q.submit(i).result(WAIT_S) for i in range(6)]
        assert set(threads) == {threading.current_thread().name}  # never a stage thread of its own
        assert not any(t.name == "fp-first" for t in threading.enumerate())
        stats = {s.name: s for s in p.stats().stages}
        assert stats["first"].count == 6 and stats["second"].count == 6 and p.stats().submitted == 6


def test_a_failure_in_the_first_stage_fails_only_its_package_and_returns_its_lease() -> None:
    pool = make_pool(slots=2)
    with _pipeline(fail_on(3), pool=pool) as p:
        futures = [p.submit(i) for i in range(6)]
        outcomes = [f.exception(WAIT_S) for f in futures]
        assert isinstance(outcomes[3], ValueError) and "stage=first" in outcomes[3].__notes__[0]
        assert [f.result() for i, f in enumerate(futures) if i != 3] == [0, 2, 4, 8, 10]
    assert pool.leased == 0


def test_an_expired_or_cancelled_package_is_dropped_before_the_first_stage_runs() -> None:
    seen: list[int] = []

    def first(pkg: Package) -> None:
        seen.append(pkg.data)

    pool = make_pool(slots=2)
    with _pipeline(first, pool=pool) as p:
        late = p.submit(1, deadline=0.0)  # time.monotonic() is far past 0
        unwanted = p.submit(2, wanted=lambda: False)
        assert isinstance(late.exception(WAIT_S), DeadlineError)
        assert unwanted.cancelled()
        assert p.submit(3).result(WAIT_S) == 6
    assert seen == [3] and pool.leased == 0


def test_graceful_close_completes_what_the_first_stage_handed_on() -> None:
    gate = Gate()
    p = BaseAsyncPipeline([Stage("first", add(1), in_submitter=True), Stage("gate", gate)],
                          PipelineConfig(queue_capacity=4), name="p")
    futures = [p.submit(i) for i in range(3)]
    assert gate.entered.wait(WAIT_S)
    closer = Worker(lambda: p.close())
    gate.opened.set()
    closer.join()
    assert [f.result(WAIT_S) for f in futures] == [1, 2, 3]
    with pytest.raises(ClosedError):
        p.submit(4)


def test_abort_while_the_first_stage_runs_fails_that_package_once_it_returns_and_frees_its_lease() -> None:
    gate = Gate()
    pool = make_pool(slots=2)
    p = _pipeline(gate, pool=pool)
    p.start()
    submitter = Worker(lambda: p.submit(0))  # fn runs in this worker's thread and parks at the gate
    assert gate.entered.wait(WAIT_S)
    p.close(abort=True, timeout=WAIT_S)  # the package in fn is held: its lease stays until fn returns
    assert pool.leased == 1
    gate.opened.set()
    submitter.join()
    future = submitter.value
    assert isinstance(future.exception(WAIT_S), ClosedError)
    assert pool.leased == 0


def test_an_in_submitter_stage_is_only_the_first_of_several_and_has_no_thread_hooks() -> None:
    with pytest.raises(ValueError, match="only the first stage"):
        BaseAsyncPipeline([Stage("a", double), Stage("b", double, in_submitter=True)])
    with pytest.raises(ValueError, match="needs a stage after it"):
        BaseAsyncPipeline([Stage("a", double, in_submitter=True)])
    with pytest.raises(ValueError, match="no threads of its own"):
        Stage("a", double, in_submitter=True, setup=lambda: None)
    with pytest.raises(ValueError, match="no threads of its own"):
        Stage("a", double, in_submitter=True, workers=2)


def test_concurrent_submitters_each_run_the_first_stage_and_every_future_completes_once() -> None:
    with _pipeline(add(1), capacity=2) as p:
        with cf.ThreadPoolExecutor(8) as ex:
            futures = list(ex.map(lambda i: p.submit(i), range(64)))
        assert sorted(f.result(WAIT_S) for f in futures) == [2 * (i + 1) for i in range(64)]
        assert p.stats().in_flight == 0
