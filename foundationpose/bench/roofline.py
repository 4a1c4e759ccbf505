"""``python -m foundationpose.bench.roofline``: where RefineNet's and ScoreNet's time goes, layer by layer (JSON).

For each network and batch size (register: both networks at 252; track: the refiner at 1, 8, 16, 32) on random
inputs of the real crop size:

* **Per layer** (forward hooks on the unrolled inference copy, :mod:`foundationpose.models.unrolled`): measured time
  (CUDA events on the GPU, ``perf_counter`` on the CPU; median of ``--repeats``), analytic FLOPs and bytes from the
  shapes (:mod:`foundationpose.models.costs`), achieved TFLOP/s and GB/s, arithmetic intensity against the ridge
  point of the precision's peak, ``bound`` (compute or memory) and ``roof_fraction`` (achieved over the attainable
  ``min(peak, intensity x bandwidth)``). Time inside a block but outside its layers (residual adds, concatenation,
  token reshapes, means) is a ``glue`` row of that block.
* **By op kind** (``torch.profiler``): device time of the kernels grouped as convolution, linear, attention,
  normalisation, elementwise, layout (copies, memory-format conversions, concatenation), cast (dtype conversions)
  and other, with the number of kernel launches and their host time.
* **Launch overhead** (CUDA): the plain eager forward against a CUDA-graph replay of the same forward.

Peaks: on an H200 the stated figures (dense bf16/fp16 matmul measured there at ~790 TFLOP/s and a device copy at
~4.3 TB/s, 2026-11-29; TF32 494 TFLOP/s dense from the data sheet); on other GPUs and on the CPU
they are measured by this command (a large matmul and a large copy; bytes counted read + write). Hooks add a
little time per layer (event records): ``forward_ms`` (no hooks) is the figure to quote for a whole forward.
``torch.compile`` is not applied (per-layer hooks and fusion exclude each other).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from foundationpose.models.costs import LayerCost, layer_cost, layer_kind

__all__ = ["DevicePeaks", "H200_PEAKS", "classify_op", "main", "measure_peaks", "roofline_network"]

OP_KINDS = ("convolution", "linear", "attention", "normalisation", "elementwise", "layout", "cast", "other")


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """Peak rates the roofline compares against; None where the device has no such units."""

    name: str
    tflops_16bit: float  # dense fp16 / bf16 tensor math
    tflops_tf32: float | None  # dense TF32 tensor math (fp32 convolutions and matmuls on the GPU)
    tflops_fp32: float  # fp32 on the vector units (CUDA cores / CPU SIMD)
    mem_gbps: float  # DRAM bandwidth, read + write bytes
    source: str

    def tflops(self, math_kind: str, dtype: str) -> float:
        """The peak for a call's math units and precision (fp32 tensor math uses TF32 when the device has it)."""
        if math_kind == "vector":
            return self.tflops_fp32
        if dtype in ("fp16", "bf16"):
            return self.tflops_16bit
        if dtype == "fp32" and self.tflops_tf32 is not None and torch.backends.cudnn.allow_tf32:
            return self.tflops_tf32
        return self.tflops_fp32


