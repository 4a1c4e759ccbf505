"""Stream hooks of GPU stages, checked on CPU with fake streams and events.

The real CUDA path (torch.cuda.Stream / Event) is the same code with real objects; it is
exercised on the GPU machine, not here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

import deploy_core.timing as timing
from deploy_core.pipeline import BaseAsyncPipeline, Package, Stage
from tests.deploy_core.test_pipeline_support import WAIT_S


class FakeEvent:
    def __init__(self, stream: FakeStream, t_ms: float) -> None:
        self.stream = stream
        self.t_ms = t_ms
        self.synced = 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.synced += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t_ms - self.t_ms


class FakeStream:
    """Enough of torch.cuda.Stream for the pipeline: record_event / wait_event."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread = threading.current_thread().name
        self.recorded: list[FakeEvent] = []
        self.waited: list[FakeEvent] = []

    def record_event(self) -> FakeEvent:
        ev = FakeEvent(self, 1.0 * len(self.recorded))
        self.recorded.append(ev)
        return ev

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


@pytest.fixture
def fake_cuda_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_record_event", lambda stream: stream.record_event())
    # On a CUDA machine torch.cuda.stream() would make a FakeStream current: enter nothing for fakes instead.
    real_stream = torch.cuda.stream
    monkeypatch.setattr(torch.cuda, "stream",
                        lambda s: contextlib.nullcontext() if isinstance(s, FakeStream) else real_stream(s))


def test_gpu_stages_hand_off_through_ready_events(fake_cuda_events: None) -> None:
    streams: dict[str, FakeStream] = {}
    seen_ready: list[tuple[str, Any]] = []

    def factory(name: str):
        def make() -> FakeStream:
            streams[name] = FakeStream(name)
            return streams[name]
        return make

    def look(name: str):
        def fn(pkg: Package) -> None:
            seen_ready.append((name, pkg.ready_event))
        return fn

    stages = [Stage("upload", look("upload"), stream_factory=factory("upload")),
              Stage("cpu", look("cpu")),
              Stage("render", look("render"), stream_factory=factory("render"))]
    with BaseAsyncPipeline(stages, name="p", result_fn=lambda pkg: pkg) as p:
        pkgs = [p.submit(i).result(WAIT_S) for i in range(3)]
        assert p.stats().stage("render").gpu_p50_ms == 1.0    # start/end fake events 1 ms apart
    up, rd = streams["upload"], streams["render"]
    assert (up.thread, rd.thread) == ("fp-upload", "fp-render")  # created in the stage's own thread
    # per package each GPU stage records: timing start, timing end, ready event
    assert len(up.recorded) == len(rd.recorded) == 9
    for i, pkg in enumerate(pkgs):
        handed = up.recorded[3 * i + 2]
        assert rd.waited[i] is handed                          # render waited on upload's hand-off
        assert pkg.ready_event is rd.recorded[3 * i + 2]
        assert pkg.ready_event.synced == 1                     # synchronised once, before completion
        assert [r.gpu_ms for r in (t.resolve() for t in pkg.timings)] == [1.0, None, 1.0]
    assert up.waited == []                                     # first GPU stage: nothing to wait for
    assert [name for name, _ in seen_ready] == ["upload", "cpu", "render"] * 3


def test_sync_path_ignores_streams(fake_cuda_events: None) -> None:
    made: list[str] = []

    def factory() -> FakeStream:
        made.append("stream")
        return FakeStream("s")

    p = BaseAsyncPipeline([Stage("gpu", lambda pkg: None, stream_factory=factory)], name="p")
    pkg_ready = p.run(1)
    assert pkg_ready == 1 and made == []
    p.close()


class RecordingPool:
    """A pool fake that records the stream each lease is released on."""

    def __init__(self) -> None:
        self.released_on: list[Any] = []

    def acquire(self, timeout: float | None = None, *, owner: Any = None) -> Any:
        pool = self

        class _Lease:
            def release(self, stream: Any = None) -> None:
                pool.released_on.append(stream)

        return _Lease()


def test_lease_of_a_package_failing_in_a_gpu_stage_is_released_on_its_stream(fake_cuda_events: None) -> None:
    streams: list[FakeStream] = []

    def make() -> FakeStream:
        streams.append(FakeStream("gpu"))
        return streams[-1]

    def fail_on_one(pkg: Package) -> None:
        if pkg.data == 1:
            raise RuntimeError("kernel launch failed")

    pool = RecordingPool()
    stages = [Stage("cpu", lambda pkg: None), Stage("gpu", fail_on_one, stream_factory=make)]
    with BaseAsyncPipeline(stages, pool=pool, name="p") as p:
        assert isinstance(p.submit(1).exception(WAIT_S), RuntimeError)
        assert p.submit(2).result(WAIT_S) == 2
        assert p.run(3) == 3                                   # sync path: caller's stream
    assert pool.released_on == [streams[0], streams[0], None]


