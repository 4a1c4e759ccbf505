"""CPU rasteriser against analytic scenes: coverage, perspective-correct xyz, texture, shading, occlusion,
flip, crop vs full frame, clipping and the z-buffer of a closed mesh (spec §3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foundationpose.errors import RenderError
from foundationpose.mesh import MeshTensors
from foundationpose.render import CpuRasterizer, RenderConfig, RenderOutput, make_renderer, render_full_frame
from foundationpose.render._reference import render_crops_reference
from foundationpose.render.attributes import interpolate, texture_linear_wrap
from foundationpose.render.cpu_raster import rasterize
from foundationpose.render.projection import (
    clip_from_centred,
    crop_bounds,
    projection_from_K,
    vertices_to_clip,
)
from foundationpose.render.shading import vertices_in_cam
from foundationpose.synthetic.pillow_box import angle_weighted_normals, pillow_box_arrays

FX, FY, CX, CY = 319.5820007324219, 417.1186828613281, 320.2149847676956, 244.3486680871047
K = np.array([[FX, 0.0, CX], [0.0, FY, CY], [0.0, 0.0, 1.0]])
H, W, S = 480, 640, 160
SHADE_FACING = 0.8 + 0.5  # albedo factor of a surface facing the camera (diffuse = 1)


@pytest.fixture(scope="module")
def renderer() -> CpuRasterizer:
    return CpuRasterizer("cpu")


# -- scene helpers ------------------------------------------------------------------------------------------------


def rot(axis: str, deg: float) -> np.ndarray:
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return {
        "x": np.array([[1, 0, 0], [0, c, -s], [0, s, c]]),
        "y": np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]]),
        "z": np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]]),
    }[axis]


def pose(r: np.ndarray, t: tuple[float, float, float]) -> torch.Tensor:
    m = np.eye(4)
    m[:3, :3], m[:3, 3] = r, t
    return torch.tensor(m, dtype=torch.float32)


def mesh(verts, faces, **colour) -> MeshTensors:
    v = torch.as_tensor(np.asarray(verts), dtype=torch.float32)
    f = torch.as_tensor(np.asarray(faces), dtype=torch.int32)
    tensors = {k: None if x is None else torch.as_tensor(np.asarray(x), dtype=torch.float32) for k, x in colour.items()}
    if tensors.get("uv") is not None:
        tensors["uv_faces"] = f.clone()
    return MeshTensors(verts=v, faces=f, normals=angle_weighted_normals(v, f), **tensors)


def quad(half_x: float, half_y: float) -> tuple[np.ndarray, np.ndarray]:
    """Quad in the centred z = 0 plane, wound so its normal is -z (towards a camera looking along +z)."""
    verts = np.array([[-half_x, -half_y, 0], [half_x, -half_y, 0], [half_x, half_y, 0], [-half_x, half_y, 0]])
    return verts, np.array([[0, 2, 1], [0, 3, 2]])


def crop_from_edges(left: float, top: float, right: float, bottom: float) -> torch.Tensor:
    """(1, 3, 3) float32 F of spec §2.5 from window edges."""
    sx, sy = np.float32(S / (right - left)), np.float32(S / (bottom - top))
    f = [[sx, 0, sx * np.float32(-left)], [0, sy, sy * np.float32(-top)], [0, 0, 1]]
    return torch.tensor(np.array(f, dtype=np.float32))[None]


def crop_samples(f: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Image-plane sample (u, v) of every crop pixel (spec §3.3): (S, S) arrays indexed [row, col]."""
    x0, y0, x1, y1 = crop_bounds(f, S)[0].double().numpy()
    j = np.arange(S) + 0.5
    return np.meshgrid(x0 + j * (x1 - x0) / S, y0 + j * (y1 - y0) / S, indexing="xy")


