"""One client's round trip with the track step reduced to one copy: the service's own floor on this host (issue 11).

The one-client figures (``POST /track/binary`` <= 6 ms, a stream frame <= 4 ms) are the GPU step plus everything
around it: the client, HTTP or the WebSocket, an ingest worker's relay, the server's phases. This runs the real
server in this process (:func:`hub_cost.reduced_server`: uvicorn, uvloop, one ingest worker, the graphed track
step reduced to one copy, so the step costs ~nothing and poses stay put) and ``tools/loadtest.py`` with one client
against the main port or the track port, so the printed p50 is what this host adds to the GPU's step.

    python tools/edge_floor.py --mode stream --via track --image 640x480     # through an ingest worker
    python tools/edge_floor.py --mode stream --via main                      # the main port
    python tools/edge_floor.py --mode http-binary --via track --device cuda  # on the H200 (graphed, reduced)

Prints JSON: the settings, p50/p90/p99 ms, the round trip outside the server's phases (streams), the server's
phases (p50, ms) and the load generator's CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hub_cost import reduced_server, run_beside, wait_ready  # tools/ is this script's folder

_TOOLS = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("stream", "http-binary"), default="stream")
    p.add_argument("--via", choices=("main", "track"), default="track",
                   help="the main port, or the track port of one ingest worker (default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--renderer", default=None)
    p.add_argument("--image", default="640x480", help="WxH of the frames (the server's max image too)")
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--port", type=int, default=18951)
    p.add_argument("--switch-interval-ms", type=float, default=0.5)
    p.add_argument("--stream-fragment-kib", type=int, default=None,
                   help="streams: the client's WebSocket fragment size (tools/loadtest.py's option; 0: one frame)")
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.image.lower().split("x"))
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    app, server = reduced_server(device=args.device, renderer=args.renderer, image_hw=(h, w), port=args.port,
                                 reduced=True, fast=True, submit_in_loop=True)
    def work() -> dict[str, Any]:
        base = f"http://127.0.0.1:{args.port}"
        wait_ready(base, 900.0)
        track = ["--track-url", f"http://127.0.0.1:{args.port + 1}"] if args.via == "track" else []
        done = subprocess.run(
            [sys.executable, str(_TOOLS / "loadtest.py"), "--url", base, *track, "--image", f"{w}x{h}",
             "--clients", "1", "--mode", args.mode, "--duration-s", str(args.duration_s),
             "--tracks-per-register", "100000", "--max-requests", "1000000",
             *([] if args.stream_fragment_kib is None else ["--stream-fragment-kib", str(args.stream_fragment_kib)])],
            capture_output=True, text=True, timeout=args.duration_s + 600)
        if done.returncode != 0:
            raise RuntimeError(f"loadtest failed ({done.returncode}): {done.stderr[-1500:]}")
        run = json.loads(done.stdout)
        endpoints = run["endpoints"]
        row = endpoints.get("stream_frame") or endpoints.get("track") or {}
        endpoint = "/track/stream" if "stream_frame" in endpoints else "/track/binary"
        return dict(mode=args.mode, via=args.via, device=args.device, image=args.image,
                    stream_fragment_kib=run["settings"]["stream_fragment_kib"],
                    answered=row.get("ok"), errors=run["errors_by_status"],
                    **{k: row.get(k) for k in ("p50_ms", "p90_ms", "p99_ms")},
                    outside_phases_ms=run.get("stream_outside_phases_ms"),
                    server_phases_ms=run["server_phases_ms"].get(endpoint, {}),
                    load_generator=run.get("load_generator"))

    report = run_beside(server, "edge-floor-driver", work)
    print(json.dumps(report, indent=1))
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
