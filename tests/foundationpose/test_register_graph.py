"""The captured register (foundationpose.register_graph): refine iterations + scorer as one step on static buffers.

CPU: the step runs eagerly on the runner's buffers and must equal the iteration-by-iteration register
(:func:`foundationpose._steps_reference.register_reference`) bit for bit (the closed-form window inverses give the
LU's values there). CUDA (skipped without a GPU): the replay equals the
same step run eagerly on the same buffers, for new frames, K and hypotheses through one graph, and the
iteration-by-iteration register within the fp16 tolerance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from foundationpose._steps_reference import register_reference
from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.observation import prepare_frame
from foundationpose.register_graph import RegisterGraphConfig, RegisterGraphRunner
from foundationpose.service import PoseService, ServiceConfig

from .conftest import render_scene

ITERATIONS = 2


def _runner(estimator: PoseEstimator, **config) -> RegisterGraphRunner:
    return RegisterGraphRunner(
        estimator.networks.refiner, estimator.networks.scorer, estimator.renderer, estimator.device,
        crop_size=estimator.config.crop_size, config=RegisterGraphConfig(**config), constants=estimator.constants,
    )


def _inputs(estimator: PoseEstimator, sc):
    frame = prepare_frame(sc.rgb, sc.depth, sc.K, estimator.device, xyz_float64=True, constants=estimator.constants)
    mask = torch.as_tensor(sc.mask, device=estimator.device)
    return frame, estimator.hypotheses(frame, mask)


def _other_scene(scene):
    """The scene's object at another pose and size, seen with another K (new data for the same shapes or not)."""
    K2 = np.array([[170.0, 0.0, 82.5], [0.0, 171.0, 57.5], [0.0, 0.0, 1.0]])
    pose = scene.cam_from_centred.copy()
    pose[:3, 3] += np.array([0.01, 0.004, 0.03], np.float32)
    return render_scene(scene.obj, pose, K2, scene.depth.shape)


def _cpu_only(estimator: PoseEstimator) -> None:
    if estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity; the CUDA twin is test_register_replay_equals_eager_on_cuda")


def test_the_estimators_register_is_the_step_eager_on_the_cpu(tiny_estimator) -> None:
    _cpu_only(tiny_estimator)
    runner = tiny_estimator.register_runner
    assert runner is not None and not runner.capturable  # the same step, eagerly, on its static buffers


@pytest.fixture(scope="module")
def other_scene(scene):
    return _other_scene(scene)


@pytest.fixture(scope="module")
def estimator_register(tiny_estimator):
    """``tiny_estimator.register`` of a scene at some iterations, run once per module (a CPU register takes seconds;
    the estimator is deterministic on the CPU, so the tests that compare against it share its answers)."""
    done: dict[tuple[int, int | None], object] = {}

    def register(sc, iterations: int | None = None):
        key = (id(sc), iterations)
        if key not in done:
            done[key] = (sc, tiny_estimator.register(sc.obj, sc.rgb, sc.depth, sc.mask, sc.K, iterations=iterations))
        return done[key][1]

    return register


@pytest.fixture(scope="module")
def fresh_pick(scene, tiny_estimator):
    """A fresh runner's step on the scene's inputs (every refined pose and score kept), run once per module."""
    runner = _runner(tiny_estimator)
    frame, poses = _inputs(tiny_estimator, scene)
    ticket = runner.submit(scene.obj, frame, poses, ITERATIONS, keep_all=True)
    return frame, poses, ticket, runner.collect(ticket)


@pytest.mark.slow
def test_step_on_static_buffers_equals_the_iteration_by_iteration_register(scene, other_scene, tiny_estimator,
                                                                           estimator_register) -> None:
    _cpu_only(tiny_estimator)
    est = tiny_estimator
    est.register_runner.forget(scene.obj)
    for sc in (scene, other_scene):  # one entry, new frame, K and hypotheses the second time
        poses, scores, best = register_reference(est, sc.obj, _request(sc))
        got = est.register_candidates(sc.obj, _request(sc))
        assert "refine_score" in got.timings_ms and "refine_1" not in got.timings_ms
        assert got.best == best
        torch.testing.assert_close(got.cam_from_centred, poses, rtol=0, atol=0)
        torch.testing.assert_close(got.scores, scores, rtol=0, atol=0)
        result = estimator_register(sc)
        np.testing.assert_array_equal(result.cam_from_centred, poses[best].numpy())
        assert result.score == float(scores[best])
    ours = [key for key in est.register_runner.keys() if key[0] == id(scene.obj)]  # other tests share the estimator
    assert ours == [(id(scene.obj), 6, *scene.depth.shape, est.config.register_iterations)]


def _request(sc):
    from foundationpose import validate

    return validate.register_request(sc.rgb, sc.depth, sc.mask, sc.K)


