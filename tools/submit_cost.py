"""What a track request's submit costs the host, piece by piece, in one thread (issue 10 diagnostic).

With sessions as coroutines of one event loop (``foundationpose.bench.sessions``), every frame's submit runs in the
loop's thread one after the other, so the loop tracks at most 1 / (submit time) frames/s. This times the pieces of
``PoseService.submit_track`` on their own: validation, taking a page-locked block, the two staging copies (NumPy's,
and PyTorch's, which splits a large copy over its intra-op threads), with ``--in-flight`` staged frames alive at once
(as under load: the copies then write memory no cache holds) and ``--sources`` distinct input frames (a session's
frames are new each time; one shared source stays in the cache).

    python tools/submit_cost.py --device cuda --image 640x480 --in-flight 64 --sources 64

Prints JSON: per piece, mean / p50 / p90 microseconds per frame.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from deploy_core.memory.pinned import PinnedBlocks
from deploy_core.timing import percentile
from foundationpose import validate


def _time(fn: Callable[[int], object], frames: int) -> dict[str, float]:
    for i in range(min(frames, 20)):
        fn(i)
    times = []
    for i in range(frames):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    ordered = sorted(times)
    return {"mean_us": round(float(np.mean(times)), 1), "p50_us": round(percentile(ordered, 50), 1),
            "p90_us": round(percentile(ordered, 90), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: page-locked blocks; cpu: ordinary memory (default: cuda when available)")
    parser.add_argument("--image", default="640x480", help="WxH (default 640x480)")
    parser.add_argument("--frames", type=int, default=500, help="timed frames per piece (default 500)")
    parser.add_argument("--in-flight", type=int, default=64, help="staged frames kept alive at once (default 64)")
    parser.add_argument("--sources", type=int, default=64, help="distinct input frames cycled through (default 64)")
    args = parser.parse_args(argv)
    w, h = (int(v) for v in args.image.lower().split("x"))
    pinned = args.device.startswith("cuda")
    rng = np.random.default_rng(0)
    rgbs = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(args.sources)]
    depths = [rng.uniform(0.3, 2.0, (h, w)).astype(np.float32) for _ in range(args.sources)]
    K = np.array([[500.0, 0.0, w / 2], [0.0, 500.0, h / 2], [0.0, 0.0, 1.0]])
    pose = np.eye(4)
    pose[2, 3] = 0.5
    limits = validate.InputLimits(max_image_hw=(h, w))
    blocks = PinnedBlocks(allocate=(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned)))
    alive: deque = deque(maxlen=args.in_flight)  # the staged frames a loaded lane still holds
    nbytes = h * w * 3 + h * w * 4

    def src(i: int) -> tuple[np.ndarray, np.ndarray]:
        return rgbs[i % len(rgbs)], depths[i % len(depths)]

    def validate_only(i: int) -> None:
        rgb, depth = src(i)
        validate.track_request(rgb, depth, K, pose, limits=limits, depth_borrowed=True)

    def take(i: int) -> np.ndarray:
        block = blocks.take(nbytes)
        alive.append(block)
        return block

    def copies_numpy(i: int) -> None:
        rgb, depth = src(i)
        block = take(i)
        block[: rgb.nbytes].reshape(rgb.shape)[...] = rgb
        block[rgb.nbytes:].view(np.float32).reshape(depth.shape)[...] = depth

    def copies_torch(i: int) -> None:
        rgb, depth = src(i)
        block = torch.from_numpy(take(i))
        block[: rgb.nbytes].copy_(torch.from_numpy(rgb).view(-1))
        block[rgb.nbytes:].view(torch.float32).copy_(torch.from_numpy(depth).view(-1))

    def depth_check(i: int) -> None:
        validate.depth_in_range(src(i)[1])

    pieces = {"validate": validate_only, "depth_range_check": depth_check, "take_block": take,
              "stage_copies_numpy": copies_numpy, "stage_copies_torch": copies_torch}
    report = {"device": args.device, "image": f"{w}x{h}", "in_flight": args.in_flight, "sources": args.sources,
              "torch_threads": torch.get_num_threads(), "frame_mib": round(nbytes / 2**20, 2)}
    for name, fn in pieces.items():
        alive.clear()
        report[name] = _time(fn, args.frames)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
