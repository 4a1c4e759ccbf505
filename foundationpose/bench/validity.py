"""Cost of the track step's validity measurements and verdict (:mod:`foundationpose.validity`).

    python -m foundationpose.bench.validity                  # batches 1 and 64, 640x480, the bundled object
    python -m foundationpose.bench.validity --batches 1,16,64  # on a GPU: the kernels and the torch twin (A/B)
    python -m foundationpose.bench.validity --device cpu --batches 1,4 --replays 20

Prints one JSON object. Per batch size: the time of :func:`~foundationpose.validity.measure_validity` followed
by :func:`~foundationpose.validity.judge_validity` on the bundled sequence's first frame, posed at its
annotated pose (every row the same request), with the appearance part on the refiner's network inputs of that
pose (built once, as the track step's last iteration leaves them); and, under ``appearance``, the appearance
part alone (:func:`~foundationpose.validity.measure_appearance` on the 160 x 160 crops). On CUDA each is captured
in a CUDA graph, as it runs inside the captured track step, and each replay is timed with CUDA events (GPU time;
``p50_ms``, ``p90_ms``, ``p99_ms``); the eager wall time per call, synchronised, is reported beside it. On the
CPU only the eager time.

These top-level timings are the path ``--impl`` picks (default "auto": what the track step runs, the Triton
kernels on CUDA, the torch twin on the CPU), named in ``path``. When that path is the kernels, ``reference``
holds the same timings of the batched torch twin (``impl="torch"``) from the same run, for an A/B on one
machine, and ``max_abs_diff``: each measurement column's largest difference between the two paths (NaN against
NaN counts as equal), with ``valid_equal``, whether the verdicts agree row for row. ``--no-reference`` skips it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from foundationpose.bench.e2e import latency_stats
from foundationpose.coordinate_frames import to_centred_frame
from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence
from foundationpose.mesh import load_object
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.refine import build_refiner_inputs_per_frame
from foundationpose.render import make_renderer
from foundationpose.sampling.backprojection import depth_to_xyz
from foundationpose.sampling.depth_filters import FILTER_IMPLS, FilterImpl
from foundationpose.validity import (
    MEASUREMENTS,
    FrameJudge,
    config_of,
    judge_validity,
    measure_appearance,
    measure_validity,
    validity_impl,
)

__all__ = ["main", "time_validity"]


def time_validity(batch: int, device: torch.device, replays: int, impl: FilterImpl = "auto",
                  reference: bool = True) -> dict[str, Any]:
    """Timings of one batch size (see the module docstring) and the judged rows' validity share, on the path
    ``impl`` picks; with ``reference``, the torch twin's too where that path is not the twin."""
    seq = RecordedSequence(BUNDLED_SEQUENCE_DIR)
    frame = seq.read(0)
    obj = load_object(seq.mesh_path, device)
    judge = FrameJudge(obj, config_of(obj), device)
    config = judge.config
    depth = judge.filtered_depth(frame.depth).expand(batch, -1, -1).contiguous()
    K = torch.as_tensor(seq.K, dtype=torch.float32, device=device).expand(batch, 3, 3).contiguous()
    pose = torch.as_tensor(to_centred_frame(frame.gt_pose, obj.mesh_from_centred), device=device)
    pose = pose.expand(batch, 4, 4).contiguous()

    rgb = torch.as_tensor(frame.rgb, dtype=torch.float32, device=device)[None].expand(batch, -1, -1, -1).contiguous()
    xyz = depth_to_xyz(depth, K.to(torch.float64))
    with torch.no_grad():
        inputs = build_refiner_inputs_per_frame(pose, rgb, xyz, K.to(torch.float64), obj, make_renderer("auto", device),
                                                crop_size=CROP_SIZE)
    pair = (inputs.render_input, inputs.transf_input)

    def step_of(path: FilterImpl) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            m = measure_validity(depth, K, pose, pose, judge.model, config, appearance=pair, impl=path)
            confidence, valid = judge_validity(m, config)
            return m, confidence, valid
        return step

    def appearance_of(path: FilterImpl) -> Callable[[], torch.Tensor]:
        return lambda: measure_appearance(*pair, config, judge.model.textured, impl=path)

    step = step_of(impl)
    m, confidence, valid = step()
    path = validity_impl(device, impl)
    result: dict[str, Any] = {"batch": batch, "path": path, **_timed(step, device, replays),
                              "valid_share": float(valid.float().mean()),
                              "support_fraction": float(m[0, MEASUREMENTS.index("support_fraction")]),
                              "appearance_ncc": float(m[0, MEASUREMENTS.index("appearance_ncc")]),
                              "appearance": _timed(appearance_of(impl), device, replays)}
    if reference and path != "torch":
        twin = step_of("torch")
        m_ref, _, valid_ref = twin()
        result["reference"] = {"path": "torch", **_timed(twin, device, replays),
                               "appearance": _timed(appearance_of("torch"), device, replays),
                               "max_abs_diff": _column_diffs(m, m_ref),
                               "valid_equal": bool(torch.equal(valid, valid_ref))}
    return result


def _column_diffs(m: torch.Tensor, m_ref: torch.Tensor) -> dict[str, float]:
    """Each measurement column's largest ``|m - m_ref|`` over the rows (NaN against NaN: 0; NaN against a
    number: NaN)."""
    both_nan = torch.isnan(m) & torch.isnan(m_ref)
    diff = torch.where(both_nan, torch.zeros_like(m), (m - m_ref).abs())
    worst = diff.amax(0).cpu().tolist()
    return {name: float(v) for name, v in zip(MEASUREMENTS, worst, strict=True)}


def _timed(step: Callable[[], Any], device: torch.device, replays: int) -> dict[str, Any]:
    """``eager_wall`` (and on CUDA ``graph_gpu``) latency statistics of ``step`` (module docstring)."""
    cuda = device.type == "cuda"
    for _ in range(3):
        step()
    eager_ms = []
    for _ in range(replays):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        eager_ms.append(1000 * (time.perf_counter() - t0))
    result: dict[str, Any] = {"eager_wall": latency_stats(eager_ms)}
    if cuda:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph_ms = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            graph_ms.append(start.elapsed_time(end))
        result["graph_gpu"] = latency_stats(graph_ms)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundationpose.bench.validity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--replays", type=int, default=200, help="timed calls per batch size (default: %(default)s)")
    parser.add_argument("--impl", default="auto", choices=FILTER_IMPLS,
                        help="the measured path: auto (the kernels on CUDA, the torch twin on the CPU), torch, or "
                             "triton (on the CPU under the Triton interpreter: slow) (default: %(default)s)")
    parser.add_argument("--no-reference", action="store_true",
                        help="do not time the torch twin beside a kernel path")
    args = parser.parse_args(argv)
    if args.replays < 1:
        parser.error(f"--replays must be >= 1, got {args.replays}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if any(b < 1 for b in batches):
        parser.error(f"--batches must be >= 1, got {args.batches!r}")
    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(name)
    rows = [time_validity(b, device, args.replays, args.impl, not args.no_reference) for b in batches]
    print(json.dumps({"device": str(device), "image": "640x480", "replays": args.replays, "batches": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
