"""Pose overlay: green box edges and coloured axes where the pose projects them (spec §7.2)."""

from __future__ import annotations

import numpy as np

from foundationpose.demo.overlay import (
    GT_BOX_COLOUR_RGB,
    STATE_COLOURS_RGB,
    UNTRUSTED_BOX_COLOUR_RGB,
    box_corners,
    draw_pose,
    outside_notice,
    project_points,
)

K = np.array([[500.0, 0.0, 320.0], [0.0, 500.0, 240.0], [0.0, 0.0, 1.0]])
EXTENTS = np.array([0.2, 0.1, 0.06])


def _px(point_cam) -> tuple[int, int]:
    u, v = project_points(np.asarray(point_cam, dtype=np.float64)[None], K)[0]
    return int(round(v)), int(round(u))  # (row, col)


def _is(pixel: np.ndarray, colour: str) -> bool:
    r, g, b = (int(c) for c in pixel)
    return {"green": g > 200 and r < 60 and b < 60, "red": r > 200 and g < 60 and b < 60,
            "blue": b > 200 and r < 60 and g < 60}[colour]


def test_box_corners():
    corners = box_corners(EXTENTS)
    assert corners.shape == (8, 3)
    np.testing.assert_allclose(corners.max(0), EXTENTS / 2)
    np.testing.assert_allclose(corners.min(0), -EXTENTS / 2)


def test_box_edges_green_and_axes_coloured():
    image = np.full((480, 640, 3), 30, np.uint8)
    cam_from_mesh = np.eye(4)
    cam_from_mesh[:3, 3] = [0.0, 0.0, 0.6]
    out = draw_pose(image, cam_from_mesh, K, (np.eye(4), EXTENTS))
    assert out.dtype == np.uint8 and out.shape == image.shape
    assert (image == 30).all()  # input untouched
    # midpoints of box edges (front top, back bottom, a side edge of the front face)
    for point in ([0.0, -0.05, 0.57], [0.0, 0.05, 0.63], [-0.1, 0.0, 0.57]):
        assert _is(out[_px(point)], "green"), (point, out[_px(point)])
    # axes from the box centre: x red, y green, z (pointing away) blue, 0.1 m long
    assert _is(out[_px([0.05, 0.0, 0.6])], "red")
    assert _is(out[_px([0.0, 0.05, 0.6])], "green")
    assert _is(out[_px([0.0, 0.09, 0.6])], "green")  # the y axis leaves the box (bottom at y = 0.05)...
    assert (out[_px([0.0, 0.13, 0.6])] == 30).all()  # ...and stops at 0.1 m
    # far from every line the image is unchanged
    assert (out[10, 10] == 30).all() and (out[470, 630] == 30).all()


def test_to_origin_is_inverted():
    # mesh frame offset from the box frame: box_from_mesh translates by -c; drawing must undo it
    c = np.array([0.03, -0.02, 0.01])
    to_origin = np.eye(4)
    to_origin[:3, 3] = -c
    cam_from_mesh = np.eye(4)
    cam_from_mesh[:3, 3] = np.array([0.0, 0.0, 0.6]) - c  # puts the box centre at (0, 0, 0.6)
    out = draw_pose(np.zeros((480, 640, 3), np.uint8), cam_from_mesh, K, (to_origin, EXTENTS))
    assert _is(out[_px([0.0, -0.05, 0.57])], "green")
    assert _is(out[_px([0.05, 0.0, 0.6])], "red")


def test_an_estimate_outside_the_image_is_announced_not_drawn():
    image = np.zeros((120, 160, 3), np.uint8)
    pose = np.eye(4)
    pose[:3, 3] = [0.0, 0.0, -0.5]
    out = draw_pose(image, pose, K, (np.eye(4), EXTENTS))
    assert not out[:60].any()  # no box, no axes: only the notice at the bottom right
    assert out[100:, 80:].any()
    assert outside_notice(pose, EXTENTS, K, (120, 160)) == ("estimate behind the camera", None)
    pose[:3, 3] = [1e9, 0.0, 0.5]  # absurd translation: skipped, no OpenCV overflow
    text, direction = outside_notice(pose, EXTENTS, K, (120, 160))
    assert text == "estimate outside the image, to the right" and direction[0] > 0.99
    out = draw_pose(image, pose, K, (np.eye(4), EXTENTS))
    assert out[50:70, 140:].any() and not out[:40, :60].any()  # an arrow at the right border, nothing at the left
    pose[:3, 3] = [0.0, -2.0, 0.5]
    assert outside_notice(pose, EXTENTS, K, (120, 160))[0] == "estimate outside the image, above"
    pose[:3, 3] = [0.0, 0.0, 0.6]
    assert outside_notice(pose, EXTENTS, K, (480, 640)) is None


def test_session_status_is_written_and_an_untrusted_box_is_grey():
    image = np.full((480, 640, 3), 30, np.uint8)
    pose = np.eye(4)
    pose[:3, 3] = [0.0, 0.0, 0.6]
    lost = draw_pose(image, pose, K, (np.eye(4), EXTENTS), status={"state": "lost", "confidence": 0.12,
                                                                    "pose_valid": False})
    edge = lost[_px([0.0, -0.05, 0.57])]
    assert tuple(int(c) for c in edge) == UNTRUSTED_BOX_COLOUR_RGB
    badge = lost[:30, 400:]
    assert (np.abs(badge.astype(int) - STATE_COLOURS_RGB["lost"]).sum(-1) < 60).any()  # red text, top right
    ok = draw_pose(image, pose, K, (np.eye(4), EXTENTS), status={"state": "tracking", "confidence": 0.9,
                                                                  "pose_valid": True})
    assert _is(ok[_px([0.0, -0.05, 0.57])], "green")
    assert (np.abs(ok[:30, 400:].astype(int) - STATE_COLOURS_RGB["tracking"]).sum(-1) < 60).any()


def test_ground_truth_box_labels_and_warning():
    image = np.full((480, 640, 3), 30, np.uint8)
    estimate, truth = np.eye(4), np.eye(4)
    estimate[:3, 3] = [0.0, 0.0, 0.6]
    truth[:3, 3] = [0.15, 0.0, 0.6]  # 12.5 cm to the right: the boxes do not overlap
    out = draw_pose(image, estimate, K, (np.eye(4), EXTENTS), gt_cam_from_mesh=truth,
                    labels=["frame 3 (000003)"], warning="random weights: poses meaningless")
    gt_edge = _px([0.15 + 0.1, 0.0, 0.57])  # the truth box's right front edge, clear of the axes
    assert tuple(int(c) for c in out[gt_edge]) == GT_BOX_COLOUR_RGB
    assert _is(out[_px([0.0, -0.05, 0.57])], "green")  # the estimate still drawn
    top, bottom = out[:40, :200], out[-40:, :300]
    assert ((top == 255).all(axis=-1)).sum() > 50  # white label text on its dark box
    assert (top == 0).all(axis=-1).sum() > 1000
    red = (bottom[..., 0] > 200) & (bottom[..., 1] < 80) & (bottom[..., 2] < 80)
    assert red.sum() > 50  # the warning, in red at the bottom
    plain = draw_pose(image, estimate, K, (np.eye(4), EXTENTS))
    assert (plain[:40, :200] == 30).all() and (plain[-40:, :300] == 30).all()  # nothing without them
