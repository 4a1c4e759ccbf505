"""Triton depth filters (foundationpose/sampling/_depth_filters_triton.py) against the torch reference.

Three groups:
- dispatch (no triton needed);
- kernels under the Triton interpreter on CPU tensors (needs ``triton``; the interpreter evaluates the
  bilateral weight's exp in float64 and rounds once, like the naive reference, so results are exact);
- compiled kernels on CUDA vs the torch reference on CUDA (needs a GPU), plus an offline compile for
  sm_90 that checks the generated PTX for approximate division and FMA contraction (needs triton's
  NVIDIA backend, no GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.bench.filters import K_BENCH, synthetic_depth
from foundationpose.observation import filter_and_backproject_stacked, prepare_frame
from foundationpose.sampling import depth_filters, depth_to_xyz
from foundationpose.sampling.depth_filters import (
    bilateral_filter_depth,
    erode_depth,
    filter_depth_and_backproject,
)
from tests.foundationpose._triton import import_kernels, skip_without_ptx_compiler, triton_marks
from tests.foundationpose.test_depth_filters import naive_bilateral, naive_erode, random_depth

kernels, _IMPORT_ERROR = import_kernels("foundationpose.sampling._depth_filters_triton")

needs_interpreter, needs_cuda = triton_marks(kernels, _IMPORT_ERROR)
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def test_auto_on_cpu_never_touches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden():
        raise AssertionError("triton probed for a CPU tensor")

    monkeypatch.setattr(depth_filters, "_triton_filters", forbidden)
    depth = torch.from_numpy(random_depth(0))
    np.testing.assert_array_equal(erode_depth(depth).numpy(), naive_erode(random_depth(0)))
    bilateral_filter_depth(depth)
    filter_depth_and_backproject(depth, K_BENCH)
    prepare_frame(np.zeros((*depth.shape, 3), np.uint8), depth, K_BENCH, "cpu", xyz_float64=False)


def test_impl_triton_without_triton_raises_and_bad_impl_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(depth_filters, "_triton_filters", lambda: None)
    depth = torch.zeros(4, 5)
    with pytest.raises(RuntimeError, match="triton"):
        erode_depth(depth, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        bilateral_filter_depth(depth, impl="cuda")  # type: ignore[arg-type]
    assert torch.equal(erode_depth(depth, impl="torch"), depth)  # explicit torch never probes triton


@needs_interpreter
def test_impl_argument_selects_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frame builders pass their ``impl`` through to the kernels ("auto" picks them on CUDA)."""
    calls = []
    real = kernels.erode_depth_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "erode_depth_triton", spy)
    depth = torch.from_numpy(random_depth(1, 12, 16))
    rgb = torch.zeros((*depth.shape, 3), dtype=torch.uint8)
    frame = prepare_frame(rgb, depth, K_BENCH, "cpu", xyz_float64=False, impl="triton")
    assert len(calls) == 1
    reference = prepare_frame(rgb, depth, K_BENCH, "cpu", xyz_float64=False, impl="torch")
    assert len(calls) == 1 and torch.equal(frame.xyz_cam, reference.xyz_cam)
    batch = filter_and_backproject_stacked(rgb[None], depth[None], [K_BENCH], impl="triton")
    assert len(calls) == 2 and torch.equal(batch.xyz_cam[0], reference.xyz_cam)


# ----------------------------------------------------------------------------------------------
# Kernels under the interpreter (CPU tensors)
# ----------------------------------------------------------------------------------------------

SMALL_TILE = None if kernels is None else kernels.TileConfig(block_h=8, block_w=16, num_warps=1)


@needs_interpreter
@pytest.mark.parametrize("seed", range(3))
def test_interpreter_erode_exact(seed: int) -> None:
    depth = random_depth(seed, 21, 37)  # not a multiple of any tile
    expected = naive_erode(depth)
    got = erode_depth(torch.from_numpy(depth), impl="triton").numpy()
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.float32 and got.shape == depth.shape
    # Many small tiles: every window crosses tile borders somewhere.
    tiled = kernels.erode_depth_triton(torch.from_numpy(depth)[None], 2, 0.001, 0.8, 100.0, 0.001, SMALL_TILE)
    np.testing.assert_array_equal(tiled[0].numpy(), expected)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("seed", range(3))
