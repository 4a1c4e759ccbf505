"""Driver launches of captured track steps (foundationpose.track_launch, deploy_core.cuda_driver).

CPU: the copy plan, run with memmove on CPU buffers, fills the static buffers exactly as the PyTorch copy-in does;
which images a driver launch takes as they are; no driver here means PyTorch launches. CUDA (skipped without a
GPU): driver-launched batches give the PyTorch-launched poses bit for bit, through the runner and the service lane,
and the ring of launch slots falls back to PyTorch when every slot is in flight.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from deploy_core.cuda_driver import CudaDriverError, load_driver
from deploy_core.memory import SharedFrames
from foundationpose.track_graph import TrackBuffers, TrackFrame
from foundationpose.track_launch import (
    copy_in,
    copy_plan,
    images_copyable,
    run_plan_on_host,
    shared_rows,
    stack_frames,
)

from .test_track_graph import ITERATIONS, _frame, _rows, _runner, _start

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="driver launches need a CUDA device")


def _frames(n: int, hw: tuple[int, int], seed: int = 0) -> list[TrackFrame]:
    rng = np.random.default_rng(seed)
    h, w = hw
    frames = []
    for i in range(n):
        K = np.array([[500.0 + i, 0.0, w / 2 + i], [0.0, 501.0 - i, h / 2], [0.0, 0.0, 1.0]])
        start = rng.normal(size=(4, 4)).astype(np.float32)
        rgb = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        depth = torch.from_numpy(rng.uniform(0.1, 2.0, (h, w)).astype(np.float32))
        frames.append(TrackFrame(rgb=rgb, depth=depth, K=K, start=start))
    return frames


@pytest.mark.parametrize("n", [1, 3])
def test_the_copy_plan_fills_the_buffers_as_the_torch_copy_in_does(n: int) -> None:
    hw = (6, 7)
    frames = _frames(n, hw)
    by_torch, by_plan = TrackBuffers(4, hw, torch.device("cpu")), TrackBuffers(4, hw, torch.device("cpu"))
    copy_in(by_torch, stack_frames(frames, pinned=False), n, non_blocking=False)
    ks = torch.from_numpy(np.stack([f.K for f in frames]))
    starts = torch.from_numpy(np.stack([f.start for f in frames]))
    plan = copy_plan(by_plan, [f.rgb for f in frames], [f.depth for f in frames], ks, starts)
    assert len(plan) == 2 * n + 2  # one copy per image row, one for all K rows, one for all start rows
    run_plan_on_host(plan)
    for name in ("rgb", "depth", "K", "cam_from_centred"):
        got, want = getattr(by_plan, name), getattr(by_torch, name)
        assert torch.equal(got, want), name  # rows >= n keep the start values in both
    assert torch.equal(by_plan.K[n:], TrackBuffers(4, hw, torch.device("cpu")).K[n:])


def test_rows_reading_one_image_cross_once_and_copy_the_first_row_on_the_device() -> None:
    hw = (5, 4)
    a, b = _frames(2, hw, seed=3)
    frames = [a, b, a, a, b]  # the objects of two frames: rows 2, 3 read row 0's images, row 4 row 1's
    n = len(frames)
    by_torch, by_plan = TrackBuffers(8, hw, torch.device("cpu")), TrackBuffers(8, hw, torch.device("cpu"))
    copy_in(by_torch, stack_frames(frames, pinned=False), n, non_blocking=False)
    ks = torch.from_numpy(np.stack([f.K for f in frames]))
    starts = torch.from_numpy(np.stack([f.start for f in frames]))
    plan = copy_plan(by_plan, [f.rgb for f in frames], [f.depth for f in frames], ks, starts)
    rgb_row = hw[0] * hw[1] * 3
    rgb_copies = [c for c in plan if c.nbytes == rgb_row]
    assert [c.on_device for c in rgb_copies] == [False, False, True, True, True]
    assert [c.src for c in rgb_copies[2:]] == [by_plan.rgb[0].data_ptr(), by_plan.rgb[0].data_ptr(),
                                                by_plan.rgb[1].data_ptr()]
    assert sum(not c.on_device for c in plan) == 2 * 2 + 2  # two frames' images from the host, K and starts
    run_plan_on_host(plan)
    for name in ("rgb", "depth", "K", "cam_from_centred"):
        assert torch.equal(getattr(by_plan, name), getattr(by_torch, name)), name
    for row, source in ((2, a), (3, a), (4, b)):
        assert torch.equal(by_torch.rgb[row], source.rgb) and torch.equal(by_torch.depth[row], source.depth)


def test_shared_rows_keys_an_image_by_its_memory() -> None:
    image = torch.arange(24, dtype=torch.uint8).reshape(2, 4, 3)
    same_bytes = image.clone()  # equal values elsewhere: its own row
    assert shared_rows([image, same_bytes, image, image[:1]]) == ([0, 1, 3], [(2, 0)])


def test_a_driver_launch_takes_staged_tensors_and_page_locked_arrays_only() -> None:
    rgb = torch.zeros((4, 5, 3), dtype=torch.uint8)
    assert images_copyable([rgb, rgb], torch.uint8, np.uint8)
    assert not images_copyable([rgb.float()], torch.uint8, np.uint8)  # wrong dtype
    assert not images_copyable([rgb.transpose(0, 1)], torch.uint8, np.uint8)  # not contiguous
    assert not images_copyable([np.zeros((4, 5, 3), np.uint8)], torch.uint8, np.uint8)  # pageable array: a stage
    assert images_copyable([], torch.uint8, np.uint8)


@pytest.mark.slow
def test_without_a_driver_the_runner_launches_with_torch(scene, tiny_estimator) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a driver; the CUDA tests cover both launches")
    assert load_driver() is None
    runner = _runner(tiny_estimator, batch_sizes=(2,))
    runner.run(scene.obj, [_frame(scene, _start(scene))], ITERATIONS)
    assert runner.driver_launches == 0


def test_a_driver_error_names_the_call_and_the_code() -> None:
    err = CudaDriverError("cuGraphLaunch", 400, "CUDA_ERROR_INVALID_HANDLE")
    assert str(err) == "cuGraphLaunch failed: CUDA_ERROR_INVALID_HANDLE (400)" and err.code == 400


# -- CUDA ---------------------------------------------------------------------------------------------------------


def _cuda_scene(scene):
    import dataclasses

    return dataclasses.replace(scene, obj=dataclasses.replace(scene.obj, tensors=scene.obj.tensors.to("cuda")))


def _torch_launched(runner):
    """The runner with its PyTorch launches only (the reference twin of the driver launch)."""
    runner._driver_submit = None
    return runner


def _staged_frames(sc, count: int, runner) -> list[TrackFrame]:
    frames = []
    for i in range(count):
        rgb, depth = runner.host_images(sc.rgb, sc.depth)
        frames.append(TrackFrame(rgb=rgb, depth=depth, K=sc.K, start=_start(sc, dx=0.001 * i, angle=0.01 * (i + 1))))
    return frames


@cuda
def test_driver_launches_give_the_torch_launches_poses(scene, cuda_triton_estimator) -> None:
    sc = _cuda_scene(scene)
    est = cuda_triton_estimator
    by_driver = _runner(est, batch_sizes=(1, 4))
    by_torch = _torch_launched(_runner(est, batch_sizes=(1, 4)))
    assert by_driver.capturable and by_torch.capturable
    for n in (1, 3, 4):
        frames = _staged_frames(sc, n, by_driver)
        want = _rows(by_torch.run(sc.obj, frames, ITERATIONS))
        before = by_driver.driver_launches
        got = _rows(by_driver.run(sc.obj, frames, ITERATIONS))
        assert by_driver.driver_launches == before + 1, "the staged batch was not driver-launched"
        np.testing.assert_array_equal(got, want)
    assert by_torch.driver_launches == 0
    # unstaged (pageable) frames keep the PyTorch path, with the same poses
    plain = [_frame(sc, _start(sc))]
    before = by_driver.driver_launches
    np.testing.assert_array_equal(_rows(by_driver.run(sc.obj, plain, ITERATIONS)),
                                  _rows(by_torch.run(sc.obj, plain, ITERATIONS)))
    assert by_driver.driver_launches == before


@cuda
def test_rows_of_one_shared_frame_give_the_poses_of_rows_staged_apart(scene, cuda_triton_estimator) -> None:
    """The objects of one frame (one page-locked copy, SharedFrames): the driver launch copies it to the GPU once
    and fills the other rows on the device; the poses equal the PyTorch launch's and those of frames staged apart."""
    sc = _cuda_scene(scene)
    est = cuda_triton_estimator
    by_driver = _runner(est, batch_sizes=(4,))
    by_torch = _torch_launched(_runner(est, batch_sizes=(4,)))
    shared = SharedFrames(lock=True)
    rgb, depth = shared.share(sc.rgb, sc.depth)
    frames = [TrackFrame(rgb=rgb, depth=depth, K=sc.K, start=_start(sc, dx=0.001 * i, angle=0.01 * (i + 1)))
              for i in range(4)]
    want = _rows(by_torch.run(sc.obj, frames, ITERATIONS))
    before = by_driver.driver_launches
    np.testing.assert_array_equal(_rows(by_driver.run(sc.obj, frames, ITERATIONS)), want)
    assert by_driver.driver_launches == before + 1, "the shared frame's batch was not driver-launched"
    np.testing.assert_array_equal(_rows(by_driver.run(sc.obj, _staged_frames(sc, 4, by_driver), ITERATIONS)), want)
    shared.close()


