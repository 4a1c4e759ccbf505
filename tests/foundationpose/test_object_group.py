"""Several objects in one track step (foundationpose.object_group, foundationpose.render.groups).

CPU: row i of a step over an object group equals the step of row i's object alone, bit for bit (poses and judged
rows), through the runner and through the service's lane (distinct meshes of one frame: one step); the step judges
validity in ONE pass whatever its objects, each row with its own object's points and thresholds from the group's
table (bit for bit the object's own measurement and verdict, also where the table pads objects of fewer points, and
close to the readable twin); a group render
(the CPU rasteriser's per-mesh split, the Triton kernels under the interpreter) equals each mesh's own render; the
per-row diameter forms equal the scalar ones. CUDA (skipped without a GPU): a captured group step equals the same
step run eagerly, and each row the single-object step within the fp16 tolerance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from foundationpose import object_group
from foundationpose._validity_reference import measure_rows_reference
from foundationpose.crop import crop_windows
from foundationpose.diameters import RowDiameters
from foundationpose.mesh import load_object
from foundationpose.network_inputs import normalize_xyz
from foundationpose.object_group import GroupCache, ObjectGroup
from foundationpose.pose_update import apply_refiner_output
from foundationpose.render import CpuRasterizer, RenderConfig
from foundationpose.render.groups import MeshGroup, RowMeshes
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.track_graph import TrackFrame, TrackGraphConfig, TrackGraphRunner
from foundationpose.validity import (
    MEASUREMENTS,
    ValidityConfig,
    ValidityModel,
    ValidityTable,
    column,
    judge_validity,
    measure_validity,
    measure_validity_rows,
)
from tests.foundationpose._triton import missing_triton, raster_interpreter_problem, triton_marks

from .conftest import assert_same_pose, on_test_device, rotation_xyz
from .test_no_host_sync import FORBIDDEN, Probe

ITERATIONS = 2
KINDS = (("textured_asym", "L"), ("vertex_color_asym", "tee"), ("plain_asym", "L"))


@pytest.fixture(scope="module")
def objects():
    return [on_test_device(load_object(make_procedural_mesh(kind, shape=shape))) for kind, shape in KINDS]


@pytest.fixture(scope="module")
def frame(objects):
    from .conftest import render_scene

    K = np.array([[150.0, 0.0, 79.5], [0.0, 150.0, 59.5], [0.0, 0.0, 1.0]])
    pose = np.eye(4, dtype=np.float32)
    pose[:3, :3] = rotation_xyz(0.6, -0.4, 0.3)
    pose[:3, 3] = (0.01, -0.005, 0.5)
    return render_scene(load_object(make_procedural_mesh(*KINDS[0][:1])), pose, K, (120, 160))


def _start(scene, i: int) -> np.ndarray:
    pose = scene.cam_from_centred.copy()
    pose[:3, :3] = (rotation_xyz(0.03 * i, -0.02, 0.01 * i) @ pose[:3, :3]).astype(np.float32)
    pose[0, 3] += 0.002 * i
    return pose


def _runner(estimator, **config) -> TrackGraphRunner:
    return TrackGraphRunner(
        estimator.networks.track_refiner, estimator.renderer, estimator.device,
        crop_size=estimator.config.crop_size, config=TrackGraphConfig(**config), constants=estimator.constants,
    )


def _rows(result) -> np.ndarray:
    poses, judged = result
    return np.concatenate([poses.reshape(len(poses), 16), judged], axis=1)


def test_row_diameters_equal_the_scalar_forms() -> None:
    diameters = [0.123456789, 0.2, 0.0731]
    table = RowDiameters.of(diameters, "cpu")
    index = torch.tensor([2, 0, 1, 0])
    rows = table.rows(index)
    gen = torch.Generator().manual_seed(0)
    poses = torch.eye(4).repeat(4, 1, 1)
    poses[:, :3, 3] = torch.rand((4, 3), generator=gen) * 0.1 + torch.tensor([0.0, 0.0, 0.5])
    K = np.array([[150.0, 0.0, 79.5], [0.0, 150.0, 59.5], [0.0, 0.0, 1.0]])
    got = crop_windows(poses, K, rows, 1.2, S=32)
    xyz = torch.rand((4, 8, 8, 3), generator=gen)
    trans, rot = torch.rand((4, 3), generator=gen), torch.rand((4, 3), generator=gen)
    got_xyz = normalize_xyz(xyz, poses[:, :3, 3], rows, 0.001)
    got_pose = apply_refiner_output(poses, trans, rot, rows)
    for i, k in enumerate(index.tolist()):
        d = diameters[k]
        assert torch.equal(got[i], crop_windows(poses[i:i + 1], K, d, 1.2, S=32)[0])
        assert torch.equal(got_xyz[i], normalize_xyz(xyz[i:i + 1], poses[i:i + 1, :3, 3], d, 0.001)[0])
        assert torch.equal(got_pose[i], apply_refiner_output(poses[i:i + 1], trans[i:i + 1], rot[i:i + 1], d)[0])


def _group_render_check(renderer, objects) -> None:
    index = np.array([1, 0, 2, 1, 0])
    poses = torch.eye(4).repeat(5, 1, 1)
    poses[:, 2, 3] = 0.5 + 0.05 * torch.arange(5)
    poses[:, 0, 3] = 0.01 * torch.arange(5)
    poses[:, :3, :3] = torch.as_tensor(rotation_xyz(0.4, -0.3, 0.2), dtype=torch.float32)
    K = np.array([[200.0, 0.0, 80.0], [0.0, 200.0, 60.0], [0.0, 0.0, 1.0]])
    crops = crop_windows(poses, K, 0.2, 1.2, S=32)
    group = MeshGroup([o.tensors.to("cpu") for o in objects])
    got = renderer.render(RowMeshes(group, torch.as_tensor(index)), poses, K, (120, 160), crops)
    for i, k in enumerate(index.tolist()):
        want = renderer.render(objects[k].tensors.to("cpu"), poses[i:i + 1], K, (120, 160), crops[i:i + 1])
        assert want.mask.any()
        for field in ("rgb", "xyz_cam", "mask"):
            assert torch.equal(getattr(got, field)[i], getattr(want, field)[0]), (i, k, field)


def test_group_render_equals_each_mesh_alone_cpu_rasteriser(objects) -> None:
    _group_render_check(CpuRasterizer("cpu", RenderConfig(crop_size_px=32)), objects)


try:
    from foundationpose.render import _triton_raster_kernels as raster_kernels
except ImportError as exc:  # CPU CI without triton
    raster_kernels, _RASTER_IMPORT_ERROR = None, missing_triton(exc)
else:
    _RASTER_IMPORT_ERROR = ""
needs_raster_interpreter, _ = triton_marks(raster_kernels, _RASTER_IMPORT_ERROR,
                                           problem_probe=raster_interpreter_problem)


@pytest.mark.slow
@needs_raster_interpreter
def test_group_render_equals_each_mesh_alone_triton_interpreter(objects) -> None:
    from foundationpose.render.triton_raster import TritonRasterizer

    _group_render_check(TritonRasterizer("cpu", RenderConfig(crop_size_px=32)), objects)


def test_group_cache_keys_by_set_and_reuses_supersets(objects) -> None:
    cache = GroupCache("cpu", max_groups=2)
    a, b, c = objects
    abc = cache.of([a, b, c, a])
    assert len(abc) == 3 and cache.of([c, b, a]) is abc
    assert cache.of([b, a]) is abc  # a subset of several objects runs on the group that holds it
    assert len(cache.of([a])) == 1  # a single object is its own group of one
    np.testing.assert_array_equal(abc.index_of([c, a, b, a]), [2, 0, 1, 0])
    with pytest.raises(ValueError):
        ObjectGroup([a, a], "cpu")


def test_group_step_rows_equal_each_objects_step(objects, frame, tiny_estimator) -> None:
    """The parity of the issue: one step over 3 distinct meshes (5 rows, padded to 6) equals, row for row, the
    single-object step of each row's object."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity; the CUDA twin is test_captured_group_step_on_cuda")
    runner = _runner(tiny_estimator, batch_sizes=(1, 2, 6))
    order = [objects[1], objects[0], objects[2], objects[1], objects[0]]
    frames = [TrackFrame(rgb=frame.rgb, depth=frame.depth, K=frame.K, start=_start(frame, i)) for i in range(5)]
    got = _rows(runner.run(order, frames, ITERATIONS))
    assert len(runner.keys()) == 1  # one step for the three objects
    for obj in objects:
        rows = [i for i, o in enumerate(order) if o is obj]
        want = _rows(runner.run(obj, [frames[i] for i in rows], ITERATIONS))
        np.testing.assert_array_equal(got[rows], want)
    # another mix of the same objects replays the same step; its rows still equal each object's step
    again = _rows(runner.run([objects[2], objects[2], objects[0]], frames[:3], ITERATIONS))
    np.testing.assert_array_equal(again[:2], _rows(runner.run(objects[2], frames[:2], ITERATIONS)))
    np.testing.assert_array_equal(again[2:], _rows(runner.run(objects[0], frames[2:3], ITERATIONS)))
    assert sum(1 for k in runner.keys() if len(k[0]) == 3) == 1


