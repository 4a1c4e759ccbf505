"""Draw an estimated pose over an image: the object's oriented 3D box and XYZ axes (spec §7.2).

The box is the mesh's oriented bounding box (trimesh ``oriented_bounds``: ``to_origin`` = box_from_mesh,
``extents``), drawn with ``cam_from_box = cam_from_mesh @ inv(to_origin)`` as green anti-aliased lines of
width 2; then the axes of that same box frame, 0.1 m long (x red, y green, z blue, thickness 3), on top.
Projected end points are rounded to integer pixels. Images are RGB uint8; the input is not modified.

``draw_pose`` can also draw a ground-truth pose's box (magenta, under the estimate) and text lines at the
top left (e.g. the frame number and a legend) plus a red warning at the bottom (e.g. "random weights:
poses meaningless"), so an overlay explains itself.
"""

from __future__ import annotations

import itertools

import cv2
import numpy as np

__all__ = [
    "AXIS_LENGTH_M",
    "BOX_COLOUR_RGB",
    "GT_BOX_COLOUR_RGB",
    "box_corners",
    "draw_axes",
    "draw_box",
    "draw_pose",
    "draw_text",
    "project_points",
]

BOX_COLOUR_RGB = (0, 255, 0)
GT_BOX_COLOUR_RGB = (255, 0, 255)  # magenta: far from the estimate's green and the axes' colours
WARNING_COLOUR_RGB = (255, 40, 40)
TEXT_COLOUR_RGB = (255, 255, 255)
BOX_THICKNESS_PX = 2
AXIS_LENGTH_M = 0.1
AXIS_THICKNESS_PX = 3
AXIS_COLOURS_RGB = ((255, 0, 0), (0, 255, 0), (0, 0, 255))  # x, y, z
_MIN_Z_M = 1e-6  # segments with an end point at or behind the camera plane are skipped
_MAX_ABS_PX = 1 << 24  # larger projections (degenerate poses) are skipped: cv2 needs int32 coordinates


def project_points(points_cam: np.ndarray, K: np.ndarray) -> np.ndarray:
    """(P, 2) float64 pixel coordinates ``(u, v)`` of camera-frame points (P, 3), metres; integer = pixel centre."""
    pts = np.asarray(points_cam, dtype=np.float64)
    uvw = pts @ np.asarray(K, dtype=np.float64).T  # (P, 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        return uvw[:, :2] / uvw[:, 2:3]


def box_corners(extents: np.ndarray) -> np.ndarray:
    """(8, 3) float64 corners of a box centred at the origin with the given (3,) extents (metres).

    Corner ``k`` has coordinate ``+e/2`` on axis ``a`` when bit ``2 - a`` of ``k`` is set.
    """
    half = np.asarray(extents, dtype=np.float64).reshape(3) / 2
    return np.array([[sx, sy, sz] for sx, sy, sz in itertools.product((-1, 1), repeat=3)], dtype=np.float64) * half


_BOX_EDGES = tuple(
    (i, j) for i in range(8) for j in range(i + 1, 8) if bin(i ^ j).count("1") == 1
)  # the 12 pairs of corners that differ in one coordinate


def _segment_px(start_cam: np.ndarray, end_cam: np.ndarray, K: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]] | None:
    if start_cam[2] <= _MIN_Z_M or end_cam[2] <= _MIN_Z_M:
        return None
    uv = project_points(np.stack([start_cam, end_cam]), K)
    if not np.isfinite(uv).all() or np.abs(uv).max() > _MAX_ABS_PX:
        return None
    px = np.round(uv).astype(np.int64)
    return (int(px[0, 0]), int(px[0, 1])), (int(px[1, 0]), int(px[1, 1]))


def draw_box(
    rgb: np.ndarray,
    cam_from_box: np.ndarray,
    extents: np.ndarray,
    K: np.ndarray,
    colour: tuple[int, int, int] = BOX_COLOUR_RGB,
    thickness: int = BOX_THICKNESS_PX,
) -> np.ndarray:
    """Draw the 12 edges of a box (extents (3,) metres, centred in its own frame) into ``rgb`` IN PLACE.

    rgb: (H, W, 3) uint8 RGB, contiguous. cam_from_box: (4, 4). K: (3, 3) pixels. Returns ``rgb``.
    """
    pose = np.asarray(cam_from_box, dtype=np.float64)
    corners_cam = box_corners(extents) @ pose[:3, :3].T + pose[:3, 3]  # (8, 3)
    for i, j in _BOX_EDGES:
        seg = _segment_px(corners_cam[i], corners_cam[j], K)
        if seg is not None:
            cv2.line(rgb, seg[0], seg[1], colour, thickness=thickness, lineType=cv2.LINE_AA)
    return rgb