@cuda
def test_batches_in_flight_beyond_the_slots_launch_with_torch_and_all_complete(scene, cuda_triton_estimator) -> None:
    sc = _cuda_scene(scene)
    runner = _runner(cuda_triton_estimator, batch_sizes=(2,))
    by_torch = _torch_launched(_runner(cuda_triton_estimator, batch_sizes=(2,)))
    frames = _staged_frames(sc, 2, runner)
    want = _rows(by_torch.run(sc.obj, frames, ITERATIONS))
    runner.run(sc.obj, frames, ITERATIONS)  # capture
    before = runner.driver_launches
    tickets = [runner.submit(sc.obj, frames, ITERATIONS) for _ in range(12)]  # more than the 8 slots, uncollected
    assert runner.driver_launches - before == 8
    assert sum(t.slot is not None for t in tickets) == 8
    for t in tickets:
        np.testing.assert_array_equal(_rows(runner.collect(t)), want)
    again = runner.submit(sc.obj, frames, ITERATIONS)  # slots are free again once collected
    assert again.slot is not None
    np.testing.assert_array_equal(_rows(runner.collect(again)), want)


@cuda
def test_driver_launches_work_from_a_thread_that_never_used_cuda(scene, cuda_triton_estimator) -> None:
    """A fresh thread has no current CUDA context: the driver path makes the primary one current, before the first
    launch slot creates its event there (a service's step thread does exactly this)."""
    sc = _cuda_scene(scene)
    runner = _runner(cuda_triton_estimator, batch_sizes=(1,))
    frames = _staged_frames(sc, 1, runner)
    want = _rows(_torch_launched(_runner(cuda_triton_estimator, batch_sizes=(1,))).run(sc.obj, frames, ITERATIONS))
    runner.prepare(sc.obj, sc.depth.shape, ITERATIONS)  # captured here; no launch slot exists yet
    out: dict = {}

    def body() -> None:
        try:
            out["poses"] = _rows(runner.run(sc.obj, frames, ITERATIONS))
        except BaseException as exc:  # reported below
            out["error"] = exc

    before = runner.driver_launches
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=120)
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["poses"], want)
    assert runner.driver_launches == before + 1


