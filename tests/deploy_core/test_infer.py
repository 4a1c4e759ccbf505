"""BaseInferCore contract and TorchInferCore (CPU; CUDA cases skip with a reason here)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import deploy_core.infer as infer
from deploy_core.errors import CapacityError, ClosedError, EngineError
from deploy_core.infer import TensorSpec, TorchInferCore, make_infer_core
from deploy_core.memory import BufferSpec, MemBufferPool

from ._small_net import INPUTS, OUTPUTS, SmallNet

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")




def _net(seed: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet()


def _inputs(n: int, device: str = "cpu", seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 3, 8, 8, generator=g).to(device),
        "scale": torch.rand(n, 1, generator=g).to(device) + 0.5,
    }


def _core(device: str = "cpu", **kwargs: object) -> tuple[TorchInferCore, SmallNet]:
    ref = _net()
    core = TorchInferCore(_net(), INPUTS, OUTPUTS, max_batch=4, device=device, **kwargs)  # type: ignore[arg-type]
    return core, ref.to(device).eval()


def test_public_names() -> None:
    assert infer.__all__ == sorted(infer.__all__)
    assert {"BaseInferCore", "TensorSpec", "TorchInferCore", "OnnxRuntimeInferCore", "TensorRTInferCore",
            "make_infer_core", "has_onnxruntime", "has_tensorrt", "BACKENDS"} == set(infer.__all__)


def test_tensor_spec() -> None:
    spec = TensorSpec("x", [-1, 160, 160, 6], torch.float32)  # type: ignore[arg-type]
    assert spec.shape == (-1, 160, 160, 6) and spec.with_batch(3) == (3, 160, 160, 6)
    assert str(spec) == "x (N, 160, 160, 6) float32"
    with pytest.raises(ValueError, match=r"^TensorSpec 'x': shape must be \(-1, d1, ...\)"):
        TensorSpec("x", (4, 3), torch.float32)
    with pytest.raises(ValueError, match=r"^TensorSpec 'x': shape must be"):
        TensorSpec("x", (-1, -1), torch.float32)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_torch_core_matches_direct_module_call(n: int) -> None:
    core, ref = _core()
    xs = _inputs(n)
    out = core.infer(xs)
    with torch.no_grad():
        want = ref(xs["x"], xs["scale"])
    assert list(out) == ["logits", "pooled"]
    for got, exp in zip(out.values(), want, strict=True):
        assert torch.isfinite(got).all()
        # Same weights, same ops, same device: identical up to float32 summation order (measured: 0 diff).
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)


def test_outputs_are_written_into_pool_views() -> None:
    core, ref = _core()
    pool = MemBufferPool([BufferSpec("logits", (4, 5), torch.float32), BufferSpec("pooled", (4, 4), torch.float32)],
                         slots=1, device="cpu")
    xs = _inputs(3)
    with pool.acquire() as lease:
        outs = {"logits": lease.view("logits", (3, 5)), "pooled": lease.view("pooled", (3, 4))}
        ptrs = {k: v.data_ptr() for k, v in outs.items()}
        result = core.infer(xs, outputs=outs)
        assert all(result[k] is outs[k] for k in outs)
        assert {k: v.data_ptr() for k, v in result.items()} == ptrs
        with torch.no_grad():
            want = ref(xs["x"], xs["scale"])
        torch.testing.assert_close(lease.buffers["logits"][:3], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lease.buffers["pooled"][:3], want[1], rtol=1e-6, atol=1e-6)
        assert bool((lease.buffers["logits"][3:] == 0).all())  # nothing written past the view


def test_batch_above_max_raises_capacity_error() -> None:
    core, _ = _core()
    with pytest.raises(CapacityError, match=r"^torch:SmallNet: batch N=5 exceeds max_batch=4"):
        core.infer(_inputs(5))


def test_input_validation_messages() -> None:
    core, _ = _core()
    xs = _inputs(2)
    with pytest.raises(ValueError, match=r"^torch:SmallNet: input names must be \['scale', 'x'\]; "
                                         r"missing \['scale'\], unknown \['y'\]$"):
        core.infer({"x": xs["x"], "y": xs["scale"]})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: input 'x': expected shape \(N, 3, 8, 8\); got \(2, 3, 9, 8\)$"):
        core.infer({**xs, "x": torch.zeros(2, 3, 9, 8)})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: input 'x': expected shape \(N, 3, 8, 8\); got \(3, 8, 8\)$"):
        core.infer({**xs, "x": torch.zeros(3, 8, 8)})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: input 'x': expected dtype torch.float32; got torch.float64$"):
        core.infer({**xs, "x": xs["x"].double()})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: inconsistent batch: input 'x' has N=2, input 'scale' has N=3$"):
        core.infer({**xs, "scale": torch.ones(3, 1)})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: batch N must be >= 1, got 0$"):
        core.infer(_inputs(0))
    with pytest.raises(ValueError, match=r"^torch:SmallNet: output 'pooled': expected shape \(2, 4\) to match"):
        core.infer(xs, outputs={"logits": torch.zeros(2, 5), "pooled": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"^torch:SmallNet: output names must be"):
        core.infer(xs, outputs={"logits": torch.zeros(2, 5)})


def test_module_failures_become_engine_errors() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("kaput")

    class OneOutput(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return scale.expand(-1, 5)

    class WrongShape(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return scale.expand(-1, 5), scale

    with pytest.raises(EngineError, match=r"^b: module forward failed at N=2: kaput$") as info:
        TorchInferCore(Broken(), INPUTS, OUTPUTS, 4, "cpu", name="b").infer(_inputs(2))
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.backend == "torch"
    with pytest.raises(EngineError, match=r"^o: module returned 1 tensor\(s\), the output specs name 2"):
        TorchInferCore(OneOutput(), INPUTS, OUTPUTS, 4, "cpu", name="o").infer(_inputs(2))
    with pytest.raises(EngineError, match=r"^w: module output 'pooled': expected shape \(2, 4\); got \(2, 1\)$"):
        TorchInferCore(WrongShape(), INPUTS, OUTPUTS, 4, "cpu", name="w").infer(_inputs(2))


def test_precision_rules_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"^torch:SmallNet: precision 'fp16' needs a CUDA device; on cpu use"):
        _core(precision="fp16")
    with pytest.raises(ValueError, match=r"^torch:SmallNet: precision must be"):
        _core(precision="int8")
    xs = _inputs(4)
    fp32 = _core()[0].infer(xs)
    for cast_model in (False, True):
        core, _ = _core(precision="bf16", cast_model=cast_model)
        out = core.infer(xs)
        for k in fp32:
            assert out[k].dtype == torch.float32
            # bf16 keeps 8 mantissa bits (rel. step 2^-8 = 3.9e-3); a 192-term dot product stays within ~3e-2.
            torch.testing.assert_close(out[k], fp32[k], rtol=3e-2, atol=3e-2)
            assert not torch.equal(out[k], fp32[k])  # it really ran in reduced precision


class _PausingNet(nn.Module):
    """One linear layer; a forward in thread ``paused`` stops after the layer until ``resume`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.paused: threading.Thread | None = None
        self.inside, self.resume = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if threading.current_thread() is self.paused:
            self.inside.set()
            assert self.resume.wait(30), "the test never resumed the paused forward"
        return y


class _WeightCasts(TorchDispatchMode):
    """Counts the casts of one tensor made in this thread (autocast copies a weight with ``aten._to_copy``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.count = weight.data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == self.ptr:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _casts_while_another_thread_is_inside(net: _PausingNet, forward) -> int:  # noqa: ANN001
    """Weight casts of ``forward(x)`` in this thread while another thread's ``forward`` is paused inside ``net``."""
    x = torch.ones(2, 4)
    other = threading.Thread(target=forward, args=(x,))
    net.paused = other
    net.inside.clear()
    net.resume.clear()
    other.start()
    try:
        assert net.inside.wait(30), "the other thread's forward never got inside the module"
        with _WeightCasts(net.fc.weight) as casts:
            forward(x)
    finally:
        net.resume.set()
        other.join(30)
    return casts.count


def test_concurrent_autocast_calls_do_not_share_weight_casts() -> None:
    # The hazard: PyTorch's autocast weight-cast cache is process-wide. With it on, a second thread reuses the
    # bf16/fp16 copy the first thread made (on CUDA: written on the first thread's stream, read unordered on the
    # second's, and freed when either thread leaves autocast). The control shows the detector sees that sharing.
    net = _PausingNet()

    def cached_forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            return net(x)

    assert _casts_while_another_thread_is_inside(net, cached_forward) == 0, \
        "control: with the cache on, this thread should have used the other thread's cached weight cast"
    core = TorchInferCore(net, (TensorSpec("x", (-1, 4), torch.float32),), (TensorSpec("y", (-1, 4), torch.float32),),
                          max_batch=2, device="cpu", precision="bf16")
    assert _casts_while_another_thread_is_inside(net, lambda x: core.infer({"x": x})) == 1  # its own cast


def test_graph_and_compile_options() -> None:
    for mode in ("reduce-overhead", "max-autotune"):  # they capture graphs of their own: graphs do not nest
        with pytest.raises(ValueError, match=rf"^torch:SmallNet: compile mode '{mode}' captures CUDA graphs of its own"):
            _core(cuda_graph_batches=(1,), compile=True, compile_kwargs={"mode": mode})
    _core(cuda_graph_batches=(1,), compile=True)  # default mode: its kernels are captured by the core's graphs
    with pytest.raises(ValueError, match=r"^torch:SmallNet: cuda_graph_batches entry 5 is outside 1..max_batch=4$"):
        _core(cuda_graph_batches=(5,))
    core, _ = _core(cuda_graph_batches=(1,))  # CPU: ignored with a warning
    core.warmup([1])
    assert core.graph_batches == () and core.startup_s > 0


def test_compile_at_warmup() -> None:
    # backend="eager" exercises the torch.compile wiring (Dynamo tracing) without a C++ toolchain run.
    core, ref = _core(compile=True, compile_kwargs={"backend": "eager"})
    assert core._call is core.module  # nothing compiled before warm-up
    core.warmup([2])
    assert core._call is not core.module and core.startup_s > 0
    xs = _inputs(2)
    out = core.infer(xs)
    with torch.no_grad():
        want = ref(xs["x"], xs["scale"])
    torch.testing.assert_close(out["logits"], want[0], rtol=1e-6, atol=1e-6)


def test_close_and_factory() -> None:
    core = make_infer_core("torch", _net(), INPUTS, OUTPUTS, 4, "cpu")
    assert isinstance(core, TorchInferCore) and core.max_batch == 4 and core.device == torch.device("cpu")
    assert repr(core).startswith("<TorchInferCore 'torch:SmallNet' cpu N<=4 [x (N, 3, 8, 8) float32")
    with core:
        core.infer(_inputs(1))
    for _ in range(2):
        with pytest.raises(ClosedError, match=r"^torch:SmallNet: inference core is closed$"):
            core.infer(_inputs(1))
    core.close()  # idempotent
    with pytest.raises(ValueError, match=r"^unknown inference backend 'tvm'"):
        make_infer_core("tvm")  # type: ignore[arg-type]


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_graph_replay_matches_eager(precision: str) -> None:
    eager, _ = _core("cuda", precision=precision)
    graphed, _ = _core("cuda", precision=precision, cuda_graph_batches=(1, 3))
    graphed.warmup([1, 3])
    assert graphed.graph_batches == (1, 3)
    stream = torch.cuda.Stream()
    for n in (1, 3, 2):  # 2 has no graph: eager fallback
        xs = _inputs(n, "cuda")
        want = eager.infer(xs)
        outs = {s.name: torch.empty(s.with_batch(n), device="cuda") for s in OUTPUTS}
        ptrs = {k: v.data_ptr() for k, v in outs.items()}
        stream.wait_stream(torch.cuda.current_stream())
        got = graphed.infer(xs, outputs=outs, stream=stream)
        stream.synchronize()
        assert {k: v.data_ptr() for k, v in got.items()} == ptrs
        # Same kernels in and out of the graph; the fp16 bound allows one fp16 ulp near 1 (9.8e-4) in case
        # cuDNN picks another algorithm under capture.
        tol = 1e-5 if precision == "fp32" else 2e-3
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol)
