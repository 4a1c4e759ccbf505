"""The validation step: a request's decoded frame and parsed values into the library's validated request.

``foundationpose.validate`` holds the rules every way in shares (shapes, dtypes, units, finiteness, K and pose
plausibility, the working range); this step applies them once per request (``validate.register_request`` /
``validate.track_request`` with the service's limits) and adds the server's own rule: the principal point of K
must lie inside the image it comes with (:func:`check_K_fits`), which catches a K sent with frames of another
size. The valid-masked-depth rule is the pipeline's (it needs the filtered depth), so the server never refuses a
frame the algorithm accepts.
"""

from __future__ import annotations

from concurrent.futures import Executor

import numpy as np

from foundationpose import validate
from foundationpose.errors import InputError
from server.flow.frames import FrameBytes, decode_frame
from server.phases import Phases

__all__ = ["K_EDGE_FRACTION", "check_K_fits", "register_request", "track_request"]

# The principal point lies at least this fraction of the image's side inside each edge. Cameras put it near the
# centre; one on or past an edge (cx = 640 for a 640x480 frame, or a 1920x1080 K's cx = 960) means K belongs to
# another image size (the library's own check accepts half an image beyond each edge).
K_EDGE_FRACTION = 0.02


def check_K_fits(K: np.ndarray, hw: tuple[int, int]) -> None:
    """InputError naming ``K`` when its principal point (cx, cy) is not inside the (H, W) image."""
    h, w = hw
    cx, cy, m = float(K[0, 2]), float(K[1, 2]), K_EDGE_FRACTION
    if not (m * w <= cx <= (1 - m) * w and m * h <= cy <= (1 - m) * h):
        raise InputError("K", f"the principal point (cx, cy) inside the {w}x{h} image "
                              f"({m * w:g} <= cx <= {(1 - m) * w:g}, {m * h:g} <= cy <= {(1 - m) * h:g})",
                         f"cx={cx:g}, cy={cy:g}", "K for another image size? Scale K with the image")


def register_request(frame: FrameBytes, K: np.ndarray, *, max_hw: tuple[int, int], limits: validate.InputLimits,
                     phases: Phases, pool: Executor | None = None) -> validate.RegisterRequest:
    """The validated register request of one frame (with its mask); laps ``decode`` and ``validate``.

    InputError naming the field; ImageTooLargeError (413) above ``max_hw``.
    """
    decoded = decode_frame(frame, max_hw, phases, with_mask=True, pool=pool)
    # the decoded depth is this request's own array (or a read-only view, which validation copies)
    request = validate.register_request(decoded.rgb, decoded.depth, decoded.mask, K, limits=limits, depth_owned=True)
    check_K_fits(request.K, request.hw)
    phases.lap("validate")
    return request


def track_request(frame: FrameBytes, K: np.ndarray | None, prev_pose: np.ndarray, prev_frame: str, *,
                  session_K: np.ndarray | None, session_hw: tuple[int, int] | None, max_hw: tuple[int, int],
                  limits: validate.InputLimits, phases: Phases, pool: Executor | None = None) -> validate.TrackRequest:
    """The validated track request of one frame; laps ``decode`` and ``validate``.

    Without a K the session's (``session_K``) is used, for frames of its size (``session_hw``; None: a session
    started from a given pose that has no frame yet, any size) only; a stateless request (``session_K`` None)
    must send one.
    """
    decoded = decode_frame(frame, max_hw, phases, pool=pool)
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
                                     depth_checked=frame.depth_in_range)
    check_K_fits(request.K, request.hw)
    phases.lap("validate")
    return request