@cuda
def test_the_service_lane_driver_launches_staged_requests_with_the_same_poses(scene, cuda_triton_estimator) -> None:
    from foundationpose.service import PoseService, ServiceConfig

    sc = _cuda_scene(scene)
    est = cuda_triton_estimator
    results = {}
    for driver in (True, False):
        # one batch of exactly 4 in both runs (another padded size is another graph, whose kernels may round
        # differently): the batcher waits for the fourth request, none runs inline
        config = ServiceConfig(max_image_hw=(240, 320), track_max_batch=4, track_max_wait_ms=10_000.0)
        with PoseService(est, config) as service:
            service._batcher.idle_dispatch = False
            if not driver:
                _torch_launched(service._track_runner)
            service.prepare_track(sc.obj, sc.depth.shape, ITERATIONS)
            futures = [service.submit_track(sc.obj, sc.rgb, sc.depth, sc.K, _start(sc, dx=0.001 * i),
                                            prev_frame="centred", key=i, iterations=ITERATIONS) for i in range(4)]
            done = [f.result(timeout=120) for f in futures]
            launches = service.stats().track_driver_launches
        assert all(r.timings_ms["batch"] == 4.0 for r in done)
        results[driver] = [r.cam_from_centred for r in done]
        assert launches == (1 if driver else 0)
    for got, want in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_launch_slot_is_given_back_once_at_collect_or_when_its_ticket_is_dropped() -> None:
    """A ticket nobody collects (its batch dropped at the lane's finish boundary) must not keep its slot forever;
    a collected one must not give back a slot that a later batch has taken since."""
    import gc

    from foundationpose.track_graph import RESULT_COLUMNS, TrackGraphRunner, _slot_ticket
    from foundationpose.track_launch import LaunchSlot

    class HostSlot:  # LaunchSlot's state and release without its pinned tensors (CPU machines have none)
        release = LaunchSlot.release

        def __init__(self) -> None:
            self.busy, self.out_np = True, np.zeros((4, RESULT_COLUMNS), np.float32)

    slot = HostSlot()
    ticket = _slot_ticket(2, slot, None, frames=["frame"])
    assert ticket.host.shape == (2, RESULT_COLUMNS) and slot.busy
    poses, judged = TrackGraphRunner.collect(ticket)
    np.testing.assert_array_equal(poses, np.zeros((2, 4, 4), np.float32))
    assert judged.shape == (2, RESULT_COLUMNS - 16)
    assert not slot.busy and ticket.slot is None and ticket.keep is None
    slot.busy = True  # taken by a later batch
    del ticket
    gc.collect()
    assert slot.busy  # the collected ticket's release ran once, at collect
    dropped = _slot_ticket(1, slot, None, frames=[])
    del dropped
    gc.collect()
    assert not slot.busy  # given back by the finaliser
