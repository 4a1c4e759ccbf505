"""The synchronous reference path on a synthetic scene (CPU renderer, random weights, tiny config)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import trimesh

from foundationpose.coordinate_frames import to_centred_frame, to_mesh_frame
from foundationpose.crop import crop_windows, warp_to_crops
from foundationpose.errors import InputError
from foundationpose.estimator import EstimatorConfig, PoseEstimator, Tracker, subsample_grid
from foundationpose.mesh import load_object
from foundationpose.network_inputs import REFINE_CROP_RATIO
from foundationpose.observation import prepare_frame
from foundationpose.pose_update import apply_refiner_output
from foundationpose.render import RenderConfig, make_renderer
from foundationpose.sampling import guess_translation

from .conftest import render_scene, rotation_xyz


def _assert_rigid(pose: np.ndarray) -> None:
    assert pose.shape == (4, 4)
    assert np.isfinite(pose).all()
    rot = pose[:3, :3]
    np.testing.assert_allclose(rot @ rot.T, np.eye(3), atol=1e-5)
    assert np.linalg.det(rot) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_array_equal(pose[3], [0, 0, 0, 1])


def test_translation_guess_of_a_thin_plate_is_within_a_few_mm() -> None:
    # A 10 x 8 x 0.4 cm plate facing the camera: the visible surface is 2 mm in front of its centre.
    plate = load_object(trimesh.creation.box(extents=(0.10, 0.08, 0.004)))
    K = np.array([[200.0, 0.0, 79.5], [0.0, 200.0, 59.5], [0.0, 0.0, 1.0]])
    pose = np.eye(4, dtype=np.float32)
    pose[:3, 3] = (0.012, -0.008, 0.45)
    scene = render_scene(plate, pose, K, (120, 160))
    frame = prepare_frame(scene.rgb, scene.depth, K, "cpu", xyz_float64=True)
    t0 = guess_translation(frame.depth, torch.as_tensor(scene.mask), K).numpy()
    err = np.abs(t0 - pose[:3, 3])
    assert err.max() < 0.004, err  # metres


def test_crop_window_contains_the_projected_object(scene) -> None:
    pose = torch.as_tensor(scene.cam_from_centred)[None]
    crop_from_img = crop_windows(pose, scene.K, scene.obj.diameter, REFINE_CROP_RATIO, S=160)[0].double().numpy()
    verts = scene.obj.tensors.verts.double().cpu().numpy()  # the scene's object may live on FP_TEST_DEVICE
    cam = verts @ scene.cam_from_centred[:3, :3].T.astype(np.float64) + scene.cam_from_centred[:3, 3]
    uv1 = cam @ scene.K.T
    uv1 /= uv1[:, 2:]
    crop = uv1 @ crop_from_img.T
    assert crop[:, :2].min() >= 0.0 and crop[:, :2].max() <= 159.0
    centre = crop_from_img @ np.r_[(scene.K @ cam.mean(0))[:2] / (scene.K @ cam.mean(0))[2], 1.0]
    assert np.abs(centre[:2] - 79.5).max() < 25  # the object sits near the middle of its crop


def test_render_at_the_true_pose_matches_the_observed_depth(scene) -> None:
    frame = prepare_frame(scene.rgb, scene.depth, scene.K, "cpu", xyz_float64=True)
    pose = torch.as_tensor(scene.cam_from_centred)[None]
    crop_from_img = crop_windows(pose, scene.K, scene.obj.diameter, REFINE_CROP_RATIO, S=160)
    mesh = scene.obj.tensors.to("cpu")  # a CPU check of the geometry, wherever the scene's object lives
    rendered = make_renderer("cpu", "cpu").render(mesh, pose, scene.K, frame.hw, crop_from_img)
    observed = warp_to_crops(torch.as_tensor(scene.depth)[..., None], crop_from_img, S=160, mode="nearest")[0, ..., 0]
    render_mask = rendered.mask[0]
    observed_mask = observed > 0
    iou = (render_mask & observed_mask).sum().item() / (render_mask | observed_mask).sum().item()
    assert iou > 0.95, iou
    both = render_mask & observed_mask
    median_err = (rendered.depth[0][both] - observed[both]).abs().median().item()
    assert median_err < 0.001, median_err  # metres


def test_zero_network_output_leaves_the_pose_unchanged(scene) -> None:
    pose = torch.as_tensor(scene.cam_from_centred)[None].repeat(3, 1, 1)
    zeros = torch.zeros(3, 3)
    out = apply_refiner_output(pose, zeros, zeros, scene.obj.diameter)
    assert torch.equal(out, pose)


def test_mesh_and_centred_frames_round_trip(scene) -> None:
    cam_from_mesh = to_mesh_frame(scene.cam_from_centred, scene.obj.centred_from_mesh)
    assert cam_from_mesh.dtype == np.float64
    back = to_centred_frame(cam_from_mesh, scene.obj.mesh_from_centred)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, scene.cam_from_centred, atol=1e-7)


@pytest.mark.parametrize("field", ["crop_size", "crop_size_px"])
def test_crop_side_settings_must_match_the_networks(tiny_estimator, field: str) -> None:
    config, renderer = EstimatorConfig(num_hypotheses=2), tiny_estimator.renderer
    if field == "crop_size":
        config = EstimatorConfig(num_hypotheses=2, crop_size=128)
        match = r"^EstimatorConfig.crop_size: expected 160, the refiner network's input side .*; got 128$"
    else:
        renderer = make_renderer("cpu", "cpu", RenderConfig(crop_size_px=96))
        match = r"^RenderConfig.crop_size_px: expected 160, the refiner network's input side .*; got 96$"
    with pytest.raises(ValueError, match=match):
        PoseEstimator(tiny_estimator.networks, renderer, device="cpu", config=config)


@pytest.mark.slow
def test_register_and_track_are_rigid_and_deterministic(scene, tiny_estimator) -> None:
    first = tiny_estimator.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)
    second = tiny_estimator.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)
    _assert_rigid(first.cam_from_mesh)
    np.testing.assert_array_equal(first.cam_from_mesh, second.cam_from_mesh)
    assert first.score == second.score and np.isfinite(first.score)
    assert {"prepare", "hypotheses", "refine_score"} <= set(first.timings_ms) and "total" in first.timings_ms
    assert all(v >= 0 for v in first.timings_ms.values())

    tracked = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, first.cam_from_mesh)
    again = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, first.cam_from_mesh)
    _assert_rigid(tracked.cam_from_mesh)
    np.testing.assert_array_equal(tracked.cam_from_mesh, again.cam_from_mesh)
    assert set(tracked.timings_ms) == {"track_step", "total"}


@pytest.mark.slow
def test_tracker_keeps_the_centred_state(scene, tiny_estimator) -> None:
    tracker = Tracker(tiny_estimator, scene.obj, recovery=None)
    with pytest.raises(RuntimeError, match="before a successful register"):
        tracker.track(scene.rgb, scene.depth, scene.K)
    reg = tracker.register(scene.rgb, scene.depth, scene.mask, scene.K)
    np.testing.assert_array_equal(tracker.cam_from_centred, reg.cam_from_centred)
    step = tracker.track(scene.rgb, scene.depth, scene.K)
    expected = tiny_estimator.track(
        scene.obj, scene.rgb, scene.depth, scene.K, reg.cam_from_centred, prev_frame="centred"
    )
    np.testing.assert_array_equal(step.cam_from_mesh, expected.cam_from_mesh)
    assert step.session is not None and expected.session is None  # the Tracker is the session; the estimator is not


def _judged_by(obj, **thresholds):
    """``obj`` whose results are judged with these validity thresholds (the defaults for the rest)."""
    from foundationpose.validity import ValidityConfig

    return dataclasses.replace(obj, validity=ValidityConfig(**thresholds))


def _lenient(obj):
    """Every pose that keeps the object in view of a depth map with readings everywhere is valid (random weights
    move the pose by decimetres: only the thresholds decide here, which is what these tests are about); appearance is
    not judged (no crop has that many cells)."""
    return _judged_by(obj, depth_tolerance_diameters=1e3, min_support=1e-6, min_consistent=1e-6,
                      max_translation_m=1e3, max_rotation_deg=1e3, min_appearance_cells=1e9)


def _filled(depth):
    """The scene's depth with a wall 5 cm behind the object where it had no reading."""
    return np.where(depth > 0, depth, np.float32(depth[depth > 0].max() + 0.05)).astype(np.float32)


