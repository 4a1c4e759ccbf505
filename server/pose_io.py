"""Turn the uploads of one pose request into a validated request, and check a pose before it is answered.

Shared by the in-process routes (:mod:`server.routes_pose`) and the Ray Serve replicas
(:mod:`server.serve.replica`), so both decode, validate and refuse exactly alike: the codecs decode
(:mod:`server.codecs`), ``validate.register_request`` / ``validate.track_request`` validate the whole
request once with the service's limits.
"""

from __future__ import annotations

import numpy as np

from foundationpose import validate
from foundationpose.errors import InputError
from server import codecs
from server.errors import PoseDivergedError

__all__ = ["check_finite_pose", "decode_register_request", "decode_track_request", "pose_json"]


def decode_register_request(rgb: bytes, depth: bytes, mask: bytes, K_text: str | None, *,
                            max_hw: tuple[int, int], limits) -> validate.RegisterRequest:
    """The validated register request of the uploads; InputError naming the field, ImageTooLargeError (413)."""
    return validate.register_request(
        codecs.decode_rgb(rgb, max_hw), codecs.decode_depth(depth, max_hw), codecs.decode_mask(mask, max_hw),
        codecs.parse_K(K_text), limits=limits,
    )


def decode_track_request(rgb: bytes, depth: bytes, K_text: str | None, prev_pose: np.ndarray, prev_frame: str, *,
                         session_K: np.ndarray | None, session_hw: tuple[int, int] | None,
                         max_hw: tuple[int, int], limits) -> validate.TrackRequest:
    """The validated track request. Without a K the session's (``session_K``) is used, for frames of its size
    (``session_hw``) only; a stateless request (``session_K`` None) must send one."""
    rgb_a = codecs.decode_rgb(rgb, max_hw)
    depth_a = codecs.decode_depth(depth, max_hw)
    if K_text is not None:
        K_a = codecs.parse_K(K_text)
    elif session_K is None:
        raise InputError("K", "a JSON 3x3 K (required for stateless tracking)", "nothing")
    elif tuple(rgb_a.shape[:2]) != tuple(session_hw):
        (h, w), (sh, sw) = rgb_a.shape[:2], session_hw
        raise InputError("K", f"the K of this {w}x{h} frame (the session's K is for {sw}x{sh} frames)", "no K",
                         "Send K with frames of a new size")
    else:
        K_a = session_K
    return validate.track_request(rgb_a, depth_a, K_a, prev_pose, prev_frame=prev_frame, limits=limits)


def check_finite_pose(pose: np.ndarray, what: str) -> None:
    """PoseDivergedError (500, nothing stored) when the pipeline returned NaN or inf entries."""
    if not np.isfinite(pose).all():
        raise PoseDivergedError(f"{what} produced a pose with NaN or inf entries; nothing was stored")


def pose_json(pose: np.ndarray) -> list[list[float]]:
    """A 4x4 pose as JSON rows of float64."""
    return np.asarray(pose, dtype=np.float64).tolist()
