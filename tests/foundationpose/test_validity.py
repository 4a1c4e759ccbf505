"""Validity measurements: the batched function against its readable twin, capture rules, and what they say."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foundationpose._validity_reference import measure_validity_reference
from foundationpose.surface import sample_surface
from foundationpose.validity import (
    GATED,
    MEASUREMENTS,
    ValidityConfig,
    ValidityModel,
    column,
    judge_validity,
    measure_validity,
)
from tests.foundationpose.conftest import pose_xyz, render_scene, rotation_xyz
from tests.foundationpose.test_no_host_sync import FORBIDDEN, Probe

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
K = np.array([[600.0, 0.0, 159.5], [0.0, 600.0, 119.5], [0.0, 0.0, 1.0]])  # 0.8 mm pixels at 0.5 m, like a VGA sensor
HW = (240, 320)
CONFIG = ValidityConfig()


@pytest.fixture(scope="module")
def observed(textured_object):
    """The object at a known pose in front of a plane 0.8 m away (depth with a background)."""
    gt = pose_xyz(0.6, -0.4, 0.3, (0.01, -0.005, 0.5))
    scene = render_scene(textured_object, gt, K, HW)
    depth = np.where(scene.mask, scene.depth, 0.8).astype(np.float32)
    return scene, depth, gt


@pytest.fixture(scope="module")
def model(textured_object) -> ValidityModel:
    return ValidityModel.from_object(textured_object)


def _batch(depth: np.ndarray, poses: list[np.ndarray], starts: list[np.ndarray] | None = None, device="cpu"):
    n = len(poses)
    d = torch.as_tensor(depth, device=device)[None].expand(n, *depth.shape).contiguous()
    k = torch.as_tensor(K, device=device)[None].expand(n, 3, 3).contiguous()
    final = torch.as_tensor(np.stack(poses), device=device)
    start = final.clone() if starts is None else torch.as_tensor(np.stack(starts), device=device)
    return d, k, start, final


def _poses_of_every_kind(gt: np.ndarray) -> list[np.ndarray]:
    shifted, turned, outside, behind_cam = gt.copy(), gt.copy(), gt.copy(), gt.copy()
    shifted[0, 3] += 0.04
    turned[:3, :3] = rotation_xyz(0.0, 0.9, 0.0) @ gt[:3, :3]
    outside[0, 3] += 0.5  # far right of the image
    behind_cam[2, 3] = -0.5
    return [gt, shifted, turned, outside, behind_cam]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_measurements_match_the_reference(observed, model, device: str, batch: int) -> None:
    _, depth, gt = observed
    poses = _poses_of_every_kind(gt)[:batch]
    starts = [gt] * batch
    d, k, start, final = _batch(depth, poses, starts, device)
    fast = measure_validity(d, k, start, final, model.to(device), CONFIG).cpu()
    ref = measure_validity_reference(d.cpu(), k.cpu(), start.cpu(), final.cpu(), model, CONFIG)
    assert fast.shape == (batch, len(MEASUREMENTS)) and fast.dtype == torch.float32
    assert torch.isfinite(fast).all()
    # The twin projects in float64, the fast path in float32: a point at a pixel border or at the tolerance's
    # edge may land on the other side, so counts may differ by a point or two (2 of ~250 visible); measured: every column equal on the CPU.
    counts = [column(n) for n in ("visible_points",)]
    fractions = [i for i, n in enumerate(MEASUREMENTS) if n.endswith("_fraction")]
    torch.testing.assert_close(fast[:, counts], ref[:, counts], rtol=0, atol=2.0)
    torch.testing.assert_close(fast[:, fractions], ref[:, fractions], rtol=0, atol=2.0 / 200)
    torch.testing.assert_close(fast[:, column("residual_m")], ref[:, column("residual_m")], rtol=0, atol=2e-4)
    motion = [column("translation_m"), column("rotation_deg")]
    # acos near 1 in float32 vs float64 can differ by ~0.03 deg at identity, far below any limit
    torch.testing.assert_close(fast[:, motion], ref[:, motion], rtol=1e-4, atol=0.05)


def test_no_host_synchronisation(observed, model) -> None:
    _, depth, gt = observed
    d, k, start, final = _batch(depth, _poses_of_every_kind(gt))
    measure_validity(d, k, start, final, model, CONFIG)
    with Probe() as probe:
        confidence, valid = judge_validity(measure_validity(d, k, start, final, model, CONFIG), CONFIG)
    assert not (set(probe.ops) & FORBIDDEN), probe.ops
    assert confidence.shape == valid.shape == (5,) and valid.dtype == torch.bool


def test_the_true_pose_is_valid_and_wrong_poses_are_not(observed, model) -> None:
    _, depth, gt = observed
    d, k, start, final = _batch(depth, _poses_of_every_kind(gt), [gt] * 5)
    m = measure_validity(d, k, start, final, model, CONFIG)
    confidence, valid = judge_validity(m, CONFIG)
    assert valid.tolist() == [True, False, False, False, False]
    assert m[0, column("consistent_fraction")] > 0.95 and m[0, column("support_fraction")] > 0.5
    assert m[1, column("behind_fraction")] > 0.3  # shifted 4 cm sideways: the camera sees the plane behind it
    assert m[3, column("in_image_fraction")] == 0 and m[4, column("visible_points")] == 0
    assert confidence[0] > 0.5 > confidence[1:].max()


def test_a_diverged_pose_is_judged_invalid_without_reading_outside_the_depth(observed, model) -> None:
    """A NaN or huge pose (a diverged step) gets an invalid row; its pixels never index outside the depth map."""
    _, depth, gt = observed
    nan_pose, huge_pose = np.full((4, 4), np.nan, np.float32), gt.copy()
    huge_pose[:3, 3] = 1e30
    m = measure_validity(*_batch(depth, [gt, nan_pose, huge_pose]), model, CONFIG)
    confidence, valid = judge_validity(m, CONFIG)
    assert valid.tolist() == [True, False, False] and confidence[1:].tolist() == [0.0, 0.0]


def test_occlusion_and_absence_are_told_apart(observed, model) -> None:
    scene, depth, gt = observed
    occluded = np.where(scene.mask, 0.3, depth).astype(np.float32)  # a board 0.3 m away covers the object
    gone = np.full_like(depth, 0.8)  # the object left; the plane remains
    m = measure_validity(*_stacked(occluded, gone, gt), model, CONFIG)
    _, valid = judge_validity(m, CONFIG)
    assert m[0, column("occluded_fraction")] > 0.95 and m[1, column("behind_fraction")] > 0.95
    assert valid.tolist() == [False, False]


def _stacked(a: np.ndarray, b: np.ndarray, pose: np.ndarray):
    d = torch.as_tensor(np.stack([a, b]))
    k = torch.as_tensor(K)[None].expand(2, 3, 3)
    p = torch.as_tensor(np.stack([pose, pose]))
    return d, k, p, p


def test_motion_beyond_the_limits_is_invalid(observed, model) -> None:
    _, depth, gt = observed
    far_start, turned_start = gt.copy(), gt.copy()
    far_start[1, 3] += 2 * CONFIG.max_translation_m
    turned_start[:3, :3] = rotation_xyz(0.0, 0.0, math.radians(2 * CONFIG.max_rotation_deg)) @ gt[:3, :3]
    m = measure_validity(*_batch(depth, [gt, gt], [far_start, turned_start]), model, CONFIG)
    assert m[0, column("translation_m")] == pytest.approx(2 * CONFIG.max_translation_m, rel=1e-4)
    assert m[1, column("rotation_deg")] == pytest.approx(2 * CONFIG.max_rotation_deg, rel=1e-3)
    confidence, valid = judge_validity(m, CONFIG)
    assert valid.tolist() == [False, False] and confidence.max() < 0.05


def test_confidence_is_half_at_the_thresholds_and_orders_like_valid() -> None:
    gen = torch.Generator().manual_seed(0)
    m = torch.rand(2000, len(MEASUREMENTS), generator=gen)
    m[:, column("translation_m")] *= 2 * CONFIG.max_translation_m
    m[:, column("rotation_deg")] *= 2 * CONFIG.max_rotation_deg
    confidence, valid = judge_validity(m, CONFIG)
    assert ((confidence >= 0) & (confidence <= 1)).all()
    clear = (confidence - 0.5).abs() > 1e-5  # exactly at a threshold, rounding decides
    assert torch.equal(valid[clear], confidence[clear] >= 0.5)
    edge = torch.tensor([[0.0] * len(MEASUREMENTS)])
    edge[0, column("support_fraction")] = CONFIG.min_support
    edge[0, column("consistent_fraction")] = 1.0
    assert judge_validity(edge, CONFIG)[0].item() == pytest.approx(0.5)
    nan = torch.full((1, len(MEASUREMENTS)), float("nan"))
    confidence, valid = judge_validity(nan, CONFIG)
    assert confidence.item() == 0.0 and not valid.item()
    assert set(GATED) <= set(MEASUREMENTS)


def test_config_rejects_impossible_thresholds() -> None:
    with pytest.raises(ValueError, match=r"^min_support must be in \(0, 1\)"):
        ValidityConfig(min_support=1.0)
    with pytest.raises(ValueError, match=r"^max_rotation_deg must be > 0"):
        ValidityConfig(max_rotation_deg=0)
    with pytest.raises(KeyError, match="unknown measurement 'nope'"):
        column("nope")


def test_surface_samples_are_uniform_on_the_area_and_seeded() -> None:
    # two rectangles of area 3 and 1, each two triangles
    verts = np.array([[0, 0, 0], [3, 0, 0], [3, 1, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1]], float)
    faces = np.array([[0, 1, 2], [0, 2, 3], [4, 5, 6], [4, 6, 7]])
    samples = sample_surface(verts, faces, 20000, seed=3)
    on_big = np.isclose(samples.points[:, 2], 0.0)
    assert abs(on_big.mean() - 0.75) < 0.01  # area 3 vs 1
    assert np.allclose(samples.normals[on_big], [0, 0, 1]) and np.allclose(samples.normals[~on_big], [0, 0, 1])
    assert samples.points[on_big, 0].max() <= 3 and samples.points[:, 1].min() >= 0
    again = sample_surface(verts, faces, 20000, seed=3)
    assert np.array_equal(samples.points, again.points)
    assert samples.describe() == {"kind": "uniform surface samples (area-weighted)", "count": 20000, "seed": 3}


@pytest.mark.slow
def test_frame_judge_filters_like_the_track_step(observed, model) -> None:
    from foundationpose.sampling import bilateral_filter_depth, erode_depth
    from foundationpose.validity import FrameJudge

    scene, depth, gt = observed
    judge = FrameJudge(scene.obj)
    raw = torch.as_tensor(depth)[None]
    np.testing.assert_array_equal(judge.filtered_depth(depth).numpy(), bilateral_filter_depth(erode_depth(raw)).numpy())
    good = judge.judge(depth, K, gt, gt)
    shifted = gt.copy()
    shifted[0, 3] += 0.04
    assert good.valid and good.confidence > 0.5 and good.measurements.shape == (len(MEASUREMENTS),)
    assert not judge.judge(depth, K, gt, shifted).valid


@pytest.mark.slow
def test_a_track_result_carries_the_judgement_of_its_pose(observed, tiny_estimator) -> None:
    """The depth measurements of a track's judgement equal the host judge's on the same frame and pose; the
    appearance columns are the step's own (it has the refiner's crops, the host judge has none and leaves them 0:
    not judged)."""
    from foundationpose.validity import MEASUREMENTS, FrameJudge

    scene, depth, gt = observed
    result = tiny_estimator.track(scene.obj, scene.rgb, depth, K, gt, prev_frame="centred")
    again = FrameJudge(scene.obj).judge(depth, K, gt, result.cam_from_centred)
    first = list(MEASUREMENTS).index("appearance_cells")
    np.testing.assert_array_equal(result.validity.measurements[:first], again.measurements[:first])
    np.testing.assert_array_equal(again.measurements[first:], 0.0)
    assert result.validity.measurements[first] >= 1  # the step compared the crops' cells
    assert not result.validity.valid and not again.valid  # random weights: the depth already refuses the pose
