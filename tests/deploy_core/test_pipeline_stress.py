"""Pipeline under load: fault injection, per-key order, cancellations, drain and abort.

Random delays here are workload (they shuffle thread interleavings), never synchronisation.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
import torch

from deploy_core.errors import BusyError, ClosedError
from deploy_core.memory import BufferSpec, MemBufferPool
from deploy_core.pipeline import BaseAsyncPipeline, Package, PipelineConfig, Stage
from tests.deploy_core.test_pipeline_support import WAIT_S, Worker

STAGES = ("decode", "render", "score", "pick")


def make_pool(slots: int) -> MemBufferPool:
    return MemBufferPool([BufferSpec("x", (8,), torch.float32)], slots=slots, device="cpu", name="stress")


def fails_at(i: int) -> str | None:
    """1% of packages fail, spread over the four stages."""
    return STAGES[(i // 100) % 4] if i % 100 == 37 else None


class InjectedError(RuntimeError):
    pass


def make_stage(name: str) -> Stage:
    def fn(pkg: Package) -> None:
        i, trail = pkg.data
        if fails_at(i) == name:
            raise InjectedError(f"injected at {name} for {i}")
        pkg.lease.view("x", (2,)).fill_(i)  # touch the leased buffer
        pkg.data = (i, trail + name[0])
    return Stage(name, fn)


@pytest.mark.slow
def test_10k_packages_with_1_percent_failures() -> None:
    n = 10_000
    pool = make_pool(slots=8)
    with BaseAsyncPipeline([make_stage(s) for s in STAGES], pool=pool, name="stress") as p:
        futures = [p.submit((i, ""), key=i % 7) for i in range(n)]
        done, not_done = cf.wait(futures, timeout=60)
        assert not not_done
        stats = p.stats()
    failed = {i: f.exception() for i, f in enumerate(futures) if f.exception() is not None}
    assert sorted(failed) == [i for i in range(n) if fails_at(i)]
    assert len(failed) == n // 100
    for i, exc in failed.items():
        assert isinstance(exc, InjectedError)
        assert exc.pipeline_stage == fails_at(i)
        assert exc.__notes__ == [f"pipeline=stress stage={fails_at(i)} package_id={exc.pipeline_package_id} "
                                 f"key={i % 7}"]
    for i, f in enumerate(futures):
        if i not in failed:
            assert f.result() == (i, "drsp")
    assert pool.leased == 0
    assert stats.in_flight == 0 and stats.submitted == n
    assert [s.errors for s in stats.stages] == [25, 25, 25, 25]
    assert [s.count for s in stats.stages] == [n, n - 25, n - 50, n - 75]


@pytest.mark.parametrize("workers", [1, 3])
def test_results_per_key_complete_in_submission_order(workers: int) -> None:
    rng_lock = threading.Lock()
    rng = random.Random(1234)

    def jitter(pkg: Package) -> None:
        with rng_lock:
            delay = rng.uniform(0, 200e-6)
        time.sleep(delay)  # workload, not synchronisation

    stages = [Stage("a", jitter, workers=workers), Stage("b", jitter),
              Stage("c", jitter, workers=workers)]
    completed: dict[str, list[int]] = defaultdict(list)
    order_lock = threading.Lock()

    def submitter(keys: list[str], count: int) -> None:
        for seq in range(count):
            key = keys[seq % len(keys)]
            f = p.submit((key, seq), key=key)

            def on_done(f: cf.Future[Any], key: str = key, seq: int = seq) -> None:
                with order_lock:
                    completed[key].append(seq)
            f.add_done_callback(on_done)

    with BaseAsyncPipeline(stages, PipelineConfig(queue_capacity=2), name="order") as p:
        workers_ = [Worker(lambda k=k: submitter([f"{k}-x", f"{k}-y"], 150)) for k in "ABC"]
        for w in workers_:
            w.join()
            assert w.error is None
    assert sorted(completed) == sorted(f"{k}-{s}" for k in "ABC" for s in "xy")
    for key, seqs in completed.items():
        assert seqs == sorted(seqs), key
        assert len(seqs) == 75


def test_many_submitters_random_cancels_and_faults_then_drain() -> None:
    pool = make_pool(slots=6)
    rng = random.Random(7)

    def maybe_fail(pkg: Package) -> None:
        if pkg.data % 53 == 0:
            raise InjectedError(str(pkg.data))

    stages = [Stage("a", maybe_fail), Stage("b", lambda pkg: None, workers=2), Stage("c", maybe_fail)]
    futures: list[cf.Future[Any]] = []
    lock = threading.Lock()

    def submitter(base: int) -> None:
        for i in range(base, base + 500):
            f = p.submit(i)
            if rng.random() < 0.05:
                f.cancel()
            with lock:
                futures.append(f)

    with BaseAsyncPipeline(stages, pool=pool, name="mixed") as p:
        subs = [Worker(lambda b=b: submitter(b)) for b in (1, 1001, 2001, 3001)]
        for w in subs:
            w.join()
            assert w.error is None
    assert len(futures) == 2000
    assert all(f.done() for f in futures)                    # graceful close drained everything
    for f in futures:
        if not f.cancelled() and f.exception() is None:
            assert f.result() % 53 != 0
    assert pool.leased == 0


def test_abort_under_load_leaves_nothing_pending() -> None:
    pool = make_pool(slots=6)
    started = threading.Event()
    futures: list[cf.Future[Any]] = []
    lock = threading.Lock()

    def slowish(pkg: Package) -> None:
        started.set()
        time.sleep(50e-6)  # workload

    def submitter() -> int:
        refused = 0
        for i in range(100_000):
            try:
                f = p.submit(i, timeout=1.0)
            except ClosedError:
                return refused
            except BusyError:
                refused += 1
                continue
            with lock:
                futures.append(f)
        return refused

    p = BaseAsyncPipeline([Stage("a", slowish), Stage("b", slowish, workers=2), Stage("c", slowish)],
                          pool=pool, name="abort")
    p.start()
    subs = [Worker(submitter) for _ in range(3)]
    assert started.wait(WAIT_S)
    assert pool.wait_until(lambda s: s.waiting >= 1, timeout=WAIT_S)  # submitters are queueing for slots
    p.close(abort=True)
    for w in subs:
        w.join()
        assert w.error is None
    assert futures
    assert all(f.done() for f in futures)
    outcomes = {type(f.exception()).__name__ if f.exception() else "ok" for f in futures}
    assert outcomes <= {"ok", "ClosedError"}
    assert "ClosedError" in outcomes
    assert pool.leased == 0 and p.stats().in_flight == 0