def plane_hits(u: np.ndarray, v: np.ndarray, cam_from_centred: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Camera-frame hit of each pixel ray with the centred z = 0 plane, and its centred-frame coordinates."""
    t = cam_from_centred.double().numpy()
    r, c = t[:3, :3], t[:3, 3]
    n = r[:, 2]
    d = np.stack([(u - CX) / FX, (v - CY) / FY, np.ones_like(u)], -1)
    hit = d * ((n @ c) / (d @ n))[..., None]
    local = (hit - c) @ r  # R^T (p - c)
    return hit, local


def bilinear_wrap_reference(tex: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Independent float64 bilinear lookup, texel (k, l) centred at ((k+.5)/Wt, (l+.5)/Ht), wrap addressing."""
    ht, wt = tex.shape[:2]
    x, y = (u % 1.0) * wt - 0.5, (v % 1.0) * ht - 0.5
    x0, y0 = np.floor(x), np.floor(y)
    fx, fy = (x - x0)[..., None], (y - y0)[..., None]
    i0, i1 = x0.astype(int) % wt, (x0.astype(int) + 1) % wt
    k0, k1 = y0.astype(int) % ht, (y0.astype(int) + 1) % ht
    return (tex[k0, i0] * (1 - fx) + tex[k0, i1] * fx) * (1 - fy) + (tex[k1, i0] * (1 - fx) + tex[k1, i1] * fx) * fy


# -- tests --------------------------------------------------------------------------------------------------------


def test_tilted_quad_coverage_and_perspective_correct_xyz(renderer: CpuRasterizer) -> None:
    hx, hy = 0.06, 0.045
    t = pose(rot("y", 55) @ rot("x", 25), (0.012, -0.006, 0.45))
    f = crop_from_edges(219.0, 130.0, 421.0, 332.0)
    out = renderer.render(mesh(*quad(hx, hy)), t[None], K, (H, W), f)
    u, v = crop_samples(f)
    hit, local = plane_hits(u, v, t)
    inside = (np.abs(local[..., 0]) < hx) & (np.abs(local[..., 1]) < hy)
    clear = (np.abs(np.abs(local[..., 0]) - hx) > 2e-4) & (np.abs(np.abs(local[..., 1]) - hy) > 2e-4)
    mask = out.mask[0].numpy()
    assert inside.sum() > 2000
    np.testing.assert_array_equal(mask[clear], inside[clear])
    xyz = out.xyz_cam[0].double().numpy()
    # Perspective-correct barycentrics put every sample on its ray and on the plane (screen-linear
    # interpolation would be off by millimetres at this 55 degree tilt).
    np.testing.assert_allclose(xyz[mask], hit[mask], atol=2e-6)
    np.testing.assert_allclose(out.depth[0].double().numpy()[mask], hit[mask][:, 2], atol=2e-6)
    assert (xyz[~mask] == 0).all() and (out.rgb[0].numpy()[~mask] == 0).all()


def test_textured_quad_samples_expected_texels(renderer: CpuRasterizer) -> None:
    rng = np.random.default_rng(3)
    tex = rng.uniform(0.05, 0.7, size=(5, 7, 3)).astype(np.float32)
    verts, faces = quad(0.05, 0.04)
    uv = np.array([[-0.25, -0.25], [1.25, -0.25], [1.25, 1.25], [-0.25, 1.25]])  # also exercises wrap addressing
    t = pose(np.eye(3), (-0.01, 0.008, 0.4))  # facing the camera: diffuse term 1
    f = crop_from_edges(240.0, 177.0, 400.0, 337.0)
    out = renderer.render(mesh(verts, faces, uv=uv, texture=tex), t[None], K, (H, W), f)
    u, v = crop_samples(f)
    _, local = plane_hits(u, v, t)
    uu = -0.25 + 1.5 * (local[..., 0] + 0.05) / 0.1  # u along +x, v' along +y (down in the image)
    vv = -0.25 + 1.5 * (local[..., 1] + 0.04) / 0.08
    mask = out.mask[0].numpy()
    assert mask.sum() > 5000
    expected = np.clip(bilinear_wrap_reference(tex.astype(np.float64), uu, vv) * SHADE_FACING, 0, 1)
    np.testing.assert_allclose(out.rgb[0].double().numpy()[mask], expected[mask], atol=2e-5)
    # At the pixel nearest to texel (k, l) = (3, 2)'s centre the colour is that texel's, shaded; the bound allows
    # for the pixel missing the centre by up to `dist` texels.
    tu, tv = 3.5 / 7, 2.5 / 5
    dist2 = ((uu - tu) * 7) ** 2 + ((vv - tv) * 5) ** 2
    row, col = np.unravel_index(np.argmin(np.where(mask, dist2, np.inf)), uu.shape)
    bound = 2 * math.sqrt(dist2[row, col]) * 0.65 * SHADE_FACING + 1e-5
    np.testing.assert_allclose(out.rgb[0, row, col].numpy(), tex[2, 3] * SHADE_FACING, atol=bound)
    assert math.sqrt(dist2[row, col]) < 0.1


def test_texture_twin_matches_independent_bilinear() -> None:
    rng = np.random.default_rng(0)
    tex = rng.uniform(0, 1, size=(9, 13, 3)).astype(np.float32)
    uv = rng.uniform(-2, 3, size=(1000, 2)).astype(np.float32)
    got = texture_linear_wrap(torch.from_numpy(tex), torch.from_numpy(uv)).double().numpy()
    want = bilinear_wrap_reference(tex.astype(np.float64), uv[:, 0].astype(np.float64), uv[:, 1].astype(np.float64))
    np.testing.assert_allclose(got, want, atol=2e-5)  # float32 wrap/fraction of |uv| <= 3


def test_object_above_principal_point_appears_in_top_rows(renderer: CpuRasterizer) -> None:
    verts, faces = quad(0.02, 0.02)
    t = pose(np.eye(3), (0.06, -0.07, 0.5))  # up (-y) and right (+x) of the optical axis
    out = renderer.render_full_frame(mesh(verts, faces), t[None], K, (H, W))
    rows, cols = np.nonzero(out.mask[0].numpy())
    v_centre, u_centre = FY * -0.07 / 0.5 + CY, FX * 0.06 / 0.5 + CX
    assert rows.max() < CY and cols.min() > CX
    assert abs(rows.mean() + 0.5 - v_centre) < 1.0 and abs(cols.mean() + 0.5 - u_centre) < 1.0


def test_vertex_colours_interpolate_perspective_correctly_and_shade(renderer: CpuRasterizer) -> None:
    verts, faces = quad(0.05, 0.04)
    a = np.array([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0], [2.0, -2.0, 0.0]])
    b = np.array([0.4, 0.35, 0.5])
    colours = verts @ a.T + b  # affine in the centred position -> affine on the plane
    tilt = 40.0
    t = pose(rot("y", tilt), (0.0, 0.0, 0.5))
    f = crop_from_edges(230.0, 154.0, 410.0, 334.0)
    out = renderer.render(mesh(verts, faces, vertex_colors=colours), t[None], K, (H, W), f)
    u, v = crop_samples(f)
    _, local = plane_hits(u, v, t)
    diffuse = math.cos(math.radians(tilt))  # quad normal -z, rotated about y: -n_cam.z = cos(tilt)
    mask = out.mask[0].numpy()
    expected = np.clip((local @ a.T + b) * (0.8 + 0.5 * diffuse), 0, 1)
    np.testing.assert_allclose(out.rgb[0].double().numpy()[mask], expected[mask], atol=2e-5)
    # Without any colour source the albedo is trimesh's grey 102/255 (spec §8.22).
    plain = renderer.render(mesh(verts, faces), t[None], K, (H, W), f)
    np.testing.assert_array_equal(plain.mask.numpy(), out.mask.numpy())
    np.testing.assert_allclose(plain.rgb[0].numpy()[mask], 0.4 * (0.8 + 0.5 * diffuse), atol=1e-6)


