"""Count the aten ops one call of each crop / render building block dispatches on the CPU, and time it.

    python tools/count_ops.py [--n 1 252] [--runs 20] [--json FILE] [--by-op] [--root CHECKOUT]

For ``crop_windows``, ``warp_to_crops`` (bilinear and nearest), ``scorer_real_xyz`` and the non-raster part of
the renderer, at 480 x 640 with N random hypotheses, prints per call (after one warm-up call, which fills the
constant caches as a long-running service would):

* ``render_core``: ``CpuRasterizer.render`` without its ``_draw`` (the shared flow of ``render/_core.py``);
* ``render_nvdiffrast_path``: the nvdiffrast backend's whole ``render`` on the CPU, with ``dr.rasterize`` /
  ``dr.interpolate`` / ``dr.texture`` replaced by memoised torch twins that are not counted - the torch work
  the real backend adds around nvdiffrast's kernels (its CPU time here is that work's host + CPU time);

and for each:

* ``ops``: aten ops dispatched (what a ``TorchDispatchMode`` sees, i.e. after autograd / composite decomposition);
* ``compute``: those that are not views (``OpOverload.is_view`` false, nor ``_unsafe_view``): each is roughly one
  kernel launch on CUDA (``empty`` and CPU-scalar ``scalar_tensor`` launch none);
* ``sync``: ops that make the host wait for a CUDA device (``_local_scalar_dense`` = ``.item()``/``bool()``,
  ``nonzero``, ``masked_select``, ``unique``, ``_linalg_check_errors``, device-to-host copies) - on the CPU
  they are only counted, to show what the same call would do on a GPU;
* ``literal``: tensors built from Python literals (``torch.tensor([...])``): a blocking host-to-device copy each
  on CUDA;
* ``ms``: median CPU wall time of one call (``--runs`` calls after one warm-up call).

The op counts do not depend on the machine; they are the proxy for the CUDA launch count of the same call.
``--root`` picks the checkout whose ``foundationpose`` package is measured (default: the one this file is in),
e.g. a copy of an older version for before / after numbers.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEMO_K = np.array(
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)
H, W = 480, 640
DIAMETER_M = 0.2
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "_linalg_check_errors", "item"}


_ALIAS_OPS = {"_unsafe_view"}  # returns a view in practice (no kernel), though its schema does not say so


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (unless paused)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0
        self.syncs = 0
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if not self._paused:
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            if getattr(func, "is_view", False) or name in _ALIAS_OPS:
                self.views += 1
            if name in SYNC_OPS or _is_device_to_host(name, args, kwargs):
                self.syncs += 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        total = sum(self.ops.values())
        return {"ops": total, "compute": total - self.views, "sync": self.syncs, "literal": self.ops["lift_fresh"],
                "by_op": dict(self.ops.most_common())}


def _is_device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    if name not in ("_to_copy", "copy_", "to"):
        return False
    src = args[1] if name == "copy_" else args[0]
    dst_device = kwargs.get("device")
    if name == "copy_":
        dst_device = args[0].device
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None and (
        torch.device(dst_device).type == "cpu"
    )


def count(fn: Callable[[], Any], counter_hook: Callable[[OpCounter], None] | None = None) -> dict[str, Any]:
    fn()  # warm-up: fills any per-shape caches, as in a long-running service
    counter = OpCounter()
    if counter_hook is not None:
        counter_hook(counter)
    with counter:
        fn()
    return counter.summary()


def wall_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def random_poses(n: int, seed: int = 0) -> torch.Tensor:
    """(n, 4, 4) float32: random rotations, centres 0.3-1.1 m deep in front of the demo camera."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 4, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    w, x, y, z = q.unbind(1)
    rot = torch.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        dim=1,
    ).reshape(n, 3, 3)
    poses = torch.eye(4, dtype=torch.float64).repeat(n, 1, 1)
    poses[:, :3, :3] = rot
    poses[:, 0, 3] = torch.rand(n, generator=g, dtype=torch.float64) * 0.3 - 0.15
    poses[:, 1, 3] = torch.rand(n, generator=g, dtype=torch.float64) * 0.2 - 0.1
    poses[:, 2, 3] = torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.3
    return poses.to(torch.float32)


