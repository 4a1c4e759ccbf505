"""The pipelined fast path returns the reference path's poses, batches tracks, and never leaks."""

from __future__ import annotations

import threading
from concurrent.futures import wait

import numpy as np
import pytest

from deploy_core.errors import BusyError, ClosedError
from foundationpose import validate
from foundationpose.errors import InputError
from foundationpose.service import PoseService, ServiceConfig

from .conftest import TEST_DEVICE, assert_same_pose

CONFIG = ServiceConfig(max_image_hw=(240, 320), track_max_batch=4, track_max_wait_ms=20.0)


@pytest.fixture(scope="module")
def reference(scene, tiny_estimator):
    reg = tiny_estimator.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)
    trk = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, reg.cam_from_mesh)
    return reg, trk


def test_pipelined_register_and_track_equal_the_reference(scene, tiny_estimator, reference) -> None:
    reg_ref, trk_ref = reference
    with PoseService(tiny_estimator, CONFIG) as service:
        regs = [service.submit_register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K) for _ in range(3)]
        for fut in regs:
            got = fut.result(timeout=300)
            assert_same_pose(got.cam_from_mesh, reg_ref.cam_from_mesh)
            assert got.score == pytest.approx(reg_ref.score, abs=0.0 if TEST_DEVICE == "cpu" else 1e-3)
            assert {"upload", "hypotheses", "refine_score", "total"} <= set(got.timings_ms)
        tracks = [
            service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, key=f"s{i}")
            for i in range(6)
        ]
        for fut in tracks:
            assert_same_pose(fut.result(timeout=300).cam_from_mesh, trk_ref.cam_from_mesh)
        stats = service.stats()
        assert stats.track_batcher.items == 6
        assert stats.track_batcher.batches < 6  # concurrent sessions shared refiner calls
    assert stats.register.stage("refine_score").count == 3


def test_track_batch_with_one_bad_session_spares_the_others(scene, tiny_estimator, reference) -> None:
    reg_ref, trk_ref = reference
    with PoseService(tiny_estimator, CONFIG) as service:
        good = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, key="a")
        with pytest.raises(InputError, match=r"^pose: "):
            service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, np.eye(4) * 2, key="b")
        assert_same_pose(good.result(timeout=300).cam_from_mesh, trk_ref.cam_from_mesh)


def test_the_objects_of_one_frame_share_its_images_and_get_the_reference_poses(scene, tiny_estimator,
                                                                                 reference) -> None:
    reg_ref, trk_ref = reference
    with PoseService(tiny_estimator, CONFIG) as service:
        rgb, depth = service.share_frame(scene.rgb, scene.depth)
        np.testing.assert_array_equal(rgb, scene.rgb)
        np.testing.assert_array_equal(depth, scene.depth)
        release = service.hold_tracks()
        futures = [service.submit_track(scene.obj, rgb, depth, scene.K, reg_ref.cam_from_mesh, key=i) for i in range(3)]
        release()
        for future in futures:
            result = future.result(timeout=300)
            assert result.timings_ms["batch"] == 3.0  # one batch: the frame's rows read one copy of it
            assert_same_pose(result.cam_from_mesh, trk_ref.cam_from_mesh)
        negative = scene.depth.copy()
        negative[0, :4] = -1.0
        with pytest.raises(InputError, match=r"^depth: expected non-negative metres .*got 4 negative values"):
            service.share_frame(scene.rgb, negative)
        with pytest.raises(InputError, match=r"^rgb: expected an image of at most 240x320 pixels"):
            service.share_frame(np.zeros((241, 320, 3), np.uint8), np.ones((241, 320), np.float32))


@pytest.mark.slow
def test_bad_register_input_fails_its_future_and_returns_the_lease(scene, tiny_estimator) -> None:
    far_mask = np.zeros_like(scene.mask)
    far_mask[0, 0] = True
    with PoseService(tiny_estimator, CONFIG) as service:
        fut = service.submit_register(scene.obj, scene.rgb, scene.depth, far_mask, scene.K)
        with pytest.raises(InputError, match=r"^depth: expected at least 4 valid depth pixels") as info:
            fut.result(timeout=300)
        assert getattr(info.value, "pipeline_stage", None) == "select"
        assert service.stats().register_pool.leased == 0
        with pytest.raises(InputError, match=r"^rgb: expected an image of at most 240x320"):
            big = np.zeros((480, 640, 3), np.uint8)
            service.submit_register(scene.obj, big, np.zeros((480, 640), np.float32), np.ones((480, 640), bool), scene.K)