def test_interpreter_bilateral_exact(seed: int) -> None:
    eroded = naive_erode(random_depth(seed, 21, 37))
    expected = naive_bilateral(eroded)
    got = bilateral_filter_depth(torch.from_numpy(eroded), impl="triton").numpy()
    # Same float32 operations in the same order, exp correctly rounded on both sides: bit-exact.
    np.testing.assert_array_equal(got, expected)
    reference = bilateral_filter_depth(torch.from_numpy(eroded), impl="torch").numpy()
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-6)
    tiled, xyz = kernels.bilateral_filter_depth_triton(
        torch.from_numpy(eroded)[None], 2, 2.0, 1e5, 100.0, 0.001, 0.01, tile=SMALL_TILE
    )
    assert xyz is None
    np.testing.assert_array_equal(tiled[0].numpy(), expected)


@needs_interpreter
def test_interpreter_batch_and_shapes() -> None:
    depths = torch.from_numpy(np.stack([random_depth(s, 13, 18) for s in range(3)]))
    eroded = erode_depth(depths, impl="triton")
    smoothed = bilateral_filter_depth(eroded, impl="triton")
    assert eroded.shape == smoothed.shape == (3, 13, 18)
    for i in range(3):
        assert torch.equal(eroded[i], erode_depth(depths[i], impl="torch"))
        assert torch.equal(smoothed[i], bilateral_filter_depth(eroded[i], impl="torch"))
        assert torch.equal(erode_depth(depths[i], impl="triton"), eroded[i])  # (H, W) in -> (H, W) out
    # Non-contiguous input (a transposed view) is handled.
    view = depths[0].t()
    assert torch.equal(erode_depth(view, impl="triton"), erode_depth(view.contiguous(), impl="torch"))


@pytest.mark.slow
@needs_interpreter
def test_interpreter_boundaries_and_degenerate_images() -> None:
    # 20 bad of 25 is not > 0.8 (kept), 21 is (eroded).
    depth = np.full((5, 5), 1.0, dtype=np.float32)
    ring = [(r, c) for r in range(5) for c in range(5) if (r, c) != (2, 2)]
    for r, c in ring[:20]:
        depth[r, c] = 2.0
    assert erode_depth(torch.from_numpy(depth), impl="triton")[2, 2].item() == 1.0
    depth[ring[20]] = 2.0
    assert erode_depth(torch.from_numpy(depth), impl="triton")[2, 2].item() == 0.0
    # Corner window has 9 in-image pixels: 2 good of 9 keeps the pixel.
    corner = np.zeros((6, 7), dtype=np.float32)
    corner[0, 0] = corner[0, 1] = 1.0
    out = erode_depth(torch.from_numpy(corner), impl="triton").numpy()
    assert out[0, 0] == 1.0 and out[0, 1] == 0.0
    # All holes / all beyond zfar -> all zero; tiny images.
    for image in (
        np.zeros((6, 6), np.float32),
        np.full((6, 6), 150.0, np.float32),
        np.full((1, 1), 0.8, np.float32),
    ):
        t = torch.from_numpy(image)
        assert torch.equal(bilateral_filter_depth(t, impl="triton"), bilateral_filter_depth(t, impl="torch"))
        assert torch.equal(erode_depth(t, impl="triton"), erode_depth(t, impl="torch"))
    # A plane with holes: filled, exactly as the naive loop.
    plane = np.full((9, 10), F32(0.75), dtype=np.float32)
    plane[4, 5] = plane[0, 0] = 0.0
    np.testing.assert_array_equal(
        bilateral_filter_depth(torch.from_numpy(plane), impl="triton").numpy(), naive_bilateral(plane)
    )