def _validity_batch(frame, n: int, seed: int = 0):
    """n rows of the frame's depth, K and poses around the true one, with a pair of (n, 32, 32, 6) crops whose
    observed half is the rendered half with noise (depths agreeing in most pixels)."""
    gen = torch.Generator().manual_seed(seed)
    depth = torch.as_tensor(frame.depth, dtype=torch.float32)[None].expand(n, *frame.depth.shape).contiguous()
    K = torch.as_tensor(frame.K, dtype=torch.float64)[None].expand(n, 3, 3).contiguous()
    final = torch.as_tensor(np.stack([_start(frame, i) for i in range(n)]), dtype=torch.float32)
    start = torch.as_tensor(np.stack([_start(frame, i + 1) for i in range(n)]), dtype=torch.float32)
    render = torch.rand((n, 32, 32, 6), generator=gen)
    render[..., 3:] -= 0.5
    render[:, :4] = 0.0  # a few rows of pixels without a surface
    transf = render + 0.02 * torch.randn((n, 32, 32, 6), generator=gen)
    return depth, K, start, final, (render, transf)


def test_one_validity_pass_judges_each_row_as_its_object_alone(objects, frame) -> None:
    """The table form (objects of 512, 300 and 700 points, so two are padded; each with its own thresholds)
    measures and judges every row in one pass exactly as the row's object alone: bit for bit."""
    configs = [ValidityConfig(), ValidityConfig(max_translation_m=0.004, min_appearance_ncc=0.9),
               ValidityConfig(depth_tolerance_diameters=0.02, min_support=0.5, min_appearance_cells=10.0)]
    models = [ValidityModel.from_object(o, "cpu", count=c) for o, c in zip(objects, (512, 300, 700), strict=True)]
    validity = list(zip(models, configs, strict=True))
    table = ValidityTable.of(validity, "cpu")
    assert table.points.shape == (3, 700, 3) and int(table.present.sum()) == 1512
    row_object = [2, 0, 1, 0, 2, 1, 1]
    depth, K, start, final, pair = _validity_batch(frame, len(row_object))
    rows = table.rows(torch.tensor(row_object))
    got = measure_validity_rows(depth, K, start, final, rows, pair)
    confidence, valid = judge_validity(got, rows.params)
    assert got.shape == (len(row_object), len(MEASUREMENTS))
    for k, (model, config) in enumerate(validity):
        idx = [i for i, o in enumerate(row_object) if o == k]
        want = measure_validity(depth[idx], K[idx], start[idx], final[idx], model, config,
                                (pair[0][idx], pair[1][idx]))
        assert torch.equal(got[idx], want), k
        want_confidence, want_valid = judge_validity(want, config)
        assert torch.equal(confidence[idx], want_confidence) and torch.equal(valid[idx], want_valid), k
    assert (got[:, column("visible_points")] > 0).all()  # the rows see their objects: the check has teeth
    assert confidence.unique().numel() > 1
    index = torch.tensor(row_object)
    with Probe() as probe:  # the one pass keeps the capture rules: gathers, no host synchronisation
        rows = table.rows(index)
        judge_validity(measure_validity_rows(depth, K, start, final, rows, pair), rows.params)
    assert not (set(probe.ops) & FORBIDDEN), probe.ops