H200_PEAKS = DevicePeaks(
    name="NVIDIA H200", tflops_16bit=790.0, tflops_tf32=494.0, tflops_fp32=67.0, mem_gbps=4300.0,
    source="stated: bf16 matmul ~790 TFLOP/s and device copy ~4.3 TB/s measured on an H200 (2026-11-29); "
           "TF32 494 and FP32 67 TFLOP/s dense from the H200 data sheet",
)


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(device: torch.device) -> DevicePeaks:
    """The stated H200 figures on an H200; otherwise a measured matmul (fp32 on the CPU, bf16 on a GPU) and copy."""
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return H200_PEAKS
    if device.type == "cuda":
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        t16 = 2 * n**3 / _best_seconds(lambda: a @ a, device) / 1e12
        src, dst = (torch.ones(2**28, dtype=torch.uint8, device=device) for _ in range(2))
        gbps = 2 * src.numel() / _best_seconds(lambda: dst.copy_(src), device) / 1e9
        a32 = a.float()
        t32 = 2 * n**3 / _best_seconds(lambda: a32 @ a32, device) / 1e12
        return DevicePeaks(name=torch.cuda.get_device_name(device), tflops_16bit=t16,
                           tflops_tf32=None, tflops_fp32=t32, mem_gbps=gbps,
                           source="measured by this command: bf16 and fp32 matmul 8192^3, 256 MiB copy")
    n = 1024
    a = torch.randn(n, n)
    t32 = 2 * n**3 / _best_seconds(lambda: a @ a, device) / 1e12
    src, dst = (torch.ones(2**26, dtype=torch.float32) for _ in range(2))  # 256 MiB each, pages touched
    gbps = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), device) / 1e9
    return DevicePeaks(name=f"CPU ({torch.get_num_threads()} threads)", tflops_16bit=t32,
                       tflops_tf32=None, tflops_fp32=t32, mem_gbps=gbps,
                       source="measured by this command: fp32 matmul 1024^3 (every precision's peak on the CPU), 256 MiB copy")


# -- per-layer timing ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    name: str
    module: nn.Module
    parent: int | None
    children: list[int]
    start: Any = None
    end: Any = None
    cost: LayerCost | None = None


class _LayerTimer:
    """Pre / post forward hooks on every module: one timed call record per module call, in call order."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.calls: list[_Call] = []
        self.stack: list[int] = []
        self.record_costs = False
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, name)))
            self.handles.append(module.register_forward_hook(partial(self._post, name)))

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, name: str, module: nn.Module, _args: tuple[Any, ...]) -> None:
        parent = self.stack[-1] if self.stack else None
        index = len(self.calls)
        self.calls.append(_Call(name, module, parent, []))
        if parent is not None:
            self.calls[parent].children.append(index)
        self.stack.append(index)
        self.calls[index].start = self._mark()

    def _post(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        index = self.stack.pop()
        call = self.calls[index]
        call.end = self._mark()
        assert call.name == name, (call.name, name)
        if self.record_costs:
            call.cost = layer_cost(module, args, output)

    def run(self, forward: Callable[[], Any], record_costs: bool) -> list[_Call]:
        self.calls, self.stack, self.record_costs = [], [], record_costs
        forward()
        if self.cuda:
            torch.cuda.synchronize()
        return self.calls

    def duration_ms(self, call: _Call) -> float:
        return call.start.elapsed_time(call.end) if self.cuda else (call.end - call.start) * 1e3

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _row(call: _Call, ms: float, peaks: DevicePeaks) -> dict[str, Any]:
    cost = call.cost
    kind = cost.kind if cost is not None else layer_kind(call.module)
    row: dict[str, Any] = {"name": call.name or "(network)", "type": type(call.module).__name__, "kind": kind,
                           "ms": round(ms, 5)}
    if cost is None:
        return row
    peak = peaks.tflops(cost.math, cost.dtype)
    ridge = peak * 1e12 / (peaks.mem_gbps * 1e9)  # FLOP / byte where the roofs meet
    seconds = ms / 1e3
    achieved = cost.flops / seconds / 1e12 if seconds > 0 else None
    attainable = min(peak, cost.intensity * peaks.mem_gbps * 1e9 / 1e12) if cost.bytes else peak
    row.update({
        "dtype": cost.dtype, "math": cost.math, "gflop": round(cost.flops / 1e9, 6), "mbytes": round(cost.bytes / 1e6, 4),
        "intensity": round(cost.intensity, 3) if math.isfinite(cost.intensity) else None,
        "ridge": round(ridge, 2), "bound": "compute" if cost.intensity >= ridge else "memory",
        "tflops": None if achieved is None else round(achieved, 4),
        "gbps": round(cost.bytes / seconds / 1e9, 3) if seconds > 0 else None,
        "roof_fraction": round(achieved / attainable, 4) if achieved is not None and attainable > 0 else None,
    })
    return row


def time_layers(model: nn.Module, forward: Callable[[], Any], device: torch.device, peaks: DevicePeaks,
                repeats: int) -> dict[str, Any]:
    """Per-layer rows (leaf calls and the glue time of blocks) from ``repeats`` hooked forwards (medians)."""
    timer = _LayerTimer(model, device)
    try:
        first = timer.run(forward, record_costs=True)
        runs = [[timer.duration_ms(c) for c in first]]
        for _ in range(repeats - 1):
            calls = timer.run(forward, record_costs=False)
            if [c.name for c in calls] != [c.name for c in first]:
                raise RuntimeError("the network's call sequence changed between forwards")
            runs.append([timer.duration_ms(c) for c in calls])
    finally:
        timer.close()
    ms = [statistics.median(values) for values in zip(*runs, strict=True)]
    layers, glue_ms = [], 0.0
    for index, call in enumerate(first):
        if not call.children:
            layers.append(_row(call, ms[index], peaks))
            continue
        own = ms[index] - sum(ms[c] for c in call.children)
        if own > 0:
            layers.append({"name": f"{call.name or '(network)'} (glue)", "type": type(call.module).__name__,
                           "kind": "glue", "ms": round(own, 5)})
            glue_ms += own
    return {"hooked_forward_ms": round(ms[0], 4), "layers": layers, "glue_ms": round(glue_ms, 4)}


# -- whole-forward timing and the profiler view --------------------------------------------------------------------


def time_forward(forward: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of an un-hooked forward."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_graph(forward: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """Median milliseconds of a CUDA-graph replay of the forward (its inputs are static tensors already)."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        return {"graph_ms": round(time_forward(graph.replay, device, repeats), 4)}
    except Exception as exc:  # report, do not fail the roofline
        return {"graph_ms": None, "graph_error": f"{type(exc).__name__}: {exc}"}