@pytest.mark.parametrize("near_first", [True, False])
def test_nearer_triangle_wins_whatever_the_face_order(renderer: CpuRasterizer, near_first: bool) -> None:
    near = [[-0.03, -0.03, 0.4], [0.0, 0.03, 0.4], [0.03, -0.03, 0.4]]  # wound to face the camera
    far = [[-0.1, -0.08, 0.6], [0.0, 0.1, 0.6], [0.1, -0.08, 0.6]]
    red, green = [0.7, 0.1, 0.1], [0.1, 0.7, 0.1]
    verts = np.array(near + far if near_first else far + near)
    cols = np.array([red] * 3 + [green] * 3 if near_first else [green] * 3 + [red] * 3)
    faces = np.array([[0, 1, 2], [3, 4, 5]])
    out = renderer.render_full_frame(mesh(verts, faces, vertex_colors=cols), torch.eye(4)[None], K, (H, W))
    z = out.depth[0].numpy()
    rgb = out.rgb[0].numpy()
    near_px = np.isclose(z, 0.4, atol=1e-6)
    far_px = np.isclose(z, 0.6, atol=1e-6)
    assert near_px.sum() > 500 and far_px.sum() > 500 and (near_px | far_px).sum() == out.mask[0].sum()
    # The centre pixel is covered by both triangles: the near (red) one is visible.
    row, col = int(CY), int(CX)
    assert near_px[row, col]
    np.testing.assert_allclose(rgb[near_px] - np.array(red) * SHADE_FACING, 0.0, atol=1e-6)
    np.testing.assert_allclose(rgb[far_px] - np.array(green) * SHADE_FACING, 0.0, atol=1e-6)


