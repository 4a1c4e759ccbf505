"""Build each object's track steps for an image size before its tracks need them, in one background thread.

A graphed track lane captures the step of each (object, padded batch, H, W) on its first batch, and every other
track submit waits on the runner meanwhile (two eager warm-up steps and a capture per batch size, tens of ms on
the H200). :class:`TrackPreparer` runs ``PoseService.prepare_track(obj, (H, W))`` once per (object, size) as soon
as a register (or a stateless track, a stream start) shows that pair, off the event loop and off every request's
path: requests only schedule it (a lock and a dictionary lookup) and never wait for it.

Guarantees:

* Once per key. A key is the ObjectModel the service sees (its identity, held by a weak reference, so a freed
  object's key can never match a new one at the same address) and the image size. :meth:`forget` drops an
  object's keys (the object store calls it when it drops the object); at most ``max_keys`` are kept (least
  recently scheduled dropped first), so the set stays bounded whatever the clients send. A dropped key that
  comes back is prepared again (a no-op when the lane still holds its steps).
* A failure logs one warning naming the object and the size and is not retried for that key.
* One worker, a daemon started on first use: a stuck capture cannot keep the process alive. :meth:`close`
  cancels what is queued and waits at most its timeout for the one running.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from deploy_core.thread_names import name_native_thread

__all__ = ["TrackPreparer"]

log = logging.getLogger(__name__)

_Key = tuple[int, int, int]  # (id(obj), H, W)


class TrackPreparer:
    """Runs ``prepare(obj, (H, W)) -> int`` (steps newly built) once per (object, size) in its own thread.

    Counters (read under no lock; ints): ``ok`` / ``failed`` prepares finished, ``built`` steps they built.
    """

    def __init__(self, prepare: Callable[[Any, tuple[int, int]], int], *, max_keys: int = 256,
                 thread_name: str = "fp-track-prepare") -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self._prepare = prepare
        self.max_keys = max_keys
        self._thread_name = thread_name
        self._cond = threading.Condition()
        self._keys: OrderedDict[_Key, weakref.ref[Any]] = OrderedDict()
        self._queue: deque[tuple[Any, tuple[int, int], Future[int]]] = deque()
        self._running: Future[int] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.ok = 0
        self.failed = 0
        self.built = 0

    @property
    def key_count(self) -> int:
        """Keys held (scheduled, running or done)."""
        with self._cond:
            return len(self._keys)

    def schedule(self, obj: Any, hw: tuple[int, int]) -> Future[int] | None:
        """Queue the prepare of ``obj`` at ``hw`` (H, W) unless that key was scheduled already; never blocks on the
        work and never raises. Returns the new job's future (its result: the steps built), else None (known key,
        or closed)."""
        h, w = int(hw[0]), int(hw[1])
        key = (id(obj), h, w)
        with self._cond:
            if self._closed:
                return None
            known = self._keys.get(key)
            if known is not None and known() is obj:
                self._keys.move_to_end(key)
                return None
            self._keys[key] = weakref.ref(obj)
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            future: Future[int] = Future()
            self._queue.append((obj, (h, w), future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return future

    def forget(self, obj: Any) -> None:
        """Drop every key of ``obj`` (the object store dropped it); a job already queued still runs."""
        with self._cond:
            for key in [k for k, ref in self._keys.items() if ref() is obj]:
                del self._keys[key]

    def wait_idle(self, timeout: float) -> bool:
        """Block (a thread, not the loop) until nothing is queued or running; False after ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._running is None, timeout)

    def close(self, timeout: float) -> bool:
        """Stop: queued jobs are cancelled, the running one gets at most ``timeout`` s. True when the worker ended
        (or never started); False leaves it behind (a daemon). Idempotent."""
        with self._cond:
            self._closed = True
            while self._queue:
                self._queue.popleft()[2].cancel()
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _loop(self) -> None:
        name_native_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                obj, hw, future = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    self._cond.notify_all()
                    continue
                self._running = future
            self._run(obj, hw, future)
            del obj, future  # a deleted object must not stay alive in this frame until the next job
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _run(self, obj: Any, hw: tuple[int, int], future: Future[int]) -> None:
        """One job: counters first, then the future (whoever sees it done sees the counters)."""
        name = getattr(obj, "name", obj)
        try:
            built = int(self._prepare(obj, hw))
        except Exception as exc:  # noqa: BLE001 - one warning, no retry: its tracks capture lazily instead
            log.warning("track prepare of object %r at %dx%d (WxH) failed, not retried: %s: %s",
                        name, hw[1], hw[0], type(exc).__name__, exc)
            with self._cond:
                self.failed += 1
            future.set_exception(exc)
            return
        log.debug("track prepare of object %r at %dx%d (WxH): %d steps built", name, hw[1], hw[0], built)
        with self._cond:
            self.ok += 1
            self.built += built
        future.set_result(built)
