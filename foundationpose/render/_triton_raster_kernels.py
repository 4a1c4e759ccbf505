"""Triton kernels of the capturable rasteriser (private to :mod:`foundationpose.render.triton_raster`).

(One module of ~560 lines on purpose: the kernels of one rasteriser share their JIT helpers and constants.)

Three kernels per chunk of ``n`` hypotheses, all with grids fixed by ``n``, the mesh and the raster size (no
host synchronisation, so a CUDA graph can capture them):

1. ``_raster_small_kernel``, one program per (block of triangles, hypothesis), one lane per triangle: transforms
   the three vertices (``clip = M (v, 1)`` then the crop transform), culls the triangle against the view volume,
   computes its pixel bounding box exactly as :func:`foundationpose.render.cpu_raster._raster_pairs` does and,
   for boxes of at most ``SMALL_AREA`` pixels, walks the box and z-tests every covered pixel into the z-buffer
   with an int64 ``atomic_min`` on ``(sortable z/w bits << 32) + face`` (nearest wins, exact ties go to the lowest
   face, like the CPU twin). Larger boxes are appended to a queue (an atomic counter and a fixed-size list);
   when the queue is full the lane walks its box inline instead (slower, never wrong).
2. ``_raster_large_kernel``, a fixed grid of programs that share out the queued triangles; each walks its
   triangle's box in ``TILE_H x TILE_W`` pixel tiles, one lane per pixel (big triangles are not slow).
(Before them, per render, ``_crop_bounds_kernel`` inverts the crop windows in closed form, so no batched LU
sits in a captured graph.)

3. ``_resolve_kernel``, one program per (block of pixels, hypothesis): takes the winning face, recomputes the
   perspective-correct barycentrics with nvdiffrast's pixel-shader formulas, interpolates camera-frame xyz, the
   Lambert term and uv or vertex colours, samples the texture (bilinear, wrap), shades (spec §3.4) and writes
   the vertically flipped outputs through arbitrary strides (optionally already as the networks' input: rgb
   rescaled and xyz centred, scaled and clipped as :mod:`foundationpose.network_inputs` does); it then resets
   its z-buffer pixels and the queue counter, so the scratch is ready for the next chunk without a clearing pass.

Arithmetic follows the torch twins (:mod:`cpu_raster`, :mod:`attributes`, :mod:`shading`) operation by
operation: every division is ``div_rn``, the square root ``sqrt_rn``, and kernels are compiled without FMA
contraction, so results differ from the CPU twin only by the vertex transform's summation order (a float32
rounding of the clip and camera coordinates).

Interpreter: kernels and their device helpers are plain functions. For the compiler they are wrapped by
``triton.jit``; for the CPU interpreter, by ``InterpretedFunction`` with the helpers bound into a copy of the
module globals (the interpreter can call ``@jit`` functions only when ``TRITON_INTERPRET=1`` was set before
triton was imported). The lane maximum is ``tl.reduce`` with triton's element-wise max, which the
interpreter evaluates with NumPy.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import triton
import triton.language as tl

from foundationpose._triton_optional import InterpretedFunction

__all__ = [
    "CROP_BOUNDS_KERNELS",
    "EMPTY_KEY",
    "RESOLVE_KERNELS",
    "RASTER_LARGE_KERNELS",
    "RASTER_SMALL_KERNELS",
    "interpreter_available",
]

EMPTY_KEY = tl.constexpr(2**63 - 1)  # z-buffer value of an uncovered pixel (larger than every packed key)
_BBOX_EPS_PX = tl.constexpr(1e-2)  # as cpu_raster: widen each box a little, the edge test decides coverage
_NORMALISE_EPS = tl.constexpr(1e-12)  # as shading.vertex_diffuse (F.normalize's default)

_max_combine = tl.standard._elementwise_max  # what tl.max reduces with; the interpreter special-cases it


# ------------------------------------------------------------------------------------------------
# Device helpers
# ------------------------------------------------------------------------------------------------


def _clip_vertex(verts_ptr, vid, m_ptr, crop_ptr, img, HAS_CROP: tl.constexpr):
    """Clip coordinates of vertex ``vid`` under hypothesis ``img``: ``M (v, 1)``, then the crop transform
    ``x' = x ax + w bx``, ``y' = y ay + w by`` (crop row ``[ax, ay, bx, by]``)."""
    vx = tl.load(verts_ptr + vid * 3)
    vy = tl.load(verts_ptr + vid * 3 + 1)
    vz = tl.load(verts_ptr + vid * 3 + 2)
    m = m_ptr + img * 16
    x = vx * tl.load(m) + vy * tl.load(m + 1) + vz * tl.load(m + 2) + tl.load(m + 3)
    y = vx * tl.load(m + 4) + vy * tl.load(m + 5) + vz * tl.load(m + 6) + tl.load(m + 7)
    z = vx * tl.load(m + 8) + vy * tl.load(m + 9) + vz * tl.load(m + 10) + tl.load(m + 11)
    w = vx * tl.load(m + 12) + vy * tl.load(m + 13) + vz * tl.load(m + 14) + tl.load(m + 15)
    if HAS_CROP:
        c = crop_ptr + img * 4
        x = x * tl.load(c) + w * tl.load(c + 2)
        y = y * tl.load(c + 1) + w * tl.load(c + 3)
    return x, y, z, w


def _rotate(px, py, pz, pose_ptr, img, ADD_T: tl.constexpr):
    """``R p (+ t)`` with the pose of hypothesis ``img`` (row-major 4 x 4)."""
    t = pose_ptr + img * 16
    x = px * tl.load(t) + py * tl.load(t + 1) + pz * tl.load(t + 2)
    y = px * tl.load(t + 4) + py * tl.load(t + 5) + pz * tl.load(t + 6)
    z = px * tl.load(t + 8) + py * tl.load(t + 9) + pz * tl.load(t + 10)
    if ADD_T:
        x = x + tl.load(t + 3)
        y = y + tl.load(t + 7)
        z = z + tl.load(t + 11)
    return x, y, z


def _pixel_box(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, width, height):
    """(keep, x_lo, x_hi, y_lo, y_hi) of a triangle: culled against the view volume, box clamped to the target
    (the whole target when a vertex is behind the camera); int32 inclusive bounds."""
    outside = (
        ((x0 > w0) & (x1 > w1) & (x2 > w2))
        | ((x0 < -w0) & (x1 < -w1) & (x2 < -w2))
        | ((y0 > w0) & (y1 > w1) & (y2 > w2))
        | ((y0 < -w0) & (y1 < -w1) & (y2 < -w2))
        | ((z0 > w0) & (z1 > w1) & (z2 > w2))
        | ((z0 < -w0) & (z1 < -w1) & (z2 < -w2))
        | ((w0 <= 0.0) & (w1 <= 0.0) & (w2 <= 0.0))
    )
    in_front = (w0 > 0.0) & (w1 > 0.0) & (w2 > 0.0)
    wf = width + 0.0  # float32 (an int argument equal to 1 arrives as a constexpr, which has no .to)
    hf = height + 0.0
    half_w = 0.5 * wf
    half_h = 0.5 * hf
    s0 = tl.where(w0 > 0.0, w0, 1.0)
    s1 = tl.where(w1 > 0.0, w1, 1.0)
    s2 = tl.where(w2 > 0.0, w2, 1.0)
    sx0 = (tl.math.div_rn(x0, s0) + 1.0) * half_w - 0.5
    sx1 = (tl.math.div_rn(x1, s1) + 1.0) * half_w - 0.5
    sx2 = (tl.math.div_rn(x2, s2) + 1.0) * half_w - 0.5
    sy0 = (tl.math.div_rn(y0, s0) + 1.0) * half_h - 0.5
    sy1 = (tl.math.div_rn(y1, s1) + 1.0) * half_h - 0.5
    sy2 = (tl.math.div_rn(y2, s2) + 1.0) * half_h - 0.5
    # cpu_raster's clamps: lo to [0, W], hi to [-1, W - 1]; a box off the target has lo > hi.
    fx_lo = tl.minimum(tl.maximum(tl.ceil(tl.minimum(tl.minimum(sx0, sx1), sx2) - _BBOX_EPS_PX), 0.0), wf)
    fx_hi = tl.minimum(tl.maximum(tl.floor(tl.maximum(tl.maximum(sx0, sx1), sx2) + _BBOX_EPS_PX), -1.0), wf - 1.0)
    fy_lo = tl.minimum(tl.maximum(tl.ceil(tl.minimum(tl.minimum(sy0, sy1), sy2) - _BBOX_EPS_PX), 0.0), hf)
    fy_hi = tl.minimum(tl.maximum(tl.floor(tl.maximum(tl.maximum(sy0, sy1), sy2) + _BBOX_EPS_PX), -1.0), hf - 1.0)
    x_lo = tl.where(in_front, fx_lo, 0.0).to(tl.int32)
    x_hi = tl.where(in_front, fx_hi, wf - 1.0).to(tl.int32)
    y_lo = tl.where(in_front, fy_lo, 0.0).to(tl.int32)
    y_hi = tl.where(in_front, fy_hi, hf - 1.0).to(tl.int32)
    keep = (~outside) & (x_lo <= x_hi) & (y_lo <= y_hi)
    return keep, x_lo, x_hi, y_lo, y_hi


def _edges(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, fx, fy):
    """nvdiffrast's pixel-shader arithmetic at NDC ``(fx, fy)`` (cpu_raster._barycentrics).

    Returns the edge functions ``a0, a1``, their sum ``area``, ``z/w`` and the coverage test."""
    p0x = x0 - fx * w0
    p0y = y0 - fy * w0
    p1x = x1 - fx * w1
    p1y = y1 - fy * w1
    p2x = x2 - fx * w2
    p2y = y2 - fy * w2
    a0 = p1x * p2y - p1y * p2x
    a1 = p2x * p0y - p2y * p0x
    a2 = p0x * p1y - p0y * p1x
    area = a0 + a1 + a2
    zc = z0 * a0 + z1 * a1 + z2 * a2
    wc = w0 * a0 + w1 * a1 + w2 * a2
    zw = tl.math.div_rn(zc, wc)
    positive = (a0 >= 0.0) & (a1 >= 0.0) & (a2 >= 0.0) & (area > 0.0)
    negative = (a0 <= 0.0) & (a1 <= 0.0) & (a2 <= 0.0) & (area < 0.0)
    in_front = tl.where(area > 0.0, wc > 0.0, wc < 0.0)
    ok = (positive | negative) & in_front & (zw >= -1.0) & (zw <= 1.0)
    return a0, a1, area, zw, ok


def _depth_key(zw, face):
    """int64 ``(sortable z/w bits << 32) + face``: ordered by z/w, then by face."""
    bits = zw.to(tl.int32, bitcast=True)
    sortable = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (sortable.to(tl.int64) << 32) + face.to(tl.int64)


def _interp(b0, b1, b2, a0, a1, a2):
    return b0 * a0 + b1 * a1 + b2 * a2


def _texel(tex_ptr, row, col, tex_w, channel):
    return tl.load(tex_ptr + (row * tex_w + col) * 3 + channel)


def _bilinear(tex_ptr, iv0, iu0, iv1, iu1, fu, fv, tex_w, channel):
    """One channel of the bilinear texture lookup between texel rows iv0/iv1 and columns iu0/iu1."""
    a00 = _texel(tex_ptr, iv0, iu0, tex_w, channel)
    a10 = _texel(tex_ptr, iv0, iu1, tex_w, channel)
    a01 = _texel(tex_ptr, iv1, iu0, tex_w, channel)
    a11 = _texel(tex_ptr, iv1, iu1, tex_w, channel)
    top = a00 + fu * (a10 - a00)
    return top + fv * ((a01 + fu * (a11 - a01)) - top)


def _texture_rgb(b0, b1, b2, face, colour_ptr, colour_faces_ptr, tex_ptr, tex_h, tex_w):
    """Interpolated uv, bilinear texture lookup with wrap (attributes.texture_linear_wrap): (red, green, blue)."""
    j0 = tl.load(colour_faces_ptr + face * 3)
    j1 = tl.load(colour_faces_ptr + face * 3 + 1)
    j2 = tl.load(colour_faces_ptr + face * 3 + 2)
    u = _interp(b0, b1, b2, tl.load(colour_ptr + j0 * 2), tl.load(colour_ptr + j1 * 2), tl.load(colour_ptr + j2 * 2))
    v = _interp(
        b0, b1, b2, tl.load(colour_ptr + j0 * 2 + 1), tl.load(colour_ptr + j1 * 2 + 1), tl.load(colour_ptr + j2 * 2 + 1)
    )
    u = u - tl.floor(u)
    v = v - tl.floor(v)
    u = u * (tex_w + 0.0) - 0.5  # + 0.0, not .to: tex_w == 1 arrives as a constexpr
    v = v * (tex_h + 0.0) - 0.5
    u0f = tl.floor(u)
    v0f = tl.floor(v)
    fu = u - u0f
    fv = v - v0f
    iu0 = u0f.to(tl.int32)
    iv0 = v0f.to(tl.int32)
    iu1 = iu0 + 1
    iv1 = iv0 + 1
    iu0 = tl.where(iu0 < 0, iu0 + tex_w, iu0)
    iv0 = tl.where(iv0 < 0, iv0 + tex_h, iv0)
    iu1 = tl.where(iu1 >= tex_w, iu1 - tex_w, iu1)
    iv1 = tl.where(iv1 >= tex_h, iv1 - tex_h, iv1)
    # NaN uv (never from finite inputs) would give garbage indices: keep loads in range regardless.
    iu0 = tl.minimum(tl.maximum(iu0, 0), tex_w - 1)
    iu1 = tl.minimum(tl.maximum(iu1, 0), tex_w - 1)
    iv0 = tl.minimum(tl.maximum(iv0, 0), tex_h - 1)
    iv1 = tl.minimum(tl.maximum(iv1, 0), tex_h - 1)
    red = _bilinear(tex_ptr, iv0, iu0, iv1, iu1, fu, fv, tex_w, 0)
    green = _bilinear(tex_ptr, iv0, iu0, iv1, iu1, fu, fv, tex_w, 1)
    blue = _bilinear(tex_ptr, iv0, iu0, iv1, iu1, fu, fv, tex_w, 2)
    return red, green, blue


def _vertex_rgb(b0, b1, b2, i0, i1, i2, colour_ptr):
    """Interpolated vertex colours: (red, green, blue)."""
    red = _interp(b0, b1, b2, tl.load(colour_ptr + i0 * 3), tl.load(colour_ptr + i1 * 3), tl.load(colour_ptr + i2 * 3))
    green = _interp(
        b0, b1, b2, tl.load(colour_ptr + i0 * 3 + 1), tl.load(colour_ptr + i1 * 3 + 1), tl.load(colour_ptr + i2 * 3 + 1)
    )
    blue = _interp(
        b0, b1, b2, tl.load(colour_ptr + i0 * 3 + 2), tl.load(colour_ptr + i1 * 3 + 2), tl.load(colour_ptr + i2 * 3 + 2)
    )
    return red, green, blue


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _raster_small_kernel(
    verts_ptr,
    faces_ptr,
    m_ptr,
    crop_ptr,
    zbuf_ptr,
    queue_ptr,
    count_ptr,
    row_mesh_ptr,
    face_start_ptr,
    face_count_ptr,
    n_faces,
    height,
    width,
    xs,
    xo,
    ys,
    yo,
    queue_capacity,
    HAS_CROP: tl.constexpr,
    GROUPED: tl.constexpr,
    SMALL_AREA: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    img = tl.program_id(1)
    local = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if GROUPED:  # the row's mesh: its range of the packed faces (the grid covers the largest mesh)
        mesh = tl.load(row_mesh_ptr + img)
        face = tl.load(face_start_ptr + mesh) + local
        valid = local < tl.load(face_count_ptr + mesh)
    else:
        face = local
        valid = face < n_faces
    i0 = tl.load(faces_ptr + face * 3, mask=valid, other=0)
    i1 = tl.load(faces_ptr + face * 3 + 1, mask=valid, other=0)
    i2 = tl.load(faces_ptr + face * 3 + 2, mask=valid, other=0)
    x0, y0, z0, w0 = _clip_vertex(verts_ptr, i0, m_ptr, crop_ptr, img, HAS_CROP)
    x1, y1, z1, w1 = _clip_vertex(verts_ptr, i1, m_ptr, crop_ptr, img, HAS_CROP)
    x2, y2, z2, w2 = _clip_vertex(verts_ptr, i2, m_ptr, crop_ptr, img, HAS_CROP)
    keep, x_lo, x_hi, y_lo, y_hi = _pixel_box(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, width, height)
    keep = keep & valid
    box_w = x_hi - x_lo + 1
    area = tl.where(keep, box_w * (y_hi - y_lo + 1), 0)
    large = keep & (area > SMALL_AREA)
    slot = tl.atomic_add(count_ptr + face * 0, 1, mask=large, sem="relaxed")
    queued = large & (slot < queue_capacity)
    tl.store(queue_ptr + slot, img * n_faces + face, mask=queued)
    inline = keep & (~queued)
    steps = tl.reduce(tl.where(inline, area, 0), 0, _max_combine)
    image = zbuf_ptr + img.to(tl.int64) * height * width
    px = x_lo
    py = y_lo
    for k in range(0, steps):
        fx = px.to(tl.float32) * xs + xo
        fy = py.to(tl.float32) * ys + yo
        _a0, _a1, _area, zw, ok = _edges(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, fx, fy)
        hit = inline & (k < area) & ok
        tl.atomic_min(image + py * width + px, _depth_key(zw, face), mask=hit, sem="relaxed")
        px += 1
        wrap = px > x_hi
        px = tl.where(wrap, x_lo, px)
        py = tl.where(wrap, py + 1, py)


def _raster_large_kernel(
    verts_ptr,
    faces_ptr,
    m_ptr,
    crop_ptr,
    zbuf_ptr,
    queue_ptr,
    count_ptr,
    row_mesh_ptr,
    face_start_ptr,
    face_count_ptr,
    n_faces,
    height,
    width,
    xs,
    xo,
    ys,
    yo,
    queue_capacity,
    HAS_CROP: tl.constexpr,
    TILE_H: tl.constexpr,
    TILE_W: tl.constexpr,
):
    # Program (p, s): queue entries p, p + P, ...; tile rows s, s + S, ... of each entry's box.
    programs = tl.num_programs(0)
    row_step = tl.num_programs(1) * TILE_H
    count = tl.minimum(tl.load(count_ptr), queue_capacity)
    rows = tl.arange(0, TILE_H)[:, None]
    cols = tl.arange(0, TILE_W)[None, :]
    for e in range(tl.program_id(0), count, programs):
        entry = tl.load(queue_ptr + e)
        img = entry // n_faces
        face = entry - img * n_faces
        i0 = tl.load(faces_ptr + face * 3)
        i1 = tl.load(faces_ptr + face * 3 + 1)
        i2 = tl.load(faces_ptr + face * 3 + 2)
        x0, y0, z0, w0 = _clip_vertex(verts_ptr, i0, m_ptr, crop_ptr, img, HAS_CROP)
        x1, y1, z1, w1 = _clip_vertex(verts_ptr, i1, m_ptr, crop_ptr, img, HAS_CROP)
        x2, y2, z2, w2 = _clip_vertex(verts_ptr, i2, m_ptr, crop_ptr, img, HAS_CROP)
        _keep, x_lo, x_hi, y_lo, y_hi = _pixel_box(
            x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, width, height
        )
        image = zbuf_ptr + img.to(tl.int64) * height * width
        for ty in range(y_lo + tl.program_id(1) * TILE_H, y_hi + 1, row_step):
            py = ty + rows
            fy = py.to(tl.float32) * ys + yo
            for tx in range(x_lo, x_hi + 1, TILE_W):
                px = tx + cols
                fx = px.to(tl.float32) * xs + xo
                _a0, _a1, _area, zw, ok = _edges(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, fx, fy)
                hit = (py <= y_hi) & (px <= x_hi) & ok
                tl.atomic_min(image + py * width + px, _depth_key(zw, face), mask=hit, sem="relaxed")


def _resolve_kernel(
    verts_ptr,
    normals_ptr,
    faces_ptr,
    colour_ptr,
    colour_faces_ptr,
    tex_ptr,
    m_ptr,
    crop_ptr,
    pose_ptr,
    zbuf_ptr,
    count_ptr,
    rgb_ptr,
    xyz_ptr,
    mask_ptr,
    height,
    width,
    xs,
    xo,
    ys,
    yo,
    tex_h,
    tex_w,
    uniform_albedo,
    ambient_weight,
    diffuse_weight,
    rgb_unit_scale,
    xyz_scale,
    invalid_z,
    xyz_clip,
    rgb_sn,
    rgb_sh,
    rgb_sw,
    rgb_sc,
    xyz_sn,
    xyz_sh,
    xyz_sw,
    xyz_sc,
    mask_sn,
    mask_sh,
    mask_sw,
    row_mesh_ptr,
    albedo_ptr,
    vertex_colour_ptr,
    tex_offset_ptr,
    tex_h_ptr,
    tex_w_ptr,
    HAS_CROP: tl.constexpr,
    GROUPED: tl.constexpr,  # rows of a mesh group: the colour source per row from the tables (ALBEDO unused)
    ALBEDO: tl.constexpr,  # 0 uniform grey, 1 vertex colours, 2 texture
    NETWORK_INPUT: tl.constexpr,  # write the network's rgb and normalised xyz instead of colour and metres
    BLOCK_P: tl.constexpr,
):
    img = tl.program_id(1)
    pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = pix < height * width
    slot = zbuf_ptr + img.to(tl.int64) * height * width + pix
    key = tl.load(slot, mask=valid, other=EMPTY_KEY)
    covered = valid & (key != EMPTY_KEY)
    tl.store(slot, tl.full([BLOCK_P], EMPTY_KEY, tl.int64), mask=valid)  # ready for the next chunk
    if tl.program_id(0) == 0:
        if img == 0:
            tl.store(count_ptr, 0)  # the raster kernels are done with the queue (same stream)
    face = tl.where(covered, key.to(tl.int32), 0)  # low 32 bits
    row = pix // width
    col = pix - row * width
    i0 = tl.load(faces_ptr + face * 3)
    i1 = tl.load(faces_ptr + face * 3 + 1)
    i2 = tl.load(faces_ptr + face * 3 + 2)
    x0, y0, z0, w0 = _clip_vertex(verts_ptr, i0, m_ptr, crop_ptr, img, HAS_CROP)
    x1, y1, z1, w1 = _clip_vertex(verts_ptr, i1, m_ptr, crop_ptr, img, HAS_CROP)
    x2, y2, z2, w2 = _clip_vertex(verts_ptr, i2, m_ptr, crop_ptr, img, HAS_CROP)
    fx = col.to(tl.float32) * xs + xo
    fy = row.to(tl.float32) * ys + yo
    a0, a1, area, _zw, _ok = _edges(x0, y0, z0, w0, x1, y1, z1, w1, x2, y2, z2, w2, fx, fy)
    inv_area = tl.math.div_rn(1.0, area)
    b0 = tl.minimum(tl.maximum(a0 * inv_area, 0.0), 1.0)
    b1 = tl.minimum(tl.maximum(a1 * inv_area, 0.0), 1.0)
    b2 = 1.0 - b0 - b1

    # Camera-frame position (spec §3.1) and Lambert term (spec §3.4) of the three vertices.
    vx0 = tl.load(verts_ptr + i0 * 3)
    vy0 = tl.load(verts_ptr + i0 * 3 + 1)
    vz0 = tl.load(verts_ptr + i0 * 3 + 2)
    vx1 = tl.load(verts_ptr + i1 * 3)
    vy1 = tl.load(verts_ptr + i1 * 3 + 1)
    vz1 = tl.load(verts_ptr + i1 * 3 + 2)
    vx2 = tl.load(verts_ptr + i2 * 3)
    vy2 = tl.load(verts_ptr + i2 * 3 + 1)
    vz2 = tl.load(verts_ptr + i2 * 3 + 2)
    cx0, cy0, cz0 = _rotate(vx0, vy0, vz0, pose_ptr, img, True)
    cx1, cy1, cz1 = _rotate(vx1, vy1, vz1, pose_ptr, img, True)
    cx2, cy2, cz2 = _rotate(vx2, vy2, vz2, pose_ptr, img, True)
    nx0, ny0, nz0 = _rotate(
        tl.load(normals_ptr + i0 * 3), tl.load(normals_ptr + i0 * 3 + 1), tl.load(normals_ptr + i0 * 3 + 2),
        pose_ptr, img, False,
    )
    nx1, ny1, nz1 = _rotate(
        tl.load(normals_ptr + i1 * 3), tl.load(normals_ptr + i1 * 3 + 1), tl.load(normals_ptr + i1 * 3 + 2),
        pose_ptr, img, False,
    )
    nx2, ny2, nz2 = _rotate(
        tl.load(normals_ptr + i2 * 3), tl.load(normals_ptr + i2 * 3 + 1), tl.load(normals_ptr + i2 * 3 + 2),
        pose_ptr, img, False,
    )
    d0 = tl.minimum(tl.maximum(-tl.math.div_rn(nz0, tl.maximum(tl.sqrt_rn(nx0 * nx0 + ny0 * ny0 + nz0 * nz0), _NORMALISE_EPS)), 0.0), 1.0)
    d1 = tl.minimum(tl.maximum(-tl.math.div_rn(nz1, tl.maximum(tl.sqrt_rn(nx1 * nx1 + ny1 * ny1 + nz1 * nz1), _NORMALISE_EPS)), 0.0), 1.0)
    d2 = tl.minimum(tl.maximum(-tl.math.div_rn(nz2, tl.maximum(tl.sqrt_rn(nx2 * nx2 + ny2 * ny2 + nz2 * nz2), _NORMALISE_EPS)), 0.0), 1.0)
    diffuse = _interp(b0, b1, b2, d0, d1, d2)
    px = _interp(b0, b1, b2, cx0, cx1, cx2)
    py = _interp(b0, b1, b2, cy0, cy1, cy2)
    pz = _interp(b0, b1, b2, cz0, cz1, cz2)

    if GROUPED:  # rows of a mesh group: each row's mesh picks its colour source (a branch per program)
        mesh = tl.load(row_mesh_ptr + img)
        source = tl.load(albedo_ptr + mesh)
        if source == 2:
            red, green, blue = _texture_rgb(
                b0, b1, b2, face, colour_ptr, colour_faces_ptr, tex_ptr + tl.load(tex_offset_ptr + mesh),
                tl.load(tex_h_ptr + mesh), tl.load(tex_w_ptr + mesh),
            )
        elif source == 1:
            red, green, blue = _vertex_rgb(b0, b1, b2, i0, i1, i2, vertex_colour_ptr)
        else:
            red = tl.full([BLOCK_P], 0.0, tl.float32) + uniform_albedo
            green = red
            blue = red
    elif ALBEDO == 2:  # texture: interpolate uv, bilinear lookup with wrap (attributes.texture_linear_wrap)
        red, green, blue = _texture_rgb(b0, b1, b2, face, colour_ptr, colour_faces_ptr, tex_ptr, tex_h, tex_w)
    elif ALBEDO == 1:  # vertex colours
        red, green, blue = _vertex_rgb(b0, b1, b2, i0, i1, i2, colour_ptr)
    else:
        red = tl.full([BLOCK_P], 0.0, tl.float32) + uniform_albedo
        green = red
        blue = red

    # clamp(albedo * 0.8 + diffuse * albedo * 0.5, 0, 1), 0 on background (spec §3.4, §3.5).
    red = tl.where(covered, tl.minimum(tl.maximum(red * ambient_weight + diffuse * red * diffuse_weight, 0.0), 1.0), 0.0)
    green = tl.where(
        covered, tl.minimum(tl.maximum(green * ambient_weight + diffuse * green * diffuse_weight, 0.0), 1.0), 0.0
    )
    blue = tl.where(covered, tl.minimum(tl.maximum(blue * ambient_weight + diffuse * blue * diffuse_weight, 0.0), 1.0), 0.0)
    px = tl.where(covered, px, 0.0)
    py = tl.where(covered, py, 0.0)
    pz = tl.where(covered, pz, 0.0)
    if NETWORK_INPUT:
        # network_inputs: rgb_to_unit(rgb * 255) and normalize_xyz(xyz, t, diameter, invalid_z), same float32 ops.
        red = (red * 255.0) * rgb_unit_scale
        green = (green * 255.0) * rgb_unit_scale
        blue = (blue * 255.0) * rgb_unit_scale
        invalid = pz < invalid_z  # on the metres, before shifting
        pose = pose_ptr + img * 16
        px = (px - tl.load(pose + 3)) * xyz_scale
        py = (py - tl.load(pose + 7)) * xyz_scale
        pz = (pz - tl.load(pose + 11)) * xyz_scale
        px = tl.where(invalid | (tl.abs(px) >= xyz_clip), 0.0, px)
        py = tl.where(invalid | (tl.abs(py) >= xyz_clip), 0.0, py)
        pz = tl.where(invalid | (tl.abs(pz) >= xyz_clip), 0.0, pz)

    out_row = (height - 1 - row).to(tl.int64)  # vertical flip: output row 0 = top of the image
    col64 = col.to(tl.int64)
    img64 = img.to(tl.int64)
    rgb = rgb_ptr + img64 * rgb_sn + out_row * rgb_sh + col64 * rgb_sw
    tl.store(rgb, red, mask=valid)
    tl.store(rgb + rgb_sc, green, mask=valid)
    tl.store(rgb + 2 * rgb_sc, blue, mask=valid)
    xyz = xyz_ptr + img64 * xyz_sn + out_row * xyz_sh + col64 * xyz_sw
    tl.store(xyz, px, mask=valid)
    tl.store(xyz + xyz_sc, py, mask=valid)
    tl.store(xyz + 2 * xyz_sc, pz, mask=valid)
    tl.store(mask_ptr + img64 * mask_sn + out_row * mask_sh + col64 * mask_sw, covered.to(tl.uint8), mask=valid)


def _crop_bounds_kernel(f_ptr, out_ptr, n, last, BLOCK: tl.constexpr):
    """Crop bounds ``[x0, y0, x1, y1]`` (projection.crop_bounds) of ``n`` affine ``crop_from_img`` (n, 3, 3).

    The inverse is closed-form: for the crop windows (no shear: ``b = d = 0``) ``1/a``, ``1/e``, ``-c/a``,
    ``-f/e``, which is what LU back-substitution gives (bit-equal to ``linalg.inv_ex`` on the CPU); otherwise the
    adjugate over the determinant. Then ``inv @ corner + t`` in the order of crop_bounds' matmul and add."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    f = f_ptr + i * 9
    a = tl.load(f, mask=valid, other=1.0)
    b = tl.load(f + 1, mask=valid, other=0.0)
    c = tl.load(f + 2, mask=valid, other=0.0)
    d = tl.load(f + 3, mask=valid, other=0.0)
    e = tl.load(f + 4, mask=valid, other=1.0)
    g = tl.load(f + 5, mask=valid, other=0.0)
    diagonal = (b == 0.0) & (d == 0.0)
    det = a * e - b * d
    i00 = tl.where(diagonal, tl.math.div_rn(1.0, a), tl.math.div_rn(e, det))
    i11 = tl.where(diagonal, tl.math.div_rn(1.0, e), tl.math.div_rn(a, det))
    i01 = tl.where(diagonal, 0.0, tl.math.div_rn(-b, det))
    i10 = tl.where(diagonal, 0.0, tl.math.div_rn(-d, det))
    tx = tl.where(diagonal, -tl.math.div_rn(c, a), tl.math.div_rn(b * g - e * c, det))
    ty = tl.where(diagonal, -tl.math.div_rn(g, e), tl.math.div_rn(d * c - a * g, det))
    out = out_ptr + i * 4
    tl.store(out, tx, mask=valid)
    tl.store(out + 1, ty, mask=valid)
    tl.store(out + 2, (i00 * last + i01 * last) + tx, mask=valid)
    tl.store(out + 3, (i10 * last + i11 * last) + ty, mask=valid)


