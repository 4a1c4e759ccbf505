"""Symmetries found from a mesh's geometry: what plain solids have, what the suite's printed objects have and their
texture breaks, that a symmetric untextured object keeps its symmetry, and that the declarations close."""

from __future__ import annotations

import numpy as np
import pytest
import trimesh

from foundationpose.mesh import load_object
from foundationpose.symmetry import rotation_about, symmetry_tfs
from foundationpose.symmetry_detect import DetectionConfig, detect_symmetries, real_symmetries
from foundationpose.symmetry_evidence import surface_colours
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.objects import SUITE, make_suite_mesh
from foundationpose.synthetic.primitives import circle, prism, rectangle


def _mesh(part) -> trimesh.Trimesh:
    return trimesh.Trimesh(part.vertices, part.faces, process=False)


def _found(mesh: trimesh.Trimesh) -> dict[str, tuple[bool, bool, bool]]:
    """declaration -> (real, geometry_breaks, texture_breaks)."""
    return {d.declaration: (d.real, d.geometry_breaks, d.texture_breaks) for d in detect_symmetries(mesh)}


def test_a_cylinder_has_its_turns_and_half_turns_and_the_declarations_close_into_their_group() -> None:
    found = detect_symmetries(_mesh(prism(circle(0.04, 64), 0.0, 0.1)))
    assert {d.declaration: (d.real, d.geometry_breaks, d.texture_breaks) for d in found} == {
        "z:inf": (True, False, False), "x:2": (True, False, False), "y:2": (True, False, False)}
    declared = real_symmetries(found)
    assert [s.kind for s in declared] == ["continuous", "discrete"]  # y:2 adds nothing to z:inf and x:2
    assert len(symmetry_tfs(declared, np.zeros(3))) == 144  # 72 turns, each also upside down


def test_a_box_has_its_three_half_turns() -> None:
    found = detect_symmetries(_mesh(prism(rectangle(0.1, 0.06), 0.0, 0.2, smooth=False)))
    assert [d.declaration for d in found] == ["x:2", "y:2", "z:2"] and all(d.real for d in found)
    assert len(symmetry_tfs(real_symmetries(found), np.zeros(3))) == 4


def test_a_cube_has_the_rotation_group_of_the_cube() -> None:
    cube = trimesh.creation.box((0.1, 0.1, 0.1))
    assert len(symmetry_tfs(real_symmetries(detect_symmetries(cube)), np.zeros(3))) == 24


def test_an_asymmetric_block_has_none() -> None:
    assert detect_symmetries(make_procedural_mesh("textured_asym")) == ()


@pytest.mark.slow  # about 1.6 s: the object loaded with its 144 transforms
def test_an_axis_off_the_mesh_axes_is_found_and_declared_about_its_point() -> None:
    cylinder = _mesh(prism(circle(0.03, 64), -0.06, 0.06))
    tilt = rotation_about((1.0, 0.0, 0.0), np.radians(35.0), (0.0, 0.0, 0.0))
    tilt[:3, 3] = (0.05, -0.02, 0.3)
    cylinder.apply_transform(tilt)
    found = detect_symmetries(cylinder)
    (continuous,) = [d for d in found if d.declaration.endswith(":inf")]
    axis = np.array([float(c) for c in continuous.declaration.split(":")[0].split(",")])
    assert abs(float(axis @ tilt[:3, 2])) > 0.999 and np.allclose(continuous.point, tilt[:3, 3], atol=2e-3)
    obj = load_object(cylinder, symmetries=real_symmetries(found))
    assert obj.symmetry is not None and len(obj.symmetry.tfs_mesh) == 144
    # the declared transforms keep the surface at the cylinder's radius about its tilted axis
    pts = np.asarray(trimesh.sample.sample_surface(cylinder, 500, seed=1)[0])
    for tf in obj.symmetry.tfs_mesh[[1, 40, 100]]:
        moved = pts @ tf[:3, :3].T + tf[:3, 3]
        along = (moved - tilt[:3, 3]) @ tilt[:3, 2]
        radius = np.linalg.norm(np.cross(moved - tilt[:3, 3], tilt[:3, 2]), axis=1)
        assert radius.max() < 0.0301 and np.abs(along).max() < 0.0601


@pytest.mark.parametrize("name", [o.name for o in SUITE if "texture" in o.near_symmetries[0].broken_by])
def test_a_printed_object_s_shape_symmetries_are_found_and_its_texture_breaks_every_one(name) -> None:
    found = detect_symmetries(make_suite_mesh(name))
    by_name = {d.declaration: d for d in found}
    (obj,) = [o for o in SUITE if o.name == name]
    for near in obj.near_symmetries:
        assert near.declaration in by_name, (name, near.declaration, list(by_name))
        assert by_name[near.declaration].texture_breaks and not by_name[near.declaration].geometry_breaks
    assert found and not any(d.real for d in found) and real_symmetries(found) == []


@pytest.mark.slow  # about 1-2 s each: no axis fits, so every order is tried on every axis
@pytest.mark.parametrize("name", [o.name for o in SUITE if "geometry" in o.near_symmetries[0].broken_by])
def test_a_detail_breaks_the_shape_s_symmetry(name) -> None:
    found = detect_symmetries(make_suite_mesh(name))
    assert not any(d.real for d in found) and real_symmetries(found) == []


def test_the_same_shape_without_its_print_keeps_its_symmetry() -> None:
    can = make_suite_mesh("can")
    plain = trimesh.Trimesh(can.vertices, can.faces, process=False)  # trimesh's default grey
    found = detect_symmetries(plain)
    assert {d.declaration: d.real for d in found} == {"z:inf": True, "x:2": True, "y:2": True}
    assert [s.describe() for s in real_symmetries(found)] == ["continuous z every 5 deg", "discrete x 2"]


def test_detection_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="probes"):
        DetectionConfig(probes=50)
    with pytest.raises(ValueError, match="near_fit"):
        DetectionConfig(near_fit=0.99, min_fit=0.9)
    with pytest.raises(ValueError, match="orders"):
        DetectionConfig(orders=(1,))


def test_a_written_glb_pbr_texture_gives_the_same_findings_as_the_mesh_in_memory(tmp_path) -> None:
    path = tmp_path / "can.glb"
    path.write_bytes(make_suite_mesh("can").export(file_type="glb"))
    loaded = load_object(path).mesh  # a PBR material: the texture is its baseColorTexture
    assert [d.describe() for d in detect_symmetries(loaded)] == [
        d.describe() for d in detect_symmetries(make_suite_mesh("can"))]


def test_surface_colours_of_vertex_coloured_and_plain_meshes() -> None:
    coloured = make_procedural_mesh("vertex_color_asym")
    points, faces = trimesh.sample.sample_surface(coloured, 200, seed=0)
    colours = surface_colours(coloured, np.asarray(points), np.asarray(faces))
    expected = np.asarray(coloured.visual.face_colors)[faces, :3] / 255.0
    assert np.array_equal(colours, expected) and len(np.unique(colours, axis=0)) > 3
    plain = make_procedural_mesh("plain_asym")
    grey = surface_colours(plain, np.asarray(points), np.asarray(faces))
    assert np.allclose(grey, 102 / 255)