def test_exact_depth_ties_go_to_the_lowest_face_index(renderer: CpuRasterizer) -> None:
    tri = [[-0.03, -0.03, 0.4], [0.0, 0.03, 0.4], [0.03, -0.03, 0.4]]
    verts = np.array(tri + tri)
    faces = np.array([[0, 1, 2], [3, 4, 5]])
    cols = np.array([[0.6, 0.0, 0.0]] * 3 + [[0.0, 0.0, 0.6]] * 3)
    out = renderer.render_full_frame(mesh(verts, faces, vertex_colors=cols), torch.eye(4)[None], K, (H, W))
    rgb = out.rgb[0].numpy()[out.mask[0].numpy()]
    assert len(rgb) > 500 and (rgb[:, 0] > 0.7).all() and (rgb[:, 2] == 0).all()
    swapped = mesh(verts, faces[::-1].copy(), vertex_colors=cols)
    rgb2 = renderer.render_full_frame(swapped, torch.eye(4)[None], K, (H, W)).rgb[0].numpy()[out.mask[0].numpy()]
    assert (rgb2[:, 2] > 0.7).all() and (rgb2[:, 0] == 0).all()


def test_crop_render_equals_full_frame_at_the_same_samples(renderer: CpuRasterizer) -> None:
    rng = np.random.default_rng(1)
    tex = rng.uniform(0.05, 0.7, size=(16, 16, 3)).astype(np.float32)
    verts, faces = quad(0.06, 0.05)
    uv = np.array([[0, 0], [1, 0], [1, 1], [0, 1]], dtype=np.float64)
    m = mesh(verts, faces, uv=uv, texture=tex)
    t = pose(rot("y", 35) @ rot("x", -20), (0.01, 0.02, 0.5))
    left, top = 243, 190
    # Scale 159/160: bounds span exactly S pixels, so crop pixel (j, i) samples u = left + j + 0.5, which is the
    # sample of full-frame pixel (left + j, top + i) in the reference's half-pixel convention.
    sx = np.float32(159 / 160)
    f = torch.tensor([[[sx, 0, -left * sx], [0, sx, -top * sx], [0, 0, 1]]], dtype=torch.float32)
    crop = renderer.render(m, t[None], K, (H, W), f)
    full = renderer.render_full_frame(m, t[None], K, (H, W))
    window = (slice(top, top + S), slice(left, left + S))
    both = crop.mask[0] & full.mask[0][window]
    assert both.sum() > 5000
    assert (crop.mask[0] ^ full.mask[0][window]).sum() <= 3  # pixel centres within float noise of an edge
    torch.testing.assert_close(crop.xyz_cam[0][both], full.xyz_cam[0][window][both], atol=2e-6, rtol=0)
    torch.testing.assert_close(crop.rgb[0][both], full.rgb[0][window][both], atol=2e-4, rtol=0)