@needs_interpreter
@pytest.mark.parametrize("radius", [1, 3])
def test_interpreter_other_radii(radius: int) -> None:
    depth = random_depth(7)
    eroded = erode_depth(torch.from_numpy(depth), radius=radius, impl="triton").numpy()
    np.testing.assert_array_equal(eroded, naive_erode(depth, radius=radius))
    smoothed = bilateral_filter_depth(torch.from_numpy(eroded), radius=radius, sigma_d=1.5, impl="triton")
    np.testing.assert_array_equal(smoothed.numpy(), naive_bilateral(eroded, radius=radius, sigma_d=1.5))


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("xyz_float64", [False, True])
def test_interpreter_fused_backprojection_exact(xyz_float64: bool) -> None:
    depth = synthetic_depth(2, 24, 40, seed=5)
    ref_depth, ref_xyz = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=xyz_float64, impl="torch")
    got_depth, got_xyz = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=xyz_float64, impl="triton")
    assert got_xyz.shape == (2, 24, 40, 3) and got_xyz.dtype == torch.float32
    assert torch.equal(got_depth, ref_depth)
    assert torch.equal(got_xyz, ref_xyz)
    assert torch.equal(ref_xyz, depth_to_xyz(ref_depth, K_BENCH, float64=xyz_float64))
    assert (ref_depth == 0).any() and not got_xyz[ref_depth == 0].any()
    # The xyz validity threshold is applied to the filtered depth (float32 comparison).
    threshold = float(ref_depth[ref_depth > 0].median())
    _, got_cut = filter_depth_and_backproject(
        depth, K_BENCH, xyz_float64=xyz_float64, min_depth=threshold, impl="triton"
    )
    assert torch.equal(got_cut, depth_to_xyz(ref_depth, K_BENCH, min_depth=threshold, float64=xyz_float64))
    assert not got_cut[(ref_depth > 0) & (ref_depth < F32(threshold))].any()
    # K as a float32 tensor; (H, W) input.
    K32 = torch.from_numpy(K_BENCH.astype(np.float32))
    one_ref = filter_depth_and_backproject(depth[1], K32, xyz_float64=xyz_float64, impl="torch")
    one_got = filter_depth_and_backproject(depth[1], K32, xyz_float64=xyz_float64, impl="triton")
    assert one_got[1].shape == (24, 40, 3)
    assert torch.equal(one_got[0], one_ref[0]) and torch.equal(one_got[1], one_ref[1])


@needs_interpreter
def test_interpreter_fused_backprojection_reads_k_from_the_owner_memo() -> None:
    from foundationpose.render._cache import GeometryConstants

    c = GeometryConstants(name="test")
    depth = synthetic_depth(1, 12, 16, seed=3)
    want = filter_depth_and_backproject(depth, K_BENCH, impl="triton")
    for _ in range(2):
        got = filter_depth_and_backproject(depth, K_BENCH, impl="triton", constants=c)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(c.intrinsics) == 1  # one upload of this camera's K


# ----------------------------------------------------------------------------------------------
# Generated code (offline compile for sm_90; no GPU needed)
# ----------------------------------------------------------------------------------------------


