"""Does an SM partition (deploy_core.sm_partition) keep a long batch of large kernels from delaying small ones?

A stand-in for a register (``--big``: fp16 convolutions at batch 252, captured as one CUDA graph) runs on either a
low-priority stream of the whole GPU or a green-context stream of ``--sms`` SMs, while a stand-in for a track step
(``--small``: fp16 convolutions at batch 16, another graph) is replayed on a high-priority stream and timed. Prints
JSON: each graph's GPU ms alone (the big one on the whole GPU and on the partition), and the small one's ms beside
the big one either way. CUDA only.

    python tools/sm_partition_probe.py [--sms 96] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy_core.sm_partition import sm_partition  # noqa: E402


def captured(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    stream.synchronize()
    return graph


def gpu_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        graph.replay()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def beside(small: torch.cuda.CUDAGraph, small_stream: torch.cuda.Stream, big: torch.cuda.CUDAGraph,
           big_stream: torch.cuda.Stream, repeats: int) -> list[float]:
    """The small graph's GPU ms, replayed while the big one keeps its stream busy."""
    with torch.cuda.stream(big_stream):
        for _ in range(repeats // 4 + 2):
            big.replay()
    out = []
    for _ in range(repeats):
        out.append(gpu_ms(small, small_stream))
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    partition = sm_partition(dev, args.sms)
    low = torch.cuda.Stream(dev, priority=-1)
    high = torch.cuda.Stream(dev, priority=-2)
    w = torch.randn(64, 64, 3, 3, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)
    xb = torch.randn(252, 64, 40, 40, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)
    xs = torch.randn(16, 64, 40, 40, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)

    def big_fn() -> None:
        y = xb
        for _ in range(30):
            y = torch.nn.functional.conv2d(y, w, padding=1).relu_()

    def small_fn() -> None:
        y = xs
        for _ in range(60):
            y = torch.nn.functional.conv2d(y, w, padding=1).relu_()

    big_full, big_part = captured(big_fn, low), captured(big_fn, partition.stream)
    small = captured(small_fn, high)
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    result = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "device_sms": partition.device_sms, "sms": args.sms,
        "big_alone_ms": {"whole_gpu": med([gpu_ms(big_full, low) for _ in range(5)]),
                         "partition": med([gpu_ms(big_part, partition.stream) for _ in range(5)])},
        "small_alone_ms": med([gpu_ms(small, high) for _ in range(args.repeats)]),
        "small_beside_big_ms": {"whole_gpu": med(beside(small, high, big_full, low, args.repeats)),
                                "partition": med(beside(small, high, big_part, partition.stream, args.repeats))},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