@pytest.mark.slow
def test_runner_picks_the_best_scored_hypothesis_and_reports_it(scene, tiny_estimator, fresh_pick) -> None:
    _cpu_only(tiny_estimator)
    runner = _runner(tiny_estimator)
    frame, poses, ticket, (pose, score, best) = fresh_pick
    assert ticket.poses.shape == (6, 4, 4) and ticket.scores.shape == (6,)
    assert best == int(torch.argmax(ticket.scores)) and score == float(ticket.scores[best])
    np.testing.assert_array_equal(pose, ticket.poses[best].numpy())
    assert not np.array_equal(pose, poses[best].numpy())  # the iterations moved it
    # without keep_all only the pick comes back, the same one
    lean = runner.submit(scene.obj, frame, poses, ITERATIONS)
    assert lean.poses is None and lean.scores is None
    np.testing.assert_array_equal(runner.collect(lean)[0], pose)


@pytest.mark.slow
def test_cache_is_keyed_by_size_and_iterations_and_keeps_its_bound(scene, tiny_estimator) -> None:
    _cpu_only(tiny_estimator)
    runner = _runner(tiny_estimator, max_graphs=2)
    frame, poses = _inputs(tiny_estimator, scene)
    assert runner.prepare(scene.obj, 6, frame.hw, ITERATIONS) is True
    assert runner.prepare(scene.obj, 6, frame.hw, ITERATIONS) is False
    runner.run(scene.obj, frame, poses, ITERATIONS)
    assert len(runner.keys()) == 1
    # the other keys through prepare (a run takes its entry from the same cache call, and on the CPU prepare runs no
    # step: each run would only add seconds of networks); the last one through a run again
    assert runner.prepare(scene.obj, 6, frame.hw, 1) is True  # other iterations: a new entry
    assert runner.prepare(scene.obj, 6, frame.hw, ITERATIONS) is False  # the first one, now the most recent
    runner.run(scene.obj, frame, poses[:3], 1)  # fewer hypotheses (a symmetric object's grid): a new one, LRU out
    assert runner.keys() == [(id(scene.obj), 6, *frame.hw, ITERATIONS), (id(scene.obj), 3, *frame.hw, 1)]
    assert runner.forget(scene.obj) == 2 and runner.keys() == []


def test_errors_name_the_hypotheses_shape(scene, tiny_estimator) -> None:
    _cpu_only(tiny_estimator)
    runner = _runner(tiny_estimator)
    frame, poses = _inputs(tiny_estimator, scene)
    with pytest.raises(ValueError, match="at least one hypothesis"):
        runner.submit(scene.obj, frame, poses[:0], ITERATIONS)
    with pytest.raises(ValueError, match=r"\(N, 4, 4\) hypotheses; got \(6, 3, 4\)"):
        runner.submit(scene.obj, frame, poses[:, :3], ITERATIONS)
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        RegisterGraphConfig(max_graphs=0)


@pytest.mark.slow
def test_register_lane_equals_the_estimator_several_in_flight(scene, other_scene, tiny_estimator,
                                                              estimator_register) -> None:
    """The service's register lane (eager on the CPU): every register of a burst of two frames equals the
    estimator's register, fewer iterations per request included, and the slots come back."""
    _cpu_only(tiny_estimator)
    other = other_scene
    service = PoseService(tiny_estimator, ServiceConfig(frames_in_flight=2, max_image_hw=scene.depth.shape))
    try:
        names = [s.name for s in service.stats().register.stages]
        assert names == ["upload", "hypotheses", "refine_score", "select"]
        jobs = [(scene, None), (other, None), (scene, 1), (other, 1)]
        futures = [service.submit_register(sc.obj, sc.rgb, sc.depth, sc.mask, sc.K, iterations=it) for sc, it in jobs]
        for (sc, it), fut in zip(jobs, futures, strict=True):
            got = fut.result(timeout=120)
            want = estimator_register(sc, it)
            np.testing.assert_array_equal(got.cam_from_centred, want.cam_from_centred)
            assert got.score == want.score
            assert {"upload", "hypotheses", "refine_score", "total"} <= set(got.timings_ms)
        assert service.stats().register_pool.leased == 0
        assert service.forget_object(scene.obj) >= 2  # both iteration counts' entries
    finally:
        service.close()