@pytest.mark.parametrize("exact", [False, True])
def test_full_frame_pixel_convention(renderer: CpuRasterizer, exact: bool) -> None:
    verts, faces = quad(0.08, 0.06)
    t = pose(rot("x", 30), (0.0, 0.0, 0.5))
    out = renderer.render_full_frame(mesh(verts, faces), t[None], K, (H, W), pixel_centre_exact=exact)
    rows, cols = np.nonzero(out.mask[0].numpy())
    xyz = out.xyz_cam[0].double().numpy()[rows, cols]
    shift = 0.0 if exact else 0.5  # reference: pixel (j, i) samples (j + .5, i + .5)
    np.testing.assert_allclose(xyz[:, 0] / xyz[:, 2], (cols + shift - CX) / FX, atol=2e-6)
    np.testing.assert_allclose(xyz[:, 1] / xyz[:, 2], (rows + shift - CY) / FY, atol=2e-6)


@pytest.mark.slow
def test_near_plane_clipping_and_geometry_behind_the_camera(renderer: CpuRasterizer) -> None:
    # One vertex behind the camera: only the part in front of the near plane may appear.
    verts = np.array([[-0.1, 0.05, -0.3], [0.25, 0.1, 0.6], [-0.2, -0.15, 0.6]])
    out = renderer.render_full_frame(mesh(verts, [[0, 1, 2]]), torch.eye(4)[None], K, (H, W))
    mask = out.mask[0].numpy()
    rows, cols = np.mgrid[0:H, 0:W]
    d = np.stack([(cols + 0.5 - CX) / FX, (rows + 0.5 - CY) / FY, np.ones((H, W))], -1)
    p0, e1, e2 = verts[0], verts[1] - verts[0], verts[2] - verts[0]
    n = np.cross(e1, e2)
    hit = d * ((n @ p0) / (d @ n))[..., None]
    # Barycentric coordinates of the hit in the triangle.
    rel = hit - p0
    g = np.linalg.inv(np.array([[e1 @ e1, e1 @ e2], [e1 @ e2, e2 @ e2]]))
    b12 = np.stack([rel @ e1, rel @ e2], -1) @ g
    bary = np.concatenate([1 - b12.sum(-1, keepdims=True), b12], -1)
    visible = (bary >= 0).all(-1) & (hit[..., 2] >= 0.001)
    clear = (np.abs(bary).min(-1) > 1e-4) & (np.abs(hit[..., 2] - 0.001) > 1e-6)
    assert visible.sum() > 10000
    np.testing.assert_array_equal(mask[clear], visible[clear])
    assert (out.depth[0].numpy()[mask] >= 0.001 - 1e-7).all()
    np.testing.assert_allclose(out.xyz_cam[0].double().numpy()[mask & clear], hit[mask & clear], atol=1e-5, rtol=1e-5)
    behind = renderer.render_full_frame(mesh(verts, [[0, 1, 2]]), pose(np.eye(3), (0, 0, -1.0))[None], K, (H, W))
    assert not behind.mask.any() and (behind.rgb == 0).all() and (behind.xyz_cam == 0).all()


