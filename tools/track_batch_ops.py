"""Aten ops (and CPU time) of one track-lane render stage for a batch of B sessions: per-job loop vs grouped call.

    python tools/track_batch_ops.py [--batch 1 8 64] [--runs 10] [--hw 480 640]

``before``: the former render stage, ``build_refiner_inputs`` once per job (each with its own frame and K).
``after``: the vectorised stage, ``build_refiner_inputs_per_frame`` once for the group (stacked frames, per-job K).
Both write into one (B, 160, 160, 6) pair of buffers, with the nvdiffrast backend's code on the CPU (the
``dr.*`` kernels memoised and not counted, see ``tools/count_ops.py``), after one warm-up call (constant caches
filled, as in a running service). Every session has a different K. ``ops``/``compute`` as in count_ops.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from count_ops import DEMO_K, OpCounter, _nvdiffrast_path_renderer, random_poses, wall_ms  # noqa: E402


def measure(batch: int, hw: tuple[int, int], runs: int) -> dict[str, dict]:
    from foundationpose.mesh import MeshTensors
    from foundationpose.observation import FrameBatch, PreparedFrame
    from foundationpose.refine import build_refiner_inputs, build_refiner_inputs_per_frame
    from foundationpose.synthetic.pillow_box import pillow_box_arrays

    h, w = hw
    g = torch.Generator().manual_seed(2)
    Ks = np.repeat(DEMO_K[None], batch, axis=0)
    Ks[:, :2, :] *= np.linspace(0.9, 1.1, batch)[:, None, None]
    rgb = torch.rand(batch, h, w, 3, generator=g) * 255
    xyz = torch.rand(batch, h, w, 3, generator=g)
    frames = FrameBatch(rgb=rgb, depth=xyz[..., 2], xyz_cam=xyz, Ks=Ks, frames=[
        PreparedFrame(rgb=rgb[i], depth=xyz[i, ..., 2], xyz_cam=xyz[i], K=Ks[i]) for i in range(batch)
    ])
    poses = random_poses(batch)
    job_poses = [poses[i : i + 1].clone() for i in range(batch)]
    mesh = MeshTensors(**pillow_box_arrays())
    renderer = _nvdiffrast_path_renderer()

    class Obj:  # the fields build_refiner_inputs reads
        tensors, diameter = mesh, 0.2

    out_r = torch.empty(batch, 160, 160, 6)
    out_t = torch.empty(batch, 160, 160, 6)

    def before() -> None:
        for i, frame in enumerate(frames.frames):
            build_refiner_inputs(job_poses[i], frame, Obj, renderer, out_render=out_r[i : i + 1],
                                 out_transf=out_t[i : i + 1])

    def after() -> None:
        build_refiner_inputs_per_frame(poses, frames.rgb, frames.xyz_cam, frames.Ks, Obj, renderer,
                                       out_render=out_r, out_transf=out_t)

    results = {}
    for name, fn in (("before", before), ("after", after)):
        fn()
        counter = OpCounter()
        renderer._dr.counter = counter
        with counter:
            fn()
        renderer._dr.counter = None
        summary = counter.summary()
        summary["ms"] = wall_ms(fn, runs)
        results[name] = summary
    return results  # values are not compared here: the memoised dr.* twins return one raster per shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--hw", type=int, nargs=2, default=[480, 640])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, image {args.hw[0]}x{args.hw[1]}")
    print(f"{'B':>4}{'path':>8}{'ops':>7}{'compute':>9}{'sync':>6}{'ops/job':>9}{'cpu ms':>9}")
    for b in args.batch:
        for name, r in measure(b, tuple(args.hw), args.runs).items():
            print(f"{b:>4}{name:>8}{r['ops']:>7}{r['compute']:>9}{r['sync']:>6}{r['ops'] / b:>9.1f}{r['ms']:>9.2f}")


if __name__ == "__main__":
    main()
