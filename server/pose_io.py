"""Turn the uploads of one pose request into validated arrays, and check a pose before it is answered.

Shared by the in-process routes (:mod:`server.routes_pose`) and the Ray Serve replicas
(:mod:`server.serve.replica`), so both decode, validate and refuse exactly alike.
"""

from __future__ import annotations

import numpy as np

from foundationpose import validate
from foundationpose.errors import InputError
from server import codecs
from server.errors import PoseDivergedError

__all__ = ["check_finite_pose", "decode_register_inputs", "decode_track_inputs", "pose_json"]


def decode_register_inputs(rgb: bytes, depth: bytes, mask: bytes, K_text: str | None,
                           max_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rgb uint8 HxWx3, depth float metres HxW, mask HxW, K float64 3x3); InputError naming the field."""
    rgb_a = codecs.decode_rgb(rgb, max_hw)
    hw = rgb_a.shape[:2]
    depth_a = validate.validate_depth(codecs.decode_depth(depth, max_hw), hw)
    mask_a = validate.validate_mask(codecs.decode_mask(mask, max_hw), hw)
    K_a = codecs.parse_K(K_text)
    validate.check_masked_depth(depth_a, mask_a)  # on the host, before any device work
    return rgb_a, depth_a, mask_a, K_a


def decode_track_inputs(rgb: bytes, depth: bytes, K_text: str | None, default_K: np.ndarray | None,
                        max_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rgb, depth, K) of a track frame; ``K_text`` None means ``default_K`` (a session's), required otherwise."""
    rgb_a = codecs.decode_rgb(rgb, max_hw)
    depth_a = validate.validate_depth(codecs.decode_depth(depth, max_hw), rgb_a.shape[:2])
    if K_text is None:
        if default_K is None:
            raise InputError("K", "a JSON 3x3 K (required for stateless tracking)", "nothing")
        return rgb_a, depth_a, default_K
    return rgb_a, depth_a, codecs.parse_K(K_text)


def check_finite_pose(pose: np.ndarray, what: str) -> None:
    """PoseDivergedError (500, nothing stored) when the pipeline returned NaN or inf entries."""
    if not np.isfinite(pose).all():
        raise PoseDivergedError(f"{what} produced a pose with NaN or inf entries; nothing was stored")


def pose_json(pose: np.ndarray) -> list[list[float]]:
    """A 4x4 pose as JSON rows of float64."""
    return np.asarray(pose, dtype=np.float64).tolist()
