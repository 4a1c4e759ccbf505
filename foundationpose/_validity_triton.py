"""Triton kernels of the validity measurements (private to :mod:`foundationpose.validity`).

:mod:`foundationpose.validity` imports this module lazily (triton is optional; CPU CI runs the kernels through the
Triton interpreter on small inputs, in NumPy). Two kernels replace the batched torch code's some 45 small ops of
the appearance part and 100 of the depth part (:func:`foundationpose.validity.measure_validity_rows` with
``impl="torch"``, which stays the readable twin; ops as dispatched on the CPU):

1. ``_appearance_cells_kernel``, one program per (row of cells, request): walks the ``CELL`` pixel rows of its
   cells in the rendered and the observed crop (NHWC, any strides), marks the compared pixels (both crops have a
   surface, ``|z_render - z_real| <= band``) and writes each cell's compared share and its rendered and observed
   mean intensity to a (B, 3, C*C) float32 scratch. Its pixels are read once; the crops of a batch of 64 are
   78 MB, so at large batches it is bound by memory bandwidth.
2. ``_measure_rows_kernel``, one program per request: the depth part (the model points rotated and projected,
   the filtered depth read at their pixels, the counts and the agreeing residuals summed, the step's motion) and
   the appearance part's statistics over the cells (weighted means, variances, covariance, contrast and
   correlation), written straight into the (B, M) measurement rows. ``DEPTH`` off: the appearance columns alone
   (:func:`foundationpose.validity.measure_appearance`); ``APPEARANCE`` off: they are written as 0 (not judged).

Arithmetic follows the torch twin operation by operation (the same float32 products and element-wise additions in order,
every division ``div_rn`` and square root ``sqrt_rn``, compiled without FMA contraction; the projection's
``round`` is an exact round-half-to-even from ``floor``; acos is libdevice's, the function torch's CUDA ``acos``
calls), so every count, and every fraction of counts, equals the twin's. What differs is the order of the float
sums (the agreeing residuals, the trace of ``R_final R_start^T``, the translation's squares, each cell's 64
pixels and the cells' weighted moments): those columns agree with the twin to float32 rounding
(tests/foundationpose/test_validity_triton.py states the tolerances). The residual sum runs over the points in
fixed chunks of ``CHUNK`` lanes, so zero padding of a table's points adds exact zeros and a row's result does not
depend on the padding, nor on its batch (one program per row). Under the interpreter libdevice does not exist:
there acos is a float64 series rounded once to float32 (``ACOS_F64``).

Nothing is read back and the grids and the one scratch tensor depend only on the shapes, so a CUDA graph can
capture the launches; scalars are kernel arguments (rounded to float32 on the host as torch rounds a Python scalar)
or each row's own value read from a (B,) tensor (``*_ROWS``), so no host value is copied to the device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from foundationpose._triton_optional import InterpretedFunction, libdevice

__all__ = ["CHUNK", "interpreter_available", "measure_appearance_triton", "measure_rows_triton"]

CHUNK = 128  # model points per step of the depth part's loop (fixed: the residual sum's order depends on it)
_NUM_WARPS = 4
_ACOS_SERIES_TERMS = tl.constexpr(48)  # interpreter's asin series on [0, sqrt(1/2)]: ratio <= 1/2 per term
_PI = tl.constexpr(math.pi)
_RAD_TO_DEG = tl.constexpr(float(np.float32(180.0 / math.pi)))  # torch.rad2deg's factor, rounded to float32

_sum = tl.standard._sum_combine  # what tl.sum reduces with; the interpreter evaluates it with NumPy


# ------------------------------------------------------------------------------------------------
# Kernels (plain functions; wrapped below for the compiler and for the interpreter). Only builtins of
# triton.language are called (tl.reduce with triton's sum, not the @jit tl.sum): the interpreter can call
# @jit functions only when TRITON_INTERPRET=1 was set before triton was imported.
# ------------------------------------------------------------------------------------------------


def _appearance_cells_kernel(
    render_ptr, transf_ptr, cells_ptr,
    r_sn, r_sh, r_sw, r_sc,
    t_sn, t_sh, t_sw, t_sc,
    band, band_ptr, band_stride,
    n_cells,
    BAND_ROWS: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_CELLS: tl.constexpr,
):
    """Cells ``(program 0, cx)`` of request ``program 1``: (BLOCK_CELLS cells, CELL pixels) tiles, one pixel row
    of the cells at a time; writes share, mean rendered and mean observed intensity per cell."""
    cy = tl.program_id(0)
    img = tl.program_id(1).to(tl.int64)
    cx = tl.arange(0, BLOCK_CELLS)[:, None]  # (BC, 1)
    k = tl.arange(0, CELL)[None, :]  # (1, CELL)
    col = (cx * CELL + k).to(tl.int64)  # (BC, CELL) crop column
    lane = (cx < n_cells) & (k < CELL)
    if BAND_ROWS:  # each row's own band (a table's rows)
        band_v = tl.load(band_ptr + img * band_stride)
    else:
        band_v = band
    count = tl.full([BLOCK_CELLS], 0, tl.int32)
    sum_r = tl.full([BLOCK_CELLS], 0.0, tl.float32)
    sum_o = tl.full([BLOCK_CELLS], 0.0, tl.float32)
    for j in tl.static_range(CELL):
        row = (cy * CELL + j).to(tl.int64)
        rp = render_ptr + img * r_sn + row * r_sh + col * r_sw
        op = transf_ptr + img * t_sn + row * t_sh + col * t_sw
        r_x = tl.load(rp + 3 * r_sc, mask=lane, other=0.0)
        r_y = tl.load(rp + 4 * r_sc, mask=lane, other=0.0)
        r_z = tl.load(rp + 5 * r_sc, mask=lane, other=0.0)
        o_x = tl.load(op + 3 * t_sc, mask=lane, other=0.0)
        o_y = tl.load(op + 4 * t_sc, mask=lane, other=0.0)
        o_z = tl.load(op + 5 * t_sc, mask=lane, other=0.0)
        surface_r = (r_x != 0.0) | (r_y != 0.0) | (r_z != 0.0)
        surface_o = (o_x != 0.0) | (o_y != 0.0) | (o_z != 0.0)
        compared = surface_r & surface_o & (tl.abs(r_z - o_z) <= band_v) & lane
        weight = compared.to(tl.float32)
        # mean of R, G, B: their sum divided by 3
        i_r = tl.math.div_rn((tl.load(rp, mask=lane, other=0.0) + tl.load(rp + r_sc, mask=lane, other=0.0))
                             + tl.load(rp + 2 * r_sc, mask=lane, other=0.0), 3.0)
        i_o = tl.math.div_rn((tl.load(op, mask=lane, other=0.0) + tl.load(op + t_sc, mask=lane, other=0.0))
                             + tl.load(op + 2 * t_sc, mask=lane, other=0.0), 3.0)
        count += tl.reduce(compared.to(tl.int32), 1, _sum)
        sum_r += tl.reduce(i_r * weight, 1, _sum)
        sum_o += tl.reduce(i_o * weight, 1, _sum)
    pixels = CELL * CELL
    share = tl.math.div_rn(count.to(tl.float32), pixels * 1.0)  # exact: a count over a power of two
    safe = tl.maximum(share, 1e-6)
    mean_r = tl.math.div_rn(tl.math.div_rn(sum_r, pixels * 1.0), safe)  # avg-pooled, over the compared share
    mean_o = tl.math.div_rn(tl.math.div_rn(sum_o, pixels * 1.0), safe)
    cell = cy * n_cells + tl.arange(0, BLOCK_CELLS)
    valid = tl.arange(0, BLOCK_CELLS) < n_cells
    out = cells_ptr + img * (3 * n_cells * n_cells) + cell
    tl.store(out, share, mask=valid)
    tl.store(out + n_cells * n_cells, mean_r, mask=valid)
    tl.store(out + 2 * n_cells * n_cells, mean_o, mask=valid)


def _measure_rows_kernel(
    out_ptr, out_sr, out_sc,
    depth_ptr, d_sb, d_sh, d_sw, height, width,
    k_ptr, k_sb, k_sr, k_sc,
    start_ptr, s_sb, s_sr, s_sc,
    final_ptr, f_sb, f_sr, f_sc,
    points_ptr, p_sb, p_sp, p_sc,
    normals_ptr, n_sb, n_sp, n_sc,
    present_ptr, pr_sb, pr_sp,
    n_points,
    tol, tol_ptr, tol_stride,
    min_z, min_depth,
    cells_ptr, n_cell_total,
    textured, textured_ptr, textured_stride,
    DEPTH: tl.constexpr,
    APPEARANCE: tl.constexpr,
    APP_COL: tl.constexpr,
    HAS_PRESENT: tl.constexpr,
    TOL_ROWS: tl.constexpr,
    TEXTURED_ROWS: tl.constexpr,
    ACOS_F64: tl.constexpr,
    CHUNK_P: tl.constexpr,
    BLOCK_CELLS: tl.constexpr,
):
    """Request ``program 0``'s measurement row: columns 0-10 (``DEPTH``) and the appearance columns from
    ``APP_COL`` (``APPEARANCE``: from the cells' scratch; else 0)."""
    b = tl.program_id(0).to(tl.int64)
    out = out_ptr + b * out_sr
    if DEPTH:
        fp = final_ptr + b * f_sb
        r00 = tl.load(fp)
        r01 = tl.load(fp + f_sc)
        r02 = tl.load(fp + 2 * f_sc)
        r10 = tl.load(fp + f_sr)
        r11 = tl.load(fp + f_sr + f_sc)
        r12 = tl.load(fp + f_sr + 2 * f_sc)
        r20 = tl.load(fp + 2 * f_sr)
        r21 = tl.load(fp + 2 * f_sr + f_sc)
        r22 = tl.load(fp + 2 * f_sr + 2 * f_sc)
        tx = tl.load(fp + 3 * f_sc)
        ty = tl.load(fp + f_sr + 3 * f_sc)
        tz = tl.load(fp + 2 * f_sr + 3 * f_sc)
        kp = k_ptr + b * k_sb
        fx = tl.load(kp).to(tl.float32)
        cx = tl.load(kp + 2 * k_sc).to(tl.float32)
        fy = tl.load(kp + k_sr + k_sc).to(tl.float32)
        cy = tl.load(kp + k_sr + 2 * k_sc).to(tl.float32)
        if TOL_ROWS:
            tol_v = tl.load(tol_ptr + b * tol_stride)
        else:
            tol_v = tol
        n_facing = tl.full([CHUNK_P], 0, tl.int32)
        n_inside = tl.full([CHUNK_P], 0, tl.int32)
        n_reading = tl.full([CHUNK_P], 0, tl.int32)
        n_agree = tl.full([CHUNK_P], 0, tl.int32)
        n_occluded = tl.full([CHUNK_P], 0, tl.int32)
        n_behind = tl.full([CHUNK_P], 0, tl.int32)
        residual_sum = tl.full([CHUNK_P], 0.0, tl.float32)
        for first in range(0, n_points, CHUNK_P):
            i = first + tl.arange(0, CHUNK_P)
            live = i < n_points
            pp = points_ptr + b * p_sb + i.to(tl.int64) * p_sp
            px = tl.load(pp, mask=live, other=0.0)
            py = tl.load(pp + p_sc, mask=live, other=0.0)
            pz = tl.load(pp + 2 * p_sc, mask=live, other=0.0)
            nq = normals_ptr + b * n_sb + i.to(tl.int64) * n_sp
            nx = tl.load(nq, mask=live, other=0.0)
            ny = tl.load(nq + n_sc, mask=live, other=0.0)
            nz = tl.load(nq + 2 * n_sc, mask=live, other=0.0)
            # v @ R^T as multiply-adds, in the twin's order: (x R_i0 + y R_i1) + z R_i2, then + t_i
            x = ((px * r00 + py * r01) + pz * r02) + tx
            y = ((px * r10 + py * r11) + pz * r12) + ty
            z = ((px * r20 + py * r21) + pz * r22) + tz
            mx = (nx * r00 + ny * r01) + nz * r02
            my = (nx * r10 + ny * r11) + nz * r12
            mz = (nx * r20 + ny * r21) + nz * r22
            towards = (mx * x + my * y) + mz * z
            facing = (towards < 0.0) & (z > min_z) & live
            if HAS_PRESENT:
                facing = facing & (tl.load(present_ptr + b * pr_sb + i.to(tl.int64) * pr_sp, mask=live,
                                           other=0) != 0)
            z_safe = tl.maximum(z, min_z)
            u_f = tl.math.div_rn(fx * x, z_safe) + cx
            v_f = tl.math.div_rn(fy * y, z_safe) + cy
            # round half to even (torch.round), exactly: x - floor(x) is exact below 2**23, floor(x) = x above
            u_fl = tl.floor(u_f)
            u_d = u_f - u_fl
            u_odd = (u_fl - 2.0 * tl.floor(u_fl * 0.5)) != 0.0
            u = tl.where((u_d > 0.5) | ((u_d == 0.5) & u_odd), u_fl + 1.0, u_fl)
            v_fl = tl.floor(v_f)
            v_d = v_f - v_fl
            v_odd = (v_fl - 2.0 * tl.floor(v_fl * 0.5)) != 0.0
            v = tl.where((v_d > 0.5) | ((v_d == 0.5) & v_odd), v_fl + 1.0, v_fl)
            inside = facing & (u >= 0.0) & (u <= width - 1) & (v >= 0.0) & (v <= height - 1)
            col = tl.where(inside, u, 0.0).to(tl.int64)  # a NaN or far pixel never becomes an address
            row = tl.where(inside, v, 0.0).to(tl.int64)
            seen = tl.load(depth_ptr + b * d_sb + row * d_sh + col * d_sw, mask=inside, other=0.0)
            reading = inside & (seen >= min_depth)
            residual = seen - z
            agree = reading & (tl.abs(residual) <= tol_v)
            occluded = reading & (residual < -tol_v)
            behind = reading & (residual > tol_v)
            n_facing += facing.to(tl.int32)
            n_inside += inside.to(tl.int32)
            n_reading += reading.to(tl.int32)
            n_agree += agree.to(tl.int32)
            n_occluded += occluded.to(tl.int32)
            n_behind += behind.to(tl.int32)
            residual_sum += tl.where(agree, tl.abs(residual), 0.0)
        facing_f = tl.reduce(n_facing, 0, _sum).to(tl.float32)
        inside_f = tl.reduce(n_inside, 0, _sum).to(tl.float32)
        reading_f = tl.reduce(n_reading, 0, _sum).to(tl.float32)
        agree_f = tl.reduce(n_agree, 0, _sum).to(tl.float32)
        occluded_f = tl.reduce(n_occluded, 0, _sum).to(tl.float32)
        behind_f = tl.reduce(n_behind, 0, _sum).to(tl.float32)
        abs_residual = tl.reduce(residual_sum, 0, _sum)

        sp = start_ptr + b * s_sb
        trace = r00 * tl.load(sp)
        trace += r01 * tl.load(sp + s_sc)
        trace += r02 * tl.load(sp + 2 * s_sc)
        trace += r10 * tl.load(sp + s_sr)
        trace += r11 * tl.load(sp + s_sr + s_sc)
        trace += r12 * tl.load(sp + s_sr + 2 * s_sc)
        trace += r20 * tl.load(sp + 2 * s_sr)
        trace += r21 * tl.load(sp + 2 * s_sr + s_sc)
        trace += r22 * tl.load(sp + 2 * s_sr + 2 * s_sc)
        cosine = tl.clamp((trace - 1.0) * 0.5, -1.0, 1.0, propagate_nan=tl.PropagateNan.ALL)
        if ACOS_F64:  # interpreter: acos(c) = 2 asin(sqrt((1 - |c|) / 2)) (pi minus it for c < 0), in float64
            c64 = cosine.to(tl.float64)
            s2 = (1.0 - tl.abs(c64)) * 0.5
            term = tl.sqrt(s2)
            asin = term
            for n in tl.static_range(_ACOS_SERIES_TERMS):
                term = (term * s2 * tl.cast((2 * n + 1) * (2 * n + 1), tl.float64)
                        / tl.cast((2 * n + 2) * (2 * n + 3), tl.float64))
                asin = asin + term
            pi = tl.full([], _PI, tl.float64)
            angle = tl.where(c64 < 0.0, pi - 2.0 * asin, 2.0 * asin).to(tl.float32)
        else:
            angle = libdevice.acos(cosine)
        rotation_deg = angle * _RAD_TO_DEG
        dx = tx - tl.load(sp + 3 * s_sc)
        dy = ty - tl.load(sp + s_sr + 3 * s_sc)
        dz = tz - tl.load(sp + 2 * s_sr + 3 * s_sc)
        translation = tl.math.sqrt_rn((dx * dx + dy * dy) + dz * dz)

        tl.store(out, tl.math.div_rn(inside_f, tl.maximum(facing_f, 1.0)))
        tl.store(out + out_sc, tl.math.div_rn(reading_f, tl.maximum(inside_f, 1.0)))
        tl.store(out + 2 * out_sc, tl.math.div_rn(agree_f, tl.maximum(reading_f, 1.0)))
        tl.store(out + 3 * out_sc, tl.math.div_rn(occluded_f, tl.maximum(reading_f, 1.0)))
        tl.store(out + 4 * out_sc, tl.math.div_rn(behind_f, tl.maximum(reading_f, 1.0)))
        tl.store(out + 5 * out_sc, tl.math.div_rn(agree_f, tl.maximum(agree_f + behind_f, 1.0)))
        tl.store(out + 6 * out_sc, tl.math.div_rn(agree_f, tl.maximum(facing_f, 1.0)))
        tl.store(out + 7 * out_sc, tl.math.div_rn(abs_residual, tl.maximum(agree_f, 1.0)))
        tl.store(out + 8 * out_sc, translation)
        tl.store(out + 9 * out_sc, rotation_deg)
        tl.store(out + 10 * out_sc, inside_f)

    app = out + APP_COL * out_sc
    if APPEARANCE:
        c = tl.arange(0, BLOCK_CELLS)
        live_c = c < n_cell_total
        cp = cells_ptr + b * (3 * n_cell_total) + c
        share = tl.load(cp, mask=live_c, other=0.0)
        mean_r = tl.load(cp + n_cell_total, mask=live_c, other=0.0)
        mean_o = tl.load(cp + 2 * n_cell_total, mask=live_c, other=0.0)
        w = tl.where(share >= 0.5, share, 0.0)  # cells at least half compared
        if TEXTURED_ROWS:
            textured_v = tl.load(textured_ptr + b * textured_stride)
        else:
            textured_v = textured
        cells = tl.reduce((w > 0.0).to(tl.int32), 0, _sum).to(tl.float32) * textured_v
        total = tl.maximum(tl.reduce(w, 0, _sum), 1e-6)
        centred_r = mean_r - tl.math.div_rn(tl.reduce(mean_r * w, 0, _sum), total)
        centred_o = mean_o - tl.math.div_rn(tl.reduce(mean_o * w, 0, _sum), total)
        weighted_r = w * centred_r
        var_r = tl.reduce(weighted_r * centred_r, 0, _sum)
        var_o = tl.reduce((w * centred_o) * centred_o, 0, _sum)
        cov = tl.reduce(weighted_r * centred_o, 0, _sum)
        larger = tl.maximum(var_r, var_o, propagate_nan=tl.PropagateNan.ALL)
        contrast = tl.math.sqrt_rn(tl.math.div_rn(larger, total))
        ncc = tl.math.div_rn(cov, tl.maximum(tl.math.sqrt_rn(var_r * var_o), 1e-12,
                                             propagate_nan=tl.PropagateNan.ALL))
        tl.store(app, cells)
        tl.store(app + out_sc, contrast)
        tl.store(app + 2 * out_sc, ncc)
    else:
        tl.store(app, 0.0)
        tl.store(app + out_sc, 0.0)
        tl.store(app + 2 * out_sc, 0.0)


_CELLS_JIT = triton.jit(_appearance_cells_kernel)
_ROWS_JIT = triton.jit(_measure_rows_kernel)
_CELLS_INTERPRETED = InterpretedFunction(_appearance_cells_kernel) if InterpretedFunction is not None else None
_ROWS_INTERPRETED = InterpretedFunction(_measure_rows_kernel) if InterpretedFunction is not None else None


def _compile_options() -> dict[str, bool]:
    """No FMA contraction and IEEE denormals (the torch twin rounds every product; nvcc's default), where this
    triton version has the options."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no NVIDIA backend: the options are moot
        return {}
    wanted = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
    return {k: v for k, v in wanted.items() if k in CUDAOptions.__dataclass_fields__}


_COMPILE_OPTIONS = _compile_options()


def interpreter_available() -> bool:
    """Whether the kernels can run on CPU tensors through the Triton interpreter."""
    return _ROWS_INTERPRETED is not None


def _is_interpreted(kernel: object) -> bool:
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


def _pick(jit_kernel: object, interpreted_kernel: object | None, device: torch.device) -> tuple[object, bool]:
    """(kernel, interpreted): compiled for CUDA tensors (interpreted too under TRITON_INTERPRET=1), the
    interpreter for CPU ones."""
    if device.type == "cuda":
        if libdevice is None and not _is_interpreted(jit_kernel):
            raise RuntimeError("this triton has no triton.language.extra.libdevice (needs triton >= 3.0)")
        return jit_kernel, _is_interpreted(jit_kernel)
    if interpreted_kernel is None:
        raise RuntimeError(f"the triton validity kernels need a CUDA tensor or the triton interpreter; got {device}")
    return interpreted_kernel, True


@contextlib.contextmanager
def _launch_context(device: torch.device, interpreted: bool) -> Iterator[None]:
    """Launch on the tensors' GPU (triton uses the current device and stream); quiet NumPy under the
    interpreter (0 x inf and the like give NaN as on the GPU)."""
    if interpreted:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            yield
    elif device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:  # pragma: no cover - _pick never returns a compiled kernel for a CPU tensor
        yield


def _options(interpreted: bool) -> dict[str, object]:
    return {} if interpreted else {"num_warps": _NUM_WARPS, **_COMPILE_OPTIONS}


def _f32(value: float) -> float:
    """``value`` rounded to float32 (as torch rounds a Python scalar against a float32 tensor)."""
    return float(np.float32(value))


def _row_value(name: str, value: float | Tensor, batch: int, device: torch.device) -> tuple[float, Tensor | None, int]:
    """A per-request value as the kernels take it: (float32 scalar, None, 0) for one value, (0.0, the (B,)
    float32 tensor, its stride) for each row's own."""
    if isinstance(value, Tensor):
        if value.dtype != torch.float32 or tuple(value.shape) != (batch,) or value.device != device:
            raise ValueError(f"{name}: expected a ({batch},) float32 tensor on {device}; got "
                             f"{value.dtype} {tuple(value.shape)} on {value.device}")
        return 0.0, value, int(value.stride(0))
    return _f32(value), None, 0


def _check(name: str, x: Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...],
           device: torch.device) -> None:
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(str(d) for d in dtypes)}; got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}; got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}; got {x.device}")


