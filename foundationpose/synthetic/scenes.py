"""A small synthetic RGB-D frame (no files, no rendering): for the start-up warm-up, the load test and tests.

The scene is a tilted plane 0.45-0.55 m away with a raised box in the middle that the mask covers;
the colours are a smooth pattern plus seeded noise. It exercises every stage; with random weights
the poses mean nothing anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SyntheticFrame", "synthetic_frame"]


@dataclass(frozen=True, slots=True)
class SyntheticFrame:
    """rgb: (H, W, 3) uint8 RGB. depth_m: (H, W) float32 metres (0 = no reading). mask: (H, W) bool.
    K: (3, 3) float64 pixels."""

    rgb: np.ndarray
    depth_m: np.ndarray
    mask: np.ndarray
    K: np.ndarray


def synthetic_frame(height: int = 120, width: int = 160, *, seed: int = 0) -> SyntheticFrame:
    """A deterministic frame of ``height x width`` pixels (see the module docstring)."""
    if height < 8 or width < 8:
        raise ValueError(f"synthetic frames need at least 8x8 pixels, got {height}x{width}")
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
    depth = 0.5 + 0.05 * (cols / width - 0.5) + 0.02 * (rows / height - 0.5)
    top, bottom = height // 4, height - height // 4
    left, right = width // 3, width - width // 3
    mask = np.zeros((height, width), dtype=bool)
    mask[top:bottom, left:right] = True
    depth[mask] -= 0.06  # the object stands 6 cm in front of the plane
    depth[: max(1, height // 20)] = 0.0  # a strip without readings, like a real sensor's border
    pattern = np.stack(
        [np.sin(cols / 7.0), np.cos(rows / 5.0), np.sin((rows + cols) / 11.0)], axis=-1
    )
    rgb = 127.5 + 80.0 * pattern + rng.normal(0.0, 12.0, size=(height, width, 3))
    rgb[mask] = rgb[mask] * 0.5 + np.array([200.0, 60.0, 40.0]) * 0.5
    focal = 0.9 * width
    K = np.array([[focal, 0.0, (width - 1) / 2], [0.0, focal, (height - 1) / 2], [0.0, 0.0, 1.0]])
    return SyntheticFrame(
        rgb=np.clip(np.round(rgb), 0, 255).astype(np.uint8),
        depth_m=depth.astype(np.float32),
        mask=mask,
        K=K,
    )
