"""What travels between the ingress and a pose replica: plain, picklable values (no Ray types).

A call carries the request's frame as received (a :class:`~server.flow.frames.FrameBytes`: encoded images or raw
pixels; the replica decodes them, so decoding spreads over the replicas), K as parsed, and for a track the whole
:class:`~server.flow.backend.TrackStart` the step needs (start pose, a session's K and image size, frame number), so
any replica can serve any session's next frame. The answer is a :class:`~server.flow.backend.PoseResult`, or the
:class:`~server.errors.ErrorInfo` the replica's ``classify`` gave its error (typed errors do not all survive
pickling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.flow.backend import TrackStart
from server.flow.frames import FrameBytes
from server.objects import ObjectEntry

__all__ = ["ObjectRef", "RegisterCall", "TrackCall", "object_ref"]


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object of the shared objects directory and the version of its files (path and mtime, ns).

    A replica whose copy has another version (uploaded, or deleted and uploaded again, after the replica started)
    reloads it from the directory before use.
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
    """A register: the frame (with its mask) as sent, K (3, 3) float64 as parsed. session_id: the session the
    ingress creates on success (for logs). request_id: the HTTP request's id (the replica's log lines carry it).
    box: the object shown by a box (x0, y0, x1, y1 pixels) instead of a mask."""

    obj: ObjectRef
    frame: FrameBytes
    K: np.ndarray
    session_id: str | None = None
    request_id: str | None = None
    box: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class TrackCall:
    """A track step: the frame as sent, K (None: the start's session K) and where it starts (its
    ``prefer_replica`` is read by :class:`~server.serve.routing.SessionAffinityRouter`)."""

    obj: ObjectRef
    frame: FrameBytes
    K: np.ndarray | None
    start: TrackStart
    request_id: str | None = None
