"""nvdiffrast vs another backend (the torch rasteriser or the Triton one) on one CUDA machine: parity as JSON.

    python -m foundationpose.bench.render_parity [--backend cpu|triton] [--n 252] [--seed 0] [--mesh PATH]
        [--subdivisions 9] [--cpu-device cuda|cpu] [--graph] [--out FILE]

Renders a procedural textured object (a pillowed box of ``12 subdivisions^2`` faces: 1 = a 12-face box, 29 =
10 092 faces; or ``--mesh``) at ``n`` random poses in front of the demo camera (640 x 480) into refiner crops
(ratio 1.2) with nvdiffrast and ``--backend`` and reports, over all crops:

* ``mask``: IoU, mismatching pixels, worst per-crop IoU;
* ``raster``: fraction of pixels covered by both that picked the same triangle, max |barycentric| and
  |z/w| differences where they did (raw ``dr.rasterize`` against :func:`cpu_raster.rasterize`);
* ``xyz`` (metres) and ``rgb``: max / mean / p99 absolute error over pixels covered by both, and the
  fraction above 1e-5 m / 1e-4;
* median wall times (host-synchronised) of each backend (``--backend cpu``, with the raw rasteriser outputs
  compared as ``raster``); with ``--backend triton`` instead host-synchronised p50 / p90 wall times of both
  backends at batch ``n`` and batch 1 (``timing_ms``), and with ``--graph`` a CUDA graph capture of the Triton
  render: replayed on new poses, its outputs must equal an eager render's (``graph``).

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
from foundationpose.render.base import RenderConfig, RenderOutput
from foundationpose.render.cpu_raster import CpuRasterizer, rasterize
from foundationpose.render.projection import (
    apply_crop_to_clip,
    clip_from_centred,
    crop_bounds,
    crop_clip_coefficients,
    projection_from_K,
    vertices_to_clip,
)
from foundationpose.synthetic.pillow_box import pillow_box_arrays

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


def _wall_ms(fn: Callable[[], object], repeats: int) -> np.ndarray:
    """Host-synchronised wall times (ms) of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return np.asarray(times)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return float(np.median(_wall_ms(fn, repeats)))