def _launch_cells(render_input: Tensor, transf_input: Tensor, band: float | Tensor, cell: int) -> Tensor:
    """The (B, 3, C*C) float32 scratch of the cells (share, rendered mean, observed mean), one launch."""
    if render_input.ndim != 4 or render_input.shape[-1] != 6:
        raise ValueError(f"render_input: expected (B, S, S, 6); got {tuple(render_input.shape)}")
    batch, size = int(render_input.shape[0]), int(render_input.shape[1])
    device = render_input.device
    _check("render_input", render_input, (torch.float32,), (batch, size, size, 6), device)
    _check("transf_input", transf_input, (torch.float32,), (batch, size, size, 6), device)
    if size % cell or size == 0:
        raise ValueError(f"render_input: the crop side {size} is not a positive multiple of {cell}")
    if batch >= 2**16:
        raise ValueError(f"render_input: {batch} requests exceed the launch grid (< 2**16)")
    n_cells = size // cell
    cells = torch.empty((batch, 3, n_cells * n_cells), dtype=torch.float32, device=device)
    if batch == 0:
        return cells
    band_f, band_t, band_stride = _row_value("band", band, batch, device)
    kernel, interpreted = _pick(_CELLS_JIT, _CELLS_INTERPRETED, device)
    with _launch_context(device, interpreted):
        kernel[(n_cells, batch)](
            render_input, transf_input, cells,
            *render_input.stride(), *transf_input.stride(),
            band_f, band_t if band_t is not None else cells, band_stride,
            n_cells,
            BAND_ROWS=band_t is not None,
            CELL=cell,
            BLOCK_CELLS=triton.next_power_of_2(n_cells),
            **_options(interpreted),
        )
    return cells


