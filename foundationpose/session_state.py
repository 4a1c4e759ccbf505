"""The state of one tracking session, driven by each frame's validity: tracking, uncertain, lost, recovering.

::

                 invalid                  invalid x lost_after_invalid (in a row)
    TRACKING ───────────────> UNCERTAIN ─────────────────────────────────────────> LOST
       ^  ^                      │ valid                                           │  ^
       │  └──────────────────────┘                           valid (track or       │  │ invalid
       │                                                     recovery register)    v  │
       └──────────────────── valid x confirm_frames (in a row) ─────────────── RECOVERING

* A frame is *valid* when :func:`foundationpose.validity.judge_validity` says so.
* ``register(valid, forced=True)``: the client sent a mask or a box (or the session's first register): a valid
  result is trusted at once (TRACKING from any state); an invalid one leaves the session LOST.
* ``register(valid, forced=False)``: an automatic recovery register on a candidate mask: a valid result starts
  RECOVERING (it must hold for ``confirm_frames`` frames in a row before the session reports TRACKING again).
* A frame's pose is reported valid only when the frame is valid *and* the session is TRACKING after it: a LOST or
  RECOVERING session never answers as if its pose were valid (design principle 11).

Pure Python and immutable: :func:`advance` returns the next :class:`SessionState`; the caller keeps it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["SessionConfig", "SessionReport", "SessionState", "State", "advance", "start_session"]


class State(str, enum.Enum):
    """What the session knows about its object (the string values are the HTTP / JSON spelling)."""

    TRACKING = "tracking"  # the last frame's pose is valid
    UNCERTAIN = "uncertain"  # 1 .. lost_after_invalid - 1 invalid frames in a row since TRACKING
    LOST = "lost"  # no valid pose; recovery (re-register without a client mask) is due
    RECOVERING = "recovering"  # a recovered pose is being confirmed


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """lost_after_invalid: invalid frames in a row (from TRACKING) after which the session is LOST; 3 is the
    issue's figure (loss detected within 3 frames). confirm_frames: valid frames in a row a recovery needs before
    the session reports TRACKING (1 = the recovery's own frame is enough)."""

    lost_after_invalid: int = 3
    confirm_frames: int = 2

    def __post_init__(self) -> None:
        for name in ("lost_after_invalid", "confirm_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, eq=False)
class SessionState:
    """state; invalid_run / valid_run: invalid / valid frames in a row ending at the last frame;
    frames_since_valid: frames since the last reported-valid pose (0 = the last frame's; None = never);
    last_valid_cam_from_centred: (4, 4) float32 that pose (recovery searches around it), None before one."""

    state: State = State.LOST
    invalid_run: int = 0
    valid_run: int = 0
    frames_since_valid: int | None = None
    last_valid_cam_from_centred: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class SessionReport:
    """What one frame's answer says about trust: the session's state after it, whether its pose is valid, the
    frame's confidence (None when none was measured) and where its pose came from (``source``: "register",
    "track", "recovery register (region candidate)", ...)."""

    state: State
    pose_valid: bool
    confidence: float | None
    source: str = "track"


def start_session() -> SessionState:
    """A session before its first register: LOST (there is no pose to trust yet)."""
    return SessionState()


def _after_valid_track(s: SessionState, config: SessionConfig) -> State:
    if s.state in (State.TRACKING, State.UNCERTAIN):
        return State.TRACKING
    run = s.valid_run + 1  # LOST -> RECOVERING, or RECOVERING confirming
    return State.TRACKING if run >= config.confirm_frames else State.RECOVERING


def _after_invalid_track(s: SessionState, config: SessionConfig) -> State:
    if s.state is State.TRACKING:
        return State.LOST if config.lost_after_invalid <= 1 else State.UNCERTAIN
    if s.state is State.UNCERTAIN:
        return State.LOST if s.invalid_run + 1 >= config.lost_after_invalid else State.UNCERTAIN
    return State.LOST  # LOST stays; RECOVERING falls back


def advance(s: SessionState, *, valid: bool, cam_from_centred: np.ndarray | None = None,
            register: bool = False, forced: bool = False, config: SessionConfig = SessionConfig()
            ) -> tuple[SessionState, bool]:
    """The next state after one frame, and whether that frame's pose is reported valid.

    valid: the frame's verdict. cam_from_centred: its (4, 4) pose (kept as the last valid one when reported
    valid). register: the frame's pose came from a register; forced: that register was asked for by the client
    (a mask or a box) or is the session's first. A track frame is ``register=False``.
    """
    if forced and not register:
        raise ValueError("forced=True describes a register; pass register=True with it")
    if register and forced:
        new = State.TRACKING if valid else State.LOST
    elif register:  # an automatic recovery register: a candidate, to be confirmed by the next frames
        if valid:
            new = State.TRACKING if config.confirm_frames <= 1 else State.RECOVERING
        else:
            new = State.LOST
    else:
        new = _after_valid_track(s, config) if valid else _after_invalid_track(s, config)
    reported = bool(valid and new is State.TRACKING)
    valid_run = (1 if register else s.valid_run + 1) if valid else 0  # a register starts its own count
    last = s.last_valid_cam_from_centred
    if reported and cam_from_centred is not None:
        last = np.array(cam_from_centred, dtype=np.float32).reshape(4, 4)
        last.setflags(write=False)
    since = 0 if reported else (None if s.frames_since_valid is None else s.frames_since_valid + 1)
    nxt = SessionState(state=new, invalid_run=0 if valid else s.invalid_run + 1, valid_run=valid_run,
                       frames_since_valid=since, last_valid_cam_from_centred=last)
    return nxt, reported
