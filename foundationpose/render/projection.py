"""Clip-space vertex transform shared by every backend (spec §3.2, §3.3).

Float path (the reference's, kept for parity):

1. ``P`` from ``K`` with the *full* image ``W, H``, near 0.001, far 100, built in float64 and cast to float32;
2. ``M = P32 @ (G @ T)`` in float32, ``G = diag(1, -1, -1, 1)`` (OpenCV camera -> OpenGL camera);
3. ``clip = M @ (v, 1)`` per vertex, float32;
4. crop: ``bbox`` = ``crop_from_img^-1`` (float32 inverse) applied to crop pixels ``(0, 0)`` and ``(S-1, S-1)``
   -> ``x0, y0, x1, y1``; ``l = x0, r = x1, t = H - y0, b = H - y1``;
   ``clip_x' = clip_x * W/(r-l) + clip_w * (W-r-l)/(r-l)``, ``clip_y' = clip_y * H/(t-b) + clip_w * (H-t-b)/(t-b)``.

Rasterisation convention (nvdiffrast): raster pixel ``(j, i)`` of an ``Hr x Wr`` target has its centre at NDC
``((2j+1)/Wr - 1, (2i+1)/Hr - 1)``, raster row 0 = NDC ``y = -1``, so images are flipped vertically afterwards.
Net effect for a crop render: output pixel ``(j, i)`` samples the image plane at
``u = x0 + (j + 0.5)(x1 - x0)/S``, ``v = y0 + (i + 0.5)(y1 - y0)/S``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from foundationpose.render._cache import ConstantCache, GeometryConstants, cached, host_key

__all__ = [
    "GL_FROM_CAM",
    "projection_from_K",
    "projection_on_device",
    "projections_on_device",
    "single_k",
    "clip_from_centred",
    "vertices_to_clip",
    "crop_bounds",
    "full_frame_exact_bounds",
    "crop_clip_coefficients",
    "apply_crop_to_clip",
    "crop_scale_offset",
    "apply_crop_to_clip_",
    "ndc_pixel_centres",
]

GL_FROM_CAM = ((1.0, 0.0, 0.0, 0.0), (0.0, -1.0, 0.0, 0.0), (0.0, 0.0, -1.0, 0.0), (0.0, 0.0, 0.0, 1.0))
"""``G``: OpenCV camera (x right, y down, z forward) -> OpenGL camera (y up, looking down -z)."""

# Constants (G, crop corners, crop-transform vectors per size; P per host K) are memoised in the caller's
# ``constants`` (the renderer's GeometryConstants); without one they are built per call.


def projection_from_K(
    K: np.ndarray | Tensor,
    img_hw: tuple[int, int],
    z_near_m: float = 0.001,
    z_far_m: float = 100.0,
) -> Tensor:
    """OpenGL-style projection matrix of the pinhole ``K`` (``y_down`` variant, spec §3.2).

    K: (3, 3) ``[[fx, s, cx], [0, fy, cy], [0, 0, 1]]`` pixels (numpy or tensor, any float dtype), or (N, 3, 3)
        (element-wise the same arithmetic per matrix).
    img_hw: (H, W) of the full image.
    Returns (4, 4) (or (N, 4, 4)) float32 on K's device (CPU for numpy): the entries are computed in float64, then rounded::

        [[2fx/W, -2s/W, (W - 2cx)/W, 0], [0, 2fy/H, (2cy - H)/H, 0],
         [0, 0, -(f+n)/(f-n), -2fn/(f-n)], [0, 0, -1, 0]]

    With it, NDC ``x = 2u/W - 1`` and ``y = 1 - 2v/H`` for the projected pixel ``(u, v)``.
    """
    k = torch.as_tensor(K).to(torch.float64)
    assert k.shape[-2:] == (3, 3) and k.ndim in (2, 3), k.shape
    h, w = float(img_hw[0]), float(img_hw[1])
    near, far = float(z_near_m), float(z_far_m)
    depth = far - near
    zero = torch.zeros(k.shape[:-2], dtype=torch.float64, device=k.device)
    proj = torch.stack(
        [
            torch.stack([2.0 * k[..., 0, 0] / w, -2.0 * k[..., 0, 1] / w, (w - 2.0 * k[..., 0, 2]) / w, zero], -1),
            torch.stack([zero, 2.0 * k[..., 1, 1] / h, (2.0 * k[..., 1, 2] - h) / h, zero], -1),
            torch.stack([zero, zero, zero - (far + near) / depth, zero - 2.0 * (far * near) / depth], -1),
            torch.stack([zero, zero, zero - 1.0, zero], -1),
        ],
        -2,
    )
    return proj.to(torch.float32)


def projection_on_device(
    K: np.ndarray | Tensor,
    img_hw: tuple[int, int],
    z_near_m: float,
    z_far_m: float,
    device: torch.device,
    constants: GeometryConstants | None = None,
) -> Tensor:
    """``projection_from_K(K, img_hw, z_near_m, z_far_m).to(device)``, memoised in ``constants`` for a host K.

    Same values (built on the host in float64, then copied from pinned memory, asynchronously on CUDA); with
    ``constants`` the copy happens once per (K, H, W, near, far, device).
    """

    def make() -> Tensor:
        return _host_to_device(projection_from_K(K, img_hw, z_near_m, z_far_m), device)

    key = host_key(K)
    if key is None or constants is None:
        return make()
    img_key = (int(img_hw[0]), int(img_hw[1]), float(z_near_m), float(z_far_m))
    return constants.intrinsics.get(("P", key, img_key, device), make, device)


def single_k(K: np.ndarray | Tensor, n: int) -> np.ndarray | Tensor | None:
    """The one (3, 3) intrinsics of ``K`` when it is (3, 3), or a host (n, 3, 3) stack of n equal matrices; else
    None (per-hypothesis K). Device tensors are never read back (no sync): a device (n, 3, 3) K is per-hypothesis.
    Raises ValueError for any other shape."""
    shape = tuple(K.shape)
    if shape == (3, 3):
        return K
    if shape != (n, 3, 3):
        raise ValueError(f"K: expected (3, 3) or ({n}, 3, 3); got {shape}")
    if isinstance(K, Tensor) and K.device.type != "cpu":
        return None
    host = K.detach().numpy() if isinstance(K, Tensor) else np.asarray(K)
    if n and bool((host == host[:1]).all()):
        return K[0]
    return None


def projections_on_device(
    K: np.ndarray | Tensor,
    img_hw: tuple[int, int],
    z_near_m: float,
    z_far_m: float,
    device: torch.device,
) -> Tensor:
    """(N, 4, 4) float32 ``P`` per (N, 3, 3) ``K``, each equal to ``projection_on_device(K[i], ...)``.

    Built where ``K`` lives in one batched pass of the same element-wise float64 arithmetic (a fixed number of
    ops whatever N): host K on the host, then one copy to ``device`` (from pinned memory, asynchronous on CUDA),
    as :func:`projection_on_device` builds a host K; a device K on the device.
    """
    if isinstance(K, Tensor) and K.device.type != "cpu":
        return projection_from_K(K, img_hw, z_near_m, z_far_m).to(device)
    return _host_to_device(projection_from_K(K, img_hw, z_near_m, z_far_m), device)


def _host_to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``: on CUDA through pinned memory, without blocking the host (the caching host
    allocator keeps the pinned block until the copy is done)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _shapes(constants: GeometryConstants | None) -> ConstantCache | None:
    return None if constants is None else constants.shapes


def _gl_from_cam(device: torch.device, constants: GeometryConstants | None) -> Tensor:
    """(4, 4) float32 ``G`` on ``device`` (memoised in ``constants``)."""
    return cached(
        _shapes(constants), ("G", device), lambda: torch.tensor(GL_FROM_CAM, dtype=torch.float32, device=device), device
    )


def clip_from_centred(
    projection: Tensor, cam_from_centred: Tensor, *, constants: GeometryConstants | None = None
) -> Tensor:
    """``M = P32 @ (G @ T)`` in float32.

    projection: (4, 4) float32 from :func:`projection_from_K`, or (N, 4, 4): one per pose.
    cam_from_centred: (N, 4, 4) float32. constants: the renderer's memo of ``G`` (None: built per call).
    Returns (N, 4, 4) float32 on the poses' device.
    """
    gl = _gl_from_cam(cam_from_centred.device, constants)
    gl_from_centred = gl @ cam_from_centred  # (N, 4, 4): rows 1 and 2 negated, exact
    return projection.to(cam_from_centred.device) @ gl_from_centred


def vertices_to_clip(verts_centred: Tensor, clip_from_centred_: Tensor) -> Tensor:
    """Clip coordinates ``M @ (v, 1)`` of every vertex under every pose.

    verts_centred: (V, 3) float32 metres. clip_from_centred_: (N, 4, 4) float32.
    Returns (N, V, 4) float32 contiguous (x, y, z, w).
    """
    ones = torch.ones_like(verts_centred[:, :1])
    verts_h = torch.cat([verts_centred, ones], dim=1)  # (V, 4)
    return torch.matmul(verts_h, clip_from_centred_.transpose(1, 2)).contiguous()  # (N, V, 4)


def crop_bounds(crop_from_img: Tensor, crop_size_px: int, *, constants: GeometryConstants | None = None) -> Tensor:
    """Image-pixel positions of the first and last crop pixel centres (spec §3.3).

    crop_from_img: (N, 3, 3) float32 affine image-to-crop transforms.
    Returns (N, 4) float32 ``[x0, y0, x1, y1]`` = ``crop_from_img^-1`` applied (affine part, no division) to
    crop pixels ``(0, 0)`` and ``(S-1, S-1)``, with the float32 inverse as the reference computes it.
    """
    assert crop_from_img.ndim == 3 and crop_from_img.shape[1:] == (3, 3), crop_from_img.shape
    img_from_crop, _ = torch.linalg.inv_ex(crop_from_img.to(torch.float32))  # no error check: no host sync
    device = crop_from_img.device
    last = float(crop_size_px - 1)

    def corners_on_device() -> Tensor:
        return torch.tensor([[0.0, last], [0.0, last]], dtype=torch.float32, device=device)  # (2, 2)

    corners = cached(_shapes(constants), ("corners", last, device), corners_on_device, device)
    pts = img_from_crop[:, :2, :2] @ corners + img_from_crop[:, :2, 2:]  # (N, 2, 2): column k = corner k
    return pts.transpose(1, 2).reshape(-1, 4)  # [x0, y0, x1, y1]


def full_frame_exact_bounds(n: int, img_hw: tuple[int, int], device: str | torch.device) -> Tensor:
    """Bounds for an (H, W) render in the OpenCV integer-pixel-centre convention.

    NDC -1..1 then spans ``u = -0.5 .. W - 0.5`` and ``v = -0.5 .. H - 0.5`` (pixel edges), so raster pixel
    ``(j, i)`` of an (H, W) target samples ``(j, i)`` after the flip. Returns (n, 4) float32.
    """
    h, w = img_hw
    row = torch.tensor([-0.5, -0.5, w - 0.5, h - 0.5], dtype=torch.float32, device=device)
    return row.expand(n, 4).contiguous()


def crop_scale_offset(
    bounds: Tensor, img_hw: tuple[int, int], *, constants: GeometryConstants | None = None
) -> tuple[Tensor, Tensor]:
    """The crop transform of spec §3.3 as per-axis ``scale`` and ``offset``, float32 as in the reference.

    bounds: (N, 4) float32 ``[x0, y0, x1, y1]`` image pixels. img_hw: (H, W) of the full image.
    Returns (N, 2) ``[ax, ay]`` and (N, 2) ``[bx, by]`` with ``clip_x' = clip_x * ax + clip_w * bx`` and
    ``clip_y' = clip_y * ay + clip_w * by``; ``l = x0, r = x1, t = H - y0, b = H - y1``,
    ``ax = W / (r - l)`` (evaluated as torch does a scalar over a tensor: ``(r - l).reciprocal() * W``),
    ``bx = ((W - r) - l) / (r - l)``, ``ay = H / (t - b)``, ``by = ((H - t) - b) / (t - b)``.
    """
    h, w = int(img_hw[0]), int(img_hw[1])
    device = bounds.device

    def make() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        order = torch.tensor([0, 3, 2, 1], dtype=torch.int64, device=device)  # -> [x0, y1, x1, y0]
        signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float32, device=device)
        shift = torch.tensor([0.0, h, 0.0, h], dtype=torch.float32, device=device)
        size = torch.tensor([w, h], dtype=torch.float32, device=device)
        return order, signs, shift, size

    order, signs, shift, size = cached(_shapes(constants), ("crop", h, w, device), make, device)
    # [[l, b], [r, t]]: x0 * 1 + 0 and H + y * -1 (= H - y) are exact
    low_high = torch.addcmul(shift, bounds[:, order], signs).view(-1, 2, 2)
    low, high = low_high[:, 0], low_high[:, 1]
    extent = high - low  # [r - l, t - b]
    return extent.reciprocal() * size, (size - high - low) / extent


def crop_clip_coefficients(bounds: Tensor, img_hw: tuple[int, int]) -> Tensor:
    """Per-hypothesis coefficients of the crop transform (spec §3.3), float32 as in the reference.

    bounds: (N, 4) float32 ``[x0, y0, x1, y1]`` image pixels. img_hw: (H, W) of the full image.
    Returns (N, 4) float32 ``[ax, bx, ay, by]`` with ``clip_x' = clip_x * ax + clip_w * bx`` and
    ``clip_y' = clip_y * ay + clip_w * by`` (see :func:`crop_scale_offset`).
    """
    scale, offset = crop_scale_offset(bounds, img_hw)
    return torch.stack([scale, offset], dim=-1).reshape(-1, 4)


def apply_crop_to_clip(clip: Tensor, coefficients: Tensor) -> Tensor:
    """clip: (N, V, 4) float32; coefficients: (N, 4) from :func:`crop_clip_coefficients`.
    Returns a new (N, V, 4) float32 contiguous tensor (z and w unchanged)."""
    return apply_crop_to_clip_(clip.clone(memory_format=torch.contiguous_format), coefficients[:, 0::2],
                               coefficients[:, 1::2])


def apply_crop_to_clip_(clip: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """In place: ``clip[..., :2] = clip[..., :2] * scale + clip[..., 3:4] * offset`` (float32 products, then sum).

    clip: (N, V, 4) float32, modified and returned. scale, offset: (N, 2) from :func:`crop_scale_offset`.
    """
    xy = clip[..., :2] * scale[:, None, :]
    torch.add(xy, clip[..., 3:4] * offset[:, None, :], out=clip[..., :2])
    return clip


def ndc_pixel_centres(size: int, device: str | torch.device = "cpu") -> Tensor:
    """NDC coordinate of raster pixel centres ``0..size-1`` along one axis, float32, as nvdiffrast computes it:
    ``xs * j + xo`` with ``xs = float32(2/size)``, ``xo = float32(1/size) - 1``."""
    xs = np.float32(2.0) / np.float32(size)
    xo = np.float32(1.0) / np.float32(size) - np.float32(1.0)
    j = torch.arange(size, dtype=torch.float32, device=device)
    return j * float(xs) + float(xo)