# ------------------------------------------------------------------------------------------------
# Compiled and interpreted variants
# ------------------------------------------------------------------------------------------------

_HELPERS: tuple[Callable[..., object], ...] = (
    _clip_vertex, _rotate, _pixel_box, _edges, _depth_key, _interp, _texel, _bilinear, _texture_rgb, _vertex_rgb,
)


def _rebind(fn: Callable[..., object], namespace: dict[str, object]) -> Callable[..., object]:
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


def _variants(kernel: Callable[..., object]) -> tuple[object, object | None]:
    """(compiled, interpreted) versions of ``kernel``. The compiled one sees ``triton.jit`` helpers in its
    globals, the interpreted one ``InterpretedFunction`` helpers in a namespace of its own."""
    compiled = triton.jit(kernel)
    if InterpretedFunction is None:
        return compiled, None
    namespace = dict(globals())
    for helper in _HELPERS:
        namespace[helper.__name__] = InterpretedFunction(_rebind(helper, namespace))
    return compiled, InterpretedFunction(_rebind(kernel, namespace))


# Module globals name the jit helpers, which is what the compiled kernels resolve at compile time.
for _helper in _HELPERS:
    globals()[_helper.__name__] = triton.jit(_helper)
del _helper

RASTER_SMALL_KERNELS = _variants(_raster_small_kernel)
RASTER_LARGE_KERNELS = _variants(_raster_large_kernel)
RESOLVE_KERNELS = _variants(_resolve_kernel)
CROP_BOUNDS_KERNELS = _variants(_crop_bounds_kernel)


def interpreter_available() -> bool:
    """Whether the kernels can run on CPU tensors through the Triton interpreter."""
    return RESOLVE_KERNELS[1] is not None
