"""Triton renderer (foundationpose/render/triton_raster.py) against its reference twin, the CPU rasteriser.

Three groups:
- kernels under the Triton interpreter on CPU tensors (needs ``triton``): parity with :class:`CpuRasterizer` on a
  12-face box, the procedural textured mesh, vertex colours and the uniform grey, full-frame renders, the
  three raster paths (inline, queued, queue overflow) giving identical images, buffers written in place
  (also the networks' NHWC layout, bit-equal to refine's composition), scratch reuse, chunking, error paths;
- an offline compile for sm_90 (needs triton's NVIDIA backend, no GPU): IEEE divisions, no FMA contraction,
  the int64 atomic min of the z-buffer;
- compiled kernels on CUDA against the CPU twin on the same GPU (needs a GPU; run by python tools/gpu_run.py cuda-tests).

Tolerances (measured with the interpreter on these scenes): the only arithmetic difference from the twin is
the vertex transform's summation order (a float32 rounding of clip and camera coordinates), so masks agree
exactly here (asserted IoU >= 0.999, at most 2 differing pixels per render for a sample that lands on an
edge), xyz within 1.2e-7 m (asserted 1e-6 m) and rgb within 4e-5 (the texture turns uv roundings into
colour; asserted 2e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.bench.render_parity import DEMO_HW, DEMO_K, compare_renders, random_poses
from foundationpose.crop import crop_windows
from foundationpose.errors import RenderError
from foundationpose.mesh import MeshTensors, load_object
from foundationpose.render import CpuRasterizer, RenderConfig, RenderOutput, make_renderer
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.pillow_box import pillow_box_arrays
from tests.foundationpose._triton import (
    missing_triton,
    raster_interpreter_problem,
    skip_without_ptx_compiler,
    triton_marks,
)

try:
    from foundationpose.render import _triton_raster_kernels as kernels
    from foundationpose.render import triton_raster
    from foundationpose.render.triton_raster import LaunchConfig, TritonRasterizer
except ImportError as exc:  # CPU CI without triton
    kernels = triton_raster = None
    _IMPORT_ERROR = missing_triton(exc)
else:
    _IMPORT_ERROR = ""

needs_interpreter, needs_cuda = triton_marks(kernels, _IMPORT_ERROR,
                                             problem_probe=raster_interpreter_problem)

S = 32  # small crops keep the interpreter fast
CFG = RenderConfig(crop_size_px=S)
XYZ_TOL_M = 1e-6
RGB_TOL = 2e-4
# Interpreter geometry variants: everything queued for the tiled kernel, everything inline.
ALL_QUEUED = LaunchConfig(block_triangles=1024, small_area=1, tile_h=32, tile_w=32, large_programs=2,
                          large_splits=2, block_pixels=4096) if kernels is not None else None
ALL_INLINE = LaunchConfig(block_triangles=1024, small_area=1 << 20, large_programs=1, large_splits=1,
                          block_pixels=512) if kernels is not None else None


def _box() -> tuple[MeshTensors, float]:
    arrays = pillow_box_arrays(subdivisions=1)  # 12 faces: a plain textured box
    return MeshTensors(**arrays), _diameter(arrays["verts"])


def _pillow(colour: str) -> tuple[MeshTensors, float]:
    arrays = pillow_box_arrays(subdivisions=3)  # 108 faces
    if colour != "texture":
        arrays.update(uv=None, uv_faces=None, texture=None)
    if colour == "uniform":
        arrays["vertex_colors"] = None
    return MeshTensors(**arrays), _diameter(arrays["verts"])


def _procedural() -> tuple[MeshTensors, float]:
    obj = load_object(make_procedural_mesh("textured_asym"))
    return obj.tensors, obj.diameter


def _diameter(verts: torch.Tensor) -> float:
    v = verts.double()
    return float(torch.cdist(v, v).max())


MESHES = {
    "box": _box,
    "procedural_textured": _procedural,
    "vertex_colours": lambda: _pillow("vertex_colors"),
    "uniform": lambda: _pillow("uniform"),
}


def _scene(n: int, seed: int, diameter: float) -> tuple[torch.Tensor, torch.Tensor]:
    poses = random_poses(n, seed)
    return poses, crop_windows(poses, DEMO_K, diameter, 1.2, S=S)


def _assert_matches_twin(got: RenderOutput, ref: RenderOutput, *, min_covered: int, stat: str = "max") -> None:
    """stat: which error statistic must meet the tolerance ("max" on CPU; "p99" on CUDA, where cuBLAS's FMAs in
    the twin's vertex transform move a few grazing-angle pixels more)."""
    report = compare_renders(got, ref)
    n = got.mask.shape[0]
    assert report["mask"]["covered_px"] >= min_covered  # the scene really renders something
    assert report["mask"]["iou"] >= 0.999 and report["mask"]["mismatch_px"] <= 2 * n, report["mask"]
    assert report["xyz_m"][stat] <= XYZ_TOL_M and report["xyz_m"]["mean"] <= XYZ_TOL_M / 10, report["xyz_m"]
    assert report["rgb"][stat] <= RGB_TOL and report["rgb"]["mean"] <= RGB_TOL / 10, report["rgb"]
    assert report["background_zero"]
    assert not got.xyz_cam[~got.mask].any()  # background xyz 0


def _assert_identical(a: RenderOutput, b: RenderOutput) -> None:
    assert torch.equal(a.mask, b.mask)
    assert torch.equal(a.rgb, b.rgb)
    assert torch.equal(a.xyz_cam, b.xyz_cam)


@pytest.fixture(scope="module")
def renderer():  # noqa: ANN201
    return TritonRasterizer("cpu", CFG)


def _twin(triton_renderer, config: RenderConfig = CFG) -> CpuRasterizer:  # noqa: ANN001
    """The CPU rasteriser on the Triton renderer's device, fed the same crop bounds (the closed-form inverse:
    bit-equal to the LU one on the CPU for crop windows; on CUDA the LU may round differently)."""

    class SameBounds(CpuRasterizer):
        def _crop_bounds(self, crop_from_img: torch.Tensor, crop_size_px: int) -> torch.Tensor:
            return triton_renderer._crop_bounds(crop_from_img, crop_size_px)

    return SameBounds(triton_renderer.device, config)


# ----------------------------------------------------------------------------------------------
# Interpreter: parity with the CPU rasteriser
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_crops_match_the_cpu_rasteriser(renderer, mesh_name: str) -> None:  # noqa: ANN001
    mesh, diameter = MESHES[mesh_name]()
    poses, crops = _scene(3, seed=7, diameter=diameter)
    got = renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    ref = CpuRasterizer("cpu", CFG).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    assert got.ready is None  # CPU: enqueued inline, nothing to wait for
    _assert_matches_twin(got, ref, min_covered=300)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("exact", [False, True])
def test_full_frame_matches_the_cpu_rasteriser(renderer, exact: bool) -> None:  # noqa: ANN001
    mesh, _ = _procedural()
    hw = (40, 56)
    K = DEMO_K.copy()
    K[:2] *= 56 / DEMO_HW[1]
    poses = random_poses(2, seed=3)
    poses[:, :3, 3] = torch.tensor([0.01, -0.01, 0.2])  # object near the centre, filling the view: large triangles
    got = renderer.render_full_frame(mesh, poses, K, hw, pixel_centre_exact=exact)
    ref = CpuRasterizer("cpu", CFG).render_full_frame(mesh, poses, K, hw, pixel_centre_exact=exact)
    assert got.mask.shape == (2, *hw)
    _assert_matches_twin(got, ref, min_covered=100)


@pytest.mark.slow
@needs_interpreter
def test_inline_queued_and_overflowing_paths_give_identical_images(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, diameter = _procedural()
    poses, crops = _scene(2, seed=11, diameter=diameter)
    default = TritonRasterizer("cpu", CFG).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    queued = TritonRasterizer("cpu", CFG, launch=ALL_QUEUED).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    inline = TritonRasterizer("cpu", CFG, launch=ALL_INLINE).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    monkeypatch.setattr(triton_raster, "_QUEUE_MAX", 3)  # the rest of the large triangles are drawn inline
    tiny_queue = TritonRasterizer("cpu", CFG, launch=ALL_QUEUED)
    overflow = tiny_queue.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    (scratch,) = tiny_queue._scratch.values()
    assert scratch.queue_capacity == 3
    for other in (queued, inline, overflow):
        _assert_identical(other, default)  # atomic min: the winner does not depend on the drawing order


@needs_interpreter
def test_ties_go_to_the_lowest_face_like_the_twin(renderer) -> None:  # noqa: ANN001
    # Two coincident quads with different vertex colours: equal z/w everywhere, the lowest face index wins.
    verts = np.array([[-0.05, -0.05, 0], [0.05, -0.05, 0], [0.05, 0.05, 0], [-0.05, 0.05, 0]] * 2, np.float32)
    faces = np.array([[0, 2, 1], [0, 3, 2], [4, 6, 5], [4, 7, 6]], np.int32)
    colours = np.array([[0.9, 0.1, 0.1]] * 4 + [[0.1, 0.1, 0.9]] * 4, np.float32)
    v = torch.from_numpy(verts)
    normals = torch.tensor([[0.0, 0.0, -1.0]] * 8)
    mesh = MeshTensors(verts=v, faces=torch.from_numpy(faces), normals=normals, vertex_colors=torch.from_numpy(colours))
    pose = torch.eye(4)[None].clone()
    pose[0, 2, 3] = 0.5
    crops = crop_windows(pose, DEMO_K, 0.1, 1.2, S=S)
    got = renderer.render(mesh, pose, DEMO_K, DEMO_HW, crops)
    ref = CpuRasterizer("cpu", CFG).render(mesh, pose, DEMO_K, DEMO_HW, crops)
    assert got.mask.sum() > 200
    _assert_identical(got, ref)
    red = got.rgb[got.mask]
    assert (red[:, 0] > red[:, 2]).all()  # the first quad (faces 0, 1) everywhere


# ----------------------------------------------------------------------------------------------
# Interpreter: buffers, scratch, chunks
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_interpreter
def test_outputs_written_into_the_callers_buffers_through_strides(renderer) -> None:  # noqa: ANN001
    mesh, diameter = _box()
    poses, crops = _scene(2, seed=5, diameter=diameter)
    fresh = renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    out = RenderOutput(
        rgb=torch.full((2, S, S, 3), float("nan")),
        xyz_cam=torch.full((2, S, S, 3), 7.0),
        mask=torch.ones((2, S, S), dtype=torch.bool),
    )
    ptrs = [out.rgb.data_ptr(), out.xyz_cam.data_ptr(), out.mask.data_ptr()]
    got = renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops, out=out)
    assert [got.rgb.data_ptr(), got.xyz_cam.data_ptr(), got.mask.data_ptr()] == ptrs
    _assert_identical(got, fresh)
    # Channels-first network-style buffers (N, 6, S, S): rgb and xyz written as strided (N, S, S, 3) views.
    planes = torch.full((2, 6, S, S), -1.0)
    mask_t = torch.zeros((2, S, S), dtype=torch.bool).transpose(1, 2)  # non-contiguous mask view
    views = RenderOutput(rgb=planes[:, :3].permute(0, 2, 3, 1), xyz_cam=planes[:, 3:].permute(0, 2, 3, 1), mask=mask_t)
    renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops, out=views)
    assert torch.equal(planes[:, :3], fresh.rgb.permute(0, 3, 1, 2))
    assert torch.equal(planes[:, 3:], fresh.xyz_cam.permute(0, 3, 1, 2))
    assert torch.equal(mask_t, fresh.mask)
    # The networks' NHWC (N, S, S, 6) input buffer, channels R G B X Y Z: rgb and raw xyz land in place.
    nhwc = torch.full((2, S, S, 6), -1.0)
    renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops, out=RenderOutput(nhwc[..., :3], nhwc[..., 3:], mask_t))
    assert torch.equal(nhwc, torch.cat([fresh.rgb, fresh.xyz_cam], dim=-1))


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("invalid_z", [0.001, 0.1])  # refiner, scorer
def test_network_input_layout_equals_refines_composition(renderer, invalid_z: float) -> None:  # noqa: ANN001
    from foundationpose.network_inputs import normalize_xyz, rgb_to_unit

    mesh, diameter = _procedural()
    poses, crops = _scene(2, seed=13, diameter=diameter)
    poses[1, 2, 3] = 0.6  # xyz far from t clips at |x'| >= 2 only with a small diameter: use both branches
    crops = crop_windows(poses, DEMO_K, diameter, 1.2, S=S)
    rendered = renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    expected = torch.empty((2, S, S, 6))
    rgb_to_unit(rendered.rgb * 255.0, out=expected[..., :3])  # what refine.py builds from a render
    normalize_xyz(rendered.xyz_cam, poses[:, :3, 3], diameter * 0.3, invalid_z, out=expected[..., 3:])
    buffer = torch.full((2, S, S, 6), float("nan"))
    mask = torch.zeros((2, S, S), dtype=torch.bool)
    got = renderer.render_network_input(
        mesh, poses, DEMO_K, DEMO_HW, crops, buffer, mask, diameter=diameter * 0.3, invalid_z=invalid_z
    )
    assert got.rgb.data_ptr() == buffer.data_ptr() and torch.equal(mask, rendered.mask)
    assert (expected[..., 3:][rendered.mask] == 0).any() and (expected[..., 3:] != 0).any()  # clipping exercised
    assert torch.equal(buffer, expected)  # bit-identical: the same float32 operations
    plain = renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)  # the epilogue does not leak into later renders
    _assert_identical(plain, rendered)
    with pytest.raises(ValueError, match=r"network_input: expected \(N, S, S, 6\)"):
        renderer.render_network_input(
            mesh, poses, DEMO_K, DEMO_HW, crops, buffer[..., :3], mask, diameter=diameter, invalid_z=invalid_z
        )