def draw_axes(
    rgb: np.ndarray,
    cam_from_frame: np.ndarray,
    K: np.ndarray,
    length_m: float = AXIS_LENGTH_M,
    thickness: int = AXIS_THICKNESS_PX,
) -> np.ndarray:
    """Draw the frame's x (red), y (green), z (blue) axes, ``length_m`` long, into ``rgb`` IN PLACE; returns it."""
    pose = np.asarray(cam_from_frame, dtype=np.float64)
    origin = pose[:3, 3]
    for axis, colour in enumerate(AXIS_COLOURS_RGB):
        seg = _segment_px(origin, origin + pose[:3, axis] * length_m, K)
        if seg is not None:
            cv2.line(rgb, seg[0], seg[1], colour, thickness=thickness, lineType=cv2.LINE_AA)
    return rgb


def draw_text(rgb: np.ndarray, lines: list[str], *, bottom: bool = False,
              colour: tuple[int, int, int] = TEXT_COLOUR_RGB) -> np.ndarray:
    """Write ``lines`` on dark boxes at the top left (or bottom left) of ``rgb`` IN PLACE; returns it.

    The font scales with the image height (readable from 240 to 1080 rows)."""
    height = rgb.shape[0]
    scale = max(0.4, height / 960)
    thickness = max(1, round(scale * 2))
    font = cv2.FONT_HERSHEY_SIMPLEX
    sizes = [cv2.getTextSize(line, font, scale, thickness) for line in lines]
    line_h = max((h + base for (_, h), base in sizes), default=0) + 4
    y = height - line_h * len(lines) - 4 if bottom else 4
    for line, ((w, h), _base) in zip(lines, sizes, strict=True):
        cv2.rectangle(rgb, (2, y), (8 + w, y + line_h), (0, 0, 0), thickness=-1)
        cv2.putText(rgb, line, (5, y + h + 2), font, scale, colour, thickness, cv2.LINE_AA)
        y += line_h
    return rgb


def draw_pose(
    rgb: np.ndarray,
    cam_from_mesh: np.ndarray,
    K: np.ndarray,
    oriented_bounds: tuple[np.ndarray, np.ndarray],
    *,
    axis_length_m: float = AXIS_LENGTH_M,
    gt_cam_from_mesh: np.ndarray | None = None,
    labels: list[str] | None = None,
    warning: str | None = None,
) -> np.ndarray:
    """A copy of ``rgb`` with the posed oriented box and axes drawn (spec §7.2).

    rgb: (H, W, 3) uint8 RGB.  cam_from_mesh: (4, 4) pose, metres.  K: (3, 3) pixels.
    oriented_bounds: ``(to_origin (4, 4) box_from_mesh, extents (3,) metres)``, e.g. ``ObjectModel.oriented_bounds``.
    gt_cam_from_mesh: a ground-truth pose whose box is drawn first, in ``GT_BOX_COLOUR_RGB``.
    labels: text lines at the top left; warning: one red line at the bottom.
    Returns a new (H, W, 3) uint8 RGB image. Segments with an end behind the camera are not drawn.
    """
    image = np.asarray(rgb)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"rgb must be (H, W, 3) uint8; got {image.dtype} {image.shape}")
    to_origin, extents = oriented_bounds
    mesh_from_box = np.linalg.inv(np.asarray(to_origin, dtype=np.float64))
    out = np.ascontiguousarray(image.copy())
    if gt_cam_from_mesh is not None:
        draw_box(out, np.asarray(gt_cam_from_mesh, dtype=np.float64) @ mesh_from_box, extents, K, GT_BOX_COLOUR_RGB)
    cam_from_box = np.asarray(cam_from_mesh, dtype=np.float64) @ mesh_from_box
    draw_box(out, cam_from_box, extents, K)
    draw_axes(out, cam_from_box, K, axis_length_m)
    if labels:
        draw_text(out, labels)
    if warning:
        draw_text(out, [warning], bottom=True, colour=WARNING_COLOUR_RGB)
    return out
