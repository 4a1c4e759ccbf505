"""Cost of tracking several objects in one frame, against one object's track.

    python -m foundationpose.bench.objects                 # 1, 4 and 16 objects, 640x480, the device's defaults
    python -m foundationpose.bench.objects --tiny          # a quick check on a CPU
    python -m foundationpose.bench.objects --objects 2,4,8 --weights DIR

Prints one JSON object. A :class:`~foundationpose.service.PoseService` tracks one object per frame (submitted as a
lone ``POST /track`` is: inline into an idle lane), then N objects per frame submitted as one group as ``POST
/track/sessions`` does (the frame staged once, :meth:`~foundationpose.service.PoseService.share_frame`, and
:meth:`~foundationpose.service.PoseService.hold_tracks`: one batch), in two kinds:
``instances`` (N sessions of one mesh) and ``distinct`` (N meshes); either way the batch runs as ONE track step (one
render, one refiner forward per iteration: the step over the object group, :mod:`foundationpose.object_group`).
Each figure is the wall time from the first submit of a frame to its last result (p50, p90, p99 over ``--runs``
frames) and its ratios to one object's p50 and p99 (``vs_one_p50``, ``vs_one_p99``), with the track steps the
row's frames ran (``steps_per_frame``: 1 when the objects share one step). Every object starts from the rendered
object's pose in the same frames (the work of a step does not depend on what it finds there). The distinct meshes
are the six procedural prisms (:func:`foundationpose.synthetic.meshes.make_procedural_mesh`: L and tee, textured,
vertex-coloured and plain) at scales 1, 0.85 and 1.15: up to 18 distinct meshes, each with its own vertices and
diameter.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from deploy_core.report import emit_json_report
from foundationpose.bench.e2e import DEMO_K, TINY, _sequence, latency_stats, runtime_from_args

__all__ = ["main", "run"]

MESHES = [(kind, shape, scale) for scale in (1.0, 0.85, 1.15) for shape in ("L", "tee")
          for kind in ("textured_asym", "vertex_color_asym", "plain_asym")]  # distinct meshes: 18
DEFAULT_COUNTS = "1,4,16"


def _parser() -> argparse.ArgumentParser:
    from foundationpose.runtime_options import add_runtime_options

    parser = argparse.ArgumentParser(prog="python -m foundationpose.bench.objects", description=__doc__.split("\n\n")[0])
    add_runtime_options(parser)
    parser.add_argument("--objects", default=DEFAULT_COUNTS,
                        help=f"object counts per frame, 1 to {len(MESHES)} (default {DEFAULT_COUNTS})")
    parser.add_argument("--image", default="640x480", help="WxH of the synthetic frames (default 640x480)")
    parser.add_argument("--runs", type=int, default=50, help="timed frames per figure (default 50)")
    parser.add_argument("--tiny", action="store_true",
                        help="a quick check on a CPU: 1 track iteration, 160x120 frames, 3 runs (figures are not "
                        "comparable with the full settings)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tiny:
        if args.image == parser.get_default("image"):
            args.image = TINY["image"]
        if args.runs == parser.get_default("runs"):
            args.runs = 3
    try:
        w, h = (int(v) for v in args.image.lower().split("x"))
        counts = [int(n) for n in args.objects.split(",") if n]
    except ValueError:
        parser.error(f"--image WxH and --objects N,N,...: got {args.image!r} and {args.objects!r}")
    if not counts or min(counts) < 1 or max(counts) > len(MESHES) or args.runs < 1 or min(w, h) < 16:
        parser.error(f"--objects must be 1 to {len(MESHES)}, --runs >= 1, the image at least 16x16")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        runtime = runtime_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    emit_json_report(run(runtime, (h, w), counts, runs=args.runs, tiny=args.tiny), args.out)
    return 0


def run(runtime: Any, hw: tuple[int, int], counts: list[int], *, runs: int, tiny: bool) -> dict[str, Any]:
    """The benchmark of the module docstring; returns the report."""
    from engines.files import engine_files  # an application: it wires the engines package in
    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.mesh import load_object
    from foundationpose.service import PoseService, ServiceConfig
    from foundationpose.service.pose_service import GROUP_HOLD_S
    from foundationpose.synthetic.meshes import make_procedural_mesh

    config = EstimatorConfig(track_iterations=TINY["track_iterations"]) if tiny else EstimatorConfig()
    est = PoseEstimator.create(runtime=runtime, config=config, engine_files=engine_files)
    h, w = hw
    K = DEMO_K.copy()
    K[0] *= w / 640.0
    K[1] *= h / 480.0
    most = max(counts)
    models = [load_object(_scaled(make_procedural_mesh(kind, shape=shape), scale), device=est.device)
              for kind, shape, scale in MESHES[:max(most, 1)]]
    frames = _sequence(est, models[0], hw, K, 8)
    service_config = ServiceConfig(max_image_hw=hw, track_max_batch=max(most, 8))

    with PoseService(est, service_config) as service:
        def track(objs: list, i: int, *, group: bool) -> None:
            f = frames[i % len(frames)]
            rgb, depth = service.share_frame(f["rgb"], f["depth"]) if group else (f["rgb"], f["depth"])
            release = service.hold_tracks() if group else None
            futures = [service.submit_track(obj, rgb, depth, K, f["cam_from_centred"], prev_frame="centred",
                                            key=f"object{j}", inline_if_idle=not group) for j, obj in enumerate(objs)]
            if release is not None:
                release()
            for future in futures:
                future.result()

        def timed(objs: list, *, group: bool) -> dict[str, Any]:
            for i in range(2):  # warm-up: graphs captured, caches filled
                track(objs, i, group=group)
            rows_before = service.stats().track_rows_requested
            steps_before = _steps(service)
            times = []
            for i in range(runs):
                t0 = time.perf_counter()
                track(objs, i, group=group)
                times.append(1000 * (time.perf_counter() - t0))
            stats = latency_stats(times)
            stats["steps_per_frame"] = round((_steps(service) - steps_before) / runs, 3)
            stats["rows_per_frame"] = round((service.stats().track_rows_requested - rows_before) / runs, 3)
            return stats

        one = timed(models[:1], group=False)
        rows = []
        for n in counts:
            for kind, objs in (("instances", [models[0]] * n), ("distinct", models[:n])):
                if n == 1 and kind == "distinct":
                    continue  # the same as one instance
                stats = timed(objs, group=True)
                rows.append({"objects": n, "kind": kind, "meshes": len({id(o) for o in objs}), **stats,
                             "vs_one_p50": round(stats["p50_ms"] / one["p50_ms"], 3),
                             "vs_one_p99": round(stats["p99_ms"] / one["p99_ms"], 3)})
    return {"bench": "objects_per_frame", "device": str(est.device), "image_hw": list(hw),
            "track_iterations": est.config.track_iterations, "tiny": tiny, "runs": runs, "hold_ms": GROUP_HOLD_S * 1e3,
            "one_object": one, "rows": rows,
            "targets": {"distinct_4_vs_one_p50_max": 2.0, "distinct_4_vs_one_p99_max": 2.5},
            "conditions": "synthetic frames of one rendered object; every object starts at its pose; "
                          "one object: a lone track (inline when the lane is idle); N objects: one held group, "
                          "one track step over the group's objects; distinct meshes: procedural prisms at three "
                          "scales"}


def _steps(service: Any) -> int:
    """Track steps the service's lane has run so far (each submitted batch group, inline ones included)."""
    return int(service._track_runner.steps_run)


def _scaled(mesh: Any, scale: float) -> Any:
    """``mesh`` scaled about its origin (a distinct mesh with its own vertices and diameter; texture kept)."""
    if scale == 1.0:
        return mesh
    mesh = mesh.copy()
    mesh.apply_scale(scale)
    return mesh


if __name__ == "__main__":
    raise SystemExit(main())