def measure_appearance_triton(render_input: Tensor, transf_input: Tensor, *, band: float | Tensor,
                              textured: float | Tensor, cell: int) -> Tensor:
    """Columns ``appearance_cells``, ``texture_contrast``, ``appearance_ncc`` of a batch of network-input pairs in
    two launches (see :func:`foundationpose.validity.measure_appearance`).

    render_input, transf_input: (B, S, S, 6) float32 on one device, any strides, S a multiple of ``cell``.
    band: the depth band in normalised-depth units; textured: 1.0 / 0.0; each a float or each row's own (B,)
    float32 tensor. Returns (B, 3) float32. Raises TypeError (dtype) or ValueError (shape, device).
    """
    cells = _launch_cells(render_input, transf_input, band, cell)
    batch = int(render_input.shape[0])
    out = torch.empty((batch, 3), dtype=torch.float32, device=render_input.device)
    if batch:
        _launch_rows(out, app_col=0, depth_args=None, cells=cells, textured=textured)
    return out


def measure_rows_triton(depth: Tensor, K: Tensor, start: Tensor, final: Tensor, points: Tensor, normals: Tensor,
                        present: Tensor | None, *, tol: float | Tensor, band: float | Tensor,
                        textured: float | Tensor, appearance: tuple[Tensor, Tensor] | None, cell: int,
                        min_z: float, min_depth: float, columns: int) -> Tensor:
    """The (B, ``columns``) float32 measurement rows (:func:`foundationpose.validity.measure_validity_rows`) in one
    launch, two with ``appearance``.

    depth: (B, H, W) float32. K: (B, 3, 3) float32 or float64 (rounded to float32, as the twin does).
    start, final: (B, 4, 4) float32. points, normals: (P, 3) or (B, P, 3) float32; present: None or (B, P) bool.
    tol (metres), band, textured: floats or each row's own (B,) float32. appearance: the (B, S, S, 6) pair or None
    (columns from 11 are 0). min_z, min_depth: the twin's projection and reading thresholds. Any strides.
    Raises TypeError (dtype) or ValueError (shape, device) naming the argument.
    """
    if depth.ndim != 3:
        raise ValueError(f"depth: expected (B, H, W); got {tuple(depth.shape)}")
    batch, height, width = (int(s) for s in depth.shape)
    device = depth.device
    _check("depth", depth, (torch.float32,), (batch, height, width), device)
    _check("K", K, (torch.float32, torch.float64), (batch, 3, 3), device)
    _check("start", start, (torch.float32,), (batch, 4, 4), device)
    _check("final", final, (torch.float32,), (batch, 4, 4), device)
    count = int(points.shape[-2]) if points.ndim in (2, 3) else -1
    shared = points.ndim == 2
    shape = (count, 3) if shared else (batch, count, 3)
    _check("points", points, (torch.float32,), shape, device)
    _check("normals", normals, (torch.float32,), shape, device)
    if present is not None:
        _check("present", present, (torch.bool,), (batch, count), device)
    if batch >= 2**31:  # pragma: no cover - far beyond any batch
        raise ValueError(f"depth: {batch} requests exceed the launch grid")
    out = torch.empty((batch, columns), dtype=torch.float32, device=device)
    if batch == 0:
        return out
    cells = None if appearance is None else _launch_cells(*appearance, band, cell)
    if cells is not None and int(cells.shape[0]) != batch:
        raise ValueError(f"appearance: expected {batch} pairs; got {int(cells.shape[0])}")
    tol_f, tol_t, tol_stride = _row_value("tol", tol, batch, device)
    p_strides = (0, *points.stride()) if shared else tuple(points.stride())
    n_strides = (0, *normals.stride()) if shared else tuple(normals.stride())
    present_u8 = present.view(torch.uint8) if present is not None else None
    depth_args = (
        depth, *depth.stride(), height, width,
        K, *K.stride(),
        start, *start.stride(),
        final, *final.stride(),
        points, *p_strides,
        normals, *n_strides,
        present_u8 if present_u8 is not None else depth, *(present_u8.stride() if present_u8 is not None else (0, 0)),
        count,
        tol_f, tol_t if tol_t is not None else depth, tol_stride,
        _f32(min_z), _f32(min_depth),
    )
    _launch_rows(out, app_col=columns - 3, depth_args=depth_args, cells=cells, textured=textured,
                 has_present=present is not None, tol_rows=tol_t is not None)
    return out


