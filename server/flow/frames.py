"""A request's images, from the bytes received to arrays: the one decode of every transport.

A frame arrives as :class:`FrameBytes`: each image either encoded (PNG / JPEG, ``.npy`` depth; decoded by
:mod:`server.codecs`) or raw pixels whose layout the client states (multipart ``*_shape`` / ``depth_dtype`` form
fields, or a binary message part's ``shape`` / ``dtype``):

* rgb: ``H,W,3`` uint8, RGB order, row-major;
* depth: ``H,W`` of ``uint16`` (millimetres, 0 = no reading) or ``float32`` (metres, 0 / NaN = no reading);
* mask: ``H,W`` uint8, > 0 = object.

Every declared shape is checked against the server's largest image (413 naming the field) and the byte count
against the shape (422 naming the field) *before* anything is allocated; raw pixels then become NumPy views of
the received bytes (no copy; uint16 depth is converted to float32 metres in one pass).

:func:`decode_frame` decodes into new arrays (the main port, a Serve replica) or, given ``into``, straight into
the caller's buffers (an ingest worker's shared-memory slot). Value rules (finiteness, units, K's fit) come
after, once per request (:mod:`server.flow.validation`: ``foundationpose.validate``'s rules, among them depth in
metres saved as millimetres and a K of another image size).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.errors import InputError
from foundationpose.validate import check_image_sizes, depth_in_range
from server import codecs
from server.errors import ImageTooLargeError
from server.flow.message import Part
from server.phases import Phases

__all__ = ["DEPTH_DTYPES", "Decoded", "Destination", "FrameBytes", "decode_frame", "frame_of_parts", "parse_shape",
           "raw_frame", "raw_hw", "received_as"]

DEPTH_DTYPES = {"uint16": np.dtype("<u2"), "float32": np.dtype("<f4")}
_UINT8 = np.dtype(np.uint8)

# (H, W) -> (rgb (H, W, 3) uint8, depth (H, W) float32, mask (H, W) uint8 or None): buffers to decode into
Destination = Callable[[tuple[int, int]], tuple[np.ndarray, np.ndarray, "np.ndarray | None"]]


@dataclass(frozen=True, slots=True)
class FrameBytes:
    """The images of one request as received; a ``*_shape`` set = raw pixels of that layout.

    depth_in_range: the depth is raw float32 already found in range by the process that decoded it (an ingest
    worker, :func:`foundationpose.validate.depth_in_range`): validation then skips its value checks."""

    rgb: bytes | memoryview
    depth: bytes | memoryview
    mask: bytes | memoryview | None = None
    rgb_shape: Any = None
    depth_shape: Any = None
    depth_dtype: Any = None
    mask_shape: Any = None
    depth_in_range: bool = False


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded frame: rgb (H, W, 3) uint8, depth (H, W) float metres, mask (H, W) or None. in_range: the depth
    was found in range while decoding (only with ``into``, where it is the receiver's to skip the checks)."""

    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray | None
    in_range: bool = False

    @property
    def hw(self) -> tuple[int, int]:
        return int(self.rgb.shape[0]), int(self.rgb.shape[1])

    def __iter__(self):  # rgb, depth, mask = decode_frame(...)
        return iter((self.rgb, self.depth, self.mask))


def frame_of_parts(parts: dict[str, Part], *, with_mask: bool) -> FrameBytes:
    """The images of a binary message's parts; InputError naming a missing part, or a raw rgb / mask whose declared
    dtype is not ``uint8`` (depth's dtype is checked where it is decoded: it has two)."""
    names = ("rgb", "depth", "mask") if with_mask else ("rgb", "depth")
    for name in names:
        if name not in parts:
            raise InputError(name, f"a part named {name!r}", f"parts {ascii(sorted(parts))[:80]}")
    rgb, depth = parts["rgb"], parts["depth"]
    mask = parts["mask"] if with_mask else None
    for name, part in (("rgb", rgb), ("mask", mask)):
        if part is not None and part.raw and part.dtype not in (None, "uint8"):
            raise InputError(name, "raw pixels of dtype 'uint8'", f"dtype {ascii(part.dtype)[:40]}")
    return FrameBytes(
        rgb.data, depth.data, None if mask is None else mask.data,
        rgb_shape=rgb.shape if rgb.raw else None,
        depth_shape=depth.shape if depth.raw else None,
        depth_dtype=(depth.dtype or "") if depth.raw else None,
        mask_shape=mask.shape if mask is not None and mask.raw else None)


_ENCODED = {"png": "PNG", "jpeg": "JPEG", "npy": ".npy"}
_DEPTH_ENCODED = {"png": "16-bit PNG (uint16 millimetres)", "npy": "float32 .npy (metres)"}