@pytest.mark.slow
def test_register_lane_refuses_a_frame_without_masked_depth_like_the_estimator(scene, tiny_estimator) -> None:
    from foundationpose.errors import InputError

    _cpu_only(tiny_estimator)
    service = PoseService(tiny_estimator, ServiceConfig(max_image_hw=scene.depth.shape))
    try:
        empty = np.zeros_like(scene.depth)
        with pytest.raises(InputError) as want:
            tiny_estimator.register(scene.obj, scene.rgb, empty, scene.mask, scene.K)
        with pytest.raises(InputError) as got:
            service.register(scene.obj, scene.rgb, empty, scene.mask, scene.K)
        assert str(got.value) == str(want.value)
        ok = service.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)  # the lane goes on
        assert np.isfinite(ok.cam_from_centred).all()
        assert service.stats().register_pool.leased == 0
    finally:
        service.close()


# -- CUDA ---------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_triton_estimator():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = EstimatorConfig(num_hypotheses=6, register_iterations=ITERATIONS)
    return PoseEstimator.create(device="cuda", renderer="triton", config=config)


def _on_cuda(sc):
    return dataclasses.replace(sc, obj=dataclasses.replace(sc.obj, tensors=sc.obj.tensors.to("cuda")))


@cuda
def test_register_replay_equals_eager_on_cuda(scene, cuda_triton_estimator) -> None:
    est = cuda_triton_estimator
    graphed, eager = _runner(est), _runner(est, capture=False)
    assert graphed.capturable and not eager.capturable
    obj = _on_cuda(scene).obj
    scenes = [dataclasses.replace(scene, obj=obj), dataclasses.replace(_other_scene(scene), obj=obj)]
    for sc in scenes:  # the second: new frame, K and hypotheses through the same graph
        frame, poses = _inputs(est, sc)
        got = graphed.submit(sc.obj, frame, poses, ITERATIONS, keep_all=True)
        want = eager.submit(sc.obj, frame, poses, ITERATIONS, keep_all=True)
        pick, pick_eager = graphed.collect(got), eager.collect(want)
        key = (id(sc.obj), len(poses), *sc.depth.shape, ITERATIONS)
        assert graphed.is_graphed(key), f"capture failed (failures={graphed.capture_failures}); see the log"
        torch.testing.assert_close(got.poses, want.poses, rtol=0, atol=0)  # same kernels, same buffers
        torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=0)
        assert pick[2] == pick_eager[2]
        np.testing.assert_array_equal(pick[0], pick_eager[0])
        # vs the iteration-by-iteration register (LU inverses, K from the host): the fp16 tolerance
        reference_poses, _, _ = register_reference(est, sc.obj, _request(sc))
        torch.testing.assert_close(got.poses, reference_poses, rtol=0, atol=1e-2)
    assert graphed.captures == 1 and graphed.capture_failures == 0


@cuda
def test_service_register_lane_on_cuda_matches_and_returns_its_slots(scene, cuda_triton_estimator) -> None:
    est = cuda_triton_estimator
    assert est.register_runner.capturable
    sc = _on_cuda(scene)
    service = PoseService(est, ServiceConfig(frames_in_flight=2, max_image_hw=sc.depth.shape))
    try:
        lone = service.register(sc.obj, sc.rgb, sc.depth, sc.mask, sc.K)
        burst = [service.submit_register(sc.obj, sc.rgb, sc.depth, sc.mask, sc.K) for _ in range(4)]
        for fut in burst:  # registers in flight on one graph: each the lone one's pose, bit for bit
            np.testing.assert_array_equal(fut.result(timeout=120).cam_from_centred, lone.cam_from_centred)
        assert est.register_runner.captures >= 1
        assert service.stats().register_pool.leased == 0
    finally:
        service.close()


@cuda
def test_the_runner_stream_is_never_a_pooled_default_stream(cuda_triton_estimator) -> None:
    """A capture records every kernel enqueued on its stream, from any thread: the runner's stream must not be one
    that a lane stage or renderer also got from PyTorch's default-priority pool."""
    runner = _runner(cuda_triton_estimator)
    pooled = {torch.cuda.Stream(cuda_triton_estimator.device).cuda_stream for _ in range(40)}  # > the pool of 32
    assert runner.stream is not None and runner.stream.cuda_stream not in pooled


@pytest.mark.slow
def test_time_step_reports_the_launch_and_leaves_the_entry_cached(scene, tiny_estimator, fresh_pick) -> None:
    _cpu_only(tiny_estimator)
    runner = _runner(tiny_estimator)
    frame, poses, _, (fresh_pose, _, _) = fresh_pick
    times = runner.time_step(scene.obj, frame, poses, ITERATIONS, repeats=1)  # the median of one: a step less
    assert times["gpu_ms"] is None and times["wall_ms"] > 0  # CPU: no GPU events, the eager step's wall time
    assert runner.keys() == [(id(scene.obj), 6, *frame.hw, ITERATIONS)]
    # the timed step ran on the same inputs: a register after it gives a fresh runner's pick
    np.testing.assert_array_equal(runner.run(scene.obj, frame, poses, ITERATIONS)[0], fresh_pose)
