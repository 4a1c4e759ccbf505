"""The validity kernels (foundationpose/_validity_triton.py) against the batched torch twin (``impl="torch"``).

Three groups:
- dispatch and the capture rules of the wrappers (no triton kernel runs);
- the kernels under the Triton interpreter on CPU tensors (needs ``triton``);
- the compiled kernels on CUDA against the torch twin on CUDA, and under CUDA-graph capture (needs a GPU).

Tolerances, kernels against the twin on the same device: every count and fraction of counts equal (the same
float32 operations in the same order, an exact round-half-to-even); the sums in another order: ``residual_m``
within 1e-7 m + 1e-5 relative, ``translation_m`` within 1e-6 relative, the cells' ``texture_contrast`` and
``appearance_ncc`` within 1e-5; ``rotation_deg`` within 0.05 degrees (an ulp of the trace moves acos near 0 by
up to 0.03 degrees: the limit is 11).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from foundationpose import validity
from foundationpose.validity import (
    MEASUREMENTS,
    ValidityConfig,
    ValidityModel,
    ValidityTable,
    column,
    judge_validity,
    measure_appearance,
    measure_validity,
    measure_validity_rows,
    validity_impl,
)
from tests.foundationpose._triton import (
    import_kernels,
    skip_without_ptx_compiler,
    triton_marks,
    validity_rows_interpreter_problem,
)
from tests.foundationpose.conftest import pose_xyz, render_scene, rotation_xyz
from tests.foundationpose.test_no_host_sync import FORBIDDEN, Probe

kernels, _IMPORT_ERROR = import_kernels("foundationpose._validity_triton")
needs_interpreter, needs_cuda = triton_marks(kernels, _IMPORT_ERROR)
# the per-row kernel loops to a bound it loads, which some Triton interpreters cannot run with numpy >= 2.4
needs_rows_interpreter, _ = triton_marks(kernels, _IMPORT_ERROR, problem_probe=validity_rows_interpreter_problem)

K = np.array([[600.0, 0.0, 159.5], [0.0, 600.0, 119.5], [0.0, 0.0, 1.0]])
HW = (240, 320)
CONFIG = ValidityConfig()
COUNTED = [column(n) for n in MEASUREMENTS if n.endswith("_fraction")] + [column("visible_points"),
                                                                          column("appearance_cells")]
SUMMED = [column(n) for n in ("residual_m", "translation_m", "rotation_deg", "texture_contrast", "appearance_ncc")]


@pytest.fixture(scope="module")
def observed(textured_object):
    """The object at a known pose in front of a plane 0.8 m away (as test_validity's)."""
    gt = pose_xyz(0.6, -0.4, 0.3, (0.01, -0.005, 0.5))
    scene = render_scene(textured_object, gt, K, HW)
    depth = np.where(scene.mask, scene.depth, 0.8).astype(np.float32)
    return depth, gt


@pytest.fixture(scope="module")
def model(textured_object) -> ValidityModel:
    return ValidityModel.from_object(textured_object)


def _poses(gt: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(final, start) poses: true, shifted, turned, outside the image, behind the camera, a NaN pose; each judged
    from the true pose, except the true one, from a start a few millimetres away (so every motion is not 0)."""
    shifted, turned, outside, behind_cam, broken = gt.copy(), gt.copy(), gt.copy(), gt.copy(), gt.copy()
    shifted[0, 3] += 0.04
    turned[:3, :3] = rotation_xyz(0.0, 0.9, 0.0) @ gt[:3, :3]
    outside[0, 3] += 0.5
    behind_cam[2, 3] = -0.5
    broken[0, 0] = np.nan
    moved = gt.copy()
    moved[:3, 3] += (0.003, -0.002, 0.004)
    return [gt, shifted, turned, outside, behind_cam, broken], [moved, gt, gt, gt, gt, gt]


def _crops(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair of (n, size, size, 6) crops: the observed one the rendered one with noise, three pixel rows without
    a surface (their cells partly compared), a quarter whose depths disagree (cells not compared)."""
    gen = torch.Generator().manual_seed(seed)
    render = torch.rand((n, size, size, 6), generator=gen)
    render[..., 3:] -= 0.5
    render[:, :3] = 0.0
    transf = render + 0.02 * torch.randn((n, size, size, 6), generator=gen)
    transf[:, size // 2:, :size // 2, 5] += 1.0
    return render, transf


def _batch(depth: np.ndarray, finals: list[np.ndarray], starts: list[np.ndarray], device: str = "cpu"):
    n = len(finals)
    d = torch.as_tensor(depth, device=device)[None].expand(n, *depth.shape).contiguous()
    k = torch.as_tensor(K, device=device)[None].expand(n, 3, 3).contiguous()
    final = torch.as_tensor(np.stack(finals).astype(np.float32), device=device)
    start = torch.as_tensor(np.stack(starts).astype(np.float32), device=device)
    return d, k, start, final


def assert_matches_twin(fast: torch.Tensor, twin: torch.Tensor) -> None:
    """The tolerances of the module docstring."""
    assert fast.shape == twin.shape and fast.dtype == twin.dtype == torch.float32
    assert torch.equal(fast[:, COUNTED], twin[:, COUNTED]), (fast[:, COUNTED], twin[:, COUNTED])
    torch.testing.assert_close(fast[:, column("residual_m")], twin[:, column("residual_m")], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fast[:, column("translation_m")], twin[:, column("translation_m")], rtol=1e-6,
                               atol=1e-9, equal_nan=True)
    torch.testing.assert_close(fast[:, column("rotation_deg")], twin[:, column("rotation_deg")], rtol=0,
                               atol=0.05, equal_nan=True)
    appearance = [column("texture_contrast"), column("appearance_ncc")]
    torch.testing.assert_close(fast[:, appearance], twin[:, appearance], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Dispatch and the wrappers' capture rules
# ----------------------------------------------------------------------------------------------


def test_auto_on_cpu_never_touches_triton(observed, model, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden():
        raise AssertionError("triton probed for a CPU tensor")

    monkeypatch.setattr(validity, "_triton_kernels", forbidden)
    depth, gt = observed
    finals, starts = _poses(gt)
    d, k, start, final = _batch(depth, finals[:2], starts[:2])
    pair = _crops(2, 16, 0)
    auto = measure_validity(d, k, start, final, model, CONFIG, appearance=pair)
    assert torch.equal(auto, measure_validity(d, k, start, final, model, CONFIG, appearance=pair, impl="torch"))
    measure_appearance(*pair, CONFIG)
    assert validity_impl("cpu") == "torch"


def test_auto_takes_the_kernels_on_cuda_and_the_twin_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels is None:
        pytest.skip(f"triton does not import here: {_IMPORT_ERROR}")
    monkeypatch.setattr(validity, "_triton_kernels", lambda: kernels)
    assert validity_impl("cuda") == "triton" and validity_impl("cuda", "torch") == "torch"
    assert validity_impl("cpu") == "torch" and validity_impl("cpu", "triton") == "triton"


def test_impl_triton_without_triton_raises_and_bad_impl_is_rejected(observed, model,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validity, "_triton_kernels", lambda: None)
    depth, gt = observed
    d, k, start, final = _batch(depth, [gt], [gt])
    with pytest.raises(RuntimeError, match="triton"):
        measure_validity(d, k, start, final, model, CONFIG, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        measure_appearance(*_crops(1, 16, 0), CONFIG, impl="cuda")  # type: ignore[arg-type]
    assert validity_impl("cuda") == "torch"  # no triton: the twin everywhere


class _FakeKernel:
    """Stands in for a kernel: records its grids, runs nothing."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        self.grids.append(grid)
        return lambda *args, **kwargs: None


@pytest.mark.skipif(kernels is None, reason=_IMPORT_ERROR or "triton")
def test_the_wrappers_launch_fixed_grids_and_sync_nothing(observed, model, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the wrappers do around the launches is capturable: fixed-shape allocations (the rows, the cells'
    scratch) and views, nothing read back, no host value copied; grids from the shapes alone. Per batch: one
    launch, two with the appearance."""
    fake = _FakeKernel()
    monkeypatch.setattr(kernels, "_pick", lambda jit, interpreted, device: (fake, False))
    depth, gt = observed
    table = ValidityTable.of([(model, CONFIG), (ValidityModel(model.points_centred[:300], model.normals_centred[:300],
                                                              model.diameter, True), CONFIG)])
    d, k, start, final = _batch(depth, [gt] * 3, [gt] * 3)
    rows = table.rows(torch.tensor([1, 0, 1]))
    pair = _crops(3, 24, 0)
    with Probe() as probe:
        out = measure_validity_rows(d, k, start, final, rows, pair, impl="triton")
        measure_validity_rows(d, k, start, final, rows, None, impl="triton")
        measure_appearance(*pair, CONFIG, impl="triton")
    assert out.shape == (3, len(MEASUREMENTS))
    assert not (set(probe.ops) & FORBIDDEN), probe.ops
    assert set(probe.ops) <= {"empty", "view", "detach"}, probe.ops  # the bool mask viewed as uint8
    assert fake.grids == [(3, 3), (3,), (3,), (3, 3), (3,)]  # cells: (cell rows, requests); rows: (requests,)


# ----------------------------------------------------------------------------------------------
# Kernels under the interpreter (CPU tensors)
# ----------------------------------------------------------------------------------------------


@needs_rows_interpreter
def test_interpreter_rows_match_the_twin(observed, model) -> None:
    depth, gt = observed
    finals, starts = _poses(gt)
    d, k, start, final = _batch(depth, finals, starts)
    pair = _crops(len(finals), 16, 1)
    fast = measure_validity(d, k, start, final, model, CONFIG, appearance=pair, impl="triton")
    twin = measure_validity(d, k, start, final, model, CONFIG, appearance=pair, impl="torch")
    assert_matches_twin(fast, twin)
    # the check has teeth: points seen, read, agreeing and not; motion; cells compared; a NaN pose stays NaN
    assert fast[0, column("visible_points")] > 200 and 0 < fast[1, column("agree_fraction")] < 0.5
    assert fast[1, column("translation_m")] > 0.039 and fast[2, column("rotation_deg")] > 50
    assert (fast[:, column("appearance_cells")] > 0).all() and fast[:, column("residual_m")].max() > 0
    assert torch.isnan(fast[5, column("rotation_deg")]) and torch.isnan(twin[5, column("rotation_deg")])
    assert torch.equal(judge_validity(fast, CONFIG)[1], judge_validity(twin, CONFIG)[1])
    without = measure_validity(d, k, start, final, model, CONFIG, impl="triton")
    assert (without[:, -3:] == 0).all()
    torch.testing.assert_close(without[:, :-3], fast[:, :-3], rtol=0, atol=0, equal_nan=True)


@needs_interpreter
def test_interpreter_appearance_matches_the_twin_on_strided_crops() -> None:
    """Crops that are views of a larger buffer (strides not the crop's own), the kernels' cells against the twin's,
    for a textured and a plain object."""
    render, transf = _crops(2, 24, 2)
    buffer = torch.zeros((2, 32, 24, 8))
    buffer[:, 4:28, :, 1:7] = render
    strided = buffer[:, 4:28, :, 1:7]
    for textured in (True, False):
        fast = measure_appearance(strided, transf, CONFIG, textured, impl="triton")
        twin = measure_appearance(render, transf, CONFIG, textured, impl="torch")
        assert torch.equal(fast[:, 0], twin[:, 0]) and (fast[:, 0] > 0).tolist() == [textured] * 2
        torch.testing.assert_close(fast[:, 1:], twin[:, 1:], rtol=0, atol=1e-5)


@pytest.mark.slow
@needs_rows_interpreter
def test_interpreter_table_rows_equal_each_object_alone(observed, model) -> None:
    """A table's rows (objects of 512, 300 and 700 points: two padded; each with its own thresholds, some plain)
    equal each object measured alone, bit for bit, and match the twin: per-row values are read from the table,
    the padding adds exact zeros (fixed chunks) and no row depends on its batch."""
    depth, gt = observed
    points, normals = model.points_centred, model.normals_centred
    gen = torch.Generator().manual_seed(3)
    extra = torch.randperm(points.shape[0], generator=gen)[:188]
    models = [model, ValidityModel(points[:300], normals[:300], model.diameter, False),
              ValidityModel(torch.cat([points, points[extra]]), torch.cat([normals, normals[extra]]),
                            model.diameter, True)]
    configs = [CONFIG, ValidityConfig(depth_tolerance_diameters=0.02), ValidityConfig(depth_tolerance_diameters=0.06)]
    table = ValidityTable.of(list(zip(models, configs, strict=True)))
    assert table.points.shape == (3, 700, 3)
    row_object = [2, 0, 1, 0, 2, 1]
    finals, starts = _poses(gt)
    d, k, start, final = _batch(depth, finals, starts)
    pair = _crops(len(row_object), 16, 4)
    rows = table.rows(torch.tensor(row_object))
    got = measure_validity_rows(d, k, start, final, rows, pair, impl="triton")
    assert_matches_twin(got, measure_validity_rows(d, k, start, final, rows, pair, impl="torch"))
    for obj, (m, c) in enumerate(zip(models, configs, strict=True)):
        idx = [i for i, o in enumerate(row_object) if o == obj]
        alone = measure_validity(d[idx], k[idx], start[idx], final[idx], m, c, (pair[0][idx], pair[1][idx]),
                                 impl="triton")
        assert torch.equal(torch.nan_to_num(got[idx]), torch.nan_to_num(alone)), obj
    assert (got[[2, 5], column("appearance_cells")] == 0).all()  # object 1 is plain: not judged


@pytest.mark.slow
@needs_rows_interpreter
def test_bench_reports_the_kernels_beside_the_twin(capsys: pytest.CaptureFixture[str]) -> None:
    """``--impl triton`` (the interpreter on the CPU) times the kernels and, under ``reference``, the twin, with
    each column's largest difference: the A/B a GPU run reports with the default ``--impl auto``."""
    from foundationpose.bench import validity as bench_validity

    assert bench_validity.main(["--device", "cpu", "--batches", "1", "--replays", "1", "--impl", "triton"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["batches"]
    assert row["path"] == "triton" and row["valid_share"] == 1.0 and row["appearance_ncc"] > 0.5
    ref = row["reference"]
    assert ref["path"] == "torch" and ref["valid_equal"] and "graph_gpu" not in ref
    assert 0 < ref["eager_wall"]["p50_ms"] and 0 < ref["appearance"]["eager_wall"]["p50_ms"]
    assert set(ref["max_abs_diff"]) == set(MEASUREMENTS)
    assert ref["max_abs_diff"]["visible_points"] == 0 and ref["max_abs_diff"]["appearance_ncc"] <= 1e-5


# ----------------------------------------------------------------------------------------------
# Generated code (offline compile for sm_90; no GPU needed)
# ----------------------------------------------------------------------------------------------


def _compile_ptx(kernel, signature: dict, constexprs: dict, options: dict) -> str:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _opcodes(ptx: str) -> list[str]:
    return [line.split()[0] for line in (raw.strip() for raw in ptx.splitlines())
            if line and not line.startswith(("//", ".", "$", "{", "}", "@"))]


def _approximate_roots(ptx: str) -> list[str]:
    return [o for o in _opcodes(ptx) if o.startswith("sqrt") and o != "sqrt.rn.f32"]


if kernels is not None:
    import triton
    import triton.language as tl

    from foundationpose._triton_optional import libdevice

    @triton.jit
    def _acos_only(x_ptr, out_ptr):  # noqa: ANN001, ANN202 - libdevice's acos alone, to count what it brings
        tl.store(out_ptr, libdevice.acos(tl.load(x_ptr)))


@pytest.mark.slow
@pytest.mark.skipif(kernels is None, reason=_IMPORT_ERROR or "")
def test_generated_ptx_divides_and_roots_exactly_without_contraction(tmp_path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kernels compile for sm_90 (every variant the wrappers launch); every division is ``div.rn`` and every
    square root of the kernels' own ``sqrt.rn`` (libdevice's acos keeps its own approximations inside: at most as
    many as it brings compiled alone), and the products are not contracted into FMAs."""
    skip_without_ptx_compiler(kernels._is_interpreted(kernels._ROWS_JIT))
    assert kernels._COMPILE_OPTIONS == {"enable_fp_fusion": False, "enable_reflect_ftz": False}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    options = {"num_warps": 4, **kernels._COMPILE_OPTIONS}
    strides = ("r_sn", "r_sh", "r_sw", "r_sc", "t_sn", "t_sh", "t_sw", "t_sc")
    cells_sig = {"render_ptr": "*fp32", "transf_ptr": "*fp32", "cells_ptr": "*fp32", **dict.fromkeys(strides, "i64"),
                 "band": "fp32", "band_ptr": "*fp32", "band_stride": "i32", "n_cells": "i32",
                 **dict.fromkeys(("BAND_ROWS", "CELL", "BLOCK_CELLS"), "constexpr")}
    cells = _compile_ptx(kernels._CELLS_JIT, cells_sig, {"BAND_ROWS": True, "CELL": 8, "BLOCK_CELLS": 32}, options)
    rows_sig = {}
    for name in kernels._measure_rows_kernel.__code__.co_varnames[:kernels._measure_rows_kernel.__code__.co_argcount]:
        if name.isupper():
            rows_sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            rows_sig[name] = {"k_ptr": "*fp64", "present_ptr": "*u8"}.get(name, "*fp32")
        elif name in ("tol", "min_z", "min_depth", "textured"):
            rows_sig[name] = "fp32"
        else:
            rows_sig[name] = "i64"
    full = {"DEPTH": True, "APPEARANCE": True, "APP_COL": 11, "HAS_PRESENT": True, "TOL_ROWS": True,
            "TEXTURED_ROWS": True, "ACOS_F64": False, "CHUNK_P": kernels.CHUNK, "BLOCK_CELLS": 512}
    rows = _compile_ptx(kernels._ROWS_JIT, rows_sig, full, options)
    appearance = _compile_ptx(kernels._ROWS_JIT, rows_sig, {**full, "DEPTH": False, "APP_COL": 0}, options)
    depth_only = {**full, "APPEARANCE": False, "HAS_PRESENT": False, "TOL_ROWS": False, "TEXTURED_ROWS": False}
    plain = _compile_ptx(kernels._ROWS_JIT, rows_sig, depth_only, options)
    fused = _compile_ptx(kernels._ROWS_JIT, rows_sig, depth_only, {**options, "enable_fp_fusion": True})
    # libdevice's acos (the depth part's one call) may carry approximate roots of its own, by libdevice version
    acos_only = _approximate_roots(_compile_ptx(_acos_only, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {}, options))
    for ptx, acos_calls in ((cells, 0), (rows, 1), (appearance, 0), (plain, 1)):
        ops = _opcodes(ptx)
        assert not [o for o in ops if o.startswith("div") and o != "div.rn.f32"], ptx
        assert len(_approximate_roots(ptx)) <= acos_calls * len(acos_only), (_approximate_roots(ptx), acos_only)
    assert "div.rn.f32" in _opcodes(cells) and "sqrt.rn.f32" in _opcodes(appearance)
    assert "fma.rn.f32" not in _opcodes(cells) and "fma.rn.f32" not in _opcodes(appearance)
    # the depth part's only FMAs are libdevice acos's own; allowed to contract, the compiler adds many more
    assert _opcodes(fused).count("fma.rn.f32") > _opcodes(plain).count("fma.rn.f32") + 10


# ----------------------------------------------------------------------------------------------
# Compiled kernels on CUDA
# ----------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_rows_match_the_twin(observed, model) -> None:
    depth, gt = observed
    finals, starts = _poses(gt)
    d, k, start, final = _batch(depth, finals, starts, "cuda")
    pair = tuple(t.cuda() for t in _crops(len(finals), 160, 5))
    cuda_model = model.to("cuda")
    assert validity_impl("cuda") == "triton"
    fast = measure_validity(d, k, start, final, cuda_model, CONFIG, appearance=pair)  # auto: the kernels
    twin = measure_validity(d, k, start, final, cuda_model, CONFIG, appearance=pair, impl="torch")
    assert_matches_twin(fast.cpu(), twin.cpu())
    assert fast[0, column("visible_points")] > 200 and (fast[:, column("appearance_cells")] > 0).all()
    alone = measure_appearance(*pair, CONFIG, model.textured, impl="triton")
    torch.testing.assert_close(alone, fast[:, -3:], rtol=0, atol=0)


@needs_cuda
def test_cuda_graph_replay_equals_eager(observed, model) -> None:
    """Captured in a CUDA graph (fixed buffers), a replay on new poses and crops equals the eager call."""
    depth, gt = observed
    finals, starts = _poses(gt)
    d, k, start, final = _batch(depth, finals[:4], starts[:4], "cuda")
    render, transf = (t.cuda() for t in _crops(4, 160, 6))
    table = ValidityTable.of([(model, CONFIG), (model, ValidityConfig(depth_tolerance_diameters=0.02))], "cuda")
    index = torch.tensor([0, 1, 1, 0], device="cuda")

    def step() -> torch.Tensor:
        rows = table.rows(index)
        return judge_validity(measure_validity_rows(d, k, start, final, rows, (render, transf), impl="triton"),
                              rows.params)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new_render, new_transf = (t.cuda() for t in _crops(4, 160, 7))
    render.copy_(new_render)
    transf.copy_(new_transf)
    final.copy_(torch.as_tensor(np.stack(finals[1:5]).astype(np.float32)))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(captured, eager)