def received_as(frame: FrameBytes) -> dict[str, str]:
    """How each image of ``frame`` came, as the client sent it (the decoded arrays are all uint8 / float32), for
    messages: ``{"rgb": "PNG", "depth": "16-bit PNG (uint16 millimetres)", "mask": "raw uint8 array"}``."""
    def encoded(data: bytes | memoryview, names: dict[str, str]) -> str:
        kind = codecs.sniff(bytes(data[:8]))
        return names.get(kind, _ENCODED.get(kind, "image file"))

    out = {"rgb": "raw uint8 array" if frame.rgb_shape is not None else encoded(frame.rgb, _ENCODED)}
    raw_depth = frame.depth_shape is not None or frame.depth_dtype is not None
    out["depth"] = f"raw {frame.depth_dtype} array" if raw_depth else encoded(frame.depth, _DEPTH_ENCODED)
    if frame.mask is not None:
        out["mask"] = "raw uint8 array" if frame.mask_shape is not None else encoded(frame.mask, _ENCODED)
    return out


def parse_shape(text: Any, field: str, ndim: int, last: int | None = None) -> tuple[int, ...]:
    """``"480,640,3"`` or ``[480, 640, 3]`` -> (480, 640, 3), checked to have ``ndim`` positive dims."""
    want = ",".join(["H", "W", str(last)] if last else ["H", "W"])
    expected = f"{ndim} comma-separated positive integers {want}"
    if isinstance(text, str):
        items: list[Any] = [p.strip() for p in text.split(",")]
        if len(text) > 64 or not all(p.isascii() and p.isdigit() for p in items):
            raise InputError(field, expected, ascii(text[:64]))
        dims = tuple(int(p) for p in items)
    elif isinstance(text, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in text):
        dims = tuple(text)
    else:
        raise InputError(field, expected, type(text).__name__)
    if len(dims) != ndim or min(dims) < 1 or (last is not None and dims[-1] != last):
        raise InputError(field, expected, ascii(dims)[:80])
    return dims


def raw_frame(decoded: Decoded) -> FrameBytes:
    """A decoded frame as raw pixels that view its arrays (rgb uint8, depth float32 metres; no copy): a frame
    several requests share is decoded once, and each of them reads it without a decode."""
    rgb = np.ascontiguousarray(decoded.rgb, dtype=_UINT8)
    depth = np.ascontiguousarray(decoded.depth, dtype=DEPTH_DTYPES["float32"])
    return FrameBytes(memoryview(rgb).cast("B"), memoryview(depth).cast("B"), rgb_shape=rgb.shape,
                      depth_shape=depth.shape, depth_dtype="float32")


def raw_hw(frame: FrameBytes, max_hw: tuple[int, int], with_mask: bool) -> tuple[int, int] | None:
    """(H, W) when every image of ``frame`` is raw pixels declared at one size within ``max_hw``; else None."""
    shapes = [(frame.rgb_shape, 3, 3), (frame.depth_shape, 2, None)]
    if with_mask:
        shapes.append((frame.mask_shape, 2, None))
    if any(shape is None for shape, _, _ in shapes):
        return None
    try:
        dims = {parse_shape(shape, "shape", ndim, last=last)[:2] for shape, ndim, last in shapes}
    except InputError:
        return None
    if len(dims) != 1:
        return None
    h, w = next(iter(dims))
    return (h, w) if 2 <= h <= max_hw[0] and 2 <= w <= max_hw[1] else None


