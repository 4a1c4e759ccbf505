"""Decoding a request's images straight into a slot of a worker's :class:`~server.ingest.ring.FrameRing`."""

from __future__ import annotations

from foundationpose.validate import validate_depth, validate_mask
from server.ingest.ring import FrameRing
from server.phases import Phases
from server.pose_flow import FrameBytes, decode_frame

__all__ = ["decode_into"]


def decode_into(ring: FrameRing, slot: int, frame: FrameBytes, max_hw: tuple[int, int], phases: Phases, *,
                with_mask: bool = False) -> tuple[int, int]:
    """Decode ``frame`` (raw or encoded; the main port's InputError naming the field) into ``slot``; returns its
    (H, W). Laps ``decode``. A slot holds one size: a depth or mask of another size than the rgb is refused here
    with the error the main port's validation gives it."""
    rgb, depth, mask = decode_frame(frame, max_hw, phases, with_mask=with_mask)
    hw = rgb.shape[:2]
    if depth.shape != hw:
        validate_depth(depth, hw)
    if mask is not None and mask.shape != hw:
        validate_mask(mask, hw)
    ring.write(slot, rgb, depth, mask)
    phases.lap("decode")
    return int(hw[0]), int(hw[1])