@pytest.mark.slow
def test_closed_mesh_depth_is_the_nearest_surface(renderer: CpuRasterizer) -> None:
    arrays = pillow_box_arrays()
    m = MeshTensors(**arrays)
    t = pose(rot("z", 20) @ rot("y", 130) @ rot("x", -35), (0.015, -0.01, 0.45))
    out = renderer.render_full_frame(m, t[None], K, (H, W))
    # Analytic: nearest ray/triangle hit over all faces (float64 Moeller-Trumbore) for a grid of pixels.
    v = (arrays["verts"].double().numpy() @ t[:3, :3].double().numpy().T) + t[:3, 3].double().numpy()
    tri = v[arrays["faces"].long().numpy()]
    rows, cols = np.mgrid[150:330:3, 230:420:3]
    d = np.stack([(cols + 0.5 - CX) / FX, (rows + 0.5 - CY) / FY, np.ones(rows.shape)], -1).reshape(-1, 1, 3)
    e1, e2 = tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]
    p = np.cross(d, e2)
    det = (p * e1).sum(-1)
    inv = 1.0 / np.where(np.abs(det) < 1e-15, np.nan, det)
    s = -tri[:, 0]
    bu = (s * p).sum(-1) * inv
    q = np.cross(s, e1)
    bv = (d * q).sum(-1) * inv
    dist = (e2 * q).sum(-1) * inv
    hit = (bu >= 0) & (bv >= 0) & (bu + bv <= 1) & (dist > 0)
    depth = np.where(hit, dist, np.inf).min(-1).reshape(rows.shape)
    edge = np.minimum(np.minimum(bu, bv), 1 - bu - bv)
    near_edge = (np.abs(np.where(hit, edge, 1.0)) < 1e-3).any(-1).reshape(rows.shape)
    got_mask = out.mask[0].numpy()[rows, cols]
    got_depth = out.depth[0].double().numpy()[rows, cols]
    assert np.isfinite(depth).sum() > 500
    ok = ~near_edge
    np.testing.assert_array_equal(got_mask[ok], np.isfinite(depth)[ok])
    np.testing.assert_allclose(got_depth[ok & got_mask], depth[ok & got_mask], atol=1e-6)
    assert (out.rgb >= 0).all() and (out.rgb <= 1).all()


@pytest.mark.slow
def test_batch_equals_single_renders_and_out_buffers_are_filled(renderer: CpuRasterizer) -> None:
    m = MeshTensors(**pillow_box_arrays())
    poses = torch.stack(
        [pose(rot("y", 30 * i) @ rot("x", 17 * i), (0.01 * i, -0.005 * i, 0.4 + 0.1 * i)) for i in range(3)]
    )
    f = torch.cat([crop_from_edges(200.0 - 10 * i, 150.0, 440.0 - 10 * i, 390.0) for i in range(3)])
    out = RenderOutput.empty(3, (S, S), "cpu")
    out.rgb.fill_(float("nan"))
    got = renderer.render(m, poses, K, (H, W), f, out=out)
    assert got.rgb is out.rgb and got.ready is None
    assert torch.isfinite(out.rgb).all()
    for i in range(3):
        single = renderer.render(m, poses[i : i + 1], K, (H, W), f[i : i + 1])
        torch.testing.assert_close(single.rgb[0], out.rgb[i], atol=0, rtol=0)
        torch.testing.assert_close(single.xyz_cam[0], out.xyz_cam[i], atol=0, rtol=0)
        assert torch.equal(single.mask[0], out.mask[i])
    empty = renderer.render(m, poses[:0], K, (H, W), f[:0])
    assert empty.rgb.shape == (0, S, S, 3)


@pytest.mark.slow
def test_small_budgets_give_identical_rasters_and_interpolate_twin_matches() -> None:
    m = pillow_box_arrays()
    t = pose(rot("y", 70) @ rot("x", 10), (0.0, 0.0, 0.35))[None]
    clip = vertices_to_clip(m["verts"], clip_from_centred(projection_from_K(K, (H, W)), t))
    big = rasterize(clip, m["faces"], (H, W))
    small = rasterize(clip, m["faces"], (H, W), fragment_budget=97, pair_budget=100)
    assert torch.equal(big, small)
    assert big[..., 3].unique().numel() > 200  # many triangles visible
    # The full-map interpolate twin reproduces the renderer's xyz (raster convention, before the flip).
    xyz = interpolate(vertices_in_cam(m["verts"], t), big, m["faces"])
    full = CpuRasterizer().render_full_frame(MeshTensors(**m), t, K, (H, W))
    assert torch.equal(xyz.flip(1), full.xyz_cam)
    assert torch.equal(big[..., 3].flip(1) > 0, full.mask)


