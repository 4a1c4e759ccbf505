"""Hypothesis sampling and depth preprocessing for register/track (spec §2.1-§2.3).

- :mod:`.rotation_grid`: icosphere views x in-plane angles, symmetry-aware clustering.
- :mod:`.translation`: translation guess from depth + mask.
- :mod:`.depth_filters`: erosion, bilateral filter (fused with the back-projection on the Triton path).
- :mod:`.backprojection`: depth -> xyz back-projection, one or per-image K.
"""

from __future__ import annotations

from .backprojection import depth_to_xyz
from .depth_filters import FilterImpl, bilateral_filter_depth, erode_depth, filter_depth_and_backproject
from .rotation_grid import (
    centred_from_view_cam,
    cluster_poses,
    icosphere_views,
    make_rotation_grid,
    symmetry_tfs_from_bop_info,
)
from .translation import MIN_VALID_DEPTH_M, count_valid_masked_depth, guess_translation

__all__ = [
    "FilterImpl",
    "MIN_VALID_DEPTH_M",
    "bilateral_filter_depth",
    "centred_from_view_cam",
    "cluster_poses",
    "count_valid_masked_depth",
    "depth_to_xyz",
    "erode_depth",
    "filter_depth_and_backproject",
    "guess_translation",
    "icosphere_views",
    "make_rotation_grid",
    "symmetry_tfs_from_bop_info",
]