def _p50_p90_ms(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    fn()  # warm-up (JIT, scratch, caches)
    times = _wall_ms(fn, repeats)
    return {"p50": float(np.percentile(times, 50)), "p90": float(np.percentile(times, 90)), "repeats": repeats}


def _load_mesh(path: str | None, device: torch.device, subdivisions: int = 9) -> tuple[Any, float]:
    """(mesh tensors, diameter in metres) of ``path`` or of the procedural object."""
    if path is not None:
        from foundationpose.mesh import load_object

        obj = load_object(path, device=device)
        return obj.tensors, obj.diameter
    arrays = pillow_box_arrays(subdivisions=subdivisions, device=device)
    verts = arrays["verts"].double()
    diameter = float(torch.cdist(verts, verts).max())
    try:
        from foundationpose.mesh import MeshTensors
    except ImportError:  # foundationpose.mesh needs trimesh; the renderer only reads the fields
        return SimpleNamespace(**arrays), diameter
    return MeshTensors(**arrays), diameter


def run(
    n: int = 252,
    seed: int = 0,
    mesh_path: str | None = None,
    cpu_device: str = "cuda",
    *,
    backend: str = "cpu",
    subdivisions: int = 9,
    graph: bool = False,
) -> dict[str, Any]:
    """Render with nvdiffrast and ``backend`` and return the parity figures (see the module docstring)."""
    if backend == "triton":
        return run_triton(n, seed, mesh_path, subdivisions=subdivisions, graph=graph)
    if backend != "cpu":
        raise ValueError(f"backend must be 'cpu' or 'triton', got {backend!r}")
    from foundationpose.crop import crop_windows
    from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer

    device = torch.device("cuda", torch.cuda.current_device())
    mesh, diameter = _load_mesh(mesh_path, device, subdivisions)
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
        "mesh": mesh_path or f"pillow_box(subdivisions={subdivisions})",
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


def run_triton(
    n: int = 252,
    seed: int = 0,
    mesh_path: str | None = None,
    *,
    subdivisions: int = 9,
    graph: bool = False,
    crop_size_px: int = 160,
    repeats: int = 30,
) -> dict[str, Any]:
    """nvdiffrast vs the Triton renderer: render parity, timings at batch ``n`` and 1, optional graph check."""
    from foundationpose.crop import crop_windows
    from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer
    from foundationpose.render.triton_raster import TritonRasterizer

    device = torch.device("cuda", torch.cuda.current_device())
    config = RenderConfig(crop_size_px=crop_size_px)
    mesh, diameter = _load_mesh(mesh_path, device, subdivisions)
    poses = random_poses(n, seed).to(device)
    crops = crop_windows(poses, DEMO_K, diameter, CROP_RATIO, S=crop_size_px)
    nv = NvdiffrastRenderer(device, config)
    tr = TritonRasterizer(device, config)
    start = time.perf_counter()
    out_tr = tr.render(mesh, poses, DEMO_K, DEMO_HW, crops)  # JIT-compiles the kernels
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    out_nv = nv.render(mesh, poses, DEMO_K, DEMO_HW, crops)
    torch.cuda.synchronize()
    timing: dict[str, Any] = {}
    for label, sl in ((f"batch_{n}", slice(None)), ("batch_1", slice(0, 1))):
        p, c = poses[sl].contiguous(), crops[sl].contiguous()
        timing[label] = {
            name: _p50_p90_ms(lambda r=r, p=p, c=c: r.render(mesh, p, DEMO_K, DEMO_HW, c), repeats)
            for name, r in (("nvdiffrast", nv), ("triton", tr))
        }
        timing[label]["triton_speedup_p50"] = timing[label]["nvdiffrast"]["p50"] / timing[label]["triton"]["p50"]
    report: dict[str, Any] = {
        "backend": "triton",
        "n": n,
        "seed": seed,
        "faces": int(mesh.faces.shape[0]),
        "mesh": mesh_path or f"pillow_box(subdivisions={subdivisions})",
        "diameter_m": diameter,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "nvdiffrast": getattr(nv._dr, "__version__", None) or _nvdiffrast_version(),
        "triton_first_call_s": first_call_s,
        "render": compare_renders(out_nv, out_tr),
        "timing_ms": timing,
    }
    if graph:
        report["graph"] = {
            mode: _graph_check(
                mesh, poses, crops, diameter, config, repeats, use_caller_stream=(mode == "caller_stream")
            )
            for mode in ("caller_stream", "side_stream")
        }
    return report


def _graph_check(
    mesh: Any,
    poses: Tensor,
    crops: Tensor,
    diameter: float,
    config: RenderConfig,
    repeats: int,
    *,
    use_caller_stream: bool,
) -> dict[str, Any]:
    """Capture one Triton render into fixed buffers in a CUDA graph, replay it on other poses, compare with eager."""
    from foundationpose.crop import crop_windows
    from foundationpose.render.triton_raster import TritonRasterizer

    try:
        device = poses.device
        renderer = TritonRasterizer(device, config, use_caller_stream=use_caller_stream)
        n, s = poses.shape[0], config.crop_size_px
        static_poses, static_crops = poses.clone(), crops.clone()
        static_out = RenderOutput.empty(n, (s, s), device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch recommends before capture
            for _ in range(2):
                renderer.render(mesh, static_poses, DEMO_K, DEMO_HW, static_crops, out=static_out)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            renderer.render(mesh, static_poses, DEMO_K, DEMO_HW, static_crops, out=static_out)
        new_poses = random_poses(n, 12345).to(device)
        static_poses.copy_(new_poses)
        static_crops.copy_(crop_windows(new_poses, DEMO_K, diameter, CROP_RATIO, S=s))
        g.replay()
        torch.cuda.synchronize()
        eager = renderer.render(mesh, static_poses.clone(), DEMO_K, DEMO_HW, static_crops.clone())
        torch.cuda.synchronize()
        equal = {f: bool(torch.equal(getattr(static_out, f), getattr(eager, f))) for f in ("rgb", "xyz", "mask")}
        return {
            "captured": True,
            "replay_equals_eager": all(equal.values()),
            "equal": equal,
            "covered_px": int(eager.mask.sum().item()),
            "replay_ms": _p50_p90_ms(g.replay, repeats),
        }
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other figures still come back
        return {"captured": False, "error": f"{type(exc).__name__}: {exc}"}


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return None


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
    parser.add_argument("--backend", choices=("cpu", "triton"), default="cpu",
                        help="backend compared with nvdiffrast (default cpu: the torch rasteriser)")
    parser.add_argument("--n", type=int, default=252, help="number of random poses (default 252)")
    parser.add_argument("--subdivisions", type=int, default=9,
                        help="pillow box grid per side: 12 s^2 faces (default 9 = 972; 1 = 12-face box; 29 = 10092)")
    parser.add_argument("--graph", action="store_true", help="triton: also check a CUDA graph capture")
    parser.add_argument("--seed", type=int, default=0, help="pose RNG seed (default 0)")
    parser.add_argument("--mesh", default=None, help="mesh file (metres) instead of the procedural object")
    parser.add_argument("--cpu-device", default="cuda", help="device of the torch rasteriser (default cuda)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    from foundationpose.render.nvdiffrast_backend import has_nvdiffrast

    if not has_nvdiffrast():
        print(json.dumps({"error": "needs CUDA and the nvdiffrast package"}))
        return 2
    report = run(
        args.n, args.seed, args.mesh, args.cpu_device,
        backend=args.backend, subdivisions=args.subdivisions, graph=args.graph,
    )
    emit_json_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
