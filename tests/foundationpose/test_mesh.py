"""Object loading (spec §1.1, §2.4): centring, normals, diameter, colours, errors; and the procedural mesh."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh
from PIL import Image

from foundationpose.errors import InputError, InputTooLargeError
from foundationpose.mesh import MeshTensors, colors_u8_to_float, load_object, mesh_diameter
from foundationpose.synthetic.meshes import PROCEDURAL_KINDS, make_procedural_mesh, procedural_texture

INV255 = np.float32(np.float32(1) / np.float32(255))


def angle_weighted_normals(verts: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Independent float64 version of trimesh's vertex normals: sum over faces of the unit face normal
    times the face's corner angle at the vertex, normalised; degenerate faces skipped (spec §1.1)."""
    tri = verts[faces]  # (F, 3, 3)
    cross = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
    length = np.linalg.norm(cross, axis=1)
    ok = length > 1e-12
    unit = np.zeros_like(cross)
    unit[ok] = cross[ok] / length[ok, None]
    summed = np.zeros_like(verts)
    for corner in range(3):
        a = tri[:, (corner + 1) % 3] - tri[:, corner]
        b = tri[:, (corner + 2) % 3] - tri[:, corner]
        cos = np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-300)
        angle = np.arccos(np.clip(cos, -1.0, 1.0))
        np.add.at(summed, faces[ok, corner], unit[ok] * angle[ok, None])
    norms = np.linalg.norm(summed, axis=1, keepdims=True)
    return np.divide(summed, norms, out=np.zeros_like(summed), where=norms > 0)


# ----------------------------------------------------------------------------------------- procedural


@pytest.mark.parametrize("kind", PROCEDURAL_KINDS)
def test_procedural_mesh_is_a_closed_outward_l_block_in_metres(kind: str) -> None:
    mesh = make_procedural_mesh(kind)
    tri = mesh.vertices[mesh.faces]
    volume = np.linalg.det(tri).sum() / 6  # positive only with outward-facing triangles
    assert volume == pytest.approx(0.12 * 0.035 * 0.05 + 0.04 * 0.045 * 0.05, rel=1e-9)
    np.testing.assert_allclose(mesh.extents, [0.12, 0.08, 0.05], rtol=0, atol=1e-12)
    assert not np.allclose(mesh.bounds.mean(axis=0), 0.0)  # origin off the bounding-box centre


def test_procedural_texture_is_asymmetric() -> None:
    tex = procedural_texture()
    assert tex.shape == (384, 384, 3) and tex.dtype == np.uint8
    assert not np.array_equal(tex, tex[::-1]) and not np.array_equal(tex, tex[:, ::-1])
    assert len({tuple(c) for c in tex[::128, ::128].reshape(-1, 3)}) == 9  # a distinct colour per cell


# ------------------------------------------------------------------------------------ centring, tensors


def test_textured_object_tensors() -> None:
    mesh = make_procedural_mesh("textured_asym")
    obj = load_object(mesh)
    centre = (mesh.vertices.min(axis=0) + mesh.vertices.max(axis=0)) / 2
    np.testing.assert_array_equal(obj.mesh_centre, centre)
    np.testing.assert_array_equal(obj.centred_from_mesh[:3, 3], -centre)
    np.testing.assert_array_equal(obj.mesh_from_centred[:3, 3], centre)
    assert obj.diameter == pytest.approx(np.sqrt(0.12**2 + 0.08**2 + 0.05**2), rel=1e-12)
    assert isinstance(obj.diameter, float) and obj.radius == obj.diameter / 2

    t = obj.tensors
    assert (
        t.verts.dtype == torch.float32 and t.faces.dtype == torch.int32 and t.normals.dtype == torch.float32
    )
    np.testing.assert_array_equal(t.verts.numpy(), (mesh.vertices - centre).astype(np.float32))
    np.testing.assert_array_equal(t.faces.numpy(), mesh.faces)
    np.testing.assert_array_equal(t.uv_faces.numpy(), mesh.faces)
    uv32 = mesh.visual.uv.astype(np.float32)
    np.testing.assert_array_equal(t.uv.numpy(), np.column_stack([uv32[:, 0], np.float32(1) - uv32[:, 1]]))
    np.testing.assert_array_equal(t.texture.numpy(), procedural_texture().astype(np.float32) * INV255)
    assert t.vertex_colors is None and t.has_texture
    assert obj.name == "procedural_textured_asym"


def test_colour_conversion_is_the_reference_gpu_division() -> None:
    values = np.arange(256, dtype=np.uint8)
    out = colors_u8_to_float(values)
    np.testing.assert_array_equal(out, values.astype(np.float32) * INV255)
    assert out[255] == np.float32(1.0) and np.abs(out.astype(np.float64) - values / 255).max() < 1e-7