def test_make_renderer_and_errors() -> None:
    assert isinstance(make_renderer("auto", "cpu"), CpuRasterizer)
    assert isinstance(make_renderer("cpu", "cpu"), CpuRasterizer)
    with pytest.raises(RenderError, match=r"needs a CUDA device"):
        make_renderer("nvdiffrast", "cpu")
    with pytest.raises(ValueError, match=r"^renderer name must be"):
        make_renderer("opengl", "cpu")
    m = MeshTensors(**pillow_box_arrays())
    r = CpuRasterizer()
    with pytest.raises(ValueError, match=r"^crop_from_img: expected \(2, 3, 3\)"):
        r.render(m, torch.eye(4).repeat(2, 1, 1), K, (H, W), torch.eye(3)[None])
    with pytest.raises(ValueError, match=r"^cam_from_centred: expected \(N, 4, 4\)"):
        r.render(m, torch.eye(4), K, (H, W), torch.eye(3)[None])
    out = render_full_frame(m, pose(np.eye(3), (0, 0, 0.5))[None], K, (H, W), renderer=r)
    assert out.mask.shape == (1, H, W) and out.mask.any()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("colour", ["texture", "vertex_colors", "uniform"])
def test_render_is_bit_identical_to_the_reference_flow(colour: str) -> None:
    from foundationpose.bench.render_parity import random_poses
    from foundationpose.crop import crop_windows

    arrays = pillow_box_arrays()
    if colour != "texture":
        arrays.update(uv=None, uv_faces=None, texture=None)
    if colour == "uniform":
        arrays.update(vertex_colors=None)
    m = MeshTensors(**arrays)
    poses = random_poses(5, seed=4)
    poses[0, 0, 3] += 0.35  # window partly outside the image
    crop_from_img = crop_windows(poses, K, 0.2, 1.2)
    want = render_crops_reference(m, poses, K, (H, W), crop_from_img)
    assert want.mask.sum() > 1000
    for chunk in (512, 2):  # one pass, and chunks with a remainder
        r = CpuRasterizer("cpu", RenderConfig(chunk_hypotheses=chunk))
        got = r.render(m, poses, K, (H, W), crop_from_img)
        assert _bits_equal(got.rgb, want.rgb) and _bits_equal(got.xyz_cam, want.xyz_cam) and torch.equal(got.mask, want.mask)
    # Into caller buffers that are views of larger ones (e.g. pool slots), every element overwritten.
    big = RenderOutput(torch.full((6, S, S, 3), float("nan")), torch.full((6, S, S, 3), 9.0), torch.ones(6, S, S, dtype=torch.bool))
    view = RenderOutput(big.rgb[1:], big.xyz_cam[1:], big.mask[1:])
    got = CpuRasterizer("cpu", RenderConfig(chunk_hypotheses=3)).render(m, poses, K, (H, W), crop_from_img, out=view)
    assert got.rgb.data_ptr() == big.rgb[1:].data_ptr()
    assert _bits_equal(big.rgb[1:], want.rgb) and _bits_equal(big.xyz_cam[1:], want.xyz_cam) and torch.equal(big.mask[1:], want.mask)
    assert torch.isnan(big.rgb[0]).all()


