"""Draw an estimated pose over an image: the object's oriented 3D box and XYZ axes (spec §7.2).

The box is the mesh's oriented bounding box (trimesh ``oriented_bounds``: ``to_origin`` = box_from_mesh,
``extents``), drawn with ``cam_from_box = cam_from_mesh @ inv(to_origin)`` as green anti-aliased lines of
width 2; then the axes of that same box frame, 0.1 m long (x red, y green, z blue, thickness 3), on top.
Projected end points are rounded to integer pixels. Images are RGB uint8; the input is not modified.

``draw_pose`` can also draw a ground-truth pose's box (magenta, under the estimate) and text lines at the
top left (e.g. the frame number and a legend) plus a red warning at the bottom (e.g. "random weights:
poses meaningless"), so an overlay explains itself. With a session ``status`` it writes the state and the
confidence at the top right, in the state's colour, and draws the box of a pose that is not reported valid in
grey. An estimate that projects nowhere into the image gets a notice ("estimate outside the image, to the
left", "estimate behind the camera") and an arrow at the image border pointing towards it.
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
    "outside_notice",
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
STATE_COLOURS_RGB = {"tracking": (60, 220, 60), "uncertain": (255, 200, 0), "recovering": (255, 140, 0),
                     "lost": (255, 40, 40)}
UNTRUSTED_BOX_COLOUR_RGB = (150, 150, 150)  # the box of a pose the session does not report valid
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


def draw_text(rgb: np.ndarray, lines: list[str], *, bottom: bool = False, right: bool = False,
              colour: tuple[int, int, int] = TEXT_COLOUR_RGB) -> np.ndarray:
    """Write ``lines`` on dark boxes at the top left (or bottom / right) of ``rgb`` IN PLACE; returns it.

    The font scales with the image height (readable from 240 to 1080 rows)."""
    height, width = rgb.shape[:2]
    scale = max(0.4, height / 960)
    thickness = max(1, round(scale * 2))
    font = cv2.FONT_HERSHEY_SIMPLEX
    sizes = [cv2.getTextSize(line, font, scale, thickness) for line in lines]
    line_h = max((h + base for (_, h), base in sizes), default=0) + 4
    y = height - line_h * len(lines) - 4 if bottom else 4
    for line, ((w, h), _base) in zip(lines, sizes, strict=True):
        x = width - w - 10 if right else 2
        cv2.rectangle(rgb, (x, y), (x + 6 + w, y + line_h), (0, 0, 0), thickness=-1)
        cv2.putText(rgb, line, (x + 3, y + h + 2), font, scale, colour, thickness, cv2.LINE_AA)
        y += line_h
    return rgb


def outside_notice(cam_from_box: np.ndarray, extents: np.ndarray, K: np.ndarray, hw: tuple[int, int]
                   ) -> tuple[str, tuple[float, float] | None] | None:
    """``(text, direction)`` when no corner of the posed box projects inside an image of ``hw`` (H, W), else None.
    direction: the unit (du, dv) from the image centre towards the box's projected centre (None: behind the camera)."""
    pose = np.asarray(cam_from_box, dtype=np.float64)
    corners = box_corners(extents) @ pose[:3, :3].T + pose[:3, 3]
    h, w = hw
    front = corners[corners[:, 2] > _MIN_Z_M]
    if len(front):
        uv = project_points(front, K)
        if ((uv[:, 0] >= 0) & (uv[:, 0] <= w - 1) & (uv[:, 1] >= 0) & (uv[:, 1] <= h - 1)).any():
            return None
    centre = pose[:3, 3]
    if centre[2] <= _MIN_Z_M:
        return "estimate behind the camera", None
    u, v = project_points(centre[None], K)[0]
    du, dv = u - (w - 1) / 2, v - (h - 1) / 2
    norm = float(np.hypot(du, dv)) or 1.0
    if abs(du) / w >= abs(dv) / h:
        side = "to the right" if du > 0 else "to the left"
    else:
        side = "below" if dv > 0 else "above"
    return f"estimate outside the image, {side}", (du / norm, dv / norm)


def _border_arrow(rgb: np.ndarray, direction: tuple[float, float], colour: tuple[int, int, int]) -> None:
    """An arrow from inside the image to its border, along ``direction`` from the centre."""
    h, w = rgb.shape[:2]
    cu, cv = (w - 1) / 2, (h - 1) / 2
    du, dv = direction
    reach = min(cu / abs(du) if du else np.inf, cv / abs(dv) if dv else np.inf) - 8  # to 8 px from the border
    tip = (int(round(cu + du * reach)), int(round(cv + dv * reach)))
    tail = (int(round(cu + du * (reach - 0.12 * min(h, w)))), int(round(cv + dv * (reach - 0.12 * min(h, w)))))
    cv2.arrowedLine(rgb, tail, tip, colour, thickness=max(2, h // 160), line_type=cv2.LINE_AA, tipLength=0.35)


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
    status: dict | None = None,
) -> np.ndarray:
    """A copy of ``rgb`` with the posed oriented box and axes drawn (spec §7.2).

    rgb: (H, W, 3) uint8 RGB.  cam_from_mesh: (4, 4) pose, metres.  K: (3, 3) pixels.
    oriented_bounds: ``(to_origin (4, 4) box_from_mesh, extents (3,) metres)``, e.g. ``ObjectModel.oriented_bounds``.
    gt_cam_from_mesh: a ground-truth pose whose box is drawn first, in ``GT_BOX_COLOUR_RGB``.
    labels: text lines at the top left; warning: one red line at the bottom.
    status: ``{"state": "tracking" | "uncertain" | "lost" | "recovering", "confidence": float | None,
    "pose_valid": bool}`` of the session, written at the top right (the box is grey when the pose is not valid).
    Returns a new (H, W, 3) uint8 RGB image. Segments with an end behind the camera are not drawn; an estimate
    that projects nowhere into the image gets a notice and an arrow towards it.
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
    trusted = status is None or bool(status.get("pose_valid", True))
    draw_box(out, cam_from_box, extents, K, BOX_COLOUR_RGB if trusted else UNTRUSTED_BOX_COLOUR_RGB)
    draw_axes(out, cam_from_box, K, axis_length_m)
    if labels:
        draw_text(out, labels)
    notice = outside_notice(cam_from_box, extents, K, out.shape[:2])
    if status is not None:
        state = str(status.get("state", ""))
        confidence = status.get("confidence")
        text = state.upper() + ("" if confidence is None else f"  confidence {confidence:.2f}")
        draw_text(out, [text], right=True, colour=STATE_COLOURS_RGB.get(state, TEXT_COLOUR_RGB))
    if notice is not None:
        text, direction = notice
        if direction is not None:
            _border_arrow(out, direction, WARNING_COLOUR_RGB)
        draw_text(out, [text], right=True, bottom=True, colour=WARNING_COLOUR_RGB)
    if warning:
        draw_text(out, [warning], bottom=True, colour=WARNING_COLOUR_RGB)
    return out
