"""MemBufferPool / Lease: capacity views, lending, misuse errors, close, threads, no hot-path allocation."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import deploy_core.memory as mempool
from deploy_core.errors import BusyError, CapacityError, ClosedError, LeaseError
from deploy_core.memory import BufferSpec, MemBufferPool, PoolStats

WAIT_S = 10.0  # bound on waits for a state; only ever reached when the test fails

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


def _specs() -> list[BufferSpec]:
    return [
        BufferSpec("crops", (8, 4, 4, 6), torch.float32),
        BufferSpec("ids", (8,), torch.int64),
        BufferSpec("scores", (8, 1), torch.float32, host=True),
    ]


def test_public_names() -> None:
    assert mempool.__all__ == sorted(mempool.__all__)
    assert set(mempool.__all__) == {"BufferSpec", "PinnedCopies", "Lease", "MemBufferPool", "PageLockedFrames",
                                    "PinnedBlocks", "PoolStats", "SharedFrames", "is_page_locked", "is_page_locked_array",
                                    "page_lock", "page_locked_ranges", "page_unlock"}


def test_buffer_spec_validation() -> None:
    spec = BufferSpec("x", [2, 3], torch.float16)  # type: ignore[arg-type]
    assert spec.shape == (2, 3) and spec.numel == 6 and spec.nbytes == 12
    with pytest.raises(ValueError, match=r"^BufferSpec 'x': shape must be"):
        BufferSpec("x", (2, 0), torch.float32)
    with pytest.raises(ValueError, match=r"^BufferSpec.name must be"):
        BufferSpec("", (2,), torch.float32)
    with pytest.raises(TypeError, match=r"^BufferSpec 'x': dtype"):
        BufferSpec("x", (2,), "float32")  # type: ignore[arg-type]


def test_pool_validation() -> None:
    with pytest.raises(ValueError, match=r"^slots must be an int >= 1"):
        MemBufferPool(_specs(), 0, "cpu")
    with pytest.raises(ValueError, match=r"^MemBufferPool buffer names must be unique"):
        MemBufferPool([BufferSpec("a", (1,), torch.float32)] * 2, 1, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_introspection_and_allocation(device: str) -> None:
    pool = MemBufferPool(_specs(), 3, device, name="p")
    slot_bytes = 8 * 4 * 4 * 6 * 4 + 8 * 8 + 8 * 1 * 4
    assert (pool.slots, pool.leased, pool.available) == (3, 0, 3)
    assert pool.slot_bytes == slot_bytes and pool.capacity_bytes == 3 * slot_bytes
    with pool.acquire() as lease:
        bufs = lease.buffers
        assert bufs["crops"].device.type == device and bufs["scores"].device.type == "cpu"
        assert bufs["scores"].is_pinned() == (device == "cuda")  # pinned staging only next to a GPU
        assert all(bool((b == 0).all()) for b in bufs.values())    # zero-filled once at construction
        assert (pool.leased, pool.available) == (1, 2)
        assert repr(pool).startswith("<MemBufferPool 'p'") and "1/3 leased" in repr(pool)
    assert (pool.leased, pool.available) == (0, 3)


def test_view_is_a_prefix_of_the_buffer() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    with pool.acquire() as lease:
        full = lease.buffers["crops"]
        v = lease.view("crops", (3, 4, 4, 6))
        assert v.shape == (3, 4, 4, 6) and v.is_contiguous() and v.dtype == torch.float32
        assert v.data_ptr() == full.data_ptr()
        v.fill_(7.0)
        assert bool((full.view(-1)[: v.numel()] == 7).all()) and bool((full.view(-1)[v.numel():] == 0).all())
        # Any same-rank shape within the element capacity is allowed (e.g. a transposed image size).
        assert lease.view("crops", (2, 8, 4, 6)).shape == (2, 8, 4, 6)
        assert lease.view("crops", (0, 4, 4, 6)).numel() == 0
        assert lease.view("ids", torch.Size([8])).shape == (8,)


def test_view_errors_name_the_buffer() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    with pool.acquire() as lease:
        with pytest.raises(CapacityError, match=r"^buffer 'crops': requested \(9, 4, 4, 6\) \(864 elements\) "
                                                r"exceeds capacity \(8, 4, 4, 6\) \(768 elements\)$"):
            lease.view("crops", (9, 4, 4, 6))
        with pytest.raises(ValueError, match=r"^buffer 'crops': requested shape \(96, 4, 2\) has rank 3"):
            lease.view("crops", (96, 4, 2))
        with pytest.raises(ValueError, match=r"^buffer 'ids': requested shape \(-1,\) has a negative dim"):
            lease.view("ids", (-1,))
        with pytest.raises(ValueError, match=r"^pool 'pool' has no buffer 'nope'; buffers: \['crops', 'ids', 'scores'\]"):
            lease.view("nope", (1,))


def test_release_twice_and_use_after_release_raise() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    lease = pool.acquire(owner="frame-7")
    assert lease.generation == 0 and not lease.released
    lease.release()
    assert lease.released
    with pytest.raises(LeaseError, match=r"^lease of pool 'pool' slot 0 \(generation 0, owner 'frame-7'\) released twice"):
        lease.release()
    for use in (lambda: lease.view("ids", (1,)), lambda: lease.buffers, lambda: lease.wait(None)):
        with pytest.raises(LeaseError, match=r"^lease of pool 'pool' slot 0 .* was already released"):
            use()
    again = pool.acquire()
    assert again.slot == 0 and again.generation == 1  # the generation counter moved on
    with pytest.raises(LeaseError):
        lease.view("ids", (1,))                          # the stale lease stays dead while the slot is reused
    again.release()


def test_context_manager_releases_on_exception_and_tolerates_early_release() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    with pytest.raises(RuntimeError, match="^boom$"), pool.acquire():
        assert pool.leased == 1
        raise RuntimeError("boom")
    assert pool.leased == 0
    with pool.acquire() as lease:
        lease.release()  # releasing early inside the block is fine; exit does not release again
    assert pool.leased == 0


def test_timeout_raises_busy_and_is_counted() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    held = pool.acquire()
    with pytest.raises(BusyError, match=r"^pool 'pool': all 1 slots leased; gave up after 0 s$"):
        pool.acquire(timeout=0)
    with pytest.raises(BusyError):
        pool.acquire(timeout=0.01)  # the timeout is the subject here, it orders nothing
    with pytest.raises(ValueError, match=r"^timeout must be >= 0"):
        pool.acquire(timeout=-1)
    assert pool.stats().timeouts == 2
    held.release()


def test_blocked_acquire_is_woken_by_release() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    held = pool.acquire(owner="a")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(owner="b")), name="test-acquirer")
    t.start()
    assert pool.wait_until(lambda s: s.waiting == 1, timeout=WAIT_S)
    assert pool.outstanding() == {0: "a"} and not got
    held.release()
    t.join(WAIT_S)
    assert not t.is_alive()
    (lease,) = got
    assert lease.owner == "b" and pool.outstanding() == {0: "b"}  # type: ignore[attr-defined]
    stats = pool.stats()
    assert isinstance(stats, PoolStats)
    assert (stats.acquires, stats.waited, stats.waiting) == (2, 1, 0)
    assert stats.max_wait_s > 0 and stats.total_wait_s >= stats.max_wait_s and stats.mean_wait_s > 0
    lease.release()  # type: ignore[attr-defined]


def test_close_wakes_waiters_and_keeps_failing() -> None:
    pool = MemBufferPool(_specs(), 1, "cpu")
    held = pool.acquire()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=waiter, name=f"test-waiter-{i}") for i in range(3)]
    for t in threads:
        t.start()
    assert pool.wait_until(lambda s: s.waiting == 3, timeout=WAIT_S)
    pool.close()
    pool.close()  # idempotent
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    assert len(errors) == 3 and all(isinstance(e, ClosedError) for e in errors)
    assert all(str(e) == "pool 'pool' was closed while waiting for a slot" for e in errors)
    # The outstanding lease still works and can be returned; new leases keep failing.
    held.view("ids", (2,)).fill_(1)
    held.release()
    for _ in range(2):
        with pytest.raises(ClosedError, match=r"^pool 'pool' is closed$"):
            pool.acquire(timeout=0)
    assert pool.closed and pool.leased == 0 and "closed" in repr(pool)


def test_no_allocation_on_the_hot_path() -> None:
    pool = MemBufferPool(_specs(), 3, "cpu")
    prealloc: set[int] = set()
    held = [pool.acquire() for _ in range(3)]
    for lease in held:
        prealloc.update(t.data_ptr() for t in lease.buffers.values())
        lease.release()
    assert len(prealloc) == 9
    rng = random.Random(0)
    seen: set[int] = set()
    for i in range(3000):
        with pool.acquire(owner=i) as lease:
            n = rng.randint(1, 8)  # (a zero-element view reports data_ptr 0)
            for name, shape in (("crops", (n, 4, 4, 6)), ("ids", (n,)), ("scores", (n, 1))):
                seen.add(lease.view(name, shape).data_ptr())
    assert seen <= prealloc
    assert pool.stats().acquires == 3 + 3000


def test_threads_never_share_a_slot() -> None:
    pool = MemBufferPool(_specs(), 2, "cpu")
    holders = [0, 0]
    lock = threading.Lock()
    failures: list[str] = []
    per_thread = 300

    def worker(k: int) -> None:
        for i in range(per_thread):
            with pool.acquire(timeout=WAIT_S, owner=(k, i)) as lease:
                with lock:
                    holders[lease.slot] += 1
                    if holders[lease.slot] != 1:
                        failures.append(f"slot {lease.slot} shared")
                ids = lease.view("ids", (4,))
                ids.fill_(k)
                if not bool((ids == k).all()):
                    failures.append("buffer written by another holder")
                with lock:
                    holders[lease.slot] -= 1

    threads = [threading.Thread(target=worker, args=(k,), name=f"test-worker-{k}") for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
        assert not t.is_alive()
    assert not failures
    stats = pool.stats()
    assert (stats.acquires, stats.leased, stats.available, stats.waiting) == (4 * per_thread, 0, 2, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA free-event ordering needs a CUDA device")
def test_cuda_release_records_free_event_for_next_lessee() -> None:
    pool = MemBufferPool([BufferSpec("x", (1 << 20,), torch.float32)], 1, "cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    lease = pool.acquire()
    lease.wait(s1)  # never-used slot: nothing to wait for
    with torch.cuda.stream(s1):
        x = lease.view("x", (1 << 20,))
        for _ in range(20):  # keep s1 busy so the ordering matters
            x.add_(1.0)
    lease.release(s1)  # host returns at once; the "free" event sits on s1
    nxt = pool.acquire()
    nxt.wait(s2)       # s2 waits for s1's writes on the GPU, no host sync
    with torch.cuda.stream(s2):
        y = nxt.view("x", (1 << 20,)).clone()
    s2.synchronize()
    assert bool((y == 20).all())
    nxt.release(s2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA free-event ordering needs a CUDA device")
def test_cuda_free_event_chain_spans_a_lessee_that_never_used_the_slot() -> None:
    pool = MemBufferPool([BufferSpec("x", (1 << 20,), torch.float32)], 1, "cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    first = pool.acquire()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(50_000_000)               # keep s1 busy: the write lands late
        first.view("x", (1 << 20,)).fill_(1.0)
    first.release(s1)
    pool.acquire().release()                        # dropped before any GPU work: the chain must survive it
    third = pool.acquire()
    third.wait(s2)
    with torch.cuda.stream(s2):
        y = third.view("x", (1 << 20,)).clone()
    s2.synchronize()
    assert bool((y == 1.0).all())
    third.wait_host()                               # host wait: returns once the previous work completed
    third.release(s2)


def test_a_pool_without_buffers_bounds_leases_like_any_other() -> None:
    pool = MemBufferPool([], 2, "cpu", name="limiter")
    first, second = pool.acquire(owner="a"), pool.acquire(owner="b")
    assert first.buffers == {} and pool.slot_bytes == 0
    with pytest.raises(BusyError):
        pool.acquire(timeout=0.0, owner="c")  # both slots out: the bound holds
    first.release()
    third = pool.acquire(timeout=0.0, owner="c")
    with pytest.raises(LeaseError):
        first.release()  # a second release is refused, buffers or not
    second.release()
    third.release()
    assert pool.stats().leased == 0