def test_vertex_colours_and_default_grey() -> None:
    coloured = load_object(make_procedural_mesh("vertex_color_asym"))
    expected = colors_u8_to_float(make_procedural_mesh("vertex_color_asym").visual.vertex_colors[:, :3])
    np.testing.assert_array_equal(coloured.tensors.vertex_colors.numpy(), expected)
    assert coloured.tensors.texture is None and coloured.tensors.uv is None
    plain = load_object(make_procedural_mesh("plain_asym"))
    assert bool((plain.tensors.vertex_colors == np.float32(102) * INV255).all())  # trimesh grey 102


def test_loading_does_not_modify_the_callers_mesh() -> None:
    mesh = make_procedural_mesh()
    before = mesh.vertices.copy()
    obj = load_object(mesh)
    np.testing.assert_array_equal(mesh.vertices, before)
    assert obj.mesh is not mesh
    with pytest.raises(ValueError):
        obj.mesh_centre[0] = 1.0  # read-only


def test_mesh_tensors_to_device() -> None:
    t = load_object(make_procedural_mesh()).tensors
    assert t.to("cpu") is t
    moved = t.to("meta")
    assert isinstance(moved, MeshTensors) and moved.device.type == "meta"
    assert moved.texture.device.type == "meta" and moved.vertex_colors is None


# ---------------------------------------------------------------------------------------------- normals


def test_normals_are_trimesh_angle_weighted_of_the_centred_copy() -> None:
    mesh = trimesh.creation.icosphere(subdivisions=2, radius=0.05)
    rng = np.random.default_rng(0)
    verts = mesh.vertices * (1 + 0.2 * rng.random((len(mesh.vertices), 1))) + [0.3, -0.1, 0.2]
    faces = np.vstack([mesh.faces, [[0, 0, 1]]])  # plus one degenerate face
    bumpy = trimesh.Trimesh(verts, faces, process=False)
    obj = load_object(bumpy)
    mine = angle_weighted_normals(np.asarray(obj.mesh_centred.vertices), faces)
    np.testing.assert_allclose(np.asarray(obj.mesh_centred.vertex_normals), mine, rtol=0, atol=1e-12)
    np.testing.assert_allclose(obj.tensors.normals.numpy(), mine, rtol=0, atol=1e-7)


def test_normals_in_the_file_are_discarded(tmp_path: Path) -> None:
    lines = ["v 0 0 0", "v 1 0 0", "v 0 1 0", "v 0 0 1"] + ["vn 1 0 0"] * 4
    lines += ["f 1//1 3//3 2//2", "f 1//1 2//2 4//4", "f 1//1 4//4 3//3", "f 2//2 3//3 4//4"]
    path = tmp_path / "tetra.obj"
    path.write_text("\n".join(lines) + "\n")
    obj = load_object(path, max_diameter_m=None)
    loaded_normals = np.asarray(trimesh.load(path).vertex_normals)
    np.testing.assert_array_equal(
        loaded_normals, np.tile([1.0, 0.0, 0.0], (4, 1))
    )  # trimesh keeps file normals
    expected = angle_weighted_normals(
        np.asarray(obj.mesh_centred.vertices), np.asarray(obj.mesh_centred.faces)
    )
    np.testing.assert_allclose(obj.tensors.normals.numpy(), expected, rtol=0, atol=1e-7)
    assert obj.tensors.normals[0].tolist() == pytest.approx([-(3**-0.5)] * 3, abs=1e-6)


# --------------------------------------------------------------------------------------------- diameter


def test_diameter_subset_matches_the_reference_draw() -> None:
    pts = np.random.default_rng(1).normal(size=(800, 3)) * [0.1, 0.05, 0.02]
    got = mesh_diameter(pts, seed=0, max_points=500)
    state = np.random.get_state()
    try:
        np.random.seed(0)  # the reference: global legacy RNG seeded 0, then np.random.choice
        ids = np.random.choice(800, 500, replace=False)
    finally:
        np.random.set_state(state)
    sub = pts[ids]
    expected = np.linalg.norm(sub[None] - sub[:, None], axis=-1).max()
    assert got == expected
    full = np.linalg.norm(pts[None] - pts[:, None], axis=-1).max()
    assert mesh_diameter(pts, max_points=10_000) == full and got <= full
    assert mesh_diameter(pts, seed=1, max_points=500) != got  # the seed matters when subsampling


