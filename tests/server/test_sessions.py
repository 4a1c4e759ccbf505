"""SessionStore with a fake clock: lazy expiry, sweep, the cap, busy sessions, object deletion."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from deploy_core.errors import BusyError
from foundationpose.errors import UnknownSessionError
from server.errors import SessionLimitError
from server.sessions import SessionStore
from tests.server._helpers import FakeClock, box_object


def _store(clock, **kw) -> SessionStore:
    ids = (f"s{i}" for i in itertools.count())
    return SessionStore(ttl_s=kw.pop("ttl_s", 10.0), max_sessions=kw.pop("max_sessions", 3), clock=clock,
                        id_factory=lambda: next(ids), **kw)


def _add(store, object_id="obj"):
    return store.create(object_id=object_id, obj=box_object(), K=np.eye(3), image_hw=(480, 640), cam_from_centred=np.eye(4),
                        pose=np.eye(4), score=1.0)


def test_lazy_expiry_on_access_and_touch_on_use():
    clock = FakeClock()
    store = _store(clock)
    s = _add(store)
    clock.advance(9)
    assert store.get(s.session_id) is s  # used at t=9: expires at t=19
    clock.advance(9)
    assert store.get(s.session_id) is s
    clock.advance(10.5)
    with pytest.raises(UnknownSessionError, match=r"^session_id: no session 's0'"):
        store.get(s.session_id)
    assert store.expired_total == 1 and len(store) == 0


def test_sweep_removes_only_expired_idle_sessions():
    clock = FakeClock()
    store = _store(clock)
    old, busy, fresh = _add(store), _add(store), None
    clock.advance(8)
    fresh = _add(store)

    async def hold_lock_and_sweep():
        async with busy.lock:  # a request in progress: never expires under it
            clock.advance(5)
            return store.sweep()

    assert asyncio.run(hold_lock_and_sweep()) == 1
    assert old.session_id not in store and busy.session_id in store and fresh.session_id in store
    clock.advance(20)
    assert store.sweep() == 2 and len(store) == 0


def test_cap_evicts_the_least_recently_used_idle_session():
    clock = FakeClock()
    store = _store(clock, max_sessions=2)
    a, b = _add(store), _add(store)
    clock.advance(1)
    store.get(a.session_id)  # b is now the least recently used
    c = _add(store)
    assert set(s for s in (a.session_id, b.session_id, c.session_id) if s in store) == {a.session_id, c.session_id}
    assert store.evicted_total == 1


def test_cap_with_every_session_busy_raises_busy_naming_the_cap():
    store = _store(FakeClock(), max_sessions=1)
    a = _add(store)

    async def try_create():
        async with a.lock:
            with pytest.raises(BusyError, match=r"^the session cap is reached: all 1 tracking sessions have a "
                                                r"request in progress") as info:
                _add(store)
            assert isinstance(info.value, SessionLimitError)

    asyncio.run(try_create())
    assert a.session_id in store


def test_advance_only_updates_live_sessions_and_delete_by_object():
    store = _store(FakeClock(), max_sessions=5)
    a, b, c = _add(store, "x"), _add(store, "x"), _add(store, "y")
    pose = np.eye(4)
    pose[0, 3] = 0.1
    assert store.advance(a, cam_from_centred=pose, pose=pose)
    assert a.frames == 1 and a.pose[0, 3] == 0.1
    assert store.delete_object("x") == 2
    assert not store.advance(b, cam_from_centred=pose, pose=pose) and b.frames == 0
    assert c.session_id in store and len(store) == 1
    store.delete(c.session_id)
    with pytest.raises(UnknownSessionError):
        store.delete(c.session_id)


def test_default_ids_are_unguessable_tokens():
    store = SessionStore(ttl_s=1, max_sessions=10)
    ids = {_add(store).session_id for _ in range(5)}
    assert len(ids) == 5 and all(len(i) >= 22 for i in ids)
