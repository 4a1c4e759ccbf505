"""TensorRTInferCore. Engine tests need TensorRT >= 10 and a CUDA device; they skip with the reason otherwise.

The engine tests build a tiny plan from an ONNX export at test time (plans are tied to the TensorRT version
and GPU, so none is checked in).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deploy_core.errors import CapacityError, EngineError
from deploy_core.infer import TensorRTInferCore, TensorSpec, has_tensorrt, make_infer_core

from ._small_net import SmallNet


def _trt_skip_reason() -> str | None:
    try:
        import tensorrt
    except ImportError as exc:
        return f"TensorRT is not installed here (import tensorrt: {exc}); run on a CUDA machine with TensorRT >= 10"
    if not has_tensorrt():
        return f"TensorRT {tensorrt.__version__} is older than 10"
    if not torch.cuda.is_available():
        return "TensorRT is installed but there is no CUDA device"
    return None


_SKIP = _trt_skip_reason()
needs_trt = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")



def _inputs(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, 8, 8, generator=g).cuda(), "scale": (torch.rand(n, 1, generator=g) + 0.5).cuda()}


def test_cpu_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^TensorRT needs a CUDA device, got cpu$"):
        TensorRTInferCore("missing.plan", device="cpu")


def test_factory_path_alias_conflict() -> None:
    with pytest.raises(TypeError, match=r"^pass either path= or plan_path=, not both$"):
        make_infer_core("tensorrt", path="a.plan", plan_path="b.plan")


@pytest.mark.skipif(has_tensorrt(), reason="checks the message shown when TensorRT is missing")
def test_missing_tensorrt_says_how_to_install() -> None:
    assert has_tensorrt() is False
    with pytest.raises(ImportError, match=r"^TensorRT is not installed: pip install tensorrt") as info:
        TensorRTInferCore("missing.plan", device="cuda")
    # the one TensorRT seam (deploy_core.infer._trt_support): also what engines.build raises
    assert isinstance(info.value, EngineError) and info.value.backend == "tensorrt"


class _FakeILogger:
    class Severity:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self) -> None:
        pass


class _FakeEngine:
    """The engine queries _read_io makes, answered like a TensorRT 10 engine with one batch-dynamic profile."""

    _io = {  # name: (mode, shape, dtype, (min, max) batch)
        "x": ("in", (-1, 3, 8, 8), "f32", (1, 8)),
        "mask": ("in", (-1, 4), "bool", (2, 6)),
        "y": ("out", (-1, 5), "f16", None),
    }
    num_io_tensors = 3

    def __init__(self, location: str = "dev") -> None:
        self.location = location

    def get_tensor_name(self, i: int) -> str:
        return list(self._io)[i]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._io[name][1]

    def get_tensor_location(self, name: str) -> str:
        return self.location

    def get_tensor_dtype(self, name: str) -> str:
        return self._io[name][2]

    def get_tensor_mode(self, name: str) -> str:
        return self._io[name][0]

    def get_tensor_profile_shape(self, name: str, profile: int) -> tuple[tuple[int, ...], ...]:
        lo, hi = self._io[name][3]
        rest = self._io[name][1][1:]
        return (lo, *rest), (hi, *rest), (hi, *rest)


def _fake_trt() -> SimpleNamespace:
    return SimpleNamespace(
        ILogger=_FakeILogger,
        DataType=SimpleNamespace(FLOAT="f32", HALF="f16", BOOL="bool"),
        TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
        TensorLocation=SimpleNamespace(DEVICE="dev", HOST="host"),
    )


def test_engine_introspection_logic_without_tensorrt() -> None:
    from deploy_core.infer._trt_core import _read_io, _Shared

    trt = _fake_trt()
    shared = _Shared(trt, None, None, _FakeEngine(), Path("fake.plan"))
    inputs, outputs, lo, hi = _read_io(shared, 0)
    assert inputs == [TensorSpec("x", (-1, 3, 8, 8), torch.float32), TensorSpec("mask", (-1, 4), torch.bool)]
    assert outputs == [TensorSpec("y", (-1, 5), torch.float16)]
    assert (lo, hi) == (2, 6)  # the intersection of both inputs' batch ranges
    host = _Shared(trt, None, None, _FakeEngine(location="host"), Path("fake.plan"))
    with pytest.raises(EngineError, match=r"^fake.plan: tensor 'x' has shape \(-1, 3, 8, 8\); only device tensors"):
        _read_io(host, 0)


def test_logger_keeps_this_threads_errors() -> None:
    from deploy_core.infer._trt_support import make_trt_logger

    log = make_trt_logger(_fake_trt())
    sev = _FakeILogger.Severity
    log.log(sev.ERROR, "bad shape")
    log.log(sev.WARNING, "just a warning")
    log.log(sev.INTERNAL_ERROR, "worse")
    other: list[list[str]] = []
    t = threading.Thread(target=lambda: other.append(log.take()), name="test-other-thread")
    t.start()
    t.join(10)
    assert other == [[]]  # errors are per thread
    assert log.take() == ["bad shape", "worse"] and log.take() == []


# ------------------------------------------------------------------------------------------------ engine tests
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[SmallNet, Path]:
    """Profile 0: batch 1..8 (opt 4); profile 1: batch exactly 2. TF32 off so fp32 parity is tight."""
    import tensorrt as trt

    torch.manual_seed(0)
    net = SmallNet().eval()
    tmp = tmp_path_factory.mktemp("trt")
    onnx_path = tmp / "small.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 8, 8), torch.ones(2, 1)), str(onnx_path),
                          input_names=["x", "scale"], output_names=["logits", "pooled"],
                          dynamic_axes={k: {0: "N"} for k in ("x", "scale", "logits", "pooled")},
                          opset_version=17, dynamo=False)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    config.clear_flag(trt.BuilderFlag.TF32)
    for lo, opt, hi in ((1, 4, 8), (2, 2, 2)):
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (lo, 3, 8, 8), (opt, 3, 8, 8), (hi, 3, 8, 8))
        profile.set_shape("scale", (lo, 1), (opt, 1), (hi, 1))
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT failed to build the test engine"
    plan_path = tmp / "small.plan"
    plan_path.write_bytes(bytes(plan))
    return net.cuda(), plan_path


@needs_trt
@pytest.mark.parametrize("n", [1, 4])
def test_engine_matches_torch(engine: tuple[SmallNet, Path], n: int) -> None:
    net, plan = engine
    core = TensorRTInferCore(plan, device="cuda")
    assert core.max_batch == 8 and core.min_batch == 1 and core.profile_index == 0
    assert core.inputs == (TensorSpec("x", (-1, 3, 8, 8), torch.float32), TensorSpec("scale", (-1, 1), torch.float32))
    xs = _inputs(n)
    out = core.infer(xs)
    torch.cuda.synchronize()
    with torch.no_grad():
        want = net(xs["x"], xs["scale"])
    for got, exp in zip(out.values(), want, strict=True):
        assert torch.isfinite(got).all()
        # fp32 without TF32 on both sides; TensorRT fuses conv+relu and reorders sums.
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    core.close()


@needs_trt
def test_engine_writes_into_caller_buffers_on_a_stream(engine: tuple[SmallNet, Path]) -> None:
    net, plan = engine
    core = make_infer_core("tensorrt", path=plan, max_batch=4, device="cuda")
    capacity = {"logits": torch.zeros(4, 5, device="cuda"), "pooled": torch.zeros(4, 4, device="cuda")}
    outs = {k: v[:3] for k, v in capacity.items()}
    ptrs = {k: v.data_ptr() for k, v in outs.items()}
    xs = _inputs(3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    result = core.infer(xs, outputs=outs, stream=stream)
    stream.synchronize()
    assert {k: v.data_ptr() for k, v in result.items()} == ptrs
    with torch.no_grad():
        want = net(xs["x"], xs["scale"])
    torch.testing.assert_close(capacity["logits"][:3], want[0], rtol=1e-4, atol=1e-4)
    assert bool((capacity["logits"][3:] == 0).all())
    with pytest.raises(CapacityError, match=r"batch N=5 exceeds max_batch=4"):
        core.infer(_inputs(5))
    twin = core.fork()  # own context, shared engine
    torch.testing.assert_close(twin.infer(xs)["pooled"], want[1], rtol=1e-4, atol=1e-4)


@needs_trt
def test_profiles_and_errors(engine: tuple[SmallNet, Path], tmp_path: Path) -> None:
    _, plan = engine
    with pytest.raises(CapacityError, match=r"max_batch=9 exceeds profile 0's max batch 8$"):
        TensorRTInferCore(plan, max_batch=9)
    fixed = TensorRTInferCore(plan, profile_index=1)
    assert (fixed.min_batch, fixed.max_batch) == (2, 2)
    assert fixed.infer(_inputs(2))["logits"].shape == (2, 5)
    with pytest.raises(ValueError, match=r"batch N=1 is below profile 1's min batch 2$"):
        fixed.infer(_inputs(1))
    with pytest.raises(ValueError, match=r"profile_index 2 out of range; the engine has 2$"):
        TensorRTInferCore(plan, profile_index=2)
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(EngineError, match=r"^TensorRT could not deserialise .*bad.plan: "):
        TensorRTInferCore(bad)
    with pytest.raises(EngineError, match=r"^cannot read TensorRT plan "):
        TensorRTInferCore(tmp_path / "absent.plan")
