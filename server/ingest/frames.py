"""Decoding a request's images straight into a slot of a worker's :class:`~server.ingest.ring.FrameRing`."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import anyio
import numpy as np

from foundationpose.errors import InputError
from foundationpose.validate import depth_in_range, validate_depth, validate_mask
from server import frames_raw
from server.codecs import depth_mm_in_range
from server.ingest.ring import FrameRing
from server.phases import Phases
from server.pose_flow import FrameBytes, decode_frame

__all__ = ["SlotFrame", "decode_into", "decode_into_slot"]


class SlotFrame(NamedTuple):
    """A frame decoded into a slot: its (H, W), and whether its depth is in range
    (:func:`foundationpose.validate.depth_in_range`: the GPU process then skips those value checks)."""

    hw: tuple[int, int]
    depth_in_range: bool


def decode_into(ring: FrameRing, slot: int, frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, *,
                with_mask: bool = False) -> SlotFrame:
    """Decode ``frame`` (raw or encoded; the main port's InputError naming the field) into ``slot``. Laps
    ``decode``, then ``validate`` for the depth's range check (done here, in the worker's process, so that the GPU
    process does not: its value errors are still raised there, by the main port's validation). A slot holds one
    size: a depth or mask of another size than the rgb is refused here with the error the main port's validation
    gives it. Raw pixels of one declared size are decoded straight into the slot (one pass over each image);
    anything else (an encoded image, a size to refuse) is decoded as the main port does, then copied in."""
    hw = _raw_hw(frame, max_hw, with_mask)
    millimetres = None
    if hw is not None:
        frames_raw.decode_raw_rgb(frame.rgb, frame.rgb_shape, max_hw, out=ring.rgb(slot, hw))
        frames_raw.decode_raw_depth(frame.depth, frame.depth_shape, frame.depth_dtype, max_hw, out=ring.depth(slot, hw))
        if frame.depth_dtype == "uint16":  # its size was checked by the decode: the range check reads these bytes
            millimetres = np.frombuffer(frame.depth, frames_raw.DEPTH_DTYPES["uint16"])
        if with_mask:
            np.copyto(ring.mask(slot, hw), frames_raw.decode_raw_mask(frame.mask, frame.mask_shape, max_hw))
    else:
        rgb, depth, mask = decode_frame(frame, max_hw, phases, with_mask=with_mask)
        hw = int(rgb.shape[0]), int(rgb.shape[1])
        if depth.shape != hw:
            validate_depth(depth, hw)
        if mask is not None and mask.shape != hw:
            validate_mask(mask, hw)
        ring.write(slot, rgb, depth, mask)
    phases.lap("decode")
    in_range = depth_in_range(ring.depth(slot, hw)) if millimetres is None else depth_mm_in_range(millimetres)
    phases.lap("validate")
    return SlotFrame(hw, in_range)


def _raw_hw(frame: FrameBytes, max_hw: tuple[int, int], with_mask: bool) -> tuple[int, int] | None:
    """(H, W) when every image of ``frame`` is raw pixels declared at one size within ``max_hw``; else None (the
    general path decodes it, raising what the main port raises for it)."""
    shapes = [(frame.rgb_shape, 3, 3), (frame.depth_shape, 2, None)] + ([(frame.mask_shape, 2, None)] if with_mask else [])
    try:
        dims = {frames_raw.parse_shape(shape, "shape", ndim, last=last)[:2] for shape, ndim, last in shapes
                if shape is not None}
    except InputError:
        return None
    if len(dims) != 1 or any(shape is None for shape, _, _ in shapes):
        return None
    h, w = next(iter(dims))
    return (h, w) if 2 <= h <= max_hw[0] and 2 <= w <= max_hw[1] else None


async def decode_into_slot(ring: FrameRing, slot: int, frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, *,
                           with_mask: bool = False, inline: bool = False) -> SlotFrame:
    """:func:`decode_into` in a worker thread, or right here on the event loop when ``inline`` and every image is raw
    pixels (a copy and a range check, ~1 ms at 640x480: less than the two thread hops under load); encoded images
    always decode in a thread (the codecs run for several ms without the GIL)."""
    if inline and frame.rgb_shape is not None and frame.depth_shape is not None \
            and (not with_mask or frame.mask_shape is not None):
        return decode_into(ring, slot, frame, max_hw, phases, with_mask=with_mask)
    return await anyio.to_thread.run_sync(partial(decode_into, ring, slot, frame, max_hw, phases, with_mask=with_mask))