@pytest.mark.slow
def test_render_shared_flow_has_no_host_sync_or_literal_in_steady_state() -> None:
    """Without the backend's _draw, a render dispatches no .item(), nonzero, linalg error check or tensor literal
    (each a host sync on CUDA) once the constant caches are warm, and the same ops for 3 or 16 poses."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from foundationpose.bench.render_parity import random_poses
    from foundationpose.crop import crop_windows

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: Counter[str] = Counter()
            self.paused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if not self.paused:
                self.names[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    class CoreOnly(CpuRasterizer):
        ops: Ops | None = None

        def _draw(self, mesh, chunk, rgb, xyz, mask):  # noqa: ANN001, ANN202
            if self.ops is not None:
                self.ops.paused = True
            try:
                return super()._draw(mesh, chunk, rgb, xyz, mask)
            finally:
                if self.ops is not None:
                    self.ops.paused = False

    m = MeshTensors(**pillow_box_arrays())
    r = CoreOnly("cpu")
    totals = {}
    for n in (1, 3, 16):
        poses = random_poses(n, seed=5)
        crop_from_img = crop_windows(poses, K, 0.2, 1.2)
        out = RenderOutput.empty(n, (S, S), "cpu")
        r.render(m, poses, K, (H, W), crop_from_img, out=out)  # warm-up
        with Ops() as ops:
            r.ops = ops
            r.render(m, poses, K, (H, W), crop_from_img, out=out)
        r.ops = None
        forbidden = {"_local_scalar_dense", "_linalg_check_errors", "nonzero", "lift_fresh", "empty", "zeros"}
        assert not forbidden & set(ops.names), ops.names
        totals[n] = sum(ops.names.values())
    assert totals[3] == totals[16], totals


@pytest.mark.slow
def test_render_with_per_pose_k_equals_separate_renders(renderer: CpuRasterizer) -> None:
    from foundationpose.crop import crop_windows

    box = MeshTensors(**{k: torch.as_tensor(v) for k, v in pillow_box_arrays().items()})
    poses = torch.stack([pose(rot("x", 20.0 * i) @ rot("y", -15.0 * i), (0.01 * i, -0.01, 0.45 + 0.03 * i))
                         for i in range(4)])
    base = np.array([[300.0, 0.0, 160.0], [0.0, 310.0, 120.0], [0.0, 0.0, 1.0]])
    Ks = np.stack([base * np.array([[s], [s], [1.0]]) + np.array([[0, 0, 3.0 * i], [0, 0, -2.0 * i], [0, 0, 0]])
                   for i, s in enumerate((1.0, 1.2, 0.85, 1.0))])
    crops = crop_windows(poses, Ks, 0.2, 1.2)
    batched = renderer.render(box, poses, Ks, (240, 320), crops)
    for i in range(4):
        one = renderer.render(box, poses[i : i + 1], Ks[i], (240, 320), crops[i : i + 1])
        for field in ("rgb", "xyz_cam", "mask"):
            assert torch.equal(getattr(batched, field)[i], getattr(one, field)[0]), (i, field)
    assert bool(batched.mask.any(dim=(1, 2)).all())
    chunked = CpuRasterizer("cpu", RenderConfig(chunk_hypotheses=3)).render(box, poses, Ks, (240, 320), crops)
    assert torch.equal(chunked.rgb, batched.rgb) and torch.equal(chunked.xyz_cam, batched.xyz_cam)
    with pytest.raises(ValueError, match=r"K: expected \(3, 3\) or \(4, 3, 3\)"):
        renderer.render(box, poses, Ks[:2], (240, 320), crops)


def test_intrinsics_memo_off_renders_the_same_and_keeps_no_camera(renderer: CpuRasterizer) -> None:
    """RenderConfig(cache_intrinsics=False) (training: a new random K per sample) computes P per call, keeps
    nothing and never warns that its memo is full; the pixels are the memoised renderer's."""
    verts, faces = quad(0.06, 0.05)
    m = mesh(verts, faces)
    t = pose(rot("y", 25), (0.0, 0.01, 0.5))[None]
    off = make_renderer("cpu", "cpu", RenderConfig(cache_intrinsics=False))
    assert off.constants.intrinsics.max_entries == 0 and renderer.config.cache_intrinsics
    for dx in (0.0, 3.0):
        k = K.copy()
        k[0, 2] += dx
        got, want = off.render_full_frame(m, t, k, (H, W)), renderer.render_full_frame(m, t, k, (H, W))
        assert torch.equal(got.mask, want.mask) and torch.equal(got.xyz_cam, want.xyz_cam)
        assert torch.equal(got.rgb, want.rgb)
    assert len(off.constants.intrinsics) == 0 and len(renderer.constants.intrinsics) > 0
