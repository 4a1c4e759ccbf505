"""The request flow's typed inputs between the processes of one server: one encoding, written once, read once.

A process that parsed a request (:mod:`server.flow.inputs`: an ingest worker, the Ray Serve ingress) hands the
typed value on as :func:`fields_of` it (plain JSON) and its frame's images beside it; the process that runs the
step (the GPU process's ingest hub, a Serve pose replica: :mod:`server.serve.calls`) rebuilds the value with
:func:`input_of`, without parsing it again: the fields were checked where they were written, by the same parsers,
and only this server's own processes write them. ::

    {"kind": "track",    "session_id", "object_id", "K", "pose"}     TrackInput
    {"kind": "register", "object_id", "K", "session_id", "box"}      RegisterInput
    {"kind": "start",    "object_id", "K", "pose"}                   StartInput
    {"kind": "frame",    "K"}                                        StreamFrame
    {"kind": "sessions", "session_ids", "K"}                         SessionsTrackInput

K and pose are rows of float64 (JSON writes a finite float64 exactly), None where the request had none; a box is
its four integers. The images are not part of the fields: an ingest worker's travel in a slot of its frame ring
(:func:`server.ingest.relay.slot_frame`), a Serve call's as the bytes received, and :func:`input_of` takes them as
a :class:`~server.flow.frames.FrameBytes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from server.flow.frames import FrameBytes
from server.flow.inputs import RegisterInput, SessionsTrackInput, StartInput, StreamFrame, TrackInput

__all__ = ["KINDS", "Input", "fields_of", "has_frame", "input_of"]

Input = TrackInput | RegisterInput | StartInput | StreamFrame | SessionsTrackInput
KINDS = {TrackInput: "track", RegisterInput: "register", StartInput: "start", StreamFrame: "frame",
         SessionsTrackInput: "sessions"}


def _rows(value: np.ndarray | None) -> list | None:
    return None if value is None else value.tolist()


def _array(rows: list | None) -> np.ndarray | None:
    return None if rows is None else np.array(rows, dtype=np.float64)


def fields_of(value: Input) -> dict[str, Any]:
    """The typed input's fields as plain JSON values, tagged with its ``kind`` (its frame travels beside them)."""
    kind = KINDS[type(value)]
    if isinstance(value, TrackInput):
        return {"kind": kind, "session_id": value.session_id, "object_id": value.object_id, "K": _rows(value.K),
                "pose": _rows(value.pose)}
    if isinstance(value, RegisterInput):
        return {"kind": kind, "object_id": value.object_id, "K": _rows(value.K), "session_id": value.session_id,
                "box": None if value.box is None else list(value.box)}
    if isinstance(value, StartInput):
        return {"kind": kind, "object_id": value.object_id, "K": _rows(value.K), "pose": _rows(value.pose)}
    if isinstance(value, StreamFrame):
        return {"kind": kind, "K": _rows(value.K)}
    return {"kind": kind, "session_ids": list(value.session_ids), "K": _rows(value.K)}


def has_frame(value: Input) -> bool:
    """Whether ``value`` comes with images (all but a stream's start)."""
    return not isinstance(value, StartInput)


def input_of(fields: dict[str, Any], frame: FrameBytes | None) -> Input:
    """The typed input that :func:`fields_of` wrote, with ``frame`` its images (None for a start); ValueError naming
    an unknown ``kind`` (a peer of another version)."""
    kind = fields.get("kind")
    if kind == "track":
        return TrackInput(frame, session_id=fields["session_id"], object_id=fields["object_id"],
                          K=_array(fields["K"]), pose=_array(fields["pose"]))
    if kind == "register":
        box = fields["box"]
        return RegisterInput(fields["object_id"], _array(fields["K"]), frame, session_id=fields["session_id"],
                             box=None if box is None else tuple(box))
    if kind == "start":
        return StartInput(fields["object_id"], _array(fields["K"]), _array(fields["pose"]))
    if kind == "frame":
        return StreamFrame(frame, _array(fields["K"]))
    if kind == "sessions":
        return SessionsTrackInput(frame, tuple(fields["session_ids"]), _array(fields["K"]))
    raise ValueError(f"unknown input kind {kind!r}")