def _compile_ptx(kernel, signature: dict, constexprs: dict, options: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _count(ptx: str, opcode: str) -> int:
    return sum(1 for line in ptx.splitlines() if line.strip().split(" ")[0].split("\t")[0] == opcode)


@pytest.mark.slow
@pytest.mark.skipif(kernels is None, reason=_IMPORT_ERROR or "")
def test_generated_ptx_has_ieee_division_and_no_contraction(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_without_ptx_compiler(kernels._is_interpreted(kernels._BILATERAL_JIT))
    assert kernels._COMPILE_OPTIONS == {"enable_fp_fusion": False, "enable_reflect_ftz": False}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tile = kernels.TileConfig()
    common = {"height": "i32", "width": "i32", "min_depth": "fp32", "zfar": "fp32"}
    erode_sig = {
        "src_ptr": "*fp32",
        "dst_ptr": "*fp32",
        **common,
        "diff_thres": "fp32",
        "ratio_thres": "fp32",
    }
    erode_sig.update(RADIUS="constexpr", BLOCK_H="constexpr", BLOCK_W="constexpr")
    sizes = {"RADIUS": 2, "BLOCK_H": tile.block_h, "BLOCK_W": tile.block_w}
    options = {"num_warps": tile.num_warps, **kernels._COMPILE_OPTIONS}
    erode_ptx = _compile_ptx(kernels._ERODE_JIT, erode_sig, sizes, options)
    bil_sig = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "xyz_ptr": "*fp32", "k_ptr": "*fp32", **common}
    bil_sig.update(gate="fp32", two_sd2="fp32", two_sr2="fp32", xyz_min_depth="fp32")
    bil_sig.update({k: "constexpr" for k in ("RADIUS", "EXP_VIA_F64", "XYZ_MODE", "BLOCK_H", "BLOCK_W")})
    bil_consts = {**sizes, "EXP_VIA_F64": False, "XYZ_MODE": 1}
    bil_ptx = _compile_ptx(kernels._BILATERAL_JIT, bil_sig, bil_consts, options)
    fused_ptx = _compile_ptx(
        kernels._BILATERAL_JIT, bil_sig, bil_consts, {**options, "enable_fp_fusion": True}
    )

    for ptx in (erode_ptx, bil_ptx):
        assert "div.full" not in ptx and "div.approx" not in ptx  # every division IEEE round-to-nearest
    assert _count(erode_ptx, "div.rn.f32") > 0 and "fma" not in erode_ptx
    pixels_per_thread = tile.block_h * tile.block_w // (32 * tile.num_warps)
    window = 25 * pixels_per_thread
    # libdevice expf (range reduction + ex2.approx), once per window pixel; not tl.exp's bare ex2.
    assert _count(bil_ptx, "ex2.approx.ftz.f32") == window
    # Products stay separately rounded multiplies: diff*diff and w*z per window pixel at least.
    assert _count(bil_ptx, "mul.rn.f32") >= 2 * window
    # With fusion allowed the compiler would contract some of them into FMAs (e.g. w*z + sum): the
    # option is what keeps the reference's rounding.
    assert _count(fused_ptx, "fma.rn.f32") > _count(bil_ptx, "fma.rn.f32")


# ----------------------------------------------------------------------------------------------
# CUDA: compiled kernels vs the torch reference on the same GPU
# ----------------------------------------------------------------------------------------------

CUDA_SHAPES = [(1, 480, 640), (3, 480, 640), (2, 37, 53)]


def _cuda_depth(shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    batch, height, width = shape
    return synthetic_depth(batch, height, width, seed=seed).to("cuda")


@needs_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_erode_exact(shape: tuple[int, int, int]) -> None:
    depth = _cuda_depth(shape, seed=sum(shape))
    got = erode_depth(depth, impl="triton")
    ref = erode_depth(depth, impl="torch")
    assert torch.equal(got, ref), int((got != ref).sum())
    assert (ref == 0).sum() > (depth == 0).sum()
    assert torch.equal(erode_depth(depth), got)  # auto -> triton on CUDA
    assert torch.equal(erode_depth(depth[0], impl="triton"), ref[0])


@needs_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_bilateral_within_1e6(shape: tuple[int, int, int]) -> None:
    eroded = erode_depth(_cuda_depth(shape, seed=sum(shape) + 1), impl="torch")
    got = bilateral_filter_depth(eroded, impl="triton")
    ref = bilateral_filter_depth(eroded, impl="torch")
    assert (got - ref).abs().max().item() <= 1e-6
    assert torch.equal(got == 0, ref == 0)


@needs_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_bilateral_bit_exact(shape: tuple[int, int, int]) -> None:
    # Same float32 ops in the same order, libdevice expf = CUDA expf, no FMA contraction: expect 0 diff.
    eroded = erode_depth(_cuda_depth(shape, seed=sum(shape) + 1), impl="torch")
    got = bilateral_filter_depth(eroded, impl="triton")
    ref = bilateral_filter_depth(eroded, impl="torch")
    differing = int((got != ref).sum())
    assert differing == 0, f"{differing} pixels differ, max {(got - ref).abs().max().item():.3g}"


@needs_cuda
@pytest.mark.parametrize("xyz_float64", [False, True])
def test_cuda_fused_pipeline_matches_torch(xyz_float64: bool) -> None:
    depth = _cuda_depth((3, 480, 640), seed=11)
    ref_depth, ref_xyz = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=xyz_float64, impl="torch")
    got_depth, got_xyz = filter_depth_and_backproject(depth, K_BENCH, xyz_float64=xyz_float64, impl="triton")
    assert (got_depth - ref_depth).abs().max().item() <= 1e-6
    # Given equal depth, the back-projection is one IEEE op chain on both sides: exact.
    same = (got_depth == ref_depth)[..., None].expand_as(got_xyz)
    assert torch.equal(got_xyz[same], ref_xyz[same])
    assert torch.equal(got_depth, ref_depth) and torch.equal(got_xyz, ref_xyz)


@needs_cuda
def test_cuda_side_stream_and_non_contiguous() -> None:
    depth = _cuda_depth((2, 480, 640), seed=12)
    ref = bilateral_filter_depth(erode_depth(depth, impl="torch"), impl="torch")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = bilateral_filter_depth(erode_depth(depth, impl="triton"), impl="triton")
    torch.cuda.current_stream().wait_stream(stream)
    assert (got - ref).abs().max().item() <= 1e-6
    view = depth.transpose(1, 2)  # (2, 640, 480) non-contiguous
    assert torch.equal(erode_depth(view, impl="triton"), erode_depth(view, impl="torch"))
