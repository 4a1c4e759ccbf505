"""The track lane's vectorised batches: several sessions (different K, images, sizes, objects) per refiner call
return exactly the poses of :meth:`PoseEstimator.track` run one by one."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from foundationpose.mesh import load_object
from foundationpose.service import PoseService, ServiceConfig
from foundationpose.synthetic.meshes import make_procedural_mesh

from .conftest import assert_same_pose, on_test_device, pose_xyz, render_scene


@pytest.fixture(scope="module")
def sessions(scene):
    """(obj, rgb, depth, K, prev cam_from_mesh) per session: other poses, K scaled, another size, another object."""
    other_obj = on_test_device(load_object(make_procedural_mesh("vertex_color_asym")))
    k_scaled = scene.K.copy()
    k_scaled[:2] *= 1.13
    k_small = np.array([[131.0, 0.0, 69.25], [0.0, 129.5, 49.75], [0.0, 0.0, 1.0]])
    specs = [
        (scene.obj, pose_xyz(0.6, -0.4, 0.3, (0.01, -0.005, 0.5)), scene.K, (120, 160)),
        (scene.obj, pose_xyz(0.2, 0.5, -0.1, (-0.02, 0.01, 0.55)), scene.K, (120, 160)),
        (scene.obj, pose_xyz(0.6, -0.4, 0.3, (0.01, -0.005, 0.5)), k_scaled, (120, 160)),
        (other_obj, pose_xyz(-0.3, 0.2, 0.8, (0.0, 0.01, 0.45)), k_scaled, (120, 160)),
        (scene.obj, pose_xyz(0.1, -0.2, 0.4, (0.005, 0.0, 0.5)), k_small, (100, 140)),
        (other_obj, pose_xyz(0.4, 0.1, 0.2, (0.01, 0.0, 0.5)), scene.K, (120, 160)),
    ]
    out = []
    for i, (obj, pose, K, hw) in enumerate(specs):
        s = render_scene(obj, pose, K, hw)
        prev = s.cam_from_mesh.copy()
        prev[:3, 3] += (0.004, -0.003, 0.006) if i % 2 else (-0.003, 0.002, -0.005)  # a step away from the truth
        out.append((obj, s.rgb, s.depth, K, prev))
    return out


@pytest.mark.slow
def test_batched_track_sessions_equal_the_reference_one_by_one(sessions, tiny_estimator) -> None:
    expected = [tiny_estimator.track(obj, rgb, depth, K, prev).cam_from_mesh for obj, rgb, depth, K, prev in sessions]
    config = ServiceConfig(max_image_hw=(120, 160), track_max_batch=8, track_max_wait_ms=20.0,
                           track_batches_in_flight=1)
    with PoseService(tiny_estimator, config) as service:
        gate, entered = threading.Event(), threading.Event()
        step = service._track.pipeline.stages[0]
        original = step.fn

        def gated_step(pkg) -> None:
            entered.set()
            assert gate.wait(60), "test never opened the gate"
            original(pkg)

        object.__setattr__(step, "fn", gated_step)
        futures = [service.submit_track(*sessions[0], key="s0")]
        assert entered.wait(60)  # the first batch holds the only slot: the others queue up behind it
        futures += [service.submit_track(*s, key=f"s{i}") for i, s in enumerate(sessions[1:], start=1)]
        gate.set()
        results = [fut.result(timeout=300) for fut in futures]
        stats = service.stats()
    for got, want in zip(results, expected, strict=True):
        assert_same_pose(got.cam_from_mesh, want)
    assert max(r.timings_ms["batch"] for r in results) > 1  # sessions shared a refiner call
    assert stats.track_batcher.batches < len(sessions)
    assert stats.track_pool.leased == 0


@pytest.mark.slow
def test_one_batch_with_two_objects_two_sizes_and_three_k(sessions, tiny_estimator) -> None:
    """All six sessions in one batch: groups (object, size) = 3, rows out of submission order."""
    expected = [tiny_estimator.track(obj, rgb, depth, K, prev).cam_from_mesh for obj, rgb, depth, K, prev in sessions]
    config = ServiceConfig(max_image_hw=(120, 160), track_max_batch=len(sessions), track_max_wait_ms=10_000.0)
    with PoseService(tiny_estimator, config) as service:
        service._batcher.idle_dispatch = False  # the batch closes when it is full
        futures = [service.submit_track(*s, key=f"s{i}") for i, s in enumerate(sessions)]
        results = [fut.result(timeout=300) for fut in futures]
    assert [r.timings_ms["batch"] for r in results] == [float(len(sessions))] * len(sessions)
    for got, want in zip(results, expected, strict=True):
        assert_same_pose(got.cam_from_mesh, want)
