"""The track step (foundationpose.track_graph): the step on static buffers equals the reference track.

CPU: the step runs eagerly on the runner's buffers (copy in, step, copy out) and must equal the per-iteration
algorithm (:func:`foundationpose._steps_reference.track_reference`) bit for bit, in the estimator and in the
service's lane. CUDA (skipped without a GPU): graph replay equals the same step run eagerly, and the per-iteration
reference within the fp16 tolerance of ``assert_same_pose``.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from deploy_core.errors import CapacityError
from foundationpose import validate
from foundationpose._steps_reference import track_reference
from foundationpose.estimator import PoseEstimator
from foundationpose.track_graph import TrackFrame, TrackGraphConfig, TrackGraphRunner
from foundationpose.validity import JUDGED_COLUMNS
from tests.server._helpers import GatedCore

from .conftest import render_scene, rotation_xyz

ITERATIONS = 2


def _start(scene, dx: float = 0.004, angle: float = 0.05) -> np.ndarray:
    """A start pose near the scene's truth (float32 cam_from_centred)."""
    pose = scene.cam_from_centred.copy()
    pose[:3, :3] = (rotation_xyz(angle, -angle, 0.0) @ pose[:3, :3]).astype(np.float32)
    pose[0, 3] += dx
    return pose


def _reference(estimator: PoseEstimator, scene, start: np.ndarray, K: np.ndarray | None = None,
               iterations: int = ITERATIONS) -> np.ndarray:
    request = validate.track_request(scene.rgb, scene.depth, scene.K if K is None else K, start,
                                     prev_frame="centred", iterations=iterations)
    return track_reference(estimator, scene.obj, request)