@pytest.mark.slow
@needs_interpreter
def test_scratch_is_allocated_once_per_capacity_and_left_clean() -> None:
    mesh, diameter = _box()
    r = TritonRasterizer("cpu", CFG)
    poses_a, crops_a = _scene(3, seed=1, diameter=diameter)
    poses_b, crops_b = _scene(3, seed=2, diameter=diameter)
    r.render(mesh, poses_a, DEMO_K, DEMO_HW, crops_a)
    (scratch,) = r._scratch.values()
    ptr = scratch.zbuf.data_ptr()
    assert scratch.zbuf.numel() == 4 * S * S  # capacity: 3 rounded up to 4
    assert (scratch.zbuf == kernels.EMPTY_KEY.value).all() and scratch.count.item() == 0
    second = r.render(mesh, poses_b, DEMO_K, DEMO_HW, crops_b)
    r.render(mesh, poses_b[:1], DEMO_K, DEMO_HW, crops_b[:1])  # capacity 1: a second scratch
    assert len(r._scratch) == 2 and scratch.zbuf.data_ptr() == ptr
    assert (scratch.zbuf == kernels.EMPTY_KEY.value).all() and scratch.count.item() == 0
    _assert_identical(second, TritonRasterizer("cpu", CFG).render(mesh, poses_b, DEMO_K, DEMO_HW, crops_b))


