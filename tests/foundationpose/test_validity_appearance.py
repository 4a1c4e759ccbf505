"""Validity's appearance part: the batched measurement against its readable twin, the capture rules, and that it
tells a flipped pose of a printed object from the true one without penalising objects whose look has no
orientation (measured on the CPU with rendered views: :mod:`foundationpose.evaluate.flip_views`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import trimesh

from foundationpose._validity_reference import measure_validity_reference
from foundationpose.evaluate.flip_views import judge_views, plain_cylinder, summarise
from foundationpose.mesh import load_object
from foundationpose.refine import build_refiner_inputs_per_frame
from foundationpose.render import make_renderer
from foundationpose.sampling import bilateral_filter_depth, erode_depth
from foundationpose.sampling.backprojection import depth_to_xyz
from foundationpose.symmetry import rotation_about
from foundationpose.synthetic.objects import make_suite_mesh
from foundationpose.validity import (
    MEASUREMENTS,
    ValidityConfig,
    ValidityModel,
    column,
    judge_validity,
    measure_validity,
    surface_contrast,
)
from tests.foundationpose.conftest import pose_xyz, render_scene
from tests.foundationpose.test_no_host_sync import FORBIDDEN, Probe

K = np.array([[300.0, 0.0, 159.5], [0.0, 300.0, 119.5], [0.0, 0.0, 1.0]])
HW = (240, 320)
CONFIG = ValidityConfig()
APPEARANCE = [column(n) for n in ("appearance_cells", "texture_contrast", "appearance_ncc")]


@pytest.fixture(scope="module")
def can():
    return load_object(make_suite_mesh("can"), name="can")


def _flipped(pose: np.ndarray, axis: tuple[float, float, float]) -> np.ndarray:
    out = pose.copy()
    out[:3, :3] = pose[:3, :3] @ rotation_about(axis, math.pi)[:3, :3]
    return out


def _inputs(obj, poses: list[np.ndarray], gt: np.ndarray):
    """The refiner's network inputs of ``poses`` on a clean render of ``obj`` at ``gt`` (plane 0.8 m behind)."""
    scene = render_scene(obj, gt, K, HW)
    depth = np.where(scene.mask, scene.depth, 0.8).astype(np.float32)
    n = len(poses)
    depth_f = bilateral_filter_depth(erode_depth(torch.as_tensor(depth)[None])).expand(n, -1, -1).contiguous()
    k = torch.as_tensor(K)[None].expand(n, 3, 3).contiguous()
    xyz = depth_to_xyz(depth_f, k)
    rgb = torch.as_tensor(scene.rgb, dtype=torch.float32)[None].expand(n, -1, -1, -1).contiguous()
    pose_t = torch.as_tensor(np.stack(poses).astype(np.float32))
    inputs = build_refiner_inputs_per_frame(pose_t, rgb, xyz, k, obj, make_renderer("cpu"))
    return depth_f, k, pose_t, inputs


def test_appearance_matches_the_reference_and_syncs_nothing(can) -> None:
    gt = pose_xyz(1.2, 0.3, 0.4, (0.01, 0.0, 0.45))
    shifted = gt.copy()
    shifted[0, 3] += 0.01
    poses = [gt, shifted, _flipped(gt, (0, 0, 1)), _flipped(gt, (1, 0, 0))]
    depth_f, k, pose_t, inputs = _inputs(can, poses, gt)
    model = ValidityModel.from_object(can)
    assert model.textured and surface_contrast(can) > 0.1
    pair = (inputs.render_input, inputs.transf_input)
    fast = measure_validity(depth_f, k, pose_t, pose_t, model, CONFIG, appearance=pair)
    ref = measure_validity_reference(depth_f, k, pose_t, pose_t, model, CONFIG, appearance=pair)
    assert fast.shape == (4, len(MEASUREMENTS))
    assert torch.equal(fast[:, column("appearance_cells")], ref[:, column("appearance_cells")])
    torch.testing.assert_close(fast[:, APPEARANCE[1:]], ref[:, APPEARANCE[1:]], rtol=0, atol=1e-4)
    assert (fast[:, column("appearance_cells")] > CONFIG.min_appearance_cells).all()
    with Probe() as probe:
        judge_validity(measure_validity(depth_f, k, pose_t, pose_t, model, CONFIG, appearance=pair), CONFIG)
    assert not (set(probe.ops) & FORBIDDEN), probe.ops


