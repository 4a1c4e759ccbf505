"""Micro-benchmark of the server's PNG decode of one frame (rgb PNG + 16-bit depth PNG); prints one JSON object.

    python tools/bench_decode.py                      # 640x480, 200 repeats
    python tools/bench_decode.py --image 1280x720 --repeats 100 --threads 4

Frames: ``synthetic`` is the frame ``tools/loadtest.py`` sends (its depth is smooth: a small PNG);
``noisy_depth`` the same with 2 mm of sensor-like noise on the depth (a PNG of the size a real depth
camera's frame has). Variants, each p50/p90/p99 ms over ``--repeats`` calls after a warm-up:

* ``reference``: the plain twins one after the other (:func:`server.codecs.rgb_pixels_reference`: OpenCV
  BGR + ``cvtColor``; :func:`~server.codecs.depth_pixels_reference`: ``astype`` then divide), i.e. the
  decode before the fast paths;
* ``rgb`` / ``depth``: :func:`server.codecs.decode_rgb` / :func:`~server.codecs.decode_depth` alone;
* ``sequential``: :func:`server.pose_flow.decode_frame` without a pool (rgb, then depth);
* ``concurrent``: ``decode_frame`` with a ``--threads`` pool (depth in the pool while rgb decodes), as the server does.

``bit_identical`` says whether every variant's arrays equal the reference's. ``decoders``: the whole set
with ``imagecodecs`` (when installed) and with OpenCV alone (what a server without it does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from deploy_core.timing import percentile  # noqa: E402
from foundationpose.synthetic.scenes import synthetic_frame  # noqa: E402
from server import codecs, pose_flow  # noqa: E402
from server.phases import Phases  # noqa: E402


def _time(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    for _ in range(max(3, repeats // 20)):
        fn()
    ms = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        fn()
        ms.append((time.perf_counter_ns() - started) / 1e6)
    ms.sort()
    return {f"p{q}_ms": round(percentile(ms, q), 3) for q in (50, 90, 99)}


def bench_frame(rgb_png: bytes, depth_png: bytes, hw: tuple[int, int], repeats: int, threads: int) -> dict[str, Any]:
    frame = pose_flow.FrameBytes(rgb_png, depth_png)
    reference = (codecs.rgb_pixels_reference(rgb_png), codecs.depth_pixels_reference(depth_png))
    with ThreadPoolExecutor(threads, thread_name_prefix="bench-decode") as pool:
        variants: dict[str, Callable[[], Any]] = {
            "reference": lambda: (codecs.rgb_pixels_reference(rgb_png), codecs.depth_pixels_reference(depth_png)),
            "rgb": lambda: codecs.decode_rgb(rgb_png, hw),
            "depth": lambda: codecs.decode_depth(depth_png, hw),
            "sequential": lambda: pose_flow.decode_frame(frame, hw, Phases())[:2],
            "concurrent": lambda: pose_flow.decode_frame(frame, hw, Phases(), pool=pool)[:2],
        }
        out: dict[str, Any] = {"rgb_png_bytes": len(rgb_png), "depth_png_bytes": len(depth_png)}
        identical = True
        for name, fn in variants.items():
            result = fn()
            if name in ("reference", "sequential", "concurrent"):
                identical &= all(np.array_equal(a, b) for a, b in zip(result, reference, strict=True))
            elif name == "rgb":
                identical &= np.array_equal(result, reference[0])
            else:
                identical &= np.array_equal(result, reference[1])
            out[name] = _time(fn, repeats)
    out["bit_identical"] = bool(identical)
    return out


def main(argv: list[str] | None = None) -> int:
    from server.config import parse_image_size

    p = argparse.ArgumentParser(prog="python tools/bench_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--image", type=parse_image_size, default=(480, 640), dest="hw",
                   help="frame WIDTHxHEIGHT (default 640x480)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per variant (default 200)")
    p.add_argument("--threads", type=int, default=2, help="decode pool threads of the concurrent variant (default 2)")
    args = p.parse_args(argv)
    h, w = args.hw
    frame = synthetic_frame(h, w)
    noisy = frame.depth_m + np.random.default_rng(0).normal(0.0, 0.002, frame.depth_m.shape) * (frame.depth_m > 0)
    rgb_png = codecs.encode_rgb_png(frame.rgb)
    frames = {"synthetic": codecs.encode_depth_png_mm(frame.depth_m), "noisy_depth": codecs.encode_depth_png_mm(noisy)}
    summary: dict[str, Any] = {"image_wh": [w, h], "repeats": args.repeats, "threads": args.threads,
                               "cpu_count": os.cpu_count(), "decoders": {}}
    installed = codecs.FAST_PNG
    for decoder in (("imagecodecs", "opencv") if installed else ("opencv",)):
        codecs.FAST_PNG = decoder == "imagecodecs"  # this process only: the same calls with OpenCV alone
        summary["decoders"][decoder] = {name: bench_frame(rgb_png, depth_png, (h, w), args.repeats, args.threads)
                                        for name, depth_png in frames.items()}
    codecs.FAST_PNG = installed
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