def _launch_rows(out: Tensor, *, app_col: int, depth_args: tuple[object, ...] | None, cells: Tensor | None,
                 textured: float | Tensor, has_present: bool = False, tol_rows: bool = False) -> None:
    """One launch of ``_measure_rows_kernel`` over ``out``'s rows (depth columns with ``depth_args``, the
    appearance columns from ``app_col``: from ``cells``, or 0 without)."""
    batch, device = int(out.shape[0]), out.device
    depth_part = depth_args is not None
    textured_f, textured_t, textured_stride = _row_value("textured", textured, batch, device)
    if depth_args is None:  # unused by the kernel (DEPTH off): any tensor and zeros
        depth_args = (out, 0, 0, 0, 1, 1, out, 0, 0, 0, out, 0, 0, 0, out, 0, 0, 0, out, 0, 0, 0, out, 0, 0, 0,
                      out, 0, 0, 0, 0.0, out, 0, 1.0, 1.0)
    n_cell_total = int(cells.shape[2]) if cells is not None else 0
    kernel, interpreted = _pick(_ROWS_JIT, _ROWS_INTERPRETED, device)
    with _launch_context(device, interpreted):
        kernel[(batch,)](
            out, *out.stride(),
            *depth_args,
            cells if cells is not None else out, n_cell_total,
            textured_f, textured_t if textured_t is not None else out, textured_stride,
            DEPTH=depth_part,
            APPEARANCE=cells is not None,
            APP_COL=app_col,
            HAS_PRESENT=has_present,
            TOL_ROWS=tol_rows,
            TEXTURED_ROWS=textured_t is not None,
            ACOS_F64=interpreted,
            CHUNK_P=CHUNK,
            BLOCK_CELLS=max(16, triton.next_power_of_2(max(n_cell_total, 1))),
            **_options(interpreted),
        )