def test_the_table_form_matches_the_readable_twin(objects, frame) -> None:
    """Parity of the one-pass table form with the reference twin's row-by-row lookup (tolerances as
    test_validity's: the twin projects in float64)."""
    models = [ValidityModel.from_object(o, "cpu", count=c) for o, c in zip(objects, (512, 256, 384), strict=True)]
    validity = [(m, ValidityConfig()) for m in models]
    row_object = [1, 0, 2, 1]
    depth, K, start, final, pair = _validity_batch(frame, len(row_object), seed=1)
    fast = measure_validity_rows(depth, K, start, final, ValidityTable.of(validity).rows(torch.tensor(row_object)),
                                 pair)
    ref = measure_rows_reference(depth, K, start, final, validity, row_object, pair)
    counts = [column("visible_points"), column("appearance_cells")]
    fractions = [i for i, n in enumerate(MEASUREMENTS) if n.endswith("_fraction")]
    torch.testing.assert_close(fast[:, counts], ref[:, counts], rtol=0, atol=2.0)
    torch.testing.assert_close(fast[:, fractions], ref[:, fractions], rtol=0, atol=2.0 / 200)
    torch.testing.assert_close(fast[:, column("residual_m")], ref[:, column("residual_m")], rtol=0, atol=2e-4)
    torch.testing.assert_close(fast[:, -2:], ref[:, -2:], rtol=0, atol=1e-4)