def _rows(result: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """A runner's ``(poses (n, 4, 4), judged (n, J))`` as (n, 16 + J) rows: compared in one assertion."""
    poses, judged = result
    return np.concatenate([poses.reshape(len(poses), 16), judged], axis=1)


def _frame(scene, start: np.ndarray, K: np.ndarray | None = None) -> TrackFrame:
    return TrackFrame(rgb=scene.rgb, depth=scene.depth, K=scene.K if K is None else K, start=start)


def _runner(estimator: PoseEstimator, **config) -> TrackGraphRunner:
    return TrackGraphRunner(
        estimator.networks.track_refiner, estimator.renderer, estimator.device,
        crop_size=estimator.config.crop_size, config=TrackGraphConfig(**config), constants=estimator.constants,
    )


def _with_refiner(estimator: PoseEstimator, track_refiner) -> PoseEstimator:
    """``estimator`` with another track refiner core."""
    networks = dataclasses.replace(estimator.networks, track_refiner=track_refiner)
    return PoseEstimator(networks, estimator.renderer, device=estimator.device, config=estimator.config)


def _batch_when_full(service) -> None:
    """A batch of the service's lane closes only when it holds ``track_max_batch`` requests (or after its wait):
    an idle lane otherwise takes the first request alone."""
    service._batcher.idle_dispatch = False


@pytest.mark.slow
def test_step_on_static_buffers_equals_the_reference_track(scene, tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity; the CUDA twin is test_graph_replay_equals_eager_on_cuda")
    runner = _runner(tiny_estimator, batch_sizes=(1, 4))
    start = _start(scene)
    want = _reference(tiny_estimator, scene, start)
    got, judged = runner.run(scene.obj, [_frame(scene, start)], ITERATIONS)
    assert got.shape == (1, 4, 4) and got.dtype == np.float32
    assert judged.shape == (1, JUDGED_COLUMNS) and np.isfinite(judged).all()  # the step judged its pose
    assert 0.0 <= judged[0, -2] <= 1.0 and judged[0, -1] in (0.0, 1.0)  # confidence, then the verdict
    np.testing.assert_array_equal(got[0], want)
    assert not np.array_equal(want, start)  # the step did move the pose


@pytest.mark.slow
def test_padded_batch_rows_each_equal_their_own_reference_track(scene, tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    runner = _runner(tiny_estimator, batch_sizes=(1, 4))
    K2 = scene.K.copy()
    K2[0, 0] += 7.0
    K2[1, 2] -= 3.0
    starts = [_start(scene), _start(scene, dx=-0.003, angle=-0.04), _start(scene, dx=0.0, angle=0.02)]
    Ks = [scene.K, K2, scene.K]
    got, _ = runner.run(scene.obj, [_frame(scene, s, K) for s, K in zip(starts, Ks, strict=True)], ITERATIONS)
    assert got.shape == (3, 4, 4)
    assert runner.keys() == [(frozenset({id(scene.obj)}), 4, *scene.depth.shape, ITERATIONS)]  # 3 requests padded to B = 4
    assert (runner.rows_requested, runner.rows_padding) == (3, 1)
    for i, (s, K) in enumerate(zip(starts, Ks, strict=True)):
        np.testing.assert_array_equal(got[i], _reference(tiny_estimator, scene, s, K), err_msg=f"row {i}")


@pytest.mark.slow
def test_the_estimators_track_is_the_step_and_equals_the_reference(scene, tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    graphed = PoseEstimator(tiny_estimator.networks, tiny_estimator.renderer, device="cpu",
                            config=tiny_estimator.config)
    assert not graphed.track_runner.capturable  # the same step, eagerly, on the CPU
    start = _start(scene)
    result = graphed.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred", iterations=ITERATIONS)
    np.testing.assert_array_equal(result.cam_from_centred, _reference(tiny_estimator, scene, start))
    np.testing.assert_array_equal(
        result.cam_from_mesh, result.cam_from_centred.astype(np.float64) @ scene.obj.centred_from_mesh
    )
    assert set(result.timings_ms) == {"track_step", "total"}
    # the mesh-frame entry point goes through the same runner
    mesh_pose = start.astype(np.float64) @ scene.obj.centred_from_mesh
    again = graphed.track(scene.obj, scene.rgb, scene.depth, scene.K, mesh_pose, iterations=ITERATIONS)
    np.testing.assert_array_equal(again.cam_from_centred, result.cam_from_centred)
    assert len(graphed.track_runner.keys()) == 1  # one image size, one object, one iteration count


@pytest.mark.slow
def test_cache_reuses_a_size_adds_a_new_one_and_keeps_its_bound(scene, tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("cache behaviour is device-independent; checked on the CPU")
    runner = _runner(tiny_estimator, batch_sizes=(1,), max_graphs=2)
    obj, start = scene.obj, _start(scene)
    runner.run(obj, [_frame(scene, start)], 1)
    runner.run(obj, [_frame(scene, start)], 1)
    h, w = scene.depth.shape
    assert runner.keys() == [(frozenset({id(obj)}), 1, h, w, 1)]  # same size: reused
    small = render_scene(obj, scene.cam_from_centred, scene.K, (h - 8, w - 16))
    runner.run(obj, [_frame(small, start)], 1)
    assert runner.keys() == [(frozenset({id(obj)}), 1, h, w, 1), (frozenset({id(obj)}), 1, h - 8, w - 16, 1)]  # new size: new entry
    runner.run(obj, [_frame(scene, start)], 1)  # touch the first: it becomes the most recent
    runner.run(obj, [_frame(scene, start)], 2)  # a third key evicts the least recently used
    assert runner.keys() == [(frozenset({id(obj)}), 1, h, w, 1), (frozenset({id(obj)}), 1, h, w, 2)]
    assert runner.captures == 0  # CPU: never captured, always the eager step


@pytest.mark.slow
def test_prepare_builds_every_batch_size_once_and_the_service_exposes_it(scene, tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("cache behaviour is device-independent; checked on the CPU")
    runner = _runner(tiny_estimator, batch_sizes=(1, 2, 4), max_graphs=4)
    obj, start = scene.obj, _start(scene)
    h, w = scene.depth.shape
    assert runner.prepare(obj, (h, w), ITERATIONS) == 3
    assert runner.keys() == [(frozenset({id(obj)}), b, h, w, ITERATIONS) for b in (1, 2, 4)]
    assert runner.prepare(obj, (h, w), ITERATIONS) == 0  # already there: nothing rebuilt
    np.testing.assert_array_equal(runner.run(obj, [_frame(scene, start)] * 3, ITERATIONS)[0][2],
                                  _reference(tiny_estimator, scene, start))  # the prepared B=4 entry serves n=3
    assert len(runner.keys()) == 3
    with pytest.raises(ValueError, match=r"^prepare: 3 batch sizes \(1, 2, 4\) exceed max_graphs=2$"):
        _runner(tiny_estimator, batch_sizes=(1, 2, 4), max_graphs=2).prepare(obj, (h, w), ITERATIONS)

    from foundationpose.service import PoseService, ServiceConfig

    config = ServiceConfig(max_image_hw=(240, 320), track_max_batch=4)
    tiny_estimator.forget_object(obj)  # the shared estimator's own steps of obj (earlier tests tracked it)
    with PoseService(tiny_estimator, config) as service:
        assert service.prepare_track(obj, (h, w)) == 4  # batch sizes 1, 2, 3, 4 of the lane
        assert service.prepare_track(obj, (h, w)) == 0
        assert service.stats().track_captures == 0  # CPU: eager entries, nothing captured
        other = dataclasses.replace(obj)  # another object (same mesh): entries of its own
        assert service.prepare_track(other, (h, w)) == 4 and service.stats().track_graphs == 8
        assert service.forget_object(obj) == 4  # its entries only (none of the estimator's for a prepare)
        assert service.stats().track_graphs == 4 and service.forget_object(obj) == 0
        assert service.prepare_track(obj, (h, w)) == 4  # needed again: built again
        stats = service.stats()
        assert (stats.track_rows_requested, stats.track_rows_padding) == (0, 0)  # prepared, nothing requested


def test_the_batch_ladder_pads_at_most_one_row_up_to_16() -> None:
    from foundationpose.track_graph import graph_batch_sizes

    assert graph_batch_sizes(16) == (1, 2, 3, 4, 6, 8, 10, 12, 14, 16)
    assert graph_batch_sizes(32)[-5:] == (16, 20, 24, 28, 32)
    assert graph_batch_sizes(5) == (1, 2, 3, 4, 5) and graph_batch_sizes(1) == (1,)
    with pytest.raises(ValueError, match=r"^max_batch must be >= 1, got 0$"):
        graph_batch_sizes(0)


def test_errors_name_the_capacity_and_the_mismatched_frame(scene, tiny_estimator) -> None:
    runner = _runner(tiny_estimator, batch_sizes=(1, 2))
    frame = _frame(scene, _start(scene))
    with pytest.raises(CapacityError, match=r"^track batch: expected at most 2 requests per step; got 3$"):
        runner.submit(scene.obj, [frame] * 3, ITERATIONS)
    other = dataclasses.replace(frame, depth=scene.depth[:-2], rgb=scene.rgb[:-2])
    with pytest.raises(ValueError, match=r"^frames\[1\]: expected rgb \(120, 160, 3\) and depth \(120, 160\)"):
        runner.submit(scene.obj, [frame, other], ITERATIONS)
    with pytest.raises(ValueError, match=r"^frames: expected at least one"):
        runner.submit(scene.obj, [], ITERATIONS)
    with pytest.raises(ValueError, match=r"^batch_sizes must be sorted"):
        TrackGraphConfig(batch_sizes=(4, 1))
    assert runner.keys() == []  # nothing was built for refused requests


def test_track_lane_equals_the_reference_with_mixed_k_and_iterations(scene, tiny_estimator) -> None:
    """The service's track lane (step in the batcher -> finish): each request of a batch gets the reference pose,
    with two K and two iteration counts in one batch (two groups, two steps), the images staged by their requests."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity; the CUDA lane runs in the bench")
    from foundationpose.service import PoseService, ServiceConfig

    K2 = scene.K.copy()
    K2[0, 0] += 5.0
    start = _start(scene)
    config = ServiceConfig(max_image_hw=(240, 320), track_max_batch=3, track_max_wait_ms=10_000.0)
    with PoseService(tiny_estimator, config) as service:
        _batch_when_full(service)
        assert [s.name for s in service.stats().track.stages] == ["step", "finish"]
        futures = [
            service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred", key="a"),
            service.submit_track(scene.obj, scene.rgb, scene.depth, K2, start, prev_frame="centred", key="b"),
            service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred",
                                 iterations=1, key="c"),
        ]
        results = [f.result(timeout=300) for f in futures]
        assert [t.name for t in threading.enumerate() if t.name == "fp-step"] == []  # the step runs in the batcher
    assert all(r.timings_ms["batch"] == 3.0 and r.timings_ms["step"] > 0 for r in results)
    np.testing.assert_array_equal(results[0].cam_from_centred, _reference(tiny_estimator, scene, start))
    np.testing.assert_array_equal(results[1].cam_from_centred, _reference(tiny_estimator, scene, start, K2))
    np.testing.assert_array_equal(results[2].cam_from_centred, _reference(tiny_estimator, scene, start, iterations=1))


# -- CUDA ---------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")


def _cuda_scenes(scene) -> list:
    """Two image sizes and two K on the GPU (the CPU-rendered scene, plus a wider one with another K)."""
    obj = dataclasses.replace(scene.obj, tensors=scene.obj.tensors.to("cuda"))
    K2 = np.array([[180.0, 0.0, 99.5], [0.0, 181.0, 70.5], [0.0, 0.0, 1.0]])
    wide = render_scene(scene.obj, scene.cam_from_centred, K2, (144, 200))
    return [dataclasses.replace(scene, obj=obj), dataclasses.replace(wide, obj=obj)]


@cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_graph_replay_equals_eager_on_cuda(scene, cuda_triton_estimator, batch: int) -> None:
    est = cuda_triton_estimator
    graphed = _runner(est, batch_sizes=(batch,))
    eager = _runner(est, batch_sizes=(batch,), capture=False)
    assert graphed.capturable and not eager.capturable
    for sc in _cuda_scenes(scene):
        starts = [_start(sc, dx=0.001 * i, angle=0.01 * (i + 1)) for i in range(batch)]
        frames = [_frame(sc, s) for s in starts]
        got_rows = _rows(graphed.run(sc.obj, frames, ITERATIONS))
        got = got_rows[:, :16].reshape(-1, 4, 4)
        key = (frozenset({id(sc.obj)}), batch, *sc.depth.shape, ITERATIONS)
        assert graphed.is_graphed(key), f"capture failed (failures={graphed.capture_failures}); see the log"
        np.testing.assert_array_equal(got_rows, _rows(eager.run(sc.obj, frames, ITERATIONS)))  # same kernels
        again = _rows(graphed.run(sc.obj, frames, ITERATIONS))  # replay again: same inputs, same results
        np.testing.assert_array_equal(again, got_rows)
        moved = [_frame(sc, _start(sc, dx=-0.002 * (i + 1), angle=-0.02)) for i in range(batch)]  # new data, same graph
        np.testing.assert_array_equal(_rows(graphed.run(sc.obj, moved, ITERATIONS)),
                                      _rows(eager.run(sc.obj, moved, ITERATIONS)))
        for i, s in enumerate(starts):
            # vs the step-by-step path: device K (float64 P and windows built on the GPU, not the host) and the
            # refiner at batch B, not 1: fp16 tolerance as conftest.assert_same_pose uses on CUDA
            np.testing.assert_allclose(got[i], _reference(est, sc, s), rtol=0, atol=1e-2, err_msg=f"row {i}")
    assert graphed.captures == 2 and graphed.capture_failures == 0


@cuda
def test_capture_on_cuda_raises_no_sync_errors(scene, cuda_triton_estimator) -> None:
    """Capture the step directly (no fallback): any host sync inside it raises here."""
    from foundationpose.object_group import ObjectGroup
    from foundationpose.track_graph import TrackBuffers, track_step

    est = cuda_triton_estimator
    runner = _runner(est, batch_sizes=(1,))
    sc = _cuda_scenes(scene)[0]
    group = ObjectGroup([sc.obj], "cuda")  # the step over a group of one, as the runner runs it
    buffers = TrackBuffers(1, sc.depth.shape, torch.device("cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step() -> None:
        with torch.no_grad():
            track_step(buffers, group, runner.renderer, runner._forward, iterations=ITERATIONS, crop_size=160,
                       constants=runner.constants)

    with torch.cuda.stream(stream):
        step()
        step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(buffers.out).all()


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # pytest resets the module's filter
def test_both_stacking_copies_give_the_same_bytes(scene) -> None:
    """Small batches are stacked with NumPy copies, large ones with torch.stack: the same tensors either way."""
    from foundationpose import track_launch

    rng = np.random.default_rng(0)
    frames = [
        TrackFrame(rgb=rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), depth=rng.random((6, 8), dtype=np.float32),
                   K=rng.random((3, 3)), start=rng.random((4, 4)).astype(np.float32))
        for _ in range(track_launch.STACK_FROM)
    ]
    frames[0] = dataclasses.replace(frames[0], rgb=np.frombuffer(frames[0].rgb.tobytes(), np.uint8).reshape(6, 8, 3))
    large = track_launch.stack_frames(frames, pinned=False)  # torch.stack (a read-only frame included)
    small = [track_launch.stack_frames(frames[i : i + 1], pinned=False) for i in range(len(frames))]  # NumPy copies
    for field, got in enumerate(large):
        assert torch.equal(got, torch.cat([s[field] for s in small]))


def test_per_frame_images_are_copied_in_as_the_reference_loop_copies_them() -> None:
    """copy_in of images the requests copied themselves (lists): one foreach copy, the same bytes as one copy_ per
    row; rows past n stay untouched."""
    from foundationpose import track_graph, track_launch

    rng = np.random.default_rng(1)
    n, hw = 3, (6, 8)
    rgb = [torch.from_numpy(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)) for _ in range(n)]
    depth = [torch.from_numpy(rng.random(hw, dtype=np.float32)) for _ in range(n)]
    ks, starts = torch.from_numpy(rng.random((n, 3, 3))), torch.from_numpy(rng.random((n, 4, 4)).astype(np.float32))
    got, want = (track_graph.TrackBuffers(4, hw, torch.device("cpu")) for _ in range(2))
    for b in (got, want):
        b.rgb.fill_(7)
        b.depth.fill_(-1.0)
    track_launch.copy_in(got, (rgb, depth, ks, starts), n, non_blocking=False)
    track_launch.copy_rows_reference([*want.rgb[:n].unbind(0), *want.depth[:n].unbind(0)], [*rgb, *depth],
                                     non_blocking=False)
    assert torch.equal(got.rgb, want.rgb) and torch.equal(got.depth, want.depth)
    assert torch.equal(got.rgb[:n], torch.stack(rgb)) and (got.rgb[n:] == 7).all() and (got.depth[n:] == -1).all()
    assert torch.equal(got.K[:n], ks.to(got.K.dtype)) and torch.equal(got.cam_from_centred[:n], starts)


@pytest.mark.slow
def test_a_lone_track_runs_inline_and_equals_the_reference(scene, tiny_estimator) -> None:
    """PoseService.track into an idle lane runs in the caller's thread (no batch), with the reference pose;
    submit_track (a burst API) still batches."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    from foundationpose.service import PoseService, ServiceConfig

    graphed = tiny_estimator
    start = _start(scene)
    want = _reference(tiny_estimator, scene, start)
    with PoseService(graphed, ServiceConfig(max_image_hw=(240, 320))) as service:
        got = service.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        stats = service.stats()
        assert (stats.track_inline, stats.track_batcher.batches) == (1, 0)
        np.testing.assert_array_equal(got.cam_from_centred, want)
        assert got.timings_ms["batch"] == 1.0 and got.timings_ms["batcher_wait"] == 0.0
        assert got.timings_ms["step"] > 0 and "step" in [s.name for s in stats.track.stages]
        queued = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred").result(300)
        assert (service.stats().track_inline, service.stats().track_batcher.batches) == (1, 1)
        np.testing.assert_array_equal(queued.cam_from_centred, want)
    from deploy_core.errors import ClosedError

    with pytest.raises(ClosedError):  # after close, not inline either
        service.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")


@pytest.mark.slow
def test_a_track_into_a_busy_lane_is_batched_not_inline(scene, tiny_estimator) -> None:
    """While a batch is in the lane, PoseService.track goes through the batcher (it may join the next batch);
    once the lane is idle again the next one runs inline. Every answer is the reference pose."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    from concurrent.futures import ThreadPoolExecutor

    from foundationpose.service import PoseService, ServiceConfig

    gate = GatedCore(tiny_estimator.networks.track_refiner)
    graphed = _with_refiner(tiny_estimator, gate)
    start = _start(scene)
    want = _reference(tiny_estimator, scene, start)
    with PoseService(graphed, ServiceConfig(max_image_hw=(240, 320))) as service, ThreadPoolExecutor(1) as pool:
        first = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        assert gate.entered.wait(60)  # the first batch is in the lane, parked in the refiner
        queued, batcher_submit = threading.Event(), service._batcher.submit

        def submit_and_tell(*args, **kwargs):
            future = batcher_submit(*args, **kwargs)
            queued.set()
            return future

        service._batcher.submit = submit_and_tell
        second = pool.submit(service.track, scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        # queued behind it, not inline (in the inbox while the batcher runs the first batch's step itself)
        assert queued.wait(60) and service.stats().track_inline == 0
        gate.opened.set()
        results = [first.result(300), second.result(300)]
        assert service.stats().track_inline == 0 and service.stats().track_batcher.batches == 2
        third = service.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        assert service.stats().track_inline == 1
    for r in (*results, third):
        np.testing.assert_array_equal(r.cam_from_centred, want)


@pytest.mark.slow
def test_images_staged_by_their_requests_give_the_same_poses(scene, tiny_estimator) -> None:
    """Each request stages its own images (the runner's host_images: zero-copy views on the CPU) and the lane
    copies them in frame by frame; a batch of three and a lone inline track get the reference poses."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    from foundationpose.service import PoseService, ServiceConfig

    rgb_t, depth_t = _runner(tiny_estimator).host_images(scene.rgb, scene.depth)
    assert np.shares_memory(rgb_t.numpy(), scene.rgb) and np.shares_memory(depth_t.numpy(), scene.depth)
    K2 = scene.K.copy()
    K2[0, 0] += 5.0
    start = _start(scene)
    config = ServiceConfig(max_image_hw=(240, 320), track_max_batch=3, track_max_wait_ms=10_000.0)
    with PoseService(tiny_estimator, config) as service:
        _batch_when_full(service)
        futures = [service.submit_track(scene.obj, scene.rgb, scene.depth, k, start, prev_frame="centred", key=i)
                   for i, k in enumerate((scene.K, K2, scene.K))]
        results = [f.result(timeout=300) for f in futures]
    assert all(r.timings_ms["batch"] == 3.0 for r in results)
    for r, k in zip(results, (scene.K, K2, scene.K), strict=True):
        np.testing.assert_array_equal(r.cam_from_centred, _reference(tiny_estimator, scene, start, k))
    with PoseService(tiny_estimator, ServiceConfig(max_image_hw=(240, 320))) as service:
        lone = service.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        assert service.stats().track_inline == 1
    np.testing.assert_array_equal(lone.cam_from_centred, _reference(tiny_estimator, scene, start))


@cuda
def test_the_runner_stream_is_high_priority_and_never_a_pooled_default_stream(scene, cuda_triton_estimator) -> None:
    runner = _runner(cuda_triton_estimator, batch_sizes=(1,))
    default = torch.cuda.Stream(cuda_triton_estimator.device)
    assert runner.stream is not None and runner.stream.priority < default.priority  # lower number = higher priority
    pooled = {torch.cuda.Stream(cuda_triton_estimator.device).cuda_stream for _ in range(40)}  # > the pool of 32
    assert runner.stream.cuda_stream not in pooled


@cuda
def test_track_steps_outrank_register_steps_on_the_gpu(cuda_triton_estimator) -> None:
    """Beside registers (~80 ms of large kernels), a track batch's kernels are scheduled first: its runner's stream
    has a higher CUDA priority (a lower number) than the register runner's, as the device reports it."""
    from foundationpose.register_graph import RegisterGraphRunner

    est = cuda_triton_estimator
    track = _runner(est, batch_sizes=(1,))
    register = RegisterGraphRunner(est.networks.refiner, est.networks.scorer, est.renderer, est.device,
                                   crop_size=est.config.crop_size, constants=est.constants)
    assert track.stream.priority < register.stream.priority < torch.cuda.Stream(est.device).priority


def test_a_runner_stream_must_have_a_high_priority() -> None:
    from deploy_core.capture import runner_stream

    with pytest.raises(ValueError, match="high priority"):
        runner_stream(torch.device("cpu"), 0)


@cuda
def test_stage_images_pins_a_copy(cuda_triton_estimator) -> None:
    host_images = _runner(cuda_triton_estimator, batch_sizes=(1,)).host_images
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    depth = np.linspace(0.1, 1.0, 20, dtype=np.float32).reshape(4, 5)
    rgb_t, depth_t = host_images(rgb, depth)
    assert rgb_t.is_pinned() and depth_t.is_pinned()
    assert not np.shares_memory(rgb_t.numpy(), rgb)
    np.testing.assert_array_equal(rgb_t.numpy(), rgb)
    np.testing.assert_array_equal(depth_t.numpy(), depth)


@cuda
def test_stage_images_uses_page_locked_frames_in_place(cuda_triton_estimator) -> None:
    """A frame already in page-locked memory (an ingest worker's ring, registered by deploy_core.memory.ring.pin_ring) is
    not copied again; ordinary memory still is."""
    host_images = _runner(cuda_triton_estimator, batch_sizes=(1,)).host_images
    from deploy_core.memory.ring import FrameRing, pin_ring, unpin_ring

    ring = FrameRing.create(2, (4, 5))
    try:
        assert pin_ring(ring, torch.device("cuda"))
        rgb, depth = ring.rgb(1, (4, 5)), ring.depth(1, (4, 5))
        ring.write(1, np.arange(60, dtype=np.uint8).reshape(4, 5, 3), np.linspace(0.1, 1, 20, dtype=np.float32).reshape(4, 5))
        rgb_t, depth_t = host_images(rgb, depth)
        assert np.shares_memory(rgb_t.numpy(), rgb) and np.shares_memory(depth_t.numpy(), depth)
        on_gpu = depth_t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(on_gpu.cpu().numpy(), depth)
        copied, _ = host_images(rgb.copy(), depth.copy())  # ordinary memory: a pinned copy
        assert copied.is_pinned() and not np.shares_memory(copied.numpy(), rgb)
        del rgb_t, depth_t, rgb, depth
        torch.cuda.synchronize()
        unpin_ring(ring)
    finally:
        ring.unlink()


@pytest.mark.slow
def test_close_waits_for_an_inline_track_within_its_timeout(scene, tiny_estimator) -> None:
    """close(timeout) while an inline track is parked in the refiner: TimeoutError naming it, and the track still
    gets its pose once the gate opens; later tracks are refused (ClosedError)."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("CPU lane")
    from concurrent.futures import ThreadPoolExecutor

    from deploy_core.errors import ClosedError
    from foundationpose.service import PoseService, ServiceConfig

    gate = GatedCore(tiny_estimator.networks.track_refiner)
    graphed = _with_refiner(tiny_estimator, gate)
    start = _start(scene)
    service = PoseService(graphed, ServiceConfig(max_image_hw=(240, 320)))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(service.track, scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
        assert gate.entered.wait(60)  # inline, in the pool's thread
        with pytest.raises(TimeoutError, match="an inline track step is still running"):
            service.close(timeout=0.2)
        gate.opened.set()
        np.testing.assert_array_equal(running.result(300).cam_from_centred, _reference(tiny_estimator, scene, start))
    assert service.stats().track_inline == 1
    with pytest.raises(ClosedError):
        service.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")


@pytest.mark.slow
def test_the_track_step_judges_its_pose_as_the_host_judge_does(scene, tiny_estimator) -> None:
    """The validity measured inside the step (on its filtered depth, from its start pose) equals FrameJudge's on the
    same frame, bit for bit on the CPU, in the estimator and in a service batch; a register's pick is judged too."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    from foundationpose.service import PoseService, ServiceConfig
    from foundationpose.validity import FrameJudge

    start = _start(scene)
    result = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, start, prev_frame="centred")
    want = FrameJudge(scene.obj).judge(scene.depth, scene.K, start, result.cam_from_centred)
    got = result.validity
    assert got is not None and got.valid == want.valid and got.confidence == want.confidence
    np.testing.assert_array_equal(got.measurements, want.measurements)
    with PoseService(tiny_estimator, ServiceConfig(max_image_hw=(240, 320), track_max_batch=2)) as service:
        batched = [f.result(300) for f in (service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, start,
                                                                prev_frame="centred", key=i) for i in range(2))]
        registered = service.register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K)
    for r in batched:
        np.testing.assert_array_equal(r.validity.measurements, want.measurements)
    assert registered.validity is not None and 0.0 <= registered.validity.confidence <= 1.0
    pick = FrameJudge(scene.obj).judge(scene.depth, scene.K, registered.cam_from_centred, registered.cam_from_centred)
    np.testing.assert_array_equal(registered.validity.measurements, pick.measurements)
