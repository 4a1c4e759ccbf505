"""What travels between the ingress and a pose replica: plain, picklable values (no Ray types).

A call carries the request's frame as received (a :class:`~server.pose_flow.FrameBytes`: encoded
images or raw pixels; the replica decodes them, so decoding spreads over the replicas) and, for a session, the whole tracking state the step needs (start pose in the centred
frame as float32, default K, frame number), so any replica can serve any session's next frame.
The answer is a :class:`PoseReply`, or the :class:`~server.errors.ErrorInfo` the replica's
``classify`` gave its error (typed errors do not all survive pickling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from server.objects import ObjectEntry
from server.pose_flow import FrameBytes

__all__ = ["ObjectRef", "PoseReply", "RegisterCall", "TrackCall", "object_ref"]


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object of the shared objects directory and the version of its files (path and mtime, ns).

    A replica whose copy has another version (uploaded, or deleted and uploaded again, after the
    replica started) reloads it from the directory before use.
    """

    object_id: str
    version: str


def object_ref(root: Path, entry: ObjectEntry) -> ObjectRef:
    """The reference to ``entry``'s files under ``root`` (the same on every process sharing ``root``)."""
    try:
        mtime = os.stat(Path(root) / entry.mesh_file).st_mtime_ns
    except OSError:
        mtime = -1
    return ObjectRef(entry.object_id, f"{entry.mesh_file}@{mtime}")


@dataclass(frozen=True, slots=True)
class RegisterCall:
    """A register: the frame (with its mask) as sent. session_id: the session the ingress creates on
    success (for logs). request_id: the HTTP request's id (the replica's timing log lines carry it)."""

    obj: ObjectRef
    frame: FrameBytes
    K_text: str
    session_id: str | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class TrackCall:
    """A track step. start: (4, 4) float64 of a session's float32 cam_from_centred (``prev_frame="centred"``)
    or cam_from_mesh (``"mesh"``, a stateless request). session_K / session_hw: a session's K and the
    (H, W) it belongs to, used when ``K_text`` is None (for frames of that size only). frame_no: the
    step's number in its session (the answer is applied only to that frame, so a retried call is
    idempotent); None for stateless calls. prefer_replica: the replica that
    served the session's last frame (read by :class:`~server.serve.routing.SessionAffinityRouter`)."""

    obj: ObjectRef
    frame: FrameBytes
    K_text: str | None
    start: np.ndarray
    prev_frame: str
    session_K: np.ndarray | None = None
    session_hw: tuple[int, int] | None = None
    session_id: str | None = None
    frame_no: int | None = None
    prefer_replica: str | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class PoseReply:
    """cam_from_mesh: (4, 4) float64 (the answer's ``pose``). cam_from_centred: (4, 4) float32, the next tracking state.
    K: the intrinsics used. image_hw: (H, W) pixels. score: register's score (None for track or when
    not finite). replica: the serving replica's id. frame_no: echoed from the call. phases_ms: the
    replica's host phases (decode .. resume, :mod:`server.phases`)."""

    cam_from_mesh: np.ndarray
    cam_from_centred: np.ndarray
    K: np.ndarray
    image_hw: tuple[int, int]
    timings_ms: dict[str, float] = field(default_factory=dict)
    score: float | None = None
    replica: str = ""
    frame_no: int | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