def test_without_network_inputs_or_texture_the_appearance_is_not_judged(can) -> None:
    gt = pose_xyz(1.2, 0.3, 0.4, (0.01, 0.0, 0.45))
    depth_f, k, pose_t, inputs = _inputs(can, [gt, _flipped(gt, (0, 0, 1))], gt)
    model = ValidityModel.from_object(can)
    plain = measure_validity(depth_f, k, pose_t, pose_t, model, CONFIG)
    assert (plain[:, APPEARANCE] == 0).all()
    untextured = ValidityModel(model.points_centred, model.normals_centred, model.diameter, textured=False)
    m = measure_validity(depth_f, k, pose_t, pose_t, untextured, CONFIG,
                         appearance=(inputs.render_input, inputs.transf_input))
    assert (m[:, column("appearance_cells")] == 0).all()
    assert judge_validity(m, CONFIG)[1].tolist() == judge_validity(plain, CONFIG)[1].tolist()


def test_a_flip_that_fits_the_depth_is_invalid_for_its_appearance(can) -> None:
    """The can's shape is a cylinder: turned half a turn about its axis the depth fits exactly, its label does not."""
    gt = pose_xyz(1.2, 0.3, 0.4, (0.01, 0.0, 0.45))
    depth_f, k, pose_t, inputs = _inputs(can, [gt, _flipped(gt, (0, 0, 1))], gt)
    model = ValidityModel.from_object(can)
    depth_only = judge_validity(measure_validity(depth_f, k, pose_t, pose_t, model, CONFIG), CONFIG)
    m = measure_validity(depth_f, k, pose_t, pose_t, model, CONFIG,
                         appearance=(inputs.render_input, inputs.transf_input))
    confidence, valid = judge_validity(m, CONFIG)
    assert depth_only[1].tolist() == [True, True]
    assert valid.tolist() == [True, False]
    assert m[0, column("appearance_ncc")] > 0.95 > CONFIG.min_appearance_ncc > m[1, column("appearance_ncc")]
    assert confidence[1] < 0.5 < confidence[0]


def test_judging_the_appearance_needs_cells_and_contrast() -> None:
    row = torch.zeros((4, len(MEASUREMENTS)))
    row[:, column("support_fraction")] = 0.9
    row[:, column("consistent_fraction")] = 0.9
    row[:, column("appearance_ncc")] = 0.0  # nothing alike
    row[:, column("appearance_cells")] = torch.tensor([200.0, 200.0, 10.0, 200.0])
    row[:, column("texture_contrast")] = torch.tensor([0.2, 0.005, 0.2, 0.2])
    row[3, column("appearance_ncc")] = 0.9
    confidence, valid = judge_validity(row, CONFIG)
    assert valid.tolist() == [False, True, True, True]  # judged and unlike; no contrast; too few cells; alike
    assert confidence[0] == 0.0 and (confidence[1:] > 0.5).all()


def _banded_cylinder() -> trimesh.Trimesh:
    """A cylinder whose colour changes along its axis only: its look has no orientation about the axis."""
    mesh = trimesh.creation.cylinder(radius=0.035, height=0.12, sections=48)
    z = np.asarray(mesh.vertices)[:, 2]
    warm = (z - z.min()) / (z.max() - z.min())
    colours = np.stack([40 + 200 * warm, 60 + 0 * warm, 220 - 180 * warm, 255 + 0 * warm], 1).astype(np.uint8)
    mesh.visual.vertex_colors = colours
    return mesh


@pytest.mark.parametrize("mesh", [plain_cylinder, _banded_cylinder], ids=["plain", "banded"])
def test_symmetric_looks_are_never_penalised(mesh) -> None:
    """A cylinder turned about its axis looks the same (plain: nothing judged; banded along the axis: the render
    is the same print): the appearance rejects no pose the depth accepts, true or turned."""
    obj = load_object(mesh())
    report = summarise(judge_views(obj, views=2, seed=1))
    for kind in ("true", "flip_z"):
        assert report[kind]["appearance_rejects"] == 0, report
        assert report[kind]["valid"] == report[kind]["depth_valid"], report
    assert report["flip_z"]["look_alike"] == report["flip_z"]["poses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mug", "spray_bottle", "cereal_box", "can"])
def test_tune_objects_true_poses_pass_and_printed_flips_are_caught(name: str) -> None:
    """The suite's tune objects (the half thresholds are chosen on), 4 views each: no true pose the depth accepts
    is rejected for its appearance, and most flips the depth accepts and the print shows are caught."""
    report = summarise(judge_views(load_object(make_suite_mesh(name), name=name), views=4, seed=0))
    assert report["true"]["appearance_rejects"] == 0, report
    to_catch = sum(report[k]["to_catch"] for k in ("flip_x", "flip_y", "flip_z"))
    caught = sum(report[k]["appearance_rejects"] for k in ("flip_x", "flip_y", "flip_z"))
    assert caught >= to_catch // 2, report
