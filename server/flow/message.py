"""The binary message container: ``WS /track/stream``'s messages and the ``/track/binary`` and
``/register/binary`` bodies::

    uint32 little-endian N | N bytes of UTF-8 JSON header | the parts' bytes, back to back

The header names each part in ``"parts"`` (in payload order) with its ``nbytes`` and, for raw pixels, its
``shape`` and ``dtype`` (multi-byte values little-endian); a part without ``shape`` is an encoded image (PNG /
JPEG / .npy). Unpacking checks the framing only and copies nothing: the parts are views of the received bytes.
What the header's other keys must hold is :mod:`server.flow.inputs`' business.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.errors import InputError

__all__ = ["MAX_HEADER_BYTES", "Message", "Part", "pack_message", "unpack_message"]

MAX_HEADER_BYTES = 64 * 1024  # a header holds a few ids, K and a pose: far below this
_FRAMING = "uint32 little-endian header length, a JSON header, then the parts"


@dataclass(frozen=True, slots=True)
class Part:
    """One image of a message: its bytes and, for raw pixels, the declared shape and dtype (as sent)."""

    data: bytes | memoryview
    shape: Any = None  # None = an encoded image (PNG / JPEG / .npy)
    dtype: Any = None

    @property
    def raw(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded container: the JSON header (minus ``parts``) and the parts by name."""

    header: dict[str, Any]
    parts: dict[str, Part]


def pack_message(header: Mapping[str, Any], parts: Mapping[str, np.ndarray | bytes]) -> bytes:
    """Build a binary message: arrays go raw (shape and dtype from the array), bytes as encoded images.

    parts: ``{"rgb": (H, W, 3) uint8, "depth": (H, W) uint16 mm or float32 m, "mask": (H, W) uint8}``,
    or PNG/JPEG bytes for any of them.
    """
    described, payload = [], []
    for name, value in parts.items():
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            if array.dtype == np.bool_:
                array = array.astype(np.uint8)
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
            blob = array.astype(dtype, copy=False).tobytes()
            described.append({"name": name, "nbytes": len(blob), "shape": list(array.shape), "dtype": dtype.name})
        else:
            blob = bytes(value)
            described.append({"name": name, "nbytes": len(blob)})
        payload.append(blob)
    head = json.dumps({**header, "parts": described}, separators=(",", ":")).encode("utf-8")
    return b"".join([struct.pack("<I", len(head)), head, *payload])


def unpack_message(data: bytes | memoryview) -> Message:
    """Split a binary message into its header and parts; sizes are checked, nothing is copied.

    Errors are ``InputError`` naming ``message`` (framing, a header that is not a JSON object, or one whose
    numbers Python refuses to read, e.g. an integer of thousands of digits) or the part (its declaration).
    """
    if len(data) < 4:
        raise InputError("message", _FRAMING, f"{len(data)} bytes")
    (n,) = struct.unpack_from("<I", data)
    if n > MAX_HEADER_BYTES or 4 + n > len(data):
        raise InputError("message", f"a header of at most {min(MAX_HEADER_BYTES, len(data) - 4)} bytes",
                         f"a declared header of {n} bytes")
    try:
        header = json.loads(bytes(data[4:4 + n]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, an int beyond Python's digit limit
        raise InputError("message", "a UTF-8 JSON object header", f"undecodable text ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise InputError("message", "a JSON object header", f"JSON {type(header).__name__}")
    declared = header.pop("parts", [])
    if not isinstance(declared, list):
        raise InputError("parts", "a list of {name, nbytes[, shape, dtype]}", type(declared).__name__)
    view = memoryview(data)
    offset, parts = 4 + n, {}
    for item in declared:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InputError("parts", "entries {name, nbytes[, shape, dtype]}", _short(item))
        name, nbytes = item["name"], item.get("nbytes")
        if name in parts:
            raise InputError(_short_name(name), "each part once", "a second part of that name")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or offset + nbytes > len(data):
            raise InputError(_short_name(name), f"nbytes within the {len(data) - offset} bytes left in the message",
                             _short(nbytes))
        parts[name] = Part(view[offset:offset + nbytes], item.get("shape"), item.get("dtype"))
        offset += nbytes
    if offset != len(data):
        raise InputError("message", f"{offset} bytes (header + declared parts)", f"{len(data)} bytes")
    return Message(header, parts)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, ASCII only (a lone surrogate or a control character is
    escaped; an answer must never carry one raw)."""
    return ascii(value)[:limit]


def _short_name(name: str) -> str:
    """A client-chosen part name, safe to use as an error's ``field``."""
    return name if name.isascii() and name.isprintable() and len(name) <= 32 else "parts"
