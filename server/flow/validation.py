"""The validation step: a request's decoded frame and parsed values into the library's validated request.

``foundationpose.validate`` holds the rules every way in shares (shapes, dtypes, units, finiteness, depth in metres
saved as millimetres, K's plausibility for the image it comes with, the working range of poses); this step applies
them once per request (``validate.register_request`` / ``validate.track_request`` with the service's limits). The
server adds one rule of its own: a session's K is used for frames of the session's size only. The
valid-masked-depth rule is the pipeline's (it needs the filtered depth), so the server never refuses a frame the
algorithm accepts.
"""

from __future__ import annotations

from concurrent.futures import Executor

import numpy as np

from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.recovery import mask_from_box
from server.flow.frames import Decoded, FrameBytes, decode_frame, received_as
from server.phases import Phases

__all__ = ["register_request", "track_request"]

def register_request(frame: FrameBytes, K: np.ndarray, *, max_hw: tuple[int, int], limits: validate.InputLimits,
                     phases: Phases, pool: Executor | None = None, box: tuple[int, int, int, int] | None = None,
                     diameter: float | None = None) -> validate.RegisterRequest:
    """The validated register request of one frame (with its mask); laps ``decode`` and ``validate``.

    box: the frame has no mask; it is the depth cluster of the object's size (``diameter``, metres) inside the box
    (:func:`foundationpose.recovery.mask_from_box`). InputError naming the field; ImageTooLargeError (413) above
    ``max_hw``.
    """
    decoded = decode_frame(frame, max_hw, phases, with_mask=box is None, pool=pool)
    received = received_as(frame)
    validate.check_image_sizes(decoded.rgb, decoded.depth, decoded.mask, K, received=received)
    mask = decoded.mask if box is None else _mask_in_box(decoded, K, box, diameter)
    # the decoded depth is this request's own array (or a read-only view, which validation copies)
    request = validate.register_request(decoded.rgb, decoded.depth, mask, K, limits=limits, depth_owned=True,
                                        received=received)
    phases.lap("validate")
    return request


def _mask_in_box(decoded: Decoded, K: np.ndarray, box: tuple[int, int, int, int], diameter: float | None) -> np.ndarray:
    """The object's mask found in ``box`` (InputError naming ``box`` when it leaves the image or holds no depth)."""
    h, w = decoded.hw
    x0, y0, x1, y1 = box
    if x1 > w or y1 > h:
        raise InputError("box", f"a box within the {w}x{h} image (x1 <= {w}, y1 <= {h})", f"{x0},{y0},{x1},{y1}")
    if diameter is None:
        raise ValueError("a register with a box needs the object's diameter")
    depth = validate.validate_depth(decoded.depth, (h, w))
    mask = mask_from_box(depth, validate.validate_K(K, (h, w)), diameter, box)
    if not mask.any():
        raise InputError("box", "a box around the object's depth readings", f"{x0},{y0},{x1},{y1}: no valid depth")
    return mask


def track_request(frame: FrameBytes, K: np.ndarray | None, prev_pose: np.ndarray, prev_frame: str, *,
                  session_K: np.ndarray | None, session_hw: tuple[int, int] | None, max_hw: tuple[int, int],
                  limits: validate.InputLimits, phases: Phases, pool: Executor | None = None) -> validate.TrackRequest:
    """The validated track request of one frame; laps ``decode`` and ``validate``.

    Without a K the session's (``session_K``) is used, for frames of its size (``session_hw``; None: a session
    started from a given pose that has no frame yet, any size) only; a stateless request (``session_K`` None)
    must send one.
    """
    decoded = decode_frame(frame, max_hw, phases, pool=pool)
    received = received_as(frame)
    # images of two sizes: named before the session's K is matched to the rgb's size (the odd one may be the rgb)
    validate.check_image_sizes(decoded.rgb, decoded.depth, None, session_K if K is None else K, received=received)
    if K is None:
        if session_K is None:
            raise InputError("K", "a JSON 3x3 K (required for stateless tracking)", "nothing")
        if session_hw is not None and decoded.hw != tuple(session_hw):
            (h, w), (sh, sw) = decoded.hw, session_hw
            raise InputError("K", f"the K of this {w}x{h} frame (the session's K is for {sw}x{sh} frames)", "no K",
                             "Send K with frames of a new size")
        K = session_K
    request = validate.track_request(decoded.rgb, decoded.depth, K, prev_pose, prev_frame=prev_frame, limits=limits,
                                     depth_owned=True,  # the decoded depth is the request's own (or read-only)
                                     depth_checked=frame.depth_in_range, received=received)
    phases.lap("validate")
    return request
