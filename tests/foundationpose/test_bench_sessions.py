"""The bench's session driver (:mod:`foundationpose.bench.sessions`): threads and asyncio sessions answer every
frame, each session's chain of poses equals the reference path's one by one, and failures are reported."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foundationpose.bench.sessions import SESSION_MODELS, run_sessions
from foundationpose.estimator import PoseEstimator
from foundationpose.service import PoseService, ServiceConfig

SESSIONS, FRAMES = 5, 3


@pytest.fixture(scope="module")
def graphed_estimator(tiny_estimator):
    """The tiny estimator with one track iteration."""
    config = dataclasses.replace(tiny_estimator.config, track_iterations=1)
    return PoseEstimator(tiny_estimator.networks, tiny_estimator.renderer, device=tiny_estimator.device,
                         config=config)


@pytest.mark.slow
@pytest.mark.parametrize("model", SESSION_MODELS)
def test_every_session_chains_the_reference_poses(model, scene, graphed_estimator) -> None:
    est = graphed_estimator
    want = scene.cam_from_mesh
    for _ in range(FRAMES):  # the reference path, frame after frame from its own answer
        want = est.track(scene.obj, scene.rgb, scene.depth, scene.K, want).cam_from_mesh
    config = ServiceConfig(max_image_hw=scene.rgb.shape[:2], track_max_batch=4, track_max_wait_ms=5.0)
    with PoseService(est, config) as service:
        run = run_sessions(service, scene.obj, [(scene.rgb, scene.depth)], scene.K, scene.cam_from_mesh,
                           sessions=SESSIONS, frames=FRAMES, model=model)
        stats = service.stats()
    assert run.errors == []
    assert run.model == model and run.sessions == SESSIONS
    assert len(run.latencies_ms) == SESSIONS * FRAMES and all(ms > 0 for ms in run.latencies_ms)
    assert run.elapsed_s >= max(run.latencies_ms) / 1e3
    for pose in run.poses:  # batched with the other sessions, still the reference path's chain of poses
        np.testing.assert_array_equal(pose, want)
    parts = run.parts_mean_ms()
    assert set(parts) == {"submit", "batcher_wait", "step", "finish", "other"}
    assert parts["step"] > 0 and parts["submit"] > 0
    assert stats.track_batcher.items + stats.track_inline == SESSIONS * FRAMES  # each frame ran once
    assert stats.track_pool.leased == 0
    if model != "threads":  # one loop never blocks on a step of its own
        assert stats.track_inline == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", SESSION_MODELS)
def test_a_failing_session_is_reported_and_the_others_finish(model, scene, graphed_estimator) -> None:
    config = ServiceConfig(max_image_hw=scene.rgb.shape[:2], track_max_batch=4)
    bad_pose = np.full((4, 4), np.nan)  # validation refuses it in submit_track
    with PoseService(graphed_estimator, config) as service:
        good = run_sessions(service, scene.obj, [(scene.rgb, scene.depth)], scene.K, scene.cam_from_mesh,
                            sessions=2, frames=2, model=model)
        bad = run_sessions(service, scene.obj, [(scene.rgb, scene.depth)], scene.K, bad_pose,
                           sessions=2, frames=2, model=model)
    assert good.errors == [] and len(good.latencies_ms) == 4
    assert len(bad.errors) == 2 and "pose" in str(bad.errors[0])
    assert bad.latencies_ms == [] and bad.poses == [None, None]


def test_arguments_are_checked(scene, graphed_estimator) -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        run_sessions(None, scene.obj, [(scene.rgb, scene.depth)], scene.K, scene.cam_from_mesh, sessions=1, frames=1,
                     model="processes")
    with pytest.raises(ValueError, match=">= 1"):
        run_sessions(None, scene.obj, [(scene.rgb, scene.depth)], scene.K, scene.cam_from_mesh, sessions=0, frames=1)


@pytest.mark.slow
def test_tracks_from_page_locked_slots_equal_tracks_from_plain_arrays(scene, graphed_estimator) -> None:
    config = ServiceConfig(max_image_hw=scene.rgb.shape[:2], track_max_batch=4)
    with PoseService(graphed_estimator, config) as service:
        want = service.track(scene.obj, scene.rgb, scene.depth, scene.K, scene.cam_from_mesh).cam_from_mesh
        with service.page_locked_frames(2) as frames:
            rgb, depth = frames[1]
            np.copyto(rgb, scene.rgb)
            np.copyto(depth, scene.depth)
            run = run_sessions(service, scene.obj, [(rgb, depth)], scene.K, scene.cam_from_mesh, sessions=3, frames=1,
                               model="asyncio")
    assert run.errors == [] and frames.hw == scene.rgb.shape[:2]
    for pose in run.poses:
        np.testing.assert_array_equal(pose, want)
