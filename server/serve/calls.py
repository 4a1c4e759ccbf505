"""What travels between the ingress and a pose replica: plain, picklable values (no Ray types).

A call carries the request's typed input in the flow's one encoding between processes (:mod:`server.flow.wire`, as
the ingest workers send theirs: a register's K, session and box; a track's K), rebuilt by the replica without
parsing it again, the request's frame beside it as received (a :class:`~server.flow.frames.FrameBytes`: encoded
images or raw pixels; the replica decodes them, so decoding spreads over the replicas), and for a track the whole
:class:`~server.flow.backend.TrackStart` the step needs (start pose, a session's K and image size, frame number), so
any replica can serve any session's next frame. The answer is a :class:`~server.flow.backend.PoseResult`, or the
:class:`~server.errors.ErrorInfo` the replica's ``classify`` gave its error (typed errors do not all survive
pickling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.flow import wire
from server.flow.backend import TrackStart
from server.flow.frames import FrameBytes
from server.flow.inputs import RegisterInput, StreamFrame
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
    """A register: its :class:`~server.flow.inputs.RegisterInput` as :func:`~server.flow.wire.fields_of` writes it
    (``fields``) and its frame (with its mask, unless a box shows the object) as sent. request_id: the HTTP
    request's id (the replica's log lines carry it)."""

    obj: ObjectRef
    fields: dict[str, Any]
    frame: FrameBytes
    request_id: str | None = None

    @property
    def request(self) -> RegisterInput:
        return wire.input_of(self.fields, self.frame)


@dataclass(frozen=True, slots=True)
class TrackCall:
    """A track step: the frame as sent and its K as a :class:`~server.flow.inputs.StreamFrame` in ``fields`` (K None:
    the start's session K), and where it starts (its ``prefer_replica`` is read by
    :class:`~server.serve.routing.SessionAffinityRouter`)."""

    obj: ObjectRef
    fields: dict[str, Any]
    frame: FrameBytes
    start: TrackStart
    request_id: str | None = None

    @property
    def request(self) -> StreamFrame:
        return wire.input_of(self.fields, self.frame)
