"""Random RGB-D observations of one object, generated on the compute device with the project's renderer.

Each observation is a full frame (``hw``) of the object at a random pose in a working range that scales
with its diameter, composited over a random background plane and distractor clutter (rectangles and
discs at random depths, some in front of the object: occlusion), with colour / lighting jitter, pixel
noise, depth noise growing with distance, random holes, edge dropout, millimetre quantisation and a
visible-object mask that is randomly eroded. The object is rendered with the OpenCV pixel-centre
convention (``pixel_centre_exact``), as the bundled sequence is.

Frames may be windows of a larger virtual sensor: with ``fixed_K`` None each sample gets its own focal
lengths and a principal point that may lie far from the frame centre, so the object is seen off-axis
(perspective varies) while the frame stays small. Everything is a function of the ``torch.Generator``
passed in (deterministic for a seed on one device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from foundationpose.mesh import ObjectModel
from foundationpose.render import Renderer

__all__ = ["DEMO_K", "SceneBatch", "SceneConfig", "random_rotations", "sample_scenes"]

DEMO_K = np.array(  # the official demo intrinsics at 640 x 480 (spec §7.1), also the bundled sequence's
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SceneConfig:
    """Ranges of the random observations; distances in object diameters where noted."""

    distance_diameters: tuple[float, float] = (2.5, 5.5)  # object centre depth / diameter (demo: ~3.5)
    focal_scale: tuple[float, float] = (0.75, 1.35)  # times the demo focal lengths (fixed_K None)
    anisotropy: tuple[float, float] = (0.7, 1.4)  # fy / fx ratio range (demo: 1.3)
    principal_offset: float = 0.45  # principal point within +- this fraction of the frame from its centre
    centre_jitter: float = 0.12  # object centre pixel within +- this fraction of the frame from its centre
    max_distractors: int = 5
    occluder_probability: float = 0.35  # one distractor placed over the object, in front of it
    depth_noise_m_at_1m: float = 0.0025  # std of depth noise at 1 m (grows with z^2), times U(0, 1)
    hole_fraction: float = 0.04  # random pixel dropout up to this fraction
    blob_hole_probability: float = 0.5
    no_background_depth_probability: float = 0.15  # background beyond the sensor range (depth 0)
    mask_erosion_px: int = 2  # the visible mask is eroded by U{0..this} pixels

    def __post_init__(self) -> None:
        for name in ("distance_diameters", "focal_scale", "anisotropy"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {(lo, hi)}")


@dataclass(slots=True)
class SceneBatch:
    """n observations of one size on the device.

    rgb: (n, H, W, 3) uint8 RGB.  depth: (n, H, W) float32 metres (mm-quantised, 0 = no reading).
    mask: (n, H, W) bool visible object (eroded).  Ks: (n, 3, 3) float64 numpy intrinsics.
    cam_from_centred: (n, 4, 4) float32 ground-truth poses of the centred mesh.
    """

    rgb: Tensor
    depth: Tensor
    mask: Tensor
    Ks: np.ndarray
    cam_from_centred: Tensor

    def __len__(self) -> int:
        return int(self.rgb.shape[0])


def _uniform(gen: torch.Generator, n: int, lo: float, hi: float, device: torch.device | None = None) -> Tensor:
    """(n,) uniform in [lo, hi): float64 on the CPU when ``device`` is None (host parameters), else float32
    on ``device`` (pixel-level randomness, drawn from the device generator)."""
    if device is None:
        return torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    return torch.rand(n, generator=gen, device=device, dtype=torch.float32) * (hi - lo) + lo


def random_rotations(n: int, gen: torch.Generator) -> Tensor:
    """(n, 3, 3) float64 rotations uniform on SO(3) (normalised Gaussian quaternions), CPU."""
    q = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    w, x, y, z = q.unbind(1)
    return torch.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
            2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
            2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
        ],
        dim=1,
    ).reshape(n, 3, 3)


def _intrinsics(n: int, hw: tuple[int, int], cfg: SceneConfig, gen: torch.Generator, fixed_K: np.ndarray | None) -> np.ndarray:
    if fixed_K is not None:
        return np.repeat(np.asarray(fixed_K, dtype=np.float64)[None], n, axis=0)
    h, w = hw
    scale = _uniform(gen, n, *cfg.focal_scale)
    aniso = torch.exp(_uniform(gen, n, math.log(cfg.anisotropy[0]), math.log(cfg.anisotropy[1])))
    base = math.sqrt(DEMO_K[0, 0] * DEMO_K[1, 1])
    fx = base * scale / aniso.sqrt()
    fy = base * scale * aniso.sqrt()
    cx = w / 2 + _uniform(gen, n, -cfg.principal_offset, cfg.principal_offset) * w
    cy = h / 2 + _uniform(gen, n, -cfg.principal_offset, cfg.principal_offset) * h
    Ks = np.zeros((n, 3, 3))
    Ks[:, 0, 0], Ks[:, 1, 1], Ks[:, 0, 2], Ks[:, 1, 2], Ks[:, 2, 2] = fx, fy, cx, cy, 1.0
    return Ks


def _ground_truth(n: int, hw: tuple[int, int], Ks: np.ndarray, diameter: float, cfg: SceneConfig,
                  gen: torch.Generator) -> Tensor:
    h, w = hw
    z = _uniform(gen, n, *cfg.distance_diameters) * diameter
    u = w / 2 + _uniform(gen, n, -cfg.centre_jitter, cfg.centre_jitter) * w
    v = h / 2 + _uniform(gen, n, -cfg.centre_jitter, cfg.centre_jitter) * h
    K = torch.as_tensor(Ks)
    poses = torch.zeros(n, 4, 4, dtype=torch.float64)
    poses[:, :3, :3] = random_rotations(n, gen)
    poses[:, 0, 3] = (u - K[:, 0, 2]) / K[:, 0, 0] * z
    poses[:, 1, 3] = (v - K[:, 1, 2]) / K[:, 1, 1] * z
    poses[:, 2, 3] = z
    poses[:, 3, 3] = 1.0
    return poses.to(torch.float32)


def _smooth_noise(n: int, c: int, hw: tuple[int, int], cells: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """(n, c, H, W) float32 in about [0, 1]: bilinear upsampling of a (cells x cells) random grid."""
    coarse = torch.rand(n, c, cells, cells, generator=gen, device=device)
    return F.interpolate(coarse, size=hw, mode="bilinear", align_corners=False)


def _background(n: int, hw: tuple[int, int], obj_z: Tensor, cfg: SceneConfig, gen: torch.Generator,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """Random textured background: (n, 3, H, W) colour in [0, 1] and (n, H, W) depth of a tilted plane."""
    h, w = hw
    colour = 0.15 + 0.7 * _smooth_noise(n, 3, hw, 4, gen, device)
    detail = _smooth_noise(n, 1, hw, 24, gen, device)
    checker_px = _uniform(gen, n, 8.0, 48.0, device)[:, None, None, None]
    ys = torch.arange(h, device=device, dtype=torch.float32)[:, None]
    xs = torch.arange(w, device=device, dtype=torch.float32)[None]
    checker = ((torch.floor(xs / checker_px) + torch.floor(ys / checker_px)) % 2)
    use_checker = (torch.rand(n, 1, 1, 1, generator=gen, device=device) < 0.4).float()
    pattern = use_checker * (0.7 + 0.3 * checker) + (1 - use_checker) * (0.6 + 0.6 * detail)
    colour = (colour * pattern).clamp(0, 1)
    z0 = obj_z + _uniform(gen, n, 0.05, 0.8, device)
    tilt_x = _uniform(gen, n, -0.3, 0.3, device)[:, None, None] * z0[:, None, None]
    tilt_y = _uniform(gen, n, -0.3, 0.3, device)[:, None, None] * z0[:, None, None]
    depth = z0[:, None, None] + tilt_x * (xs / w - 0.5) + tilt_y * (ys / h - 0.5)
    far = torch.rand(n, generator=gen, device=device) < cfg.no_background_depth_probability
    depth = torch.where(far[:, None, None], torch.zeros_like(depth), depth)
    return colour, depth


def _distractors(colour: Tensor, depth: Tensor, obj_box: Tensor, obj_z: Tensor, diameter: float, cfg: SceneConfig,
                 gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Paint up to ``max_distractors`` rectangles / discs with their own depth over the layers (z-test later).

    Returns the distractor colour (n, 3, H, W) and depth (n, H, W) (0 where none), nearest distractor wins.
    """
    n, _, h, w = colour.shape
    device = colour.device
    ys = torch.arange(h, device=device, dtype=torch.float32)[None, :, None]
    xs = torch.arange(w, device=device, dtype=torch.float32)[None, None, :]
    d_colour = torch.zeros_like(colour)
    d_depth = torch.zeros_like(depth)
    box_w = (obj_box[:, 2] - obj_box[:, 0]).clamp(min=4.0)
    box_h = (obj_box[:, 3] - obj_box[:, 1]).clamp(min=4.0)
    for k in range(cfg.max_distractors):
        active = torch.rand(n, generator=gen, device=device) < (0.6 if k else cfg.occluder_probability)
        if k == 0:  # the occluder: over the object box, in front of the object
            cx = obj_box[:, 0] + torch.rand(n, generator=gen, device=device) * box_w
            cy = obj_box[:, 1] + torch.rand(n, generator=gen, device=device) * box_h
            half_w = box_w * _uniform(gen, n, 0.1, 0.35, device)
            half_h = box_h * _uniform(gen, n, 0.1, 0.35, device)
            z = obj_z - diameter * _uniform(gen, n, 0.6, 2.0, device)
        else:
            cx = torch.rand(n, generator=gen, device=device) * w
            cy = torch.rand(n, generator=gen, device=device) * h
            half_w = _uniform(gen, n, 0.03, 0.2, device) * w
            half_h = _uniform(gen, n, 0.03, 0.2, device) * h
            z = obj_z + diameter * _uniform(gen, n, -0.3, 3.0, device)
        dx = (xs - cx[:, None, None]) / half_w[:, None, None]
        dy = (ys - cy[:, None, None]) / half_h[:, None, None]
        disc = torch.rand(n, generator=gen, device=device) < 0.5
        inside = torch.where(disc[:, None, None], dx * dx + dy * dy <= 1.0, (dx.abs() <= 1) & (dy.abs() <= 1))
        inside &= active[:, None, None] & (z[:, None, None] > 0.05)
        # slanted surface: depth varies across the shape; colour: a base colour with a shading gradient
        slope = _uniform(gen, n, -0.2, 0.2, device)[:, None, None] * diameter
        z_map = z[:, None, None] + slope * dx.clamp(-1, 1)
        base = torch.rand(n, 3, 1, 1, generator=gen, device=device)
        shade = 0.75 + 0.25 * torch.tanh(dy)[:, None]
        nearer = inside & ((d_depth == 0) | (z_map < d_depth))
        d_depth = torch.where(nearer, z_map, d_depth)
        d_colour = torch.where(nearer[:, None], (base * shade).clamp(0, 1), d_colour)
    return d_colour, d_depth


