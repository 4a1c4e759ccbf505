"""Where a lost object may be: candidate masks from depth alone, ranked, for a re-register without a client mask.

Steps (NumPy and OpenCV on the host; a recovery runs in the register lane, at most once per frame):

1. back-project the depth (integer pixel centres, skew ignored, as :func:`foundationpose.sampling.backprojection`);
2. remove the dominant planes (a table, a wall): RANSAC on a subsample of the points, refit by least squares,
   a plane counts only when it holds at least ``min_plane_fraction`` of the valid points and its sampled inliers
   span more than ``min_plane_span_diameters`` object diameters (so the object's own faces are never taken for
   the table);
3. cut the remaining pixels at depth discontinuities (neighbours more than ``depth_jump_diameters`` apart) and
   keep the connected clusters whose 3-D extent fits the object (``extent_diameters`` range);
4. rank: first the clusters near the last valid pose, within a ball that widens with the frames since it
   (``region_radius_diameters + region_growth_diameters_per_frame x frames``), nearest first; then every other
   cluster, the best size match first.

Each candidate's mask can be passed to ``register`` as is (it is the object's visible surface when the cluster
is the object); the session's validity decides which candidate, if any, is the object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from foundationpose.constants import MIN_VALID_DEPTH_M

__all__ = ["DEFAULT_RECOVERY", "RecoveryCandidate", "RecoveryConfig", "RecoveryPlan", "mask_from_box", "recovery_candidates",
           "remove_planes", "search_radius_m"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryConfig:
    """How candidates are found; lengths in object diameters, so one config serves objects of every size."""

    region_radius_diameters: float = 1.5  # the search ball's radius at the frame after the last valid pose
    region_growth_diameters_per_frame: float = 0.5  # it widens this much per frame since (about 0.5 m/s at 30 fps)
    max_planes: int = 2
    min_plane_fraction: float = 0.15  # a dominant plane holds at least this share of the valid depth pixels
    min_plane_span_diameters: float = 3.0  # ... and its inliers span more than this (never an object's face)
    plane_tolerance_diameters: float = 0.04  # inlier distance to the plane (sensor noise + plane unevenness)
    ransac_iterations: int = 150
    ransac_points: int = 4000  # subsample the planes are searched on
    depth_jump_diameters: float = 0.25  # neighbouring pixels farther apart in depth belong to different clusters
    min_pixels: int = 30
    extent_diameters: tuple[float, float] = (0.25, 1.5)  # a cluster's 3-D extent must fit the object
    max_candidates: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.extent_diameters
        if not 0 < lo < hi:
            raise ValueError(f"extent_diameters must be (low, high) with 0 < low < high, got {self.extent_diameters}")
        if self.max_candidates < 1 or self.min_pixels < 1 or self.ransac_iterations < 1:
            raise ValueError("max_candidates, min_pixels and ransac_iterations must be >= 1")


DEFAULT_RECOVERY = RecoveryConfig()  # what a session recovers with unless told otherwise


@dataclass(frozen=True, slots=True, eq=False)
class RecoveryCandidate:
    """mask: (H, W) bool pixels of the cluster. source: "region" (near the last valid pose) or "image".
    centre_cam: (3,) float64 median point, metres. extent_m: its 3-D extent (5-95 percentile box diagonal).
    score: higher first within a source (region: closeness to the last pose; image: size match)."""

    mask: np.ndarray
    source: str
    centre_cam: np.ndarray
    extent_m: float
    score: float

    @property
    def pixels(self) -> int:
        return int(self.mask.sum())


def search_radius_m(diameter: float, frames_since_valid: int, config: RecoveryConfig = RecoveryConfig()) -> float:
    """Radius of the region search around the last valid position, metres."""
    return diameter * (config.region_radius_diameters
                       + config.region_growth_diameters_per_frame * max(0, frames_since_valid - 1))


def _backproject(depth: np.ndarray, K: np.ndarray) -> np.ndarray:
    """(H, W, 3) float64 camera-frame points; (0, 0, 0) where there is no reading."""
    h, w = depth.shape
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    z = depth.astype(np.float64)
    z = np.where(z >= MIN_VALID_DEPTH_M, z, 0.0)
    return np.stack([(u - K[0, 2]) * z / K[0, 0], (v - K[1, 2]) * z / K[1, 1], z], axis=-1)


def _fit_plane(points: np.ndarray) -> tuple[np.ndarray, float]:
    """Least-squares plane ``n . p = d`` (unit n) through (N, 3) points."""
    centre = points.mean(axis=0)
    _, _, vt = np.linalg.svd(points - centre, full_matrices=False)
    normal = vt[-1]
    return normal, float(normal @ centre)


def remove_planes(xyz: np.ndarray, valid: np.ndarray, diameter: float,
                  config: RecoveryConfig = RecoveryConfig()) -> np.ndarray:
    """(H, W) bool pixels on the dominant planes (see the module docstring, step 2). xyz: (H, W, 3) metres."""
    rng = np.random.default_rng(config.seed)
    on_plane = np.zeros(valid.shape, dtype=bool)
    tol = config.plane_tolerance_diameters * diameter
    for _ in range(config.max_planes):
        left = valid & ~on_plane
        idx = np.flatnonzero(left)
        if len(idx) < max(3, config.min_pixels):
            break
        sample = xyz.reshape(-1, 3)[idx[rng.integers(0, len(idx), size=config.ransac_points)]]  # with repeats: cheap
        tri = sample[rng.integers(0, len(sample), size=(config.ransac_iterations, 3))]  # (I, 3, 3)
        normals = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
        norms = np.linalg.norm(normals, axis=1)
        good = norms > 1e-12
        if not good.any():
            break
        normals = normals[good] / norms[good, None]
        offsets = (normals * tri[good, 0]).sum(axis=1)
        inliers = np.abs(sample @ normals.T - offsets) < tol  # (S, I')
        best = int(inliers.sum(axis=0).argmax())
        on_best = sample[inliers[:, best]]
        normal, offset = _fit_plane(on_best)
        full = left & (np.abs(xyz @ normal - offset) < tol)
        span = float(np.linalg.norm(np.percentile(on_best, 95, axis=0) - np.percentile(on_best, 5, axis=0)))
        if full.sum() < config.min_plane_fraction * valid.sum() or span < config.min_plane_span_diameters * diameter:
            break  # the largest plane left is not dominant: no more tables or walls
        on_plane |= full
    return on_plane


def _depth_edges(depth: np.ndarray, valid: np.ndarray, jump_m: float) -> np.ndarray:
    """(H, W) bool pixels with a valid 8-neighbour more than ``jump_m`` nearer or farther."""
    kernel = np.ones((3, 3), np.uint8)
    far = cv2.dilate(np.where(valid, depth, 0.0).astype(np.float32), kernel)
    near = cv2.erode(np.where(valid, depth, np.inf).astype(np.float32), kernel)
    return valid & ((far - depth > jump_m) | (depth - near > jump_m))


def recovery_candidates(depth: np.ndarray, K: np.ndarray, diameter: float, *,
                        last_cam_from_centred: np.ndarray | None = None, frames_since_valid: int | None = None,
                        config: RecoveryConfig = RecoveryConfig()) -> list[RecoveryCandidate]:
    """Ranked candidate masks for the object (module docstring). Region candidates first when a last valid pose
    is given.

    depth: (H, W) float32 metres, 0 = no reading. K: (3, 3) pixels. diameter: the object's, metres.
    last_cam_from_centred: (4, 4) the last valid pose (its translation is the object's centre), or None.
    frames_since_valid: frames since that pose (widens the region). Returns at most ``max_candidates``.
    """
    depth = np.asarray(depth, dtype=np.float32)
    K = np.asarray(K, dtype=np.float64)
    valid = depth >= MIN_VALID_DEPTH_M
    if valid.sum() < config.min_pixels:
        return []
    xyz = _backproject(depth, K)
    foreground = valid & ~remove_planes(xyz, valid, diameter, config)
    # bridge one-pixel sensor holes inside a surface, then cut at depth discontinuities
    foreground = cv2.morphologyEx(foreground.astype(np.uint8), cv2.MORPH_CLOSE, np.ones((3, 3), np.uint8)) > 0
    foreground &= ~_depth_edges(depth, valid, config.depth_jump_diameters * diameter)
    count, labels = cv2.connectedComponents(foreground.astype(np.uint8), connectivity=8)
    lo, hi = config.extent_diameters
    clusters = []
    for label in range(1, count):
        mask = labels == label
        pts = xyz[mask & valid]  # bridged holes have no point
        if len(pts) < config.min_pixels:
            continue
        extent = float(np.linalg.norm(np.percentile(pts, 95, axis=0) - np.percentile(pts, 5, axis=0)))
        if lo * diameter <= extent <= hi * diameter:
            clusters.append((mask, np.median(pts, axis=0), extent))
    region: list[RecoveryCandidate] = []
    if last_cam_from_centred is not None:
        last = np.asarray(last_cam_from_centred, dtype=np.float64)[:3, 3]
        radius = search_radius_m(diameter, frames_since_valid or 0, config)
        for mask, centre, extent in clusters:
            distance = float(np.linalg.norm(centre - last))
            if distance <= radius:
                region.append(RecoveryCandidate(mask, "region", centre, extent, 1.0 - distance / radius))
    in_region = {id(c.mask) for c in region}
    image = [RecoveryCandidate(mask, "image", centre, extent, -abs(math.log(extent / diameter)))
             for mask, centre, extent in clusters if id(mask) not in in_region]
    region.sort(key=lambda c: -c.score)
    image.sort(key=lambda c: -c.score)
    return (region + image)[: config.max_candidates]


def mask_from_box(depth: np.ndarray, K: np.ndarray, diameter: float, box: tuple[int, int, int, int], *,
                  config: RecoveryConfig = RecoveryConfig()) -> np.ndarray:
    """The object's mask inside a client's box (x0, y0, x1, y1 pixels, x1 and y1 exclusive, within the image): the
    depth cluster of the object's size inside the box (:func:`recovery_candidates` on the box's depth, the best
    size match first), else the box's nearest surface (its valid depth within one diameter of the box's 5th
    percentile). (H, W) bool; all False when the box holds no valid depth."""
    depth = np.asarray(depth, dtype=np.float32)
    x0, y0, x1, y1 = box
    inside = np.zeros(depth.shape, dtype=bool)
    inside[y0:y1, x0:x1] = True
    boxed = np.where(inside, depth, np.float32(0.0))
    candidates = recovery_candidates(boxed, K, diameter, config=config)
    if candidates:
        return candidates[0].mask & inside
    valid = boxed >= MIN_VALID_DEPTH_M
    if not valid.any():
        return valid
    near = float(np.percentile(boxed[valid], 5))
    return valid & (boxed <= near + diameter)


@dataclass(frozen=True, slots=True, eq=False)
class RecoveryPlan:
    """What one frame's recovery needs of its session, as plain values (it can travel to another process): how
    to search (``config``), the last valid pose (4, 4) or None and the frames since it, and which attempt this is
    (the ``attempt``-th frame's pick cycles through the ranked candidates)."""

    config: RecoveryConfig
    last_valid_cam_from_centred: np.ndarray | None
    frames_since_valid: int | None
    attempt: int

    def candidate(self, depth: np.ndarray, K: np.ndarray, diameter: float) -> RecoveryCandidate | None:
        """The candidate to register on in this frame (depth metres, K pixels, the object's diameter), or None
        when the depth offers none."""
        candidates = recovery_candidates(depth, K, diameter, last_cam_from_centred=self.last_valid_cam_from_centred,
                                         frames_since_valid=self.frames_since_valid, config=self.config)
        return candidates[self.attempt % len(candidates)] if candidates else None