class SlotPool:
    """One slot lent like ``MemBufferPool`` does on CUDA, with fake events: ``release(stream)`` makes the
    stream wait on the previous free event, then records the new one; a lease exposes ``prior_free_event``."""

    def __init__(self) -> None:
        self.free_event: FakeEvent | None = None
        self.released_on: list[Any] = []

    def acquire(self, timeout: float | None = None, *, owner: Any = None) -> Any:
        pool, prior = self, self.free_event

        class _Lease:
            prior_free_event = prior

            def release(self, stream: Any = None) -> None:
                pool.released_on.append(stream)
                if stream is not None:
                    if prior is not None:
                        stream.wait_event(prior)
                    pool.free_event = stream.record_event()

        return _Lease()


def test_next_lessee_waits_on_the_free_event_of_a_package_that_failed_mid_lane(fake_cuda_events: None) -> None:
    streams: dict[str, FakeStream] = {}

    def factory(name: str):
        def make() -> FakeStream:
            streams[name] = FakeStream(name)
            return streams[name]
        return make

    def render(pkg: Package) -> None:
        if pkg.data == 1:
            raise RuntimeError("render failed after enqueueing kernels")

    pool = SlotPool()
    stages = [Stage("upload", lambda pkg: None, stream_factory=factory("upload")),
              Stage("render", render, stream_factory=factory("render")),
              Stage("finish", lambda pkg: None)]
    with BaseAsyncPipeline(stages, pool=pool, name="p", result_fn=lambda pkg: pkg) as p:
        assert isinstance(p.submit(1).exception(WAIT_S), RuntimeError)
        freed_by_failure = pool.free_event
        second = p.submit(2).result(WAIT_S)
    up, rd = streams["upload"], streams["render"]
    assert pool.released_on == [rd, rd]                       # released on the stream where package 1 failed
    assert freed_by_failure is not None and freed_by_failure.stream is rd
    assert up.waited == [freed_by_failure]                    # package 2's first GPU stage waited on it
    assert second.ready_event.synced == 1
    assert p.kept_for_gpu == 0                                # fake events complete: nothing kept after close


class PendingEvent(FakeEvent):
    """An event whose GPU work has not completed until the test says so."""

    done = False

    def query(self) -> bool:
        return PendingEvent.done


class SlowStream(FakeStream):
    def record_event(self) -> FakeEvent:
        ev = PendingEvent(self, 1.0 * len(self.recorded))
        self.recorded.append(ev)
        return ev


def test_failed_package_data_lives_until_its_gpu_work_completed(fake_cuda_events: None) -> None:
    import weakref

    class Payload:
        pass

    refs: list[Any] = []

    def fail(pkg: Package) -> None:
        refs.append(weakref.ref(pkg.data))
        raise RuntimeError("bad")

    PendingEvent.done = False
    p = BaseAsyncPipeline([Stage("gpu", fail, stream_factory=lambda: SlowStream("gpu"))], name="p")
    try:
        err = p.submit(Payload()).exception(WAIT_S)
        del err
        assert p.kept_for_gpu == 1 and refs[0]() is not None  # its kernels may still read its tensors
        PendingEvent.done = True
        assert p.submit(Payload()).exception(WAIT_S) is not None  # the next finish polls the events
        assert p.kept_for_gpu == 0
    finally:
        p.close()
    import gc
    gc.collect()
    assert refs[0]() is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="real streams and events need a CUDA device")
def test_cuda_package_after_a_mid_lane_failure_sees_only_its_own_writes() -> None:
    """Package 1 fails in the second GPU stage after enqueueing a late write into its slot; package 2 (same
    slot) writes the buffer in the first stage on another stream and reads it in the second. Without the
    free event seeding package 2's first stage, the late write of package 1 lands in between."""
    import torch

    from deploy_core.cuda import new_stream
    from deploy_core.memory import BufferSpec, MemBufferPool

    pool = MemBufferPool([BufferSpec("x", (1 << 22,), torch.float32)], 1, "cuda")

    def first(pkg: Package) -> None:
        if pkg.data > 1:
            pkg.lease.view("x", (1 << 22,)).fill_(float(pkg.data))

    def second(pkg: Package) -> None:
        x = pkg.lease.view("x", (1 << 22,))
        if pkg.data == 1:
            torch.cuda._sleep(200_000_000)            # ~0.1 s of GPU time before the stale write
            x.fill_(-1.0)
            raise RuntimeError("failed after enqueueing a write")
        pkg.data = x.clone()

    stages = [Stage("first", first, stream_factory=lambda: new_stream("cuda")),
              Stage("second", second, stream_factory=lambda: new_stream("cuda"))]
    with BaseAsyncPipeline(stages, pool=pool, name="p") as p:
        assert isinstance(p.submit(1).exception(WAIT_S), RuntimeError)
        got = p.submit(2).result(WAIT_S)
        assert p.kept_for_gpu <= 1                     # package 1's data waits for its GPU work, not the host
    assert bool((got == 2.0).all()), got.unique()
    assert p.kept_for_gpu == 0 and pool.leased == 0
