"""BlockQueue: bounded FIFO, typed errors, close wakes everyone, waits on states (no sleeps)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from deploy_core.errors import BusyError, ClosedError, EmptyError
from deploy_core.pipeline import BlockQueue, QueueStatistics
from tests.deploy_core.test_pipeline_support import WAIT_S, Worker


def test_fifo_and_introspection() -> None:
    q: BlockQueue[int] = BlockQueue(3, name="a->b")
    assert (q.capacity, q.size, len(q), q.closed) == (3, 0, 0, False)
    for i in range(3):
        q.put(i)
    assert q.statistics() == QueueStatistics(size=3, capacity=3, waiting_put=0, waiting_get=0, closed=False)
    assert [q.get(), q.get_nowait(), q.get(timeout=1.0)] == [0, 1, 2]
    assert repr(q) == "<BlockQueue a->b 0/3>"


def test_statistics_is_frozen() -> None:
    stats = BlockQueue(1).statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.size = 3  # type: ignore[misc]


@pytest.mark.parametrize("capacity", [0, -1, 1.5, None])
def test_bad_capacity(capacity: Any) -> None:
    with pytest.raises(ValueError, match=r"^capacity must be an int >= 1"):
        BlockQueue(capacity)


def test_nowait_and_timeouts_raise_typed_errors() -> None:
    q: BlockQueue[int] = BlockQueue(1, name="q")
    with pytest.raises(EmptyError, match=r"^queue 'q' is empty$"):
        q.get_nowait()
    with pytest.raises(EmptyError, match=r"^queue 'q' still empty after 0.02 s$"):
        q.get(timeout=0.02)
    q.put_nowait(1)
    with pytest.raises(BusyError, match=r"^queue 'q' is full \(1/1\)$"):
        q.put_nowait(2)
    with pytest.raises(BusyError, match=r"^queue 'q' still full after 0.02 s$"):
        q.put(2, timeout=0.02)
    assert q.statistics() == QueueStatistics(1, 1, 0, 0, False)  # the waiter counts came back down
    assert q.get_nowait() == 1


def test_full_queue_blocks_producer_until_a_get() -> None:
    q: BlockQueue[int] = BlockQueue(1, name="q")
    q.put(1)
    producer = Worker(lambda: q.put(2))
    assert q.wait_until(lambda s: s.waiting_put == 1, timeout=WAIT_S)
    assert repr(q) == "<BlockQueue q 1/1, 1 put waiting>"
    assert q.get() == 1
    producer.join()
    assert producer.error is None
    assert q.get() == 2


def test_close_wakes_blocked_producer_with_closed_error() -> None:
    q: BlockQueue[int] = BlockQueue(1, name="q")
    q.put(1)
    producers = [Worker(lambda: q.put(2)) for _ in range(2)]
    assert q.wait_until(lambda s: s.waiting_put == 2, timeout=WAIT_S)
    q.close()
    for p in producers:
        p.join()
        assert isinstance(p.error, ClosedError)
        assert str(p.error) == "queue 'q' was closed while a put was waiting"
    # the consumer still drains what was queued, then sees end of stream
    assert q.get() == 1
    with pytest.raises(ClosedError, match=r"^queue 'q' is closed and drained$"):
        q.get()


def test_close_wakes_blocked_consumers_with_end_of_stream() -> None:
    q: BlockQueue[int] = BlockQueue(2, name="q")
    consumers = [Worker(lambda: list(q)) for _ in range(2)] + [Worker(q.get)]
    assert q.wait_until(lambda s: s.waiting_get == 3, timeout=WAIT_S)
    assert repr(q) == "<BlockQueue q 0/2, 3 get waiting>"
    q.close()
    for c in consumers:
        c.join()
    assert [c.value for c in consumers[:2]] == [[], []]
    assert isinstance(consumers[2].error, ClosedError)


def test_after_close_every_put_keeps_failing_and_close_is_idempotent() -> None:
    q: BlockQueue[int] = BlockQueue(2, name="q")
    q.put(7)
    q.close()
    q.close()
    for _ in range(3):
        with pytest.raises(ClosedError, match=r"^put on closed queue 'q'$"):
            q.put(1)
        with pytest.raises(ClosedError, match=r"^put on closed queue 'q'$"):
            q.put_nowait(1)
        with pytest.raises(ClosedError, match=r"^put on closed queue 'q'$"):
            q.put(1, timeout=0.01)
    assert repr(q) == "<BlockQueue q 1/2, closed>"
    assert list(q) == [7]
    for _ in range(3):
        with pytest.raises(ClosedError):
            q.get_nowait()
        with pytest.raises(ClosedError):
            q.get(timeout=0.01)


def test_drain_removes_everything_and_wakes_producer() -> None:
    q: BlockQueue[int] = BlockQueue(2)
    q.put(1)
    q.put(2)
    producer = Worker(lambda: q.put(3))
    assert q.wait_until(lambda s: s.waiting_put == 1, timeout=WAIT_S)
    assert q.drain() == [1, 2]
    producer.join()
    assert q.drain() == [3]
    assert q.drain() == []


def test_wait_until_times_out_false() -> None:
    q: BlockQueue[int] = BlockQueue(1)
    assert q.wait_until(lambda s: s.size == 1, timeout=0.01) is False
    q.put(1)
    assert q.wait_until(lambda s: s.size == 1, timeout=0) is True


def test_many_producers_and_consumers_deliver_each_item_once() -> None:
    q: BlockQueue[tuple[int, int]] = BlockQueue(2)
    n_items = 2000

    def produce(pid: int) -> None:
        for i in range(n_items):
            q.put((pid, i))

    def consume() -> list[tuple[int, int]]:
        return list(q)

    producers = [Worker(lambda pid=pid: produce(pid)) for pid in range(4)]
    consumers = [Worker(consume) for _ in range(3)]
    for p in producers:
        p.join()
        assert p.error is None
    q.close()
    got: list[tuple[int, int]] = []
    for c in consumers:
        c.join()
        # each consumer sees every producer's items in that producer's order
        for pid in range(4):
            seq = [i for (p, i) in c.value if p == pid]
            assert seq == sorted(seq)
        got.extend(c.value)
    assert sorted(got) == [(p, i) for p in range(4) for i in range(n_items)]