@pytest.mark.slow
@needs_interpreter
def test_chunked_render_equals_one_pass() -> None:
    mesh, diameter = _box()
    poses, crops = _scene(3, seed=9, diameter=diameter)
    whole = TritonRasterizer("cpu", CFG).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    chunked_cfg = RenderConfig(crop_size_px=S, chunk_hypotheses=2)
    chunked = TritonRasterizer("cpu", chunked_cfg).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    _assert_identical(chunked, whole)
    per_k = TritonRasterizer("cpu", CFG).render(mesh, poses, np.stack([DEMO_K] * 3), DEMO_HW, crops)
    _assert_identical(per_k, whole)  # a host stack of equal K is the (3, 3) path


# ----------------------------------------------------------------------------------------------
# Interpreter: factory and error paths
# ----------------------------------------------------------------------------------------------


@needs_interpreter
def test_make_renderer_builds_triton_on_request_and_auto_keeps_the_cpu_reference_on_a_cpu() -> None:
    assert isinstance(make_renderer("triton", "cpu", CFG), TritonRasterizer)
    assert isinstance(make_renderer("auto", "cpu"), CpuRasterizer)  # on a CPU device auto is the reference
    with pytest.raises(ValueError, match=r"^renderer name must be one of auto, cpu, nvdiffrast, triton"):
        make_renderer("opengl", "cpu")