def test_backpressure_then_close_completes_every_future(scene, tiny_estimator) -> None:
    threads_before = set(threading.enumerate())  # other tests' long-lived services may own fp- threads
    service = PoseService(tiny_estimator, ServiceConfig(max_image_hw=(240, 320), frames_in_flight=1, queue_capacity=1))
    gate, entered = threading.Event(), threading.Event()
    original = service._register.pipeline.stages[0].fn

    def gated_upload(pkg) -> None:
        entered.set()
        assert gate.wait(60), "test never opened the gate"
        original(pkg)

    object.__setattr__(service._register.pipeline.stages[0], "fn", gated_upload)
    futures = [service.submit_register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)]
    assert entered.wait(60)
    with pytest.raises(BusyError):  # one slot, and it is taken: admission refuses within the timeout
        service.submit_register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K, timeout=0.05)
    closer = threading.Thread(target=service.close, kwargs={"abort": True})
    closer.start()
    gate.set()
    closer.join(120)
    assert not closer.is_alive()
    done, pending = wait(futures, timeout=60)
    assert not pending
    with pytest.raises(ClosedError):
        service.submit_register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)
    assert service.stats().register_pool.leased == 0
    leftover = [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("fp-")]
    assert not leftover, leftover


@pytest.mark.slow
def test_service_calls_take_the_estimators_arguments(scene, tiny_estimator, reference) -> None:
    """register/track/submit_* accept iterations= as the estimator does (fewer than the lane runs): the
    poses equal the reference path's with the same iterations, also with mixed iterations in one batch."""
    reg_ref, trk_ref = reference
    reg_one = tiny_estimator.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K, iterations=1)
    trk_one = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, iterations=1)
    assert not np.array_equal(reg_one.cam_from_mesh, reg_ref.cam_from_mesh)
    assert not np.array_equal(trk_one.cam_from_mesh, trk_ref.cam_from_mesh)
    config = ServiceConfig(max_image_hw=(240, 320), track_max_batch=2, track_max_wait_ms=10_000.0)
    with PoseService(tiny_estimator, config) as service:
        service._batcher.idle_dispatch = False  # a track batch closes when it holds two requests
        reg = service.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K, iterations=1)
        assert_same_pose(reg.cam_from_mesh, reg_one.cam_from_mesh)
        one = service.submit_track(
            scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, iterations=1, key="a"
        )
        two = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, key="b")
        assert one.result(timeout=300).timings_ms["batch"] == 2.0
        assert_same_pose(one.result().cam_from_mesh, trk_one.cam_from_mesh)
        assert_same_pose(two.result(timeout=300).cam_from_mesh, trk_ref.cam_from_mesh)
        with pytest.raises(InputError, match=r"^iterations: expected at most 2 \(the service's track lane runs 2 "):
            service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, iterations=3)
        with pytest.raises(InputError, match=r"^iterations: expected an int >= 1, or None; got 0$"):
            service.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K, iterations=0)


@pytest.mark.slow
def test_service_submits_a_request_validated_once(scene, tiny_estimator, reference) -> None:
    reg_ref, trk_ref = reference
    request = validate.track_request(scene.rgb, scene.depth, scene.K, reg_ref.cam_from_mesh, limits=tiny_estimator.limits)
    assert_same_pose(tiny_estimator.run_track(scene.obj, request).cam_from_mesh, trk_ref.cam_from_mesh)
    with PoseService(tiny_estimator, CONFIG) as service:
        assert_same_pose(service.submit(scene.obj, request).result(timeout=300).cam_from_mesh, trk_ref.cam_from_mesh)
        with pytest.raises(TypeError, match="RegisterRequest or TrackRequest"):
            service.submit(scene.obj, "frame")  # type: ignore[call-overload]
