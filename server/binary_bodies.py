"""The binary bodies of ``POST /track/binary`` and ``POST /register/binary``: the WebSocket stream's message
container (:mod:`server.frames_raw`) read into the fields of their multipart twins.

Torch-free on purpose: the ingest workers (:mod:`server.ingest`) parse these bodies in their own processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from foundationpose.errors import InputError
from server import frames_raw, pose_flow
from server.errors import UnsupportedMediaTypeError
from server.fields import check_id

__all__ = ["BINARY_CONTENT_TYPE", "BinaryRegister", "BinaryTrack", "parse_binary_register", "parse_binary_track",
           "read_binary_body"]

BINARY_CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class BinaryTrack:
    """What a ``POST /track/binary`` body says: the frame, and the form fields of ``POST /track``."""

    frame: pose_flow.FrameBytes
    session_id: str | None
    object_id: str | None
    K_text: str | None
    pose_text: str | None


async def read_binary_body(request: Request, form_path: str = "/track") -> bytes:
    """The body of a ``POST /track/binary`` or ``/register/binary`` (UnsupportedMediaTypeError, 415, unless it is
    application/octet-stream). form_path: the multipart twin, named in the message."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != BINARY_CONTENT_TYPE:
        got = repr(content_type[:60]) if content_type else "none"
        raise UnsupportedMediaTypeError(
            f"Content-Type: expected {BINARY_CONTENT_TYPE} (multipart forms go to POST {form_path}); got {got}",
            field="Content-Type")
    return await request.body()


def _unpack_body(data: bytes, kind: str) -> frames_raw.Message:
    """A binary body in the stream's container whose header ``type`` is ``kind`` or absent."""
    message = frames_raw.unpack_message(data)
    got = message.header.get("type", kind)
    if got != kind:
        raise InputError("type", f"{kind!r} or no type", repr(got)[:40])
    return message


def parse_binary_track(data: bytes) -> BinaryTrack:
    """Unpack a ``POST /track/binary`` body (the stream's message container); InputError naming the bad field."""
    message = _unpack_body(data, "frame")
    header = message.header
    session_id, object_id = header.get("session_id"), header.get("object_id")
    if session_id is not None:
        check_id(session_id, "session_id")
    if object_id is not None:
        check_id(object_id, "object_id")
    K_value, pose_value = header.get("K"), header.get("pose")
    return BinaryTrack(
        frame=pose_flow.frame_of_parts(message.parts, with_mask=False), session_id=session_id, object_id=object_id,
        K_text=None if K_value is None else pose_flow.json_text_of(K_value),
        pose_text=None if pose_value is None else pose_flow.json_text_of(pose_value),
    )


@dataclass(frozen=True, slots=True)
class BinaryRegister:
    """What a ``POST /register/binary`` body says: the object, K (JSON text) and the frame with its mask."""

    object_id: str
    K_text: str
    frame: pose_flow.FrameBytes


def parse_binary_register(data: bytes) -> BinaryRegister:
    """Unpack a ``POST /register/binary`` body (the stream's register message); InputError naming the bad field."""
    message = _unpack_body(data, "register")
    header = message.header
    object_id = pose_flow.header_object_id(header)
    check_id(object_id, "object_id")
    return BinaryRegister(object_id=object_id, K_text=pose_flow.json_text_of(header.get("K")),
                          frame=pose_flow.frame_of_parts(message.parts, with_mask=True))