@needs_interpreter
def test_closed_form_crop_bounds_match_the_lu_inverse(renderer) -> None:  # noqa: ANN001
    from foundationpose.render.projection import crop_bounds

    windows = crop_windows(random_poses(64, seed=0), DEMO_K, 0.14, 1.2)  # the renderers' crops: scale + shift
    # within an ulp of the LU's: LAPACK rounds the shifts as c / a on some CPUs, as c * (1 / a) on others
    torch.testing.assert_close(renderer._crop_bounds(windows, 160), crop_bounds(windows, 160), rtol=3e-7, atol=0.0)
    general = torch.randn(16, 3, 3, generator=torch.Generator().manual_seed(0))
    general[:, 2] = torch.tensor([0.0, 0.0, 1.0])  # any affine map: adjugate / determinant
    ref = crop_bounds(general, 160)
    torch.testing.assert_close(renderer._crop_bounds(general, 160), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_missing_triton_is_a_render_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import foundationpose.render
    from foundationpose.render import triton_raster as module

    monkeypatch.setitem(sys.modules, "foundationpose.render._triton_raster_kernels", None)  # import fails
    monkeypatch.delattr(foundationpose.render, "_triton_raster_kernels", raising=False)
    assert not module.has_triton()
    with pytest.raises(RenderError, match=r"needs the triton package"):
        module.TritonRasterizer("cpu")


@needs_interpreter
def test_bad_inputs_are_rejected_before_any_launch(renderer) -> None:  # noqa: ANN001
    mesh, diameter = _box()
    poses, crops = _scene(2, seed=4, diameter=diameter)
    with pytest.raises(ValueError, match=r"cam_from_centred: expected \(N, 4, 4\)"):
        renderer.render(mesh, poses[:, :3], DEMO_K, DEMO_HW, crops)
    with pytest.raises(ValueError, match=r"crop_from_img: expected \(2, 3, 3\)"):
        renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops[:1])
    with pytest.raises(ValueError, match=r"K: expected \(3, 3\) or \(2, 3, 3\)"):
        renderer.render(mesh, poses, DEMO_K[:2], DEMO_HW, crops)
    bad_out = RenderOutput.empty(2, (S + 1, S), "cpu")
    with pytest.raises(ValueError, match=r"out.rgb: expected \(2, 32, 32, 3\)"):
        renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops, out=bad_out)
    meta_out = RenderOutput.empty(2, (S, S), "meta")
    with pytest.raises(ValueError, match=r"out.rgb: expected a tensor on cpu; got one on meta"):
        renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops, out=meta_out)
    with pytest.raises(ValueError, match=r"mesh: tensors are on meta but the renderer runs on cpu"):
        renderer.render(mesh.to("meta"), poses, DEMO_K, DEMO_HW, crops)
    with pytest.raises(ValueError, match=r"pass either stream or use_caller_stream"):
        TritonRasterizer("cpu", stream=object(), use_caller_stream=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_pixels must be a power of two, got 100"):
        LaunchConfig(block_pixels=100)
    empty = renderer.render(mesh, poses[:0], DEMO_K, DEMO_HW, crops[:0])
    assert empty.mask.shape == (0, S, S)


# ----------------------------------------------------------------------------------------------
# Offline compile for sm_90 (no GPU needed)
# ----------------------------------------------------------------------------------------------


def _compile_ptx(kernel, signature: dict, constexprs: dict) -> str:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": 4, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


_POINTER_TYPES = {"faces_ptr": "*i32", "colour_faces_ptr": "*i32", "queue_ptr": "*i32", "count_ptr": "*i32",
                  "zbuf_ptr": "*i64", "mask_ptr": "*u8"}  # every other pointer is *fp32
# the mesh group's tables: the launcher passes the faces (int32) in their place for a single mesh (GROUPED=False)
_GROUP_TABLES = ("row_mesh_ptr", "face_start_ptr", "face_count_ptr", "albedo_ptr", "vertex_colour_ptr",
                 "tex_offset_ptr", "tex_h_ptr", "tex_w_ptr")
_GROUP_POINTER_TYPES = {"row_mesh_ptr": "*i64", "face_start_ptr": "*i32", "face_count_ptr": "*i32",
                        "albedo_ptr": "*i32", "vertex_colour_ptr": "*fp32", "tex_offset_ptr": "*i64",
                        "tex_h_ptr": "*i32", "tex_w_ptr": "*i32"}
_FLOAT_ARGS = {"xs", "xo", "ys", "yo", "uniform_albedo", "ambient_weight", "diffuse_weight", "last",
               "rgb_unit_scale", "xyz_scale", "invalid_z", "xyz_clip"}


def _signature(kernel, meta: dict, ints_equal_to_one: bool, grouped: bool = False) -> tuple[dict, dict]:  # noqa: ANN001
    """Signature of a kernel as the launcher builds it. With ``ints_equal_to_one`` every integer argument is 1,
    which triton specialises into a constexpr (so ``arg.to(...)`` would fail to compile). ``grouped``: the mesh
    group's tables are passed (their own types; GROUPED=True where the kernel takes it), else the faces stand in."""
    import inspect

    signature, constexprs = {}, dict(meta)
    for name in inspect.signature(kernel.fn).parameters:
        if name in meta:
            signature[name] = "constexpr"
        elif name in _GROUP_TABLES:
            signature[name] = _GROUP_POINTER_TYPES[name] if grouped else "*i32"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER_TYPES.get(name, "*fp32")
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        elif ints_equal_to_one:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
    return signature, constexprs


@pytest.mark.slow
@pytest.mark.skipif(kernels is None, reason=_IMPORT_ERROR or "")
def test_kernels_compile_for_sm90_with_ieee_division_and_int64_atomics(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    skip_without_ptx_compiler(triton_raster._is_interpreted(kernels.RESOLVE_KERNELS[0]))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launch = LaunchConfig()
    cases = {
        "small": (kernels.RASTER_SMALL_KERNELS[0],
                  {"HAS_CROP": True, "SMALL_AREA": launch.small_area, "BLOCK_T": launch.block_triangles}),
        "large": (kernels.RASTER_LARGE_KERNELS[0], {"HAS_CROP": False, "TILE_H": launch.tile_h, "TILE_W": launch.tile_w}),
        "resolve": (kernels.RESOLVE_KERNELS[0],
                    {"HAS_CROP": True, "ALBEDO": 2, "NETWORK_INPUT": False, "BLOCK_P": launch.block_pixels}),
        "network": (kernels.RESOLVE_KERNELS[0],
                    {"HAS_CROP": True, "ALBEDO": 1, "NETWORK_INPUT": True, "BLOCK_P": launch.block_pixels}),
        "bounds": (kernels.CROP_BOUNDS_KERNELS[0], {"BLOCK": 128}),
    }
    for name in ("small", "resolve", "network"):  # these take GROUPED; the large kernel reads the tables always
        kernel, meta = cases[name]
        cases[name] = (kernel, {**meta, "GROUPED": False})
    ptx = {}
    for name, (kernel, meta) in cases.items():
        ptx[name] = _compile_ptx(kernel, *_signature(kernel, meta, ints_equal_to_one=False))
        _compile_ptx(kernel, *_signature(kernel, meta, ints_equal_to_one=True))  # 1 x 1 textures, unit strides
        if name != "bounds":  # a mesh group's rows: its tables
            grouped = {**meta, "GROUPED": True} if "GROUPED" in meta else meta
            ptx[f"{name}_grouped"] = _compile_ptx(kernel, *_signature(kernel, grouped, False, grouped=True))
    resolve, resolve_meta = cases["resolve"]
    for albedo in (0, 1):  # uniform grey, vertex colours
        _compile_ptx(resolve, *_signature(resolve, {**resolve_meta, "ALBEDO": albedo}, ints_equal_to_one=False))
    for text in ptx.values():
        assert "div.full" not in text and "div.approx" not in text and "fma.rn.f32" not in text
        assert "div.rn.f32" in text
    for name in ("small", "large", "small_grouped", "large_grouped"):
        assert "global.gpu.relaxed.min.s64" in ptx[name]  # the z-buffer's int64 atomic min (red or atom)
    assert "atom.global.gpu.relaxed.add" in ptx["small"]  # the queue counter (its old value is used)
    assert "sqrt.rn.f32" in ptx["resolve"]


# ----------------------------------------------------------------------------------------------
# CUDA: compiled kernels vs the CPU twin on the same GPU (python tools/gpu_run.py cuda-tests)
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mesh_name", ["box", "procedural_textured", "vertex_colours"])
def test_cuda_crops_match_the_cpu_rasteriser(mesh_name: str) -> None:
    mesh, diameter = MESHES[mesh_name]()
    mesh = mesh.to("cuda")
    cfg = RenderConfig()  # S = 160
    poses = random_poses(16, seed=21).cuda()
    crops = crop_windows(poses, DEMO_K, diameter, 1.2)
    r = TritonRasterizer("cuda", cfg)
    got = r.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    assert got.ready is not None
    ref = _twin(r, cfg).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    torch.cuda.synchronize()
    _assert_matches_twin(got, ref, min_covered=16 * 1000, stat="p99")
    again = r.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    torch.cuda.synchronize()
    _assert_identical(again, got)  # scratch left clean, deterministic


@needs_cuda
@pytest.mark.cuda
def test_cuda_paths_and_caller_stream_give_identical_images() -> None:
    mesh, diameter = _procedural()
    mesh = mesh.to("cuda")
    poses = random_poses(8, seed=2).cuda()
    crops = crop_windows(poses, DEMO_K, diameter, 1.2)
    default = TritonRasterizer("cuda").render(mesh, poses, DEMO_K, DEMO_HW, crops)
    queued = TritonRasterizer("cuda", launch=LaunchConfig(small_area=1)).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    inline = TritonRasterizer("cuda", launch=LaunchConfig(small_area=1 << 20)).render(
        mesh, poses, DEMO_K, DEMO_HW, crops
    )
    caller = TritonRasterizer("cuda", use_caller_stream=True).render(mesh, poses, DEMO_K, DEMO_HW, crops)
    assert caller.ready is None
    torch.cuda.synchronize()
    for other in (queued, inline, caller):
        _assert_identical(other, default)


@needs_cuda
@pytest.mark.cuda
def test_cuda_network_input_layout_equals_refines_composition() -> None:
    from foundationpose.network_inputs import REFINE_INVALID_Z, normalize_xyz, rgb_to_unit

    mesh, diameter = _procedural()
    mesh = mesh.to("cuda")
    poses = random_poses(8, seed=4).cuda()
    crops = crop_windows(poses, DEMO_K, diameter, 1.2)
    r = TritonRasterizer("cuda")
    rendered = r.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    expected = torch.empty((8, 160, 160, 6), device="cuda")
    rgb_to_unit(rendered.rgb * 255.0, out=expected[..., :3])
    normalize_xyz(rendered.xyz_cam, poses[:, :3, 3], diameter, REFINE_INVALID_Z, out=expected[..., 3:])
    buffer = torch.full_like(expected, float("nan"))
    mask = torch.zeros((8, 160, 160), dtype=torch.bool, device="cuda")
    r.render_network_input(
        mesh, poses, DEMO_K, DEMO_HW, crops, buffer, mask, diameter=diameter, invalid_z=REFINE_INVALID_Z
    )
    torch.cuda.synchronize()
    assert torch.equal(buffer, expected) and torch.equal(mask, rendered.mask)


@pytest.mark.slow
@needs_interpreter
def test_steady_state_render_has_no_host_sync_and_no_tensor_literal(renderer) -> None:  # noqa: ANN001
    """The render is captured inside whole track steps: after a warm-up (scratch, constants), a render may not
    copy host values to the device (a CUDA graph capture refuses it) nor synchronise."""
    from tests.foundationpose.test_no_host_sync import FORBIDDEN, Probe

    mesh, diameter = _procedural()
    poses, crops = _scene(2, seed=3, diameter=diameter)
    renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)  # warm-up
    with Probe() as probe:
        renderer.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    assert sum(probe.ops.values()) > 0
    assert not (set(probe.ops) & FORBIDDEN), {k: probe.ops[k] for k in set(probe.ops) & FORBIDDEN}