# -- raw pixels ------------------------------------------------------------------------------------------------------
def _checked_view(data: bytes | memoryview, field: str, shape: tuple[int, ...], dtype: np.dtype,
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


def _raw_rgb(frame: FrameBytes, max_hw: tuple[int, int]) -> np.ndarray:
    """A read-only (H, W, 3) uint8 view of raw rgb bytes."""
    return _checked_view(frame.rgb, "rgb", parse_shape(frame.rgb_shape, "rgb_shape", 3, last=3), _UINT8, max_hw)


def _raw_depth(frame: FrameBytes, max_hw: tuple[int, int], out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """(H, W) float32 metres of raw depth bytes (a view for float32, else new or ``out``), and whether a uint16 map
    was found in range on the way (the float32 range check is the caller's)."""
    if frame.depth_shape is None:
        raise InputError("depth_shape", "H,W of the raw depth (stated with depth_dtype)", "nothing")
    dims = parse_shape(frame.depth_shape, "depth_shape", 2)
    dtype = frame.depth_dtype
    if dtype not in DEPTH_DTYPES:
        raise InputError("depth_dtype", "uint16 (millimetres) or float32 (metres)", ascii(dtype)[:40])
    view = _checked_view(frame.depth, "depth", dims, DEPTH_DTYPES[dtype], max_hw)
    if dtype == "uint16":
        top_mm = int(view.max()) if view.size else 0  # one reduction over the 2-byte pixels decides the range
        return codecs.depth_m_from_mm(view, out), codecs.mm_in_range(top_mm)
    if out is None:
        return view, False
    np.copyto(out, view)
    return out, False


def _raw_mask(frame: FrameBytes, max_hw: tuple[int, int]) -> np.ndarray:
    return _checked_view(frame.mask, "mask", parse_shape(frame.mask_shape, "mask_shape", 2), _UINT8, max_hw)


# -- the one decode --------------------------------------------------------------------------------------------------
def decode_frame(frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, *, with_mask: bool = False,
                 pool: Executor | None = None, into: Destination | None = None) -> Decoded:
    """Decode ``frame`` (laps ``decode``; with ``into`` also ``validate``, for the range check).

    Errors, in this order: rgb's, then depth's, then mask's (InputError naming the field, 413 above ``max_hw``).
    pool: when given and the rgb is an encoded image, the depth decodes there while this thread decodes the rgb
    (the codecs release the GIL): the request pays the longer of the two, not their sum.
    into: decode into the destination's buffers for the frame's size, and check the depth's range there (an
    ingest worker's slot: the process that takes the frame skips those checks). Raw pixels of one size go
    straight in (one pass over each image); anything else decodes as without ``into``, and images of different
    sizes are refused here (:func:`~foundationpose.validate.check_image_sizes`, without the K the main port's
    validation also weighs).
    """
    hw = raw_hw(frame, max_hw, with_mask) if into is not None else None
    if hw is not None:
        return _decode_raw_into(frame, max_hw, phases, with_mask, into(hw))
    decoded = _decode(frame, max_hw, phases, with_mask, pool)
    if into is None:
        return decoded
    hw = decoded.hw
    check_image_sizes(decoded.rgb, decoded.depth, decoded.mask, received=received_as(frame))
    rgb_out, depth_out, mask_out = into(hw)
    rgb_out[...] = decoded.rgb
    depth_out[...] = decoded.depth
    if decoded.mask is not None and mask_out is not None:
        mask_out[...] = decoded.mask
    in_range = depth_in_range(depth_out)
    phases.lap("validate")
    return Decoded(rgb_out, depth_out, mask_out if decoded.mask is not None else None, in_range)


def _decode_raw_into(frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, with_mask: bool,
                     buffers: tuple[np.ndarray, np.ndarray, np.ndarray | None]) -> Decoded:
    rgb_out, depth_out, mask_out = buffers
    np.copyto(rgb_out, _raw_rgb(frame, max_hw))
    _, in_range = _raw_depth(frame, max_hw, out=depth_out)
    mask = None
    if with_mask:
        np.copyto(mask_out, _raw_mask(frame, max_hw))
        mask = mask_out
    phases.lap("decode")
    if frame.depth_dtype != "uint16":
        in_range = depth_in_range(depth_out)
    phases.lap("validate")
    return Decoded(rgb_out, depth_out, mask, in_range)


def _decode(frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, with_mask: bool,
            pool: Executor | None) -> Decoded:
    depth_future = _submit(pool, _decode_depth, frame, max_hw) if frame.rgb_shape is None else None
    if depth_future is not None:
        try:
            rgb = codecs.decode_rgb(_encoded(frame.rgb), max_hw)
        except BaseException:
            depth_future.cancel()
            raise
        depth = depth_future.result()
    else:
        rgb = _raw_rgb(frame, max_hw) if frame.rgb_shape is not None else codecs.decode_rgb(_encoded(frame.rgb), max_hw)
        depth = _decode_depth(frame, max_hw)
    mask = None
    if with_mask:
        if frame.mask is None:
            raise InputError("mask", "the object mask of the first frame", "nothing")
        mask = _raw_mask(frame, max_hw) if frame.mask_shape is not None else codecs.decode_mask(_encoded(frame.mask),
                                                                                                 max_hw)
    phases.lap("decode")
    return Decoded(rgb, depth, mask)


def _decode_depth(frame: FrameBytes, max_hw: tuple[int, int]) -> np.ndarray:
    if frame.depth_shape is not None or frame.depth_dtype is not None:
        return _raw_depth(frame, max_hw)[0]
    return codecs.decode_depth(_encoded(frame.depth), max_hw)


def _encoded(data: bytes | memoryview) -> bytes:
    return data if isinstance(data, bytes) else bytes(data)


def _submit(pool: Executor | None, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
    """``pool.submit(fn, *args)``, or None without a pool or once it is shut down (the server is stopping: the
    request then decodes in its own thread)."""
    if pool is None:
        return None
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return None
