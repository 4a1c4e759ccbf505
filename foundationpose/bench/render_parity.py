"""nvdiffrast vs the torch rasteriser on one CUDA machine: prints parity figures as JSON.

    python -m foundationpose.bench.render_parity [--n 252] [--seed 0] [--mesh PATH] [--cpu-device cuda|cpu] [--out FILE]

Renders a procedural textured object (or ``--mesh``) at ``n`` random poses in front of the demo camera
(640 x 480) into refiner crops (ratio 1.2) with both backends and reports, over all crops:

* ``mask``: IoU, mismatching pixels, worst per-crop IoU;
* ``raster``: fraction of pixels covered by both that picked the same triangle, max |barycentric| and
  |z/w| differences where they did (raw ``dr.rasterize`` against :func:`cpu_raster.rasterize`);
* ``xyz`` (metres) and ``rgb``: max / mean / p99 absolute error over pixels covered by both, and the
  fraction above 1e-5 m / 1e-4;
* median wall times (host-synchronised) of each backend.

Needs CUDA and nvdiffrast; otherwise prints ``{"error": ...}`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.report import emit_json_report
from foundationpose.render.base import RenderOutput
from foundationpose.render.cpu_raster import CpuRasterizer, rasterize
from foundationpose.synthetic.pillow_box import pillow_box_arrays
from foundationpose.render.projection import (
    apply_crop_to_clip,
    clip_from_centred,
    crop_bounds,
    crop_clip_coefficients,
    projection_from_K,
    vertices_to_clip,
)

__all__ = ["DEMO_K", "DEMO_HW", "random_poses", "compare_renders", "compare_rasters", "run", "main"]

DEMO_K = np.array(
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)
DEMO_HW = (480, 640)
CROP_RATIO = 1.2  # refiner crops (spec §2.8)


def random_poses(n: int, seed: int, K: np.ndarray = DEMO_K, img_hw: tuple[int, int] = DEMO_HW) -> Tensor:
    """(n, 4, 4) float32 CPU poses: uniform random rotations, centre 0.35-1.0 m deep, projecting inside the image."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    rot = np.stack(
        [
            np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
            np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
            np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1),
        ],
        1,
    )
    h, wd = img_hw
    depth = rng.uniform(0.35, 1.0, n)
    u = rng.uniform(0.15 * wd, 0.85 * wd, n)
    v = rng.uniform(0.15 * h, 0.85 * h, n)
    t = np.stack([(u - K[0, 2]) / K[0, 0] * depth, (v - K[1, 2]) / K[1, 1] * depth, depth], -1)
    poses = np.tile(np.eye(4), (n, 1, 1))
    poses[:, :3, :3], poses[:, :3, 3] = rot, t
    return torch.tensor(poses, dtype=torch.float32)


def _abs_stats(diff: Tensor, threshold: float) -> dict[str, float]:
    if diff.numel() == 0:
        return {"max": 0.0, "mean": 0.0, "p99": 0.0, f"frac_gt_{threshold:g}": 0.0}
    flat = diff.double().flatten()
    sample = flat if flat.numel() <= 1 << 24 else flat[torch.randperm(flat.numel(), device=flat.device)[: 1 << 24]]
    return {
        "max": flat.max().item(),
        "mean": flat.mean().item(),
        "p99": torch.quantile(sample, 0.99).item(),
        f"frac_gt_{threshold:g}": (flat > threshold).double().mean().item(),
    }


def compare_renders(a: RenderOutput, b: RenderOutput) -> dict[str, Any]:
    """Mask IoU and xyz / rgb error statistics of two renders of the same hypotheses (same shapes)."""
    inter = (a.mask & b.mask).flatten(1).sum(1).double()
    union = (a.mask | b.mask).flatten(1).sum(1).double()
    per_iou = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))
    both = a.mask & b.mask
    xyz_err = (a.xyz_cam - b.xyz_cam).abs().amax(-1)[both]
    rgb_err = (a.rgb - b.rgb).abs().amax(-1)[both]
    return {
        "mask": {
            "iou": (inter.sum() / union.sum().clamp_min(1)).item(),
            "min_iou_per_crop": per_iou.min().item(),
            "mismatch_px": int((a.mask ^ b.mask).sum().item()),
            "covered_px": int(union.sum().item()),
        },
        "xyz_m": _abs_stats(xyz_err, 1e-5),
        "rgb": _abs_stats(rgb_err, 1e-4),
        "background_zero": bool(((a.rgb[~a.mask] == 0).all() & (b.rgb[~b.mask] == 0).all()).item()),
    }


