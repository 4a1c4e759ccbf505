"""What a pose request says, parsed once from whichever transport carried it.

Every transport turns its request into one of these typed values with the functions below, so the same
request is refused the same way (the same ``InputError``, naming the same field) wherever it came in:

* :class:`RegisterInput`: ``POST /register`` (multipart), ``POST /register/binary``, a stream's ``register``;
* :class:`TrackInput`: ``POST /track`` (multipart), ``POST /track/binary`` (either port);
* :class:`SessionsTrackInput`: ``POST /track/sessions`` (several sessions, one frame);
* :class:`StartInput`: a stream's ``start`` (a session from a known pose, no register);
* :class:`StreamFrame`: a stream's ``frame``.

Parsing checks what a field holds (ids, the structure and range of JSON numbers, which fields go together),
never the images themselves (:mod:`server.flow.frames`) nor the values' plausibility for an image
(:mod:`server.flow.validation`). K and pose arrive as JSON text (form fields) or nested lists (a binary header)
and leave as float64 arrays; a number that float64 cannot hold, NaN or inf is refused here, so nothing
downstream ever sees one. Unknown header keys are ignored (and never forwarded).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.errors import InputError
from server.fields import EXPECTED, K_EXPECTED, MAX_SESSIONS_PER_FRAME, POSE_EXPECTED, check_id
from server.flow.frames import FrameBytes, frame_of_parts
from server.flow.message import Message, unpack_message

__all__ = [
    "FRAME_NUMBER_RANGE",
    "RegisterInput",
    "SessionsTrackInput",
    "StartInput",
    "StreamFrame",
    "TrackInput",
    "frame_number",
    "parse_K",
    "parse_box",
    "parse_matrix",
    "parse_pose",
    "register_input",
    "register_of_body",
    "register_of_message",
    "sessions_track_input",
    "start_of_message",
    "stream_frame_of_message",
    "track_input",
    "track_of_body",
]

_MAX_JSON_CHARS = 4096
FRAME_NUMBER_RANGE = (-(2**63), 2**63 - 1)  # a stream frame number is a signed 64-bit integer


@dataclass(frozen=True, slots=True)
class RegisterInput:
    """A register: the object, K (3, 3) float64 pixels as sent (checked against the image later) and the frame
    with its mask (None: the transport reads it once the register is admitted). session_id: re-register that
    session (None: a new session). box: (x0, y0, x1, y1) pixels instead of a mask (the server finds the object's
    mask in the box's depth; checked against the image later)."""

    object_id: str
    K: np.ndarray
    frame: FrameBytes | None = None
    session_id: str | None = None
    box: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class TrackInput:
    """A track: of a session (``session_id``), or stateless (``object_id`` + the previous ``pose``, 4x4
    cam_from_mesh float64 metres, and K). K (3, 3) float64 or None (a session's own K)."""

    frame: FrameBytes
    session_id: str | None = None
    object_id: str | None = None
    K: np.ndarray | None = None
    pose: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class SessionsTrackInput:
    """Several sessions tracked into one frame (one object each, or several instances of one object): their
    distinct ids, in the order of the answer, and K (3, 3) float64 for this frame (None: each session's own)."""

    frame: FrameBytes
    session_ids: tuple[str, ...]
    K: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class StartInput:
    """A stream's start: a session of ``object_id`` from the known ``pose`` (4x4 cam_from_mesh) with intrinsics K."""

    object_id: str
    K: np.ndarray
    pose: np.ndarray


@dataclass(frozen=True, slots=True)
class StreamFrame:
    """A stream's frame: its images and K for this frame only (None: the session's)."""

    frame: FrameBytes
    K: np.ndarray | None = None


# -- values -----------------------------------------------------------------------------------------------------------
def parse_matrix(value: Any, field: str, expected: str) -> np.ndarray:
    """A JSON matrix (text, or the nested lists of a parsed header) -> float64 array of its rows.

    InputError naming ``field`` for: nothing, text that is not JSON (or too long), anything but a list of lists
    of numbers, rows of different lengths, a number float64 cannot hold (an integer of 400 digits), NaN or inf."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise InputError(field, expected, "nothing")
    if isinstance(value, str):
        if len(value) > _MAX_JSON_CHARS:
            raise InputError(field, expected, f"{len(value)} characters of text")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; an integer beyond Python's digit limit
            where = f" ({exc.msg} at char {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
            raise InputError(field, expected, f"text that is not JSON{where}") from exc
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise InputError(field, expected, f"JSON {_json_type(value)}")
    rows = []
    for row in value:
        floats = []
        for item in row:
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise InputError(field, expected, f"a non-number entry {ascii(item)[:40]}")
            try:
                floats.append(float(item))
            except OverflowError:
                raise InputError(field, expected, "a number beyond float64's range") from None
        rows.append(floats)
    if len({len(row) for row in rows}) > 1:
        raise InputError(field, expected, "rows of different lengths")
    out = np.array(rows, dtype=np.float64)
    if not np.isfinite(out).all():
        raise InputError(field, "finite values", "NaN or inf")
    return out


def parse_K(value: Any) -> np.ndarray:
    """Intrinsics (pixels) as sent -> float64 array (shape and plausibility: ``validate.validate_K`` with the image)."""
    return parse_matrix(value, "K", K_EXPECTED)


def parse_pose(value: Any, field: str = "pose") -> np.ndarray:
    """A 4x4 ``cam_from_mesh`` (metres) as sent -> float64 array (checked by ``validate.validate_pose``)."""
    return parse_matrix(value, field, POSE_EXPECTED)


def parse_box(value: Any) -> tuple[int, int, int, int] | None:
    """A box as sent (``"x0,y0,x1,y1"`` or a list of 4 integers; None: not sent) -> (x0, y0, x1, y1) with
    0 <= x0 < x1 and 0 <= y0 < y1 (its fit to the image is checked with the image)."""
    if value is None:
        return None
    expected = EXPECTED["box"]
    if isinstance(value, str):
        items = value.split(",")
        if len(value) > 64 or not all(p.isascii() and p.isdigit() for p in items):
            raise InputError("box", expected, ascii(value[:64]))
        numbers = [int(p) for p in items]
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        numbers = list(value)
    else:
        raise InputError("box", expected, _shown(value))
    if len(numbers) != 4:
        raise InputError("box", expected, f"{len(numbers)} numbers")
    x0, y0, x1, y1 = numbers
    if not (0 <= x0 < x1 and 0 <= y0 < y1):
        raise InputError("box", expected, ascii(tuple(numbers))[:80])
    return x0, y0, x1, y1


def register_input(object_id: str, K: Any, *, box: Any, has_mask: bool,
                   session_id: str | None = None) -> RegisterInput:
    """A register's values (the frame follows); InputError naming ``mask`` unless exactly one of a mask and a box
    comes with it."""
    if has_mask and box is not None:
        raise InputError("mask", "a mask or a box, not both", "both")
    if not has_mask and box is None:
        raise InputError("mask", EXPECTED["mask"] + ", or a box x0,y0,x1,y1 around the object",
                         "nothing (the field is missing or empty)")
    return RegisterInput(object_id, parse_K(K), session_id=session_id, box=parse_box(box))


def frame_number(value: Any) -> int | None:
    """A stream frame's number: None (not sent: the server counts), or an integer in :data:`FRAME_NUMBER_RANGE`."""
    if value is None:
        return None
    lo, hi = FRAME_NUMBER_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InputError("frame", "an integer frame number in [-2^63, 2^63)", _shown(value))
    return value


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {len(str(abs(value)))} digits"
    return ascii(value)[:40]


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def _optional_id(header: dict[str, Any], field: str) -> str | None:
    value = header.get(field)
    return None if value is None else check_id(value, field)


def _object_id(header: dict[str, Any]) -> str:
    value = header.get("object_id")
    if not isinstance(value, str):
        raise InputError("object_id", "the id of a loaded object (GET /objects)", _shown(value))
    return check_id(value, "object_id")


# -- requests -----------------------------------------------------------------------------------------------------------
def track_input(frame: FrameBytes, *, session_id: str | None, object_id: str | None, K: Any, pose: Any) -> TrackInput:
    """A track of either kind (K and pose as sent: JSON text, lists, or None); InputError naming the field when
    session_id comes with pose or object_id, or neither kind is complete."""
    if session_id is not None:
        if pose is not None or object_id is not None:
            given = " and ".join(n for n, v in (("pose", pose), ("object_id", object_id)) if v is not None)
            raise InputError("session_id", "either session_id, or pose and object_id (stateless), not both",
                             "session_id with " + given)
        return TrackInput(frame, session_id=session_id, K=None if K is None else parse_K(K))
    if pose is None or object_id is None:
        raise InputError("session_id", "a session_id, or pose and object_id for stateless tracking",
                         "neither" if pose is None and object_id is None else "only one of pose and object_id")
    return TrackInput(frame, object_id=object_id, K=None if K is None else parse_K(K), pose=parse_pose(pose))


def sessions_track_input(frame: FrameBytes, *, session_ids: Any, K: Any) -> SessionsTrackInput:
    """A several-session track: ``session_ids`` as sent (comma-separated text, or a list of ids), 1 to
    :data:`MAX_SESSIONS_PER_FRAME` distinct ids; InputError naming ``session_ids`` otherwise."""
    expected = EXPECTED["session_ids"]
    if isinstance(session_ids, str):
        ids = session_ids.split(",")
    elif isinstance(session_ids, list) and all(isinstance(part, str) for part in session_ids):
        ids = list(session_ids)
    else:
        raise InputError("session_ids", expected, "nothing" if session_ids is None else _shown(session_ids))
    if not ids or len(ids) > MAX_SESSIONS_PER_FRAME:
        raise InputError("session_ids", expected, f"{len(ids)} ids")
    for part in ids:
        check_id(part, "session_ids")
    if len(set(ids)) != len(ids):
        twice = sorted({part for part in ids if ids.count(part) > 1})
        raise InputError("session_ids", expected, f"{ascii(twice[0])[:80]} more than once")
    return SessionsTrackInput(frame, tuple(ids), K=None if K is None else parse_K(K))


def _typed_message(data: bytes | memoryview, kind: str) -> Message:
    """A binary body in the message container whose header ``type`` is ``kind`` or absent."""
    message = unpack_message(data)
    got = message.header.get("type", kind)
    if got != kind:
        raise InputError("type", f"{kind!r} or no type", _shown(got))
    return message


def track_of_body(data: bytes | memoryview) -> TrackInput:
    """A ``POST /track/binary`` body: the container with the fields of ``POST /track``'s form in its header."""
    header = (message := _typed_message(data, "frame")).header
    return track_input(frame_of_parts(message.parts, with_mask=False), session_id=_optional_id(header, "session_id"),
                       object_id=_optional_id(header, "object_id"), K=header.get("K"), pose=header.get("pose"))


def register_of_message(message: Message) -> RegisterInput:
    """A register message (the stream's, or a ``POST /register/binary`` body's): a ``mask`` part, or a ``box`` in
    its header."""
    header = message.header
    values = register_input(_object_id(header), header.get("K"), box=header.get("box"), has_mask="mask" in message.parts,
                            session_id=_optional_id(header, "session_id"))
    return dataclasses.replace(values, frame=frame_of_parts(message.parts, with_mask=values.box is None))


def register_of_body(data: bytes | memoryview) -> RegisterInput:
    """A ``POST /register/binary`` body."""
    return register_of_message(_typed_message(data, "register"))


def start_of_message(message: Message) -> StartInput:
    """A stream's start message: no parts, the object, K and the pose to start from."""
    if message.parts:
        raise InputError("parts", "no parts in a start message (frames follow as frame messages)",
                         f"parts {ascii(sorted(message.parts))[:80]}")
    header = message.header
    object_id = _object_id(header)
    return StartInput(object_id, parse_K(header.get("K")), parse_pose(header.get("pose")))


def stream_frame_of_message(message: Message) -> StreamFrame:
    """A stream's frame message: its images and an optional K."""
    K = message.header.get("K")
    return StreamFrame(frame_of_parts(message.parts, with_mask=False), None if K is None else parse_K(K))