@pytest.mark.slow
def test_tracker_states_follow_validity_and_a_lost_session_never_reports_a_valid_pose(scene, tiny_estimator) -> None:
    from foundationpose.session_state import State

    depth = _filled(scene.depth)
    strict = _judged_by(scene.obj, min_support=0.999999)
    tracker = Tracker(tiny_estimator, _lenient(scene.obj), recovery=None)
    reg = tracker.register(scene.rgb, depth, scene.mask, scene.K)
    assert (reg.session.state, reg.session.pose_valid, reg.session.source) == (State.TRACKING, True,
                                                                              "register (client mask)")
    assert reg.validity.valid and reg.session.confidence == reg.validity.confidence
    step = tracker.track(scene.rgb, depth, scene.K)
    assert (step.session.state, step.session.pose_valid) == (State.TRACKING, True)
    tracker.obj = strict  # the same object judged strictly: every frame from now on is invalid
    states = [tracker.track(scene.rgb, depth, scene.K).session for _ in range(3)]
    assert [r.state for r in states] == [State.UNCERTAIN, State.UNCERTAIN, State.LOST]  # lost within 3 frames
    assert not any(r.pose_valid for r in states)
    lost = tracker.track(scene.rgb, depth, scene.K).session  # no recovery: it keeps tracking, LOST
    assert (lost.state, lost.pose_valid, lost.source) == (State.LOST, False, "track")
    forced = tracker.register(scene.rgb, depth, scene.mask, scene.K).session  # a client mask, still invalid
    assert (forced.state, forced.pose_valid) == (State.LOST, False)