def compare_rasters(a: Tensor, b: Tensor) -> dict[str, float]:
    """Compare two ``(N, Hr, Wr, 4)`` rasteriser outputs ``(b0, b1, z/w, tri + 1)``."""
    both = (a[..., 3] > 0) & (b[..., 3] > 0)
    same = both & (a[..., 3] == b[..., 3])
    return {
        "same_triangle_frac": (same.sum() / both.sum().clamp_min(1)).item(),
        "bary_max_abs": (a[..., :2] - b[..., :2]).abs()[same].max().item() if same.any() else 0.0,
        "zw_max_abs": (a[..., 2] - b[..., 2]).abs()[same].max().item() if same.any() else 0.0,
    }


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def _load_mesh(path: str | None, device: torch.device) -> tuple[Any, float]:
    """(mesh tensors, diameter in metres) of ``path`` or of the procedural object."""
    if path is not None:
        from foundationpose.mesh import load_object

        obj = load_object(path, device=device)
        return obj.tensors, obj.diameter
    arrays = pillow_box_arrays(device=device)
    verts = arrays["verts"].double()
    diameter = float(torch.cdist(verts, verts).max())
    try:
        from foundationpose.mesh import MeshTensors
    except ImportError:  # foundationpose.mesh needs trimesh; the renderer only reads the fields
        return SimpleNamespace(**arrays), diameter
    return MeshTensors(**arrays), diameter


def run(n: int = 252, seed: int = 0, mesh_path: str | None = None, cpu_device: str = "cuda") -> dict[str, Any]:
    """Render with both backends and return the parity figures (see the module docstring)."""
    from foundationpose.crop import crop_windows
    from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer

    device = torch.device("cuda", torch.cuda.current_device())
    mesh, diameter = _load_mesh(mesh_path, device)
    verts = mesh.verts
    poses = random_poses(n, seed).to(device)
    crops = crop_windows(poses, DEMO_K, diameter, CROP_RATIO)
    nv = NvdiffrastRenderer(device)
    cpu = CpuRasterizer(cpu_device)
    out_nv = nv.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    torch.cuda.synchronize()
    cpu_mesh = mesh if cpu_device.startswith("cuda") else _to(mesh, cpu_device)
    out_cpu = cpu.render(cpu_mesh, poses.to(cpu_device), DEMO_K, DEMO_HW, crops.to(cpu_device))
    out_cpu = RenderOutput(out_cpu.rgb.to(device), out_cpu.xyz_cam.to(device), out_cpu.mask.to(device))

    # Raw rasteriser outputs on the same clip coordinates.
    s = nv.config.crop_size_px
    clip = vertices_to_clip(verts, clip_from_centred(projection_from_K(DEMO_K, DEMO_HW).to(device), poses))
    clip = apply_crop_to_clip(clip, crop_clip_coefficients(crop_bounds(crops, s), DEMO_HW))
    faces = mesh.faces.to(torch.int32).contiguous()
    rast_nv = torch.cat([nv._dr.rasterize(nv._ctx, c, faces, resolution=(s, s))[0] for c in clip.split(512)])
    rast_cpu = rasterize(clip, faces, (s, s))

    report: dict[str, Any] = {
        "n": n,
        "seed": seed,
        "faces": int(mesh.faces.shape[0]),
        "mesh": mesh_path or "pillow_box",
        "diameter_m": diameter,
        "cpu_rasterizer_device": cpu_device,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "nvdiffrast": getattr(nv._dr, "__version__", None) or _nvdiffrast_version(),
        "render": compare_renders(out_nv, out_cpu),
        "raster": compare_rasters(rast_nv, rast_cpu),
        "ms_nvdiffrast_render": _median_ms(lambda: nv.render(mesh, poses, DEMO_K, DEMO_HW, crops), 10),
        "ms_cpu_rasterizer_render": _median_ms(
            lambda: cpu.render(cpu_mesh, poses.to(cpu_device), DEMO_K, DEMO_HW, crops.to(cpu_device)), 2
        ),
    }
    return report


def _to(mesh: Any, device: str) -> Any:
    if hasattr(mesh, "to"):
        return mesh.to(device)
    return SimpleNamespace(**{k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in vars(mesh).items()})


def _nvdiffrast_version() -> str | None:
    try:
        import nvdiffrast

        return str(getattr(nvdiffrast, "__version__", None))
    except ImportError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundationpose.bench.render_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=252, help="number of random poses (default 252)")
    parser.add_argument("--seed", type=int, default=0, help="pose RNG seed (default 0)")
    parser.add_argument("--mesh", default=None, help="mesh file (metres) instead of the procedural object")
    parser.add_argument("--cpu-device", default="cuda", help="device of the torch rasteriser (default cuda)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    from foundationpose.render.nvdiffrast_backend import has_nvdiffrast

    if not has_nvdiffrast():
        print(json.dumps({"error": "needs CUDA and the nvdiffrast package"}))
        return 2
    report = run(args.n, args.seed, args.mesh, args.cpu_device)
    emit_json_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