def test_diameter_equals_brute_force_on_a_symmetric_sphere() -> None:
    pts = trimesh.creation.icosphere(subdivisions=3).vertices * 0.07 + [1.0, 2.0, 3.0]  # many tied pairs
    expected = np.linalg.norm(pts[None] - pts[:, None], axis=-1).max()
    assert mesh_diameter(pts) == expected


# ---------------------------------------------------------------------------------------- file formats


def test_obj_round_trip_with_texture(tmp_path: Path) -> None:
    make_procedural_mesh().export(tmp_path / "block.obj")
    obj = load_object(tmp_path / "block.obj")
    assert obj.name == "block" and obj.tensors.has_texture
    np.testing.assert_array_equal(
        obj.tensors.texture.numpy(), procedural_texture().astype(np.float32) * INV255
    )
    assert obj.diameter == pytest.approx(np.sqrt(0.12**2 + 0.08**2 + 0.05**2), rel=1e-7)
    assert len(obj.tensors.uv) == len(obj.tensors.verts)


def test_glb_round_trip_with_texture(tmp_path: Path) -> None:
    make_procedural_mesh().export(tmp_path / "block.glb")
    obj = load_object(tmp_path / "block.glb")
    np.testing.assert_array_equal(
        obj.tensors.texture.numpy(), procedural_texture().astype(np.float32) * INV255
    )
    uv_obj = load_object(make_procedural_mesh()).tensors.uv.numpy()
    np.testing.assert_allclose(np.sort(obj.tensors.uv.numpy(), axis=0), np.sort(uv_obj, axis=0), atol=1e-6)


def test_ply_round_trip_with_vertex_colours(tmp_path: Path) -> None:
    make_procedural_mesh("vertex_color_asym").export(tmp_path / "block.ply")
    obj = load_object(tmp_path / "block.ply")
    palette = {
        tuple(c)
        for c in colors_u8_to_float(make_procedural_mesh("vertex_color_asym").visual.vertex_colors[:, :3])
    }
    assert obj.tensors.texture is None
    assert {tuple(c) for c in obj.tensors.vertex_colors.numpy()} <= palette


def test_scene_is_merged_into_one_mesh() -> None:
    scene = trimesh.Scene([make_procedural_mesh("plain_asym"), trimesh.creation.box((0.01, 0.01, 0.01))])
    obj = load_object(scene)
    assert len(obj.tensors.verts) == 36 + 8


def test_oriented_bounds_of_the_original_mesh() -> None:
    mesh = make_procedural_mesh()
    to_origin, extents = load_object(mesh).oriented_bounds
    np.testing.assert_allclose(np.sort(extents), [0.05, 0.08, 0.12], atol=1e-9)
    moved = trimesh.transform_points(mesh.vertices, to_origin)
    np.testing.assert_allclose(moved.max(axis=0), extents / 2, atol=1e-9)
    np.testing.assert_allclose(moved.min(axis=0), -extents / 2, atol=1e-9)


# ----------------------------------------------------------------------------------- material fallback


def test_material_without_image_falls_back_to_its_colour(caplog: pytest.LogCaptureFixture) -> None:
    mesh = make_procedural_mesh("plain_asym")
    material = trimesh.visual.material.SimpleMaterial(diffuse=[200, 10, 20, 255])
    mesh.visual = trimesh.visual.TextureVisuals(uv=np.zeros((len(mesh.vertices), 2)), material=material)
    with caplog.at_level(logging.WARNING, logger="foundationpose.mesh"):
        obj = load_object(mesh)
    assert "no texture image" in caplog.text
    assert obj.tensors.texture is None
    np.testing.assert_array_equal(
        obj.tensors.vertex_colors.numpy(), np.tile(colors_u8_to_float([200, 10, 20]), (36, 1))
    )


# ---------------------------------------------------------------------------------------------- errors


def test_texture_without_uvs_is_rejected() -> None:
    mesh = make_procedural_mesh("plain_asym")
    image = Image.fromarray(procedural_texture())
    mesh.visual = trimesh.visual.TextureVisuals(material=trimesh.visual.material.SimpleMaterial(image=image))
    with pytest.raises(
        InputError, match=r"^mesh: expected one \(u, v\) per vertex for the texture image; got no UV"
    ):
        load_object(mesh)


def test_non_finite_uvs_are_rejected() -> None:
    mesh = make_procedural_mesh()
    uv = mesh.visual.uv.copy()
    uv[0, 0] = np.nan
    mesh.visual = trimesh.visual.TextureVisuals(uv=uv, image=Image.fromarray(procedural_texture()))
    with pytest.raises(InputError, match=r"^mesh: expected finite UV coordinates; got UVs with NaN or inf$"):
        load_object(mesh)