class _FakeDr:
    """Stands in for ``nvdiffrast.torch`` on the CPU: returns (memoised, by shape) outputs of the torch twins of
    ``rasterize`` / ``interpolate`` / ``texture``, with the counter paused, so that what is counted and timed is
    exactly the torch work of the nvdiffrast backend around its rasteriser calls."""

    def __init__(self) -> None:
        self.counter: OpCounter | None = None
        self._memo: dict[tuple, torch.Tensor] = {}

    def _call(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.counter.paused() if self.counter is not None else contextlib.nullcontext():
            if key not in self._memo:
                self._memo[key] = make()
            return self._memo[key]

    def rasterize(self, ctx, clip, faces, resolution):  # noqa: ANN001, ANN201
        from foundationpose.render.cpu_raster import rasterize

        return self._call(("r", tuple(clip.shape), tuple(resolution)), lambda: rasterize(clip, faces, resolution)), None

    def interpolate(self, attr, rast, tri):  # noqa: ANN001, ANN201
        from foundationpose.render.attributes import interpolate

        key = ("i", tuple(attr.shape), tuple(rast.shape))
        return self._call(key, lambda: interpolate(attr, rast, tri)), None

    def texture(self, tex, uv, filter_mode, boundary_mode):  # noqa: ANN001, ANN201
        from foundationpose.render.attributes import texture_linear_wrap

        return self._call(("t", tuple(uv.shape)), lambda: texture_linear_wrap(tex[0], uv))


def _nvdiffrast_path_renderer() -> Any:
    """The NvdiffrastRenderer's code on the CPU, with :class:`_FakeDr` and no CUDA stream handling."""
    from foundationpose.render._core import RendererCore
    from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer

    class CpuNvdiffrastPath(NvdiffrastRenderer):
        def __init__(self) -> None:  # no CUDA, no plugin
            RendererCore.__init__(self, "cpu")
            self._dr, self._ctx, self._stream = _FakeDr(), None, None

        def _stream_scope(self, caller_tensors):  # noqa: ANN001, ANN202
            return contextlib.nullcontext()

        def _finish(self, out):  # noqa: ANN001, ANN202
            return out

    return CpuNvdiffrastPath()


def _core_only_renderer() -> Any:
    """A CpuRasterizer whose ``_draw`` (rasterise, interpolation, shading, write-out) is not counted."""
    from foundationpose.render.cpu_raster import CpuRasterizer

    class CoreOnly(CpuRasterizer):
        counter: OpCounter | None = None

        def _draw(self, mesh, chunk, *outputs):  # noqa: ANN001, ANN002, ANN202
            with self.counter.paused() if self.counter is not None else contextlib.nullcontext():
                return super()._draw(mesh, chunk, *outputs)

    return CoreOnly("cpu")


def measure(n: int, runs: int) -> dict[str, dict[str, Any]]:
    from foundationpose.crop import crop_windows, scorer_real_xyz, warp_to_crops
    from foundationpose.mesh import MeshTensors
    from foundationpose.render._cache import GeometryConstants
    from foundationpose.render.base import RenderOutput
    from foundationpose.synthetic.pillow_box import pillow_box_arrays

    g = torch.Generator().manual_seed(1)
    poses = random_poses(n)
    rgb = torch.rand(H, W, 3, generator=g) * 255
    xyz = torch.rand(H, W, 3, generator=g)
    depth = 0.4 + 0.6 * torch.rand(H, W, generator=g)
    depth[torch.rand(H, W, generator=g) < 0.2] = 0.0
    crops = crop_windows(poses, DEMO_K, DIAMETER_M, 1.2)
    crops_score = crop_windows(poses, DEMO_K, DIAMETER_M, 1.1)
    mesh = MeshTensors(**pillow_box_arrays())
    core_only = _core_only_renderer()
    nv_path = _nvdiffrast_path_renderer()
    render_out = RenderOutput.empty(n, (160, 160), "cpu")
    c = GeometryConstants()  # the estimator's memo: counts are the steady state after the first call

    def hook_core(counter: OpCounter) -> None:
        core_only.counter = counter

    def hook_nv(counter: OpCounter) -> None:
        nv_path._dr.counter = counter

    cases: dict[str, tuple[Callable[[], Any], Callable[[OpCounter], None] | None, str]] = {
        "crop_windows": (lambda: crop_windows(poses, DEMO_K, DIAMETER_M, 1.2, constants=c), None, ""),
        "warp_to_crops_bilinear": (lambda: warp_to_crops(rgb, crops, mode="bilinear", constants=c), None, ""),
        "warp_to_crops_nearest": (lambda: warp_to_crops(xyz, crops, mode="nearest", constants=c), None, ""),
        "scorer_real_xyz": (lambda: scorer_real_xyz(depth, crops_score, DEMO_K, constants=c), None, ""),
        "render_core": (
            lambda: core_only.render(mesh, poses, DEMO_K, (H, W), crops, out=render_out), hook_core,
            "CpuRasterizer minus _draw; ms: whole CPU render",
        ),
        "render_nvdiffrast_path": (
            lambda: nv_path.render(mesh, poses, DEMO_K, (H, W), crops, out=render_out), hook_nv,
            "nvdiffrast backend's torch ops, dr.* calls excluded/memoised",
        ),
    }

    def refine_inputs(shared_grid: bool) -> None:  # refine.build_refiner_inputs minus the normalisation
        f = crop_windows(poses, DEMO_K, DIAMETER_M, 1.2, constants=c)
        nv_path.render(mesh, poses, DEMO_K, (H, W), f, out=render_out)
        grid = crop_sampling_grid(f, (H, W), constants=c) if shared_grid else None
        warp_to_crops(rgb, f, mode="bilinear", constants=c, **({"grid": grid} if shared_grid else {}))
        warp_to_crops(xyz, f, mode="nearest", constants=c, **({"grid": grid} if shared_grid else {}))

    cases["refine_inputs"] = (lambda: refine_inputs(False), hook_nv, "crop_windows + nvdiffrast path + 2 warps")
    try:
        from foundationpose.crop import crop_sampling_grid
    except ImportError:  # older versions
        pass
    else:
        cases["refine_inputs_shared_grid"] = (lambda: refine_inputs(True), hook_nv, "same, one grid for both warps")
    results = {}
    for name, (fn, counter_hook, note) in cases.items():
        summary = count(fn, counter_hook)
        core_only.counter = nv_path._dr.counter = None
        slow = name == "render_core" or (name == "scorer_real_xyz" and n > 16)
        summary["ms"] = wall_ms(fn, max(1, runs // 10) if slow else runs)
        summary["note"] = note
        results[name] = summary
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 252])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the full results (incl. per-op counts) here")
    parser.add_argument("--by-op", action="store_true", help="print the per-op counts too")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout whose foundationpose package is measured (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.root).resolve()))
    import foundationpose

    print(f"measuring {Path(foundationpose.__file__).parent}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    torch.manual_seed(0)
    all_results = {}
    print(f"{'function':<24}{'N':>5}{'ops':>6}{'compute':>9}{'sync':>6}{'literal':>9}{'cpu ms':>10}")
    for n in args.n:
        results = measure(n, args.runs)
        all_results[n] = results
        for name, r in results.items():
            print(f"{name:<24}{n:>5}{r['ops']:>6}{r['compute']:>9}{r['sync']:>6}{r['literal']:>9}{r['ms']:>10.3f}"
                  f"  {r['note']}")
            if args.by_op:
                print("    " + ", ".join(f"{k}={v}" for k, v in r["by_op"].items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(all_results, fh, indent=1)


if __name__ == "__main__":
    main()
