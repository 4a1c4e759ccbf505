"""Recovery candidates from depth: planes removed, clusters of the object's size, the region near the last pose first."""

from __future__ import annotations

import numpy as np
import pytest

from foundationpose.mesh import load_object
from foundationpose.recovery import (
    RecoveryConfig,
    mask_from_box,
    recovery_candidates,
    remove_planes,
    search_radius_m,
)
from foundationpose.render import make_renderer
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenarios import make_scenario


def _iou(a: np.ndarray, frame) -> float:
    """IoU with the object's visible pixels that have a depth reading (a candidate can hold no others)."""
    b = frame.mask & (frame.depth > 0)
    return float((a & b).sum() / max((a | b).sum(), 1))


@pytest.fixture(scope="module")
def distractor_scene(textured_object):
    tee = load_object(make_procedural_mesh("textured_asym", shape="tee"))
    return make_scenario("distractor", textured_object, make_renderer("cpu", "cpu"), distractor=tee, seed=3, frames=30,
                         hw=(240, 320))


def test_whole_image_candidates_are_the_object_and_the_distractor(distractor_scene, textured_object) -> None:
    frame = distractor_scene.frames[0]
    found = recovery_candidates(frame.depth, distractor_scene.K, textured_object.diameter)
    assert [c.source for c in found] == ["image", "image"]  # the plane is gone, noise blobs are too small
    assert max(_iou(c.mask, frame) for c in found) > 0.7
    assert all(0.25 * textured_object.diameter <= c.extent_m <= 1.5 * textured_object.diameter for c in found)
    assert found[0].score >= found[1].score


def test_the_region_near_the_last_pose_comes_first(distractor_scene, textured_object) -> None:
    frame, d = distractor_scene.frames[0], textured_object.diameter
    last = frame.cam_from_centred
    found = recovery_candidates(frame.depth, distractor_scene.K, d, last_cam_from_centred=last, frames_since_valid=1)
    assert found[0].source == "region" and _iou(found[0].mask, frame) > 0.7
    distance = np.linalg.norm(found[0].centre_cam - last[:3, 3])
    assert distance < 0.5 * d and found[0].score == pytest.approx(1 - distance / search_radius_m(d, 1))


def test_the_region_widens_with_the_time_since_the_last_pose(distractor_scene, textured_object) -> None:
    scene, d = distractor_scene, textured_object.diameter
    gone = scene.events["gone"][0] + 1  # the object is away: only the distractor remains
    frame = scene.frames[gone]
    far_last = scene.frames[0].cam_from_centred.copy()
    far_last[0, 3] += 3.0 * d * np.sign(far_last[0, 3] - scene.events["distractor_cam_from_centred"][0, 3])
    soon = recovery_candidates(frame.depth, scene.K, d, last_cam_from_centred=far_last, frames_since_valid=1)
    late = recovery_candidates(frame.depth, scene.K, d, last_cam_from_centred=far_last, frames_since_valid=12)
    assert [c.source for c in soon] == ["image"] and [c.source for c in late] == ["region"]
    assert search_radius_m(d, 12) == pytest.approx(d * (1.5 + 0.5 * 11))


def test_a_box_around_the_object_gives_its_mask_and_never_the_distractor(distractor_scene, textured_object) -> None:
    frame, d = distractor_scene.frames[0], textured_object.diameter
    ys, xs = np.nonzero(frame.mask)
    h, w = frame.depth.shape
    for pad in (2, 10, 30):  # tight: no cluster of the object's size, the nearest surface; loose: the cluster
        box = (max(int(xs.min()) - pad, 0), max(int(ys.min()) - pad, 0), min(int(xs.max()) + 1 + pad, w),
               min(int(ys.max()) + 1 + pad, h))
        mask = mask_from_box(frame.depth, distractor_scene.K, d, box)
        assert _iou(mask, frame) > 0.8, pad
        outside = np.ones_like(mask)
        outside[box[1]:box[3], box[0]:box[2]] = False
        assert not (mask & outside).any()
    empty = mask_from_box(np.zeros((h, w), np.float32), distractor_scene.K, d, (0, 0, 10, 10))
    assert empty.shape == (h, w) and not empty.any()


@pytest.mark.slow
def test_nothing_to_find(textured_object) -> None:
    scene = make_scenario("leave", textured_object, make_renderer("cpu", "cpu"), frames=30, hw=(240, 320), seed=1)
    frame = scene.frames[scene.events["gone"][0] + 2]  # only the tilted plane, with sensor noise and holes
    assert frame.visible_fraction == 0.0
    assert recovery_candidates(frame.depth, scene.K, textured_object.diameter) == []
    assert recovery_candidates(np.zeros((40, 50), np.float32), scene.K, textured_object.diameter) == []


def test_plane_removal_keeps_small_flat_patches() -> None:
    h, w = 120, 160
    K = np.array([[150.0, 0, 79.5], [0, 150.0, 59.5], [0, 0, 1]])
    depth = np.full((h, w), 1.0, np.float32)
    depth[50:70, 60:90] = 0.6  # a small box face (flat!) in front of a wall
    v, u = np.mgrid[0:h, 0:w]
    xyz = np.stack([(u - K[0, 2]) * depth / K[0, 0], (v - K[1, 2]) * depth / K[1, 1], depth], -1).astype(np.float64)
    plane = remove_planes(xyz, depth > 0, diameter=0.1)
    assert plane[0, 0] and plane.sum() == h * w - 20 * 30  # the wall, and nothing of the patch
    found = recovery_candidates(depth, K, 0.1)
    assert len(found) == 1 and found[0].pixels >= 20 * 30 - 100  # minus the patch's discontinuity rim


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^extent_diameters must be"):
        RecoveryConfig(extent_diameters=(1.0, 0.5))
