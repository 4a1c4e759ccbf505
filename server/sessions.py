"""Server-side tracking sessions: the last pose of one object in one camera stream, with expiry and a cap.

A session is created by a successful ``POST /register`` and advanced by ``POST /track``. It keeps the
exact float32 tracking state (``cam_from_centred``, as the reference keeps it between frames), the
mesh-frame pose returned to the client, the intrinsics and the object.

Rules:

* Idle sessions expire ``ttl_s`` seconds after their last use: lazily when looked up, and by
  :meth:`SessionStore.sweep` (the server runs it periodically). A session with a request in progress
  (its lock held) never expires.
* At ``max_sessions`` a new session evicts the least recently used *idle* session; when every session
  is busy, :class:`~server.errors.SessionLimitError` (a ``BusyError``: 503 + Retry-After, naming the cap).
* ``Session.lock`` (an ``asyncio.Lock``, FIFO) serialises the track requests of one session, so frames
  apply in arrival order; the state changes only through :meth:`SessionStore.advance`, i.e. on success.

The store is not thread-safe: it is used from the event loop only. The clock is injectable (tests).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from foundationpose.errors import UnknownSessionError
from foundationpose.mesh import ObjectModel
from foundationpose.recovery import DEFAULT_RECOVERY, RecoveryConfig
from foundationpose.session_state import State
from foundationpose.session_trust import SessionTrust
from server.errors import SessionLimitError
from server.metrics import Family

__all__ = ["Session", "SessionStore"]

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 30.0  # how often expired sessions are removed


def _new_session_id() -> str:
    return secrets.token_urlsafe(16)  # 128 random bits: ids cannot be guessed


@dataclass(eq=False, slots=True)
class Session:
    """One tracking stream.

    cam_from_centred: (4, 4) float32, the tracking state. pose: (4, 4) float64 cam_from_mesh (metres).
    K: (3, 3) float64 pixels (the default for track requests without K, for frames of ``image_hw`` only).
    image_hw: (H, W) of the register frame K belongs to; None for a session started from a given pose (a
    stream's ``start`` message), until its first answered frame sets it. score: register's score (NaN
    for a started session).
    created_s / last_used_s: clock readings (seconds). frames: successful track steps so far.
    replica: the Ray Serve pose replica that served the last frame (kept by :mod:`server.serve`'s ingress
    for routing; None elsewhere). trust: the session's state (tracking, uncertain, lost, recovering), its
    recovery and the pose it shows (:class:`~foundationpose.session_trust.SessionTrust`).
    """

    session_id: str
    object_id: str
    obj: ObjectModel
    K: np.ndarray
    image_hw: tuple[int, int] | None
    cam_from_centred: np.ndarray
    pose: np.ndarray
    score: float
    created_s: float
    last_used_s: float
    frames: int = 0
    replica: str | None = None
    trust: SessionTrust | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        if self.trust is None:
            self.trust = SessionTrust(self.obj)

    @property
    def busy(self) -> bool:
        return self.lock.locked()


class SessionStore:
    """Sessions by id, least recently used first (see the module docstring for the rules)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
        id_factory: Callable[[], str] = _new_session_id,
        recovery: RecoveryConfig | None = DEFAULT_RECOVERY,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions!r}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.recovery = recovery  # how a lost session recovers (None: it does not by itself)
        self._new_id = id_factory
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.created_total = 0
        self.expired_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def _expired(self, session: Session, now: float) -> bool:
        return not session.busy and now - session.last_used_s > self.ttl_s

    def create(
        self,
        *,
        object_id: str,
        obj: ObjectModel,
        K: np.ndarray,
        image_hw: tuple[int, int] | None,
        cam_from_centred: np.ndarray,
        pose: np.ndarray,
        score: float,
        session_id: str | None = None,
    ) -> Session:
        """Add a session (evicting the least recently used idle one at the cap).

        session_id: an id drawn beforehand with :meth:`new_id` (the Ray Serve ingress routes the register
        by it); None draws one now.
        """
        now = self.clock()
        if len(self._sessions) >= self.max_sessions:
            self.sweep()
        if len(self._sessions) >= self.max_sessions:
            victim = next((s for s in self._sessions.values() if not s.busy), None)
            if victim is None:
                raise SessionLimitError(
                    f"the session cap is reached: all {self.max_sessions} tracking sessions have a request in "
                    "progress, so none can be evicted for a new one (raise max_sessions in the --config file, or end "
                    "sessions with DELETE /sessions/{session_id})"
                )
            del self._sessions[victim.session_id]
            self.evicted_total += 1
            log.info("session cap %d reached: evicted the least recently used session %s (object %s)",
                     self.max_sessions, victim.session_id, victim.object_id)
        if session_id is None:
            session_id = self.new_id()
        elif session_id in self._sessions:
            raise ValueError(f"session_id {session_id!r} is already in use")
        session = Session(
            session_id=session_id,
            object_id=object_id,
            obj=obj,
            K=np.array(K, dtype=np.float64),
            image_hw=None if image_hw is None else (int(image_hw[0]), int(image_hw[1])),
            cam_from_centred=np.array(cam_from_centred, dtype=np.float32),
            pose=np.array(pose, dtype=np.float64),
            score=float(score),
            created_s=now,
            last_used_s=now,
            trust=SessionTrust(obj, recovery=self.recovery),
        )
        self._sessions[session_id] = session
        self.created_total += 1
        return session

    async def sweep_every(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Expire idle sessions every ``interval_s`` seconds until cancelled (a failed sweep is logged)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.sweep()
            except Exception:  # never let the sweeper die silently
                log.exception("session sweep failed")

    def new_id(self) -> str:
        """A fresh session id (not in use now)."""
        session_id = self._new_id()
        while session_id in self._sessions:
            session_id = self._new_id()
        return session_id

    def get(self, session_id: str) -> Session:
        """The live session (marked as used now); UnknownSessionError if absent or expired."""
        session = self._sessions.get(session_id)
        now = self.clock()
        if session is not None and self._expired(session, now):
            self._remove(session, expired=True)
            session = None
        if session is None:
            raise UnknownSessionError(f"session_id: no session {session_id!r} (never created, expired or deleted)")
        session.last_used_s = now
        self._sessions.move_to_end(session_id)
        return session

    def peek(self, session_id: str) -> Session | None:
        """The stored session without touching its idle timer or expiring it (None if absent)."""
        return self._sessions.get(session_id)

    def is_live(self, session: Session) -> bool:
        """Whether ``session`` is still stored (not deleted, evicted or expired meanwhile)."""
        return self._sessions.get(session.session_id) is session

    def advance(self, session: Session, *, cam_from_centred: np.ndarray, pose: np.ndarray,
                image_hw: tuple[int, int] | None = None, K: np.ndarray | None = None) -> bool:
        """Record a successful step (a track, counted in ``frames``, or with ``K`` a register of the session's
        object); False (nothing changed) if the session is gone.

        image_hw: the (H, W) of the frame; it becomes the session's ``image_hw`` when that is still None (a
        session started from a given pose: its K belongs to its first frame's size), or with ``K`` (a register
        on the client's mask: the session's K and size are that frame's from now on).
        """
        if not self.is_live(session):
            return False
        if K is not None:
            session.K = np.array(K, dtype=np.float64)
            session.image_hw = None
        if session.image_hw is None and image_hw is not None:
            session.image_hw = (int(image_hw[0]), int(image_hw[1]))
        session.cam_from_centred = np.array(cam_from_centred, dtype=np.float32)
        session.pose = np.array(pose, dtype=np.float64)
        if K is None:  # a track step (a register brings its own K): counted in ``frames``
            session.frames += 1
        session.last_used_s = self.clock()
        self._sessions.move_to_end(session.session_id)
        return True

    def delete(self, session_id: str) -> Session:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise UnknownSessionError(f"session_id: no session {session_id!r} (never created, expired or deleted)")
        return session

    def delete_object(self, object_id: str) -> int:
        """End every session of ``object_id``; returns how many."""
        doomed = [s for s in self._sessions.values() if s.object_id == object_id]
        for session in doomed:
            del self._sessions[session.session_id]
        return len(doomed)

    def sweep(self) -> int:
        """Remove every expired session; returns how many."""
        now = self.clock()
        doomed = [s for s in self._sessions.values() if self._expired(s, now)]
        for session in doomed:
            self._remove(session, expired=True)
        if doomed:
            log.info("expired %d idle sessions (ttl %.0f s)", len(doomed), self.ttl_s)
        return len(doomed)

    def _remove(self, session: Session, *, expired: bool) -> None:
        del self._sessions[session.session_id]
        if expired:
            self.expired_total += 1

    def families(self) -> list[Family]:
        """The store's gauges and counters for ``/metrics``."""
        return [
            Family("fp_sessions_active", "gauge", "Live tracking sessions.").add(len(self)),
            Family("fp_sessions_busy", "gauge", "Sessions with a request in progress.").add(self.busy_count()),
            self._by_state(),
            Family("fp_sessions_created_total", "counter", "Sessions created.").add(self.created_total),
            Family("fp_sessions_expired_total", "counter", "Sessions expired after idling.").add(self.expired_total),
            Family("fp_sessions_evicted_total", "counter", "Idle sessions evicted at the session cap.")
            .add(self.evicted_total),
        ]

    def _by_state(self) -> Family:
        counts = Counter(s.trust.state.state.value for s in self._sessions.values())
        family = Family("fp_sessions_by_state", "gauge", "Live sessions by state (tracking, uncertain, lost, "
                                                         "recovering).")
        for state in State:
            family.add(counts.get(state.value, 0), state=state.value)
        return family

    def busy_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.busy)