def _erode(mask: Tensor, radius: Tensor) -> Tensor:
    """Per-sample binary erosion of (n, H, W) bool masks by ``radius`` (n,) int pixels (0 = unchanged)."""
    out = mask
    for r in range(1, int(radius.max().item()) + 1 if radius.numel() else 1):
        eroded = -F.max_pool2d(-out.float()[:, None], 3, stride=1, padding=1)[:, 0] > 0.5
        out = torch.where((radius >= r)[:, None, None], eroded, out)
    return out


@torch.no_grad()
def sample_scenes(
    obj: ObjectModel,
    renderer: Renderer,
    n: int,
    hw: tuple[int, int],
    gen: torch.Generator,
    device_gen: torch.Generator,
    cfg: SceneConfig = SceneConfig(),
    fixed_K: np.ndarray | None = None,
) -> SceneBatch:
    """``n`` random observations of ``obj`` at image size ``hw``.

    gen: CPU generator (poses, intrinsics); device_gen: generator on the renderer's device (pixels).
    fixed_K: one (3, 3) K for every frame (e.g. the demo's, for held-out evaluation views); None: random.
    """
    device = renderer.device
    h, w = hw
    Ks = _intrinsics(n, hw, cfg, gen, fixed_K)
    poses = _ground_truth(n, hw, Ks, obj.diameter, cfg, gen).to(device)
    render = renderer.render_full_frame(obj.tensors, poses, Ks, hw, pixel_centre_exact=True)
    obj_mask = render.mask  # (n, H, W)
    obj_depth = render.xyz_cam[..., 2]
    obj_z = poses[:, 2, 3]
    # colour / lighting jitter of the object: global gain, per-channel gain, offset
    gain = _uniform(device_gen, n, 0.65, 1.3, device)[:, None, None, None]
    tint = _uniform(device_gen, 3 * n, 0.85, 1.15, device).reshape(n, 3, 1, 1)
    offset = _uniform(device_gen, n, -0.06, 0.06, device)[:, None, None, None]
    obj_rgb = (render.rgb.permute(0, 3, 1, 2) * gain * tint + offset).clamp(0, 1)
    bg_rgb, bg_depth = _background(n, hw, obj_z, cfg, device_gen, device)
    ys = torch.arange(h, device=device)[None, :, None].expand(n, h, w)
    xs = torch.arange(w, device=device)[None, None, :].expand(n, h, w)
    big = torch.tensor(1 << 20, device=device)
    box = torch.stack([
        torch.where(obj_mask, xs, big).amin(dim=(1, 2)), torch.where(obj_mask, ys, big).amin(dim=(1, 2)),
        torch.where(obj_mask, xs, -1).amax(dim=(1, 2)), torch.where(obj_mask, ys, -1).amax(dim=(1, 2)),
    ], dim=1).float()  # (n, 4) x0, y0, x1, y1 (meaningless where the object is not visible)
    d_rgb, d_depth = _distractors(bg_rgb, bg_depth, box, obj_z, obj.diameter, cfg, device_gen)
    # z-test of the three layers: object, distractors, background (background loses to both)
    inf = torch.tensor(float("inf"), device=device)
    z_obj = torch.where(obj_mask, obj_depth, inf)
    z_dis = torch.where(d_depth > 0, d_depth, inf)
    visible = obj_mask & (z_obj <= z_dis)
    dis_front = (d_depth > 0) & ~visible
    rgb = torch.where(visible[:, None], obj_rgb, torch.where(dis_front[:, None], d_rgb, bg_rgb))
    depth = torch.where(visible, obj_depth, torch.where(dis_front, d_depth, bg_depth))
    # sensor effects
    rgb = rgb + torch.randn(rgb.shape, generator=device_gen, device=device) * _uniform(
        device_gen, n, 0.0, 0.03, device)[:, None, None, None]
    rgb_u8 = (rgb.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    sigma = cfg.depth_noise_m_at_1m * _uniform(device_gen, n, 0.0, 1.0, device)[:, None, None]
    depth = depth + torch.randn(depth.shape, generator=device_gen, device=device) * sigma * depth * depth
    holes = torch.rand(depth.shape, generator=device_gen, device=device) < (
        cfg.hole_fraction * _uniform(device_gen, n, 0.0, 1.0, device)[:, None, None])
    blobs = _smooth_noise(n, 1, hw, 12, device_gen, device)[:, 0] > _uniform(device_gen, n, 0.82, 1.0, device)[:, None, None]
    blobs &= (torch.rand(n, generator=device_gen, device=device) < cfg.blob_hole_probability)[:, None, None]
    edge = (F.max_pool2d(depth[:, None], 3, 1, 1) + F.max_pool2d(-depth[:, None], 3, 1, 1))[:, 0] > 0.02
    edge &= torch.rand(depth.shape, generator=device_gen, device=device) < 0.5
    depth = torch.where(holes | blobs | edge, torch.zeros_like(depth), depth)
    depth = torch.round(depth.clamp(min=0) * 1000.0) / 1000.0  # uint16 millimetres, as a sensor delivers
    depth = torch.where(depth < 0.001, torch.zeros_like(depth), depth).to(torch.float32)
    radius = torch.randint(0, cfg.mask_erosion_px + 1, (n,), generator=device_gen, device=device)
    mask = _erode(visible, radius)
    mask = torch.where(mask.flatten(1).any(1)[:, None, None], mask, visible)  # never erode a mask away
    return SceneBatch(rgb=rgb_u8, depth=depth, mask=mask, Ks=Ks, cam_from_centred=poses)