@pytest.mark.slow
def test_a_lost_tracker_recovers_by_registering_on_a_candidate_from_the_depth(scene, tiny_estimator) -> None:
    from foundationpose.session_state import SessionConfig, State

    strict = _judged_by(scene.obj, min_support=0.999999)
    tracker = Tracker(tiny_estimator, strict, config=SessionConfig(confirm_frames=1))  # session_state tests: 2+
    assert tracker.register(scene.rgb, scene.depth, scene.mask, scene.K).session.state is State.LOST
    step = tracker.track(scene.rgb, scene.depth, scene.K)  # LOST: a register on a candidate mask of the depth
    assert step.session.source.startswith("recovery register (") and step.session.state is State.LOST
    assert not step.session.pose_valid and np.isfinite(step.cam_from_mesh).all()
    tracker.obj = _lenient(scene.obj)
    depth = _filled(scene.depth)
    recovered = tracker.track(scene.rgb, depth, scene.K).session  # a valid recovery, confirmed by itself here
    assert recovered.source.startswith("recovery register (")
    assert (recovered.state, recovered.pose_valid) == (State.TRACKING, True)
    assert tracker.track(scene.rgb, depth, scene.K).session.source == "track"  # found again: back to tracking


def test_register_rejects_bad_inputs_with_named_fields(scene, tiny_estimator) -> None:
    est, obj = tiny_estimator, scene.obj
    with pytest.raises(InputError, match=r"^mask: "):
        est.register(obj, scene.rgb, scene.depth, np.zeros_like(scene.mask), scene.K)
    with pytest.raises(InputError, match=r"^depth: "):
        est.register(obj, scene.rgb, scene.depth[:-1], scene.mask, scene.K)
    with pytest.raises(InputError, match=r"^depth: "):
        est.register(obj, scene.rgb, (scene.depth * 1000).astype(np.uint16), scene.mask, scene.K)
    with pytest.raises(InputError, match=r"^K: "):
        est.register(obj, scene.rgb, scene.depth, scene.mask, np.full((3, 3), np.nan))
    with pytest.raises(InputError, match=r"^rgb: "):
        est.register(obj, scene.rgb.astype(np.float32), scene.depth, scene.mask, scene.K)
    far_mask = np.zeros_like(scene.mask)
    far_mask[0, 0] = True  # a corner of background: no depth under the mask
    with pytest.raises(InputError, match=r"^depth: expected at least 4 valid depth pixels"):
        est.register(obj, scene.rgb, scene.depth, far_mask, scene.K)
    with pytest.raises(InputError, match=r"^pose: "):
        est.track(obj, scene.rgb, scene.depth, scene.K, np.full((4, 4), 2.0))


def test_grid_subsampling_is_even_and_bounded() -> None:
    grid = np.arange(252)[:, None, None] * np.ones((252, 4, 4))
    assert len(subsample_grid(grid, None)) == 252
    assert len(subsample_grid(grid, 300)) == 252
    picked = subsample_grid(grid, 6)[:, 0, 0]
    np.testing.assert_array_equal(picked, [0, 50, 100, 151, 201, 251])


def test_scene_helper_rotation_is_proper() -> None:
    rot = rotation_xyz(0.3, -1.2, 2.0)
    np.testing.assert_allclose(rot @ rot.T, np.eye(3), atol=1e-12)