_OP_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("convolution", ("conv",)),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "softmax")),
    ("linear", ("addmm", "scaled_mm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "gemm")),
    ("normalisation", ("batch_norm", "layer_norm")),
    ("layout", ("copy_", "contiguous", "clone", "aten::cat", "permute", "transpose", "aten::view", "reshape",
                "flatten", "unflatten", "as_strided", "expand", "chunk", "split", "narrow", "slice", "select",
                "nchwtonhwc", "nhwctonchw")),
    ("cast", ("_to_copy", "aten::to")),
    ("elementwise", ("relu", "aten::add", "aten::mul", "aten::div", "aten::sub", "clamp", "aten::mean", "tanh",
                     "aten::sum", "elementwise", "vectorized", "reduce")),
)


def classify_op(name: str) -> str:
    """The op kind (one of ``OP_KINDS``) of an ATen op or kernel name."""
    lowered = name.lower()
    for kind, needles in _OP_RULES:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def _ancestor_kind(event: Any) -> str | None:
    """A matrix-product ancestor op (conv / attention / linear) owns what runs inside it."""
    node = event.cpu_parent
    while node is not None:
        kind = classify_op(node.name)
        if kind in ("convolution", "attention", "linear"):
            return kind
        node = node.cpu_parent
    return None


_LAUNCHES = ("cudalaunchkernel", "culaunchkernel", "cudalaunchkernelexc", "cudagraphlaunch", "cudamemcpyasync",
             "cudamemsetasync")


def profile_by_kind(forward: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One profiled forward: time per op kind (device kernels on CUDA, self CPU time of ATen ops on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    by_kind = dict.fromkeys(OP_KINDS, 0.0)
    launches, launch_host_us = 0, 0.0
    for event in prof.events():
        name = event.name
        if any(tag in name.lower() for tag in _LAUNCHES):
            launches += 1
            launch_host_us += event.cpu_time_total
            continue
        if device.type == "cuda":
            for kernel in getattr(event, "kernels", ()):
                kind = classify_op(kernel.name)
                if kind not in ("layout", "cast"):
                    kind = _ancestor_kind(event) or classify_op(name)
                by_kind[kind] += kernel.duration
        elif name.startswith("aten::") or "::" in name:
            kind = _ancestor_kind(event) or classify_op(name)
            by_kind[kind] += event.self_cpu_time_total
    total = sum(by_kind.values())
    return {
        "time_basis": "device kernel time" if device.type == "cuda" else "self CPU time of ops",
        "total_ms": round(total / 1e3, 4),
        "by_kind": {k: {"ms": round(v / 1e3, 4), "share": round(v / total, 4) if total else None}
                    for k, v in by_kind.items()},
        "kernel_launches": launches if device.type == "cuda" else None,
        "launch_host_ms": round(launch_host_us / 1e3, 4) if device.type == "cuda" else None,
    }


# -- one network at one batch size ---------------------------------------------------------------------------------


def _kind_totals(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = totals.setdefault(row["kind"], {"ms": 0.0, "gflop": 0.0, "mbytes": 0.0})
        entry["ms"] += row["ms"]
        entry["gflop"] += row.get("gflop", 0.0)
        entry["mbytes"] += row.get("mbytes", 0.0)
    total_ms = sum(v["ms"] for v in totals.values())
    return {k: {"ms": round(v["ms"], 4), "share": round(v["ms"] / total_ms, 4) if total_ms else None,
                "gflop": round(v["gflop"], 4), "mbytes": round(v["mbytes"], 2)}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1]["ms"])}


@torch.no_grad()
def roofline_network(model: nn.Module, network: str, batch: int, *, crop_size: int, device: torch.device,
                     dtype: torch.dtype, peaks: DevicePeaks, repeats: int, warmup: int, profile: bool = True,
                     layers: bool = True) -> dict[str, Any]:
    """The roofline of one network forward at one batch size on random crops (see the module docstring).

    model: the network (eval, on ``device``, in ``dtype``); the scorer scores the whole batch as one set.
    """
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    a, b = (torch.rand(batch, 6, crop_size, crop_size, device=device).to(dtype).contiguous(memory_format=memory_format)
            for _ in range(2))

    def forward() -> Any:
        return model(a, b)

    for _ in range(warmup):
        forward()
    result: dict[str, Any] = {"network": network, "batch": batch, "forward_ms": round(time_forward(forward, device, repeats), 4)}
    if device.type == "cuda":
        result.update(time_graph(forward, device, repeats))
        if result.get("graph_ms") is not None:
            result["launch_overhead_ms"] = round(result["forward_ms"] - result["graph_ms"], 4)
    timed = time_layers(model, forward, device, peaks, repeats)
    rows = timed["layers"]
    gflop = sum(r.get("gflop", 0.0) for r in rows)
    tensor_gflop = sum(r.get("gflop", 0.0) for r in rows if r.get("math") == "tensor")
    bound_ms = {"compute": 0.0, "memory": 0.0, "unattributed": 0.0}
    for r in rows:
        bound_ms[r.get("bound", "unattributed")] += r["ms"]
    total_ms = sum(bound_ms.values())
    result.update({
        "hooked_forward_ms": timed["hooked_forward_ms"],
        "gflop": round(gflop, 4),
        "tensor_gflop": round(tensor_gflop, 4),
        "tflops": round(tensor_gflop / result["forward_ms"], 4) if result["forward_ms"] > 0 else None,
        "fraction_of_16bit_peak": round(tensor_gflop / result["forward_ms"] / peaks.tflops_16bit, 4)
        if result["forward_ms"] > 0 else None,
        "bound_time_share": {k: round(v / total_ms, 4) if total_ms else None for k, v in bound_ms.items()},
        "by_kind": _kind_totals(rows),
        "top_layers": [{k: r.get(k) for k in ("name", "kind", "ms", "bound", "tflops", "gbps", "roof_fraction")}
                       for r in sorted(rows, key=lambda r: -r["ms"])[:8]],
    })
    if profile:
        result["profile"] = profile_by_kind(forward, device)
    if layers:
        result["layers"] = rows
    return result


# -- the command ------------------------------------------------------------------------------------------------


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from exc
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m foundationpose.bench.roofline",
                                description="Per-layer roofline of RefineNet and ScoreNetMultiPair (JSON on stdout).")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    p.add_argument("--precision", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                   help="default: auto = fp16 on cuda, fp32 on cpu")
    p.add_argument("--weights", default=None, metavar="DIR", help="weights root (default: random weights)")
    p.add_argument("--refiner-batches", type=_batches, default=None, metavar="N,N,...",
                   help="default: 1,8,16,32,252 on cuda (track and register), 1,2 on cpu")
    p.add_argument("--scorer-batches", type=_batches, default=None, metavar="N,N,...",
                   help="default: 252 on cuda (register: one set), 2 on cpu")
    p.add_argument("--crop-size", type=int, default=160, help="network crop side (default: 160; less for smoke tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed forwards per measurement (default: 5 cuda, 2 cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed forwards first (default: 3 cuda, 1 cpu)")
    p.add_argument("--fold-batchnorm", action="store_true", help="fold batch norms into the convolutions first")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler pass (op kinds, launches)")
    p.add_argument("--no-layers", action="store_true", help="leave the per-layer rows out of the JSON")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON to FILE")
    return p


def _prepare(network: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from foundationpose.models.fold import fold_batchnorm
    from foundationpose.models.unrolled import unroll
    from foundationpose.weights import ensure_weights, load_refiner, load_scorer

    root, _ = ensure_weights(args.weights)
    net = (load_refiner if network == "refiner" else load_scorer)(root, device=device)
    model = unroll(fold_batchnorm(net) if args.fold_batchnorm else net).to(dtype).eval()
    return model.to(memory_format=torch.channels_last) if device.type == "cuda" else model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from foundationpose.errors import PoseError
    from foundationpose.runtime import resolve_device

    try:
        device = resolve_device(args.device)
        cuda = device.type == "cuda"
        precision = args.precision if args.precision != "auto" else ("fp16" if cuda else "fp32")
        args.precision = precision
        if precision == "fp16" and not cuda:
            raise ValueError("precision fp16 needs a CUDA device (CPU fp16 kernels are slow or missing); use fp32 or bf16")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float16 if cuda else torch.float32)
        repeats = args.repeats or (5 if cuda else 2)
        warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
        plan = {"refiner": args.refiner_batches or ((1, 8, 16, 32, 252) if cuda else (1, 2)),
                "scorer": args.scorer_batches or ((252,) if cuda else (2,))}
        peaks = measure_peaks(device)
        report: dict[str, Any] = {
            "device": str(device), "peaks": asdict(peaks), "precision": precision,
            "settings": {"crop_size": args.crop_size, "repeats": repeats, "warmup": warmup, "batches": plan,
                         "fold_batchnorm": args.fold_batchnorm, "weights": args.weights or "random",
                         "torch": torch.__version__, "threads": torch.get_num_threads()},
            "networks": {}, "summary": [],
        }
        for network, sizes in plan.items():
            model = _prepare(network, args, device, dtype)
            for batch in sizes:
                result = roofline_network(model, network, batch, crop_size=args.crop_size, device=device, dtype=dtype,
                                          peaks=peaks, repeats=repeats, warmup=warmup, profile=not args.no_profile,
                                          layers=not args.no_layers)
                report["networks"].setdefault(network, {})[str(batch)] = result
                top_kind = next(iter(result["by_kind"]), None)
                report["summary"].append({
                    "network": network, "batch": batch, "forward_ms": result["forward_ms"],
                    "graph_ms": result.get("graph_ms"), "tflops": result["tflops"],
                    "fraction_of_16bit_peak": result["fraction_of_16bit_peak"],
                    "compute_bound_share": result["bound_time_share"]["compute"], "top_kind": top_kind,
                    "top_kind_share": result["by_kind"][top_kind]["share"] if top_kind else None})
            del model
    except (PoseError, ValueError, RuntimeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
