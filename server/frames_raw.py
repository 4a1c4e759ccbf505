"""Raw frames: pixels with no image codec, their shape and dtype stated by the client.

Two ways to send them:

* **Multipart form fields** (``POST /register``, ``POST /track``): send the pixel bytes as the usual
  ``rgb`` / ``depth`` / ``mask`` file parts and state the layout in form fields:
  ``rgb_shape=480,640,3`` (uint8, RGB order, row-major), ``depth_shape=480,640`` with
  ``depth_dtype=uint16`` (millimetres, 0 = no reading) or ``float32`` (metres, 0 / NaN = no reading),
  ``mask_shape=480,640`` (uint8, > 0 = object). A part without its ``*_shape`` field is an encoded
  image (PNG / JPEG / .npy) as before.
* **One binary message** (the WebSocket ``/track/stream``; see :func:`unpack_message`)::

      uint32 little-endian N | N bytes of UTF-8 JSON header | the parts' bytes, back to back

  The header names each part in ``"parts"`` (in payload order) with its ``nbytes`` and, for raw parts,
  ``shape`` and ``dtype``; a part without ``shape`` is an encoded image (PNG / JPEG / .npy).

Multi-byte values are little-endian. Every declared shape is checked against the server's largest image
(413 naming the field) and the byte count against the shape (422 naming the field) *before* anything is
allocated; raw pixels then become NumPy views of the received bytes (no copy; uint16 depth is converted
to float32 metres in one pass).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.errors import InputError
from server.codecs import depth_m_from_mm
from server.errors import ImageTooLargeError

__all__ = [
    "DEPTH_DTYPES",
    "MAX_HEADER_BYTES",
    "Message",
    "Part",
    "decode_raw_depth",
    "decode_raw_mask",
    "decode_raw_rgb",
    "pack_message",
    "parse_shape",
    "unpack_message",
]

DEPTH_DTYPES = {"uint16": np.dtype("<u2"), "float32": np.dtype("<f4")}
MAX_HEADER_BYTES = 64 * 1024  # a header holds a few ids, K and a pose: far below this


def parse_shape(text: Any, field: str, ndim: int, last: int | None = None) -> tuple[int, ...]:
    """``"480,640,3"`` or ``[480, 640, 3]`` -> (480, 640, 3), checked to have ``ndim`` positive dims."""
    want = ",".join(["H", "W", str(last)] if last else ["H", "W"])
    expected = f"{ndim} comma-separated positive integers {want}"
    if isinstance(text, str):
        items: list[Any] = [p.strip() for p in text.split(",")]
        if len(text) > 64 or not all(p.isdigit() for p in items):
            raise InputError(field, expected, repr(text[:64]))
        dims = tuple(int(p) for p in items)
    elif isinstance(text, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in text):
        dims = tuple(text)
    else:
        raise InputError(field, expected, type(text).__name__)
    if len(dims) != ndim or min(dims) < 1 or (last is not None and dims[-1] != last):
        raise InputError(field, expected, repr(dims))
    return dims


def _checked_view(data: bytes, field: str, shape: tuple[int, ...], dtype: np.dtype,
                  max_hw: tuple[int, int]) -> np.ndarray:
    h, w = shape[0], shape[1]
    max_h, max_w = max_hw
    if h > max_h or w > max_w:
        raise ImageTooLargeError(field, f"{field}: expected an image of at most {max_w}x{max_h} pixels (WxH); "
                                        f"got {w}x{h} declared")
    if h < 2 or w < 2:
        raise InputError(field, "an image of at least 2x2 pixels", f"{w}x{h} declared")
    want = math.prod(shape) * dtype.itemsize
    if len(data) != want:
        raise InputError(field, f"{want} bytes of raw {dtype.name} {shape}", f"{len(data)} bytes",
                         "Send the pixels only, row-major, no header" if len(data) > want else None)
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def decode_raw_rgb(data: bytes, shape: Any, max_hw: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
    """Raw uint8 (H, W, 3) RGB bytes -> a read-only (H, W, 3) uint8 view, or copied into ``out`` (that shape)."""
    view = _checked_view(data, "rgb", parse_shape(shape, "rgb_shape", 3, last=3), np.dtype(np.uint8), max_hw)
    if out is None:
        return view
    np.copyto(out, view)
    return out


def decode_raw_depth(data: bytes, shape: Any, dtype: Any, max_hw: tuple[int, int],
                     out: np.ndarray | None = None) -> np.ndarray:
    """Raw uint16 millimetres or float32 metres (H, W) bytes -> (H, W) float32 metres (a view for float32), or
    written into ``out`` (a float32 array of that shape: one pass from the bytes)."""
    dims = parse_shape(shape, "depth_shape", 2)
    if dtype not in DEPTH_DTYPES:
        raise InputError("depth_dtype", "uint16 (millimetres) or float32 (metres)", repr(dtype))
    view = _checked_view(data, "depth", dims, DEPTH_DTYPES[dtype], max_hw)
    if dtype == "uint16":
        return depth_m_from_mm(view, out)
    if out is None:
        return view
    np.copyto(out, view)
    return out


def decode_raw_mask(data: bytes, shape: Any, max_hw: tuple[int, int]) -> np.ndarray:
    """Raw uint8 (H, W) bytes, > 0 = object -> a read-only (H, W) uint8 view."""
    return _checked_view(data, "mask", parse_shape(shape, "mask_shape", 2), np.dtype(np.uint8), max_hw)


# -- the single-message container --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Part:
    """One image of a message: its bytes and, for raw pixels, the declared shape and dtype."""

    data: bytes | memoryview
    shape: Any = None  # None = an encoded image (PNG / JPEG / .npy)
    dtype: str | None = None
    in_range: bool = False  # raw float32 depth already found in range (validate.depth_in_range) by an ingest worker

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


def unpack_message(data: bytes) -> Message:
    """Split a binary message into its header and parts; sizes are checked, nothing is copied.

    Errors are ``InputError`` naming ``message`` (framing) or the part (its declaration).
    """
    expected = "uint32 little-endian header length, a JSON header, then the parts"
    if len(data) < 4:
        raise InputError("message", expected, f"{len(data)} bytes")
    (n,) = struct.unpack_from("<I", data)
    if n > MAX_HEADER_BYTES or 4 + n > len(data):
        raise InputError("message", f"a header of at most {min(MAX_HEADER_BYTES, len(data) - 4)} bytes",
                         f"a declared header of {n} bytes")
    try:
        header = json.loads(bytes(data[4:4 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
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
            raise InputError("parts", "entries {name, nbytes[, shape, dtype]}", repr(item)[:80])
        name, nbytes = item["name"], item.get("nbytes")
        if name in parts:
            raise InputError(name, "each part once", "a second part of that name")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or offset + nbytes > len(data):
            raise InputError(name, f"nbytes within the {len(data) - offset} bytes left in the message", repr(nbytes))
        parts[name] = Part(view[offset:offset + nbytes], item.get("shape"), item.get("dtype"))
        offset += nbytes
    if offset != len(data):
        raise InputError("message", f"{offset} bytes (header + declared parts)", f"{len(data)} bytes")
    return Message(header, parts)
