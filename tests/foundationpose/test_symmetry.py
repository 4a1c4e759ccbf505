"""Symmetry declarations, the group they generate, canonical poses and the register grid they prune."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import trimesh

from foundationpose.errors import InputError
from foundationpose.mesh import load_object
from foundationpose.sampling import make_rotation_grid
from foundationpose.surface import sample_surface
from foundationpose.symmetry import (
    Symmetry,
    canonical_pose,
    load_symmetry_file,
    parse_symmetry,
    symmetry_tfs,
    to_mesh_frame_tfs,
)
from tests.foundationpose.conftest import rotation_xyz
from tests.foundationpose.test_no_host_sync import FORBIDDEN, Probe


@pytest.fixture(scope="module")
def square_box():
    """A 6 x 6 x 10 cm box whose mesh origin is off its centre: 4-fold about z, 2-fold about x."""
    mesh = trimesh.creation.box(extents=(0.06, 0.06, 0.10))
    mesh.apply_translation((0.02, -0.01, 0.03))
    return load_object(mesh)


def test_parse_declarations() -> None:
    four = parse_symmetry("z:4")
    assert (four.kind, four.axis, four.order) == ("discrete", (0.0, 0.0, 1.0), 4)
    cont = parse_symmetry("x:inf")
    assert (cont.kind, cont.axis, cont.step_deg) == ("continuous", (1.0, 0.0, 0.0), 5.0)
    assert parse_symmetry("y:inf:10").step_deg == 10.0
    tilted = parse_symmetry("0,0,2:3")
    assert tilted.axis == (0.0, 0.0, 1.0) and tilted.describe() == "discrete z 3"
    assert cont.describe() == "continuous x every 5 deg"


@pytest.mark.parametrize("text", ["z", "z:1", "w:4", "z:four", "0,0:2", "0,0,0:2", "z:inf:0", "z:4:5", "z:inf:x"])
def test_bad_declarations_name_the_flag(text: str) -> None:
    with pytest.raises(InputError, match=r"^--symmetry: expected "):
        parse_symmetry(text)


def test_groups_are_closed_with_identity_first(square_box) -> None:
    centre = square_box.mesh_centre
    assert symmetry_tfs([], centre).shape == (1, 4, 4)
    four = symmetry_tfs([parse_symmetry("z:4")], centre)
    assert four.shape == (4, 4, 4) and np.array_equal(four[0], np.eye(4))
    assert symmetry_tfs([parse_symmetry("z:inf")], centre).shape == (72, 4, 4)
    box = symmetry_tfs([parse_symmetry("z:4"), parse_symmetry("x:2")], centre)
    assert len(box) == 8  # the dihedral group D4
    for a in box:  # closed under products
        for b in box:
            assert np.abs(box - a @ b).max(axis=(1, 2)).min() < 1e-6


def test_symmetries_map_the_object_onto_itself(square_box) -> None:
    mesh = square_box.mesh_centred
    pts = sample_surface(np.asarray(mesh.vertices), np.asarray(mesh.faces), 400, seed=1).points
    half = np.array([0.03, 0.03, 0.05])

    def on_box(p: np.ndarray) -> np.ndarray:  # on the centred box's surface: the largest |p_i| / h_i is 1
        return np.abs((np.abs(p) / half).max(axis=1) - 1.0) < 1e-9

    for tf in symmetry_tfs([parse_symmetry("z:4"), parse_symmetry("x:2")], square_box.mesh_centre):
        assert on_box(pts @ tf[:3, :3].T + tf[:3, 3]).all()
    not_sym = symmetry_tfs([parse_symmetry("x:4")], square_box.mesh_centre)[1]  # 6 x 10 side: not 4-fold
    assert on_box(pts @ not_sym[:3, :3].T + not_sym[:3, 3]).mean() < 0.8


def test_explicit_transforms_in_the_mesh_frame(square_box, tmp_path) -> None:
    flip_mesh = np.eye(4)  # 180 deg about the box's own z axis, which passes through its centre (0.02, -0.01)
    flip_mesh[:3, :3] = rotation_xyz(0, 0, math.pi)
    flip_mesh[:3, 3] = (0.04, -0.02, 0.0)
    path = tmp_path / "sym.json"
    path.write_text(json.dumps([flip_mesh.reshape(-1).tolist()]), encoding="utf-8")
    declared = load_symmetry_file(path)
    tfs = symmetry_tfs([declared], square_box.mesh_centre)
    want = symmetry_tfs([parse_symmetry("z:2")], square_box.mesh_centre)
    np.testing.assert_allclose(tfs, want, atol=1e-9)
    np.save(tmp_path / "sym.npy", flip_mesh[None])
    assert load_symmetry_file(tmp_path / "sym.npy").transforms.shape == (1, 4, 4)
    # the mesh-frame form composes with cam_from_mesh as the centred form does with cam_from_centred
    cam_from_centred = np.eye(4)
    cam_from_centred[:3, :3] = rotation_xyz(0.3, 0.2, -0.4)
    cam_from_centred[:3, 3] = (0.1, 0, 0.6)
    mesh_tfs = to_mesh_frame_tfs(tfs, square_box.mesh_centre)
    np.testing.assert_allclose(mesh_tfs[1], flip_mesh, atol=1e-12)
    cam_from_mesh = cam_from_centred @ square_box.centred_from_mesh
    np.testing.assert_allclose(cam_from_mesh @ mesh_tfs[1], cam_from_centred @ tfs[1] @ square_box.centred_from_mesh,
                               atol=1e-12)


def test_bad_transforms_and_huge_groups_are_refused(square_box, tmp_path) -> None:
    scaled = np.eye(4)[None] * np.array([2.0, 1, 1, 1])[:, None]
    with pytest.raises(InputError, match=r"^symmetry transforms: expected rigid transforms"):
        symmetry_tfs([Symmetry("transforms", transforms=scaled)], square_box.mesh_centre)
    with pytest.raises(InputError, match=r"^symmetries: expected a group of at most"):
        symmetry_tfs([parse_symmetry("z:inf:1"), parse_symmetry("x:inf:1")], square_box.mesh_centre)
    (tmp_path / "bad.json").write_text("[[1, 2, 3]]", encoding="utf-8")
    with pytest.raises(InputError, match=r"^--symmetry-tfs: expected "):
        load_symmetry_file(tmp_path / "bad.json")


def test_canonical_pose_undoes_a_symmetric_flip(square_box) -> None:
    tfs = torch.as_tensor(symmetry_tfs([parse_symmetry("z:4"), parse_symmetry("x:2")], square_box.mesh_centre),
                          dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    poses = torch.eye(4).repeat(6, 1, 1)
    for i in range(6):
        poses[i, :3, :3] = torch.as_tensor(rotation_xyz(*(torch.rand(3, generator=gen) * 6).tolist()))
        poses[i, :3, 3] = torch.tensor([0.0, 0.0, 0.5 + 0.1 * i])
    flipped = poses @ tfs[torch.arange(6) + 1]  # each pose hopped to another member of its class
    back = canonical_pose(flipped, tfs, reference=poses)
    torch.testing.assert_close(back, poses, atol=1e-5, rtol=0)
    absolute = canonical_pose(flipped, tfs)
    torch.testing.assert_close(canonical_pose(poses, tfs), absolute, atol=1e-5, rtol=0)  # one per class
    torch.testing.assert_close(canonical_pose(absolute, tfs), absolute, atol=1e-6, rtol=0)  # idempotent
    with Probe() as probe:
        canonical_pose(flipped, tfs, reference=poses)
    assert not (set(probe.ops) & FORBIDDEN), probe.ops


def test_the_register_grid_takes_the_group(square_box) -> None:
    plain = make_rotation_grid(None)
    four = make_rotation_grid(symmetry_tfs([parse_symmetry("z:4")], square_box.mesh_centre))
    assert len(plain) == 252 and len(four) < len(plain)


def test_a_symmetric_object_carries_its_group_into_the_register_grid(square_box) -> None:
    """load_object(symmetries=...) is the one declaration: the object's grid is the reduced one."""
    plain = load_object(square_box.mesh)
    four = load_object(square_box.mesh, symmetries=[parse_symmetry("z:4")])
    assert plain.symmetry is None and plain.symmetry_tfs is None
    assert four.symmetry.tfs_centred.shape == (4, 4, 4)
    np.testing.assert_allclose(four.symmetry_tfs, symmetry_tfs([parse_symmetry("z:4")], four.mesh_centre))
    assert len(make_rotation_grid(four.symmetry_tfs)) < len(make_rotation_grid(plain.symmetry_tfs)) == 252