def test_a_step_judges_validity_in_one_pass_whatever_its_objects(objects, frame, tiny_estimator,
                                                                monkeypatch) -> None:
    """One validity pass per step: over the three objects, over a subset reusing their step, and for one object."""
    calls: list[tuple[int, ...]] = []
    real = object_group.measure_validity_rows

    def counted(depth, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(tuple(depth.shape))
        return real(depth, *args, **kwargs)

    monkeypatch.setattr(object_group, "measure_validity_rows", counted)
    runner = _runner(tiny_estimator, batch_sizes=(1, 2, 4), capture=False)
    frames = [TrackFrame(rgb=frame.rgb, depth=frame.depth, K=frame.K, start=_start(frame, i)) for i in range(3)]
    for batch in ([objects[0], objects[1], objects[2]], [objects[1], objects[0]], [objects[2]]):
        calls.clear()
        _, judged = runner.run(batch, frames[:len(batch)], ITERATIONS)
        assert len(calls) == 1 and calls[0][0] == runner.padded_batch(len(batch)), (len(batch), calls)
        assert judged.shape[0] == len(batch)
    assert sum(1 for k in runner.keys() if len(k[0]) == 3) == 2  # the subset replayed the three objects' steps


def test_service_runs_the_objects_of_a_frame_in_one_step(objects, frame, tiny_estimator) -> None:
    """POST /track/sessions' path: distinct meshes held into one batch run as one step (one row each)."""
    if tiny_estimator.device.type != "cpu":
        pytest.skip("bit-for-bit CPU parity")
    from foundationpose.service import PoseService, ServiceConfig

    config = ServiceConfig(max_image_hw=(120, 160), track_max_batch=4)
    with PoseService(tiny_estimator, config) as service:
        release = service.hold_tracks()
        futures = [service.submit_track(obj, frame.rgb, frame.depth, frame.K, _start(frame, i), prev_frame="centred",
                                        iterations=ITERATIONS, inline_if_idle=False) for i, obj in enumerate(objects)]
        release()
        results = [f.result() for f in futures]
        track = service._track_runner
        assert [len(k[0]) for k in track.keys()] == [3]  # one step over the three objects, no per-mesh step
    runner = _runner(tiny_estimator, batch_sizes=(1,))
    for i, (obj, result) in enumerate(zip(objects, results, strict=True)):
        f = TrackFrame(rgb=frame.rgb, depth=frame.depth, K=frame.K, start=_start(frame, i))
        poses, _ = runner.run(obj, [f], ITERATIONS)
        want = poses[0].astype(np.float64) @ obj.centred_from_mesh
        np.testing.assert_array_equal(result.cam_from_mesh.astype(np.float32), want.astype(np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_group_step_on_cuda(cuda_triton_estimator, frame) -> None:
    """CUDA: the group step is captured (one graph for the objects), its replay equals the same step run eagerly
    bit for bit, and each row the object's own step within the fp16 tolerance."""
    est = cuda_triton_estimator
    objs = [dataclasses.replace(o, tensors=o.tensors.to("cuda"))
            for o in (load_object(make_procedural_mesh(kind, shape=shape)) for kind, shape in KINDS)]
    order = [objs[1], objs[0], objs[2], objs[1]]
    frames = [TrackFrame(rgb=frame.rgb, depth=frame.depth, K=frame.K, start=_start(frame, i)) for i in range(4)]
    captured = _runner(est, batch_sizes=(1, 4))
    eager = _runner(est, batch_sizes=(1, 4), capture=False)
    got = _rows(captured.run(order, frames, ITERATIONS))
    assert captured.captures >= 1
    np.testing.assert_array_equal(got, _rows(eager.run(order, frames, ITERATIONS)))
    for obj in objs:
        rows = [i for i, o in enumerate(order) if o is obj]
        want = _rows(captured.run(obj, [frames[i] for i in rows], ITERATIONS))
        assert_same_pose(got[rows, :16], want[:, :16])