def test_empty_and_non_finite_meshes_are_rejected() -> None:
    with pytest.raises(
        InputError, match=r"^mesh: expected a non-empty triangle mesh; got 0 vertices and 0 faces$"
    ):
        load_object(trimesh.Trimesh())
    mesh = make_procedural_mesh("plain_asym")
    verts = mesh.vertices.copy()
    verts[3] = np.nan
    with pytest.raises(
        InputError, match=r"^mesh: expected finite vertex coordinates; got 1 vertices with NaN"
    ):
        load_object(trimesh.Trimesh(verts, mesh.faces, process=False))


def test_bad_files_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^mesh: expected an existing mesh file .*\(no such file\)$"):
        load_object(tmp_path / "missing.obj")
    unknown = tmp_path / "block.notamesh"
    unknown.write_text("hello")
    with pytest.raises(
        InputError, match=r"^mesh: expected a mesh file trimesh can read .*; got 'block\.notamesh'"
    ):
        load_object(unknown)
    with pytest.raises(InputError, match=r"^mesh: expected a file path or a trimesh\.Trimesh; got int$"):
        load_object(3)


def test_millimetre_mesh_is_rejected_with_a_hint() -> None:
    mesh = make_procedural_mesh("plain_asym")
    mesh.apply_scale(1000.0)
    with pytest.raises(
        InputError, match=r"^mesh: expected a mesh in metres .*; got diameter 152\.6\. Mesh in millimetres\?"
    ):
        load_object(mesh)
    assert load_object(mesh, max_diameter_m=None).diameter == pytest.approx(152.64, abs=0.01)


def test_tee_is_a_second_asymmetric_shape():
    from foundationpose.synthetic.meshes import PROCEDURAL_SHAPES

    assert PROCEDURAL_SHAPES == ("L", "tee")
    tee = make_procedural_mesh("textured_asym", shape="tee")
    assert tee.vertices.shape == (48, 3) and tee.faces.shape == (28, 3)
    assert tee.volume == pytest.approx((0.025 * 0.06 + 0.10 * 0.03) * 0.07, rel=1e-9)  # outward faces
    obj = load_object(tee)
    verts = np.asarray(tee.vertices)
    farthest = np.linalg.norm(verts[:, None] - verts[None], axis=-1).max()  # 48 vertices: exact
    assert obj.diameter == pytest.approx(farthest, rel=1e-12) and 0.13 < obj.diameter < 0.14
    assert obj.tensors.texture.shape == (512, 512, 3)  # 4 x 4 atlas cells for its 10 faces
    with pytest.raises(ValueError, match=r"^shape must be one of"):
        make_procedural_mesh(shape="ring")


def test_max_texture_side_downscales_every_texture_source(tmp_path: Path) -> None:
    mesh = make_procedural_mesh("textured_asym")
    image = Image.fromarray(procedural_texture()).resize((300, 200))
    mesh.visual = trimesh.visual.TextureVisuals(uv=np.asarray(mesh.visual.uv), image=image)
    path = tmp_path / "m.glb"
    path.write_bytes(mesh.export(file_type="glb"))  # the image is embedded in the GLB
    assert tuple(load_object(path).tensors.texture.shape) == (200, 300, 3)  # None: the reference's full image
    reduced = load_object(path, max_texture_side=100).tensors.texture
    assert tuple(reduced.shape) == (67, 100, 3)
    # a filtered downscale: the mean colour stays (within 1/255), the pattern is still there (rows differ)
    full = colors_u8_to_float(np.asarray(image))
    np.testing.assert_allclose(reduced.numpy().mean(axis=(0, 1)), full.mean(axis=(0, 1)), atol=1 / 255)
    assert reduced.numpy().std(axis=(0, 1)).min() > 0.5 * full.std(axis=(0, 1)).min()
    in_memory = load_object(mesh, max_texture_side=100).tensors.texture  # a trimesh given directly
    assert tuple(in_memory.shape) == (67, 100, 3)
    assert mesh.visual.material.image.size == (300, 200)  # the caller's mesh is not modified


def test_a_texture_above_the_bomb_limit_is_refused_from_its_header(tmp_path: Path, monkeypatch) -> None:
    mesh = make_procedural_mesh("textured_asym")
    path = tmp_path / "m.glb"
    path.write_bytes(mesh.export(file_type="glb"))
    side = Image.fromarray(procedural_texture()).size
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", side[0] * side[1] - 1)
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(
        InputTooLargeError, match=r"^mesh: expected a texture image of at most \d+ pixels \(Pillow's decompression-bomb"
    ):
        load_object(path, max_texture_side=None)
