"""OnnxRuntimeInferCore (CPU EP): parity with torch, in-place output binding, the EngineError seam."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from deploy_core.errors import CapacityError, ClosedError, EngineError
from deploy_core.infer import OnnxRuntimeInferCore, TensorSpec, has_onnxruntime, make_infer_core

from ._small_net import SmallNet

pytestmark = pytest.mark.skipif(not has_onnxruntime(), reason="onnxruntime is not installed")



def _export(module: nn.Module, path: Path, dynamic: bool = True) -> Path:
    example = (torch.randn(2, 3, 8, 8), torch.ones(2, 1))
    axes = {k: {0: "N"} for k in ("x", "scale", "logits", "pooled")} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated (but fast, and needs no onnxscript)
        torch.onnx.export(module, example, str(path), input_names=["x", "scale"], output_names=["logits", "pooled"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[SmallNet, Path]:
    torch.manual_seed(0)
    net = SmallNet().eval()
    return net, _export(net, tmp_path_factory.mktemp("onnx") / "small.onnx")


def _inputs(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, 8, 8, generator=g), "scale": torch.rand(n, 1, generator=g) + 0.5}


def test_specs_are_read_from_the_model(model: tuple[SmallNet, Path]) -> None:
    core = OnnxRuntimeInferCore(model[1], max_batch=4)
    assert core.inputs == (TensorSpec("x", (-1, 3, 8, 8), torch.float32), TensorSpec("scale", (-1, 1), torch.float32))
    assert core.outputs == (TensorSpec("logits", (-1, 5), torch.float32), TensorSpec("pooled", (-1, 4), torch.float32))
    assert core.providers == ["CPUExecutionProvider"] and core.name == "onnxruntime:small.onnx"


@pytest.mark.parametrize("n", [1, 4])
def test_matches_torch(model: tuple[SmallNet, Path], n: int) -> None:
    net, path = model
    core = OnnxRuntimeInferCore(path, max_batch=4, device="cpu")
    xs = _inputs(n)
    out = core.infer(xs)
    with torch.no_grad():
        want = net(xs["x"], xs["scale"])
    for got, exp in zip(out.values(), want, strict=True):
        assert torch.isfinite(got).all() and got.shape == exp.shape
        # Same float32 maths, different kernels (MLAS vs ATen): measured max |diff| 6e-8 on the dev CPU.
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_outputs_are_written_in_place(model: tuple[SmallNet, Path]) -> None:
    net, path = model
    core = make_infer_core("onnxruntime", path=path, max_batch=4, device="cpu")
    capacity = {"logits": torch.zeros(4, 5), "pooled": torch.zeros(4, 4)}  # stands in for pool buffers
    outs = {"logits": capacity["logits"][:3], "pooled": capacity["pooled"][:3]}
    ptrs = {k: v.data_ptr() for k, v in outs.items()}
    xs = _inputs(3)
    result = core.infer(xs, outputs=outs)
    assert all(result[k] is outs[k] for k in outs) and {k: v.data_ptr() for k, v in result.items()} == ptrs
    with torch.no_grad():
        want = net(xs["x"], xs["scale"])
    torch.testing.assert_close(capacity["logits"][:3], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(capacity["pooled"][:3], want[1], rtol=1e-5, atol=1e-5)
    assert bool((capacity["logits"][3:] == 0).all())
    # A non-contiguous input is copied; a non-contiguous output cannot be bound by pointer.
    x_strided = torch.randn(3, 3, 8, 16)[..., ::2]
    core.infer({"x": x_strided, "scale": xs["scale"]})
    with pytest.raises(ValueError, match=r"^onnxruntime:small.onnx: output 'logits' must be contiguous"):
        core.infer(xs, outputs={"logits": torch.zeros(5, 3).t(), "pooled": torch.zeros(3, 4)})


def test_capacity_and_close(model: tuple[SmallNet, Path]) -> None:
    core = OnnxRuntimeInferCore(model[1], max_batch=2)
    with pytest.raises(CapacityError, match=r"^onnxruntime:small.onnx: batch N=3 exceeds max_batch=2"):
        core.infer(_inputs(3))
    core.close()
    with pytest.raises(ClosedError):
        core.infer(_inputs(1))
    assert core.providers == []


def test_load_failures_are_engine_errors(tmp_path: Path, model: tuple[SmallNet, Path]) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(EngineError, match=r"^onnxruntime could not load .*bad.onnx: ") as info:
        OnnxRuntimeInferCore(bad, max_batch=1)
    assert info.value.__cause__ is not None and info.value.backend == "onnxruntime"
    assert info.value.engine_path == str(bad)

    static = _export(model[0], tmp_path / "static.onnx", dynamic=False)
    with pytest.raises(EngineError, match=r"^.*static.onnx: tensor 'x' has shape \[2, 3, 8, 8\]; expected a dynamic"):
        OnnxRuntimeInferCore(static, max_batch=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the missing-CUDA-EP message on a CPU-only machine")
def test_cuda_without_cuda_provider_is_refused(model: tuple[SmallNet, Path]) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    with pytest.raises(EngineError, match=r"^onnxruntime has no CUDAExecutionProvider \(available: "):
        OnnxRuntimeInferCore(model[1], max_batch=1, device="cuda")
