"""FP8 layers: exact E4M3 rounding, emulation vs the float64 reference twins, the inference copy, and (on a GPU
with FP8 tensor cores) the library kernels vs the same references."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from foundationpose.models import RefineNet, ScoreNetMultiPair, randomize_
from foundationpose.models.blocks import SelfAttention
from foundationpose.models.unrolled import EncoderLayer, unroll
from foundationpose.quant import (
    E4M3_MAX,
    FP8_DTYPE,
    Fp8Conv2d,
    Fp8Linear,
    eligible_layers,
    fp8_backend_for,
    inference_copy,
    quantize_e4m3,
    weight_scales,
)
from foundationpose.quant._reference import (
    e4m3_grid,
    fp8_conv2d_reference,
    fp8_linear_reference,
    round_to_e4m3,
)
from foundationpose.quant.calibrate import PairBatch, observe_input_amax
from foundationpose.quant.quantize import copy_with_fp8

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def refine_net() -> RefineNet:
    return randomize_(RefineNet(), seed=0).eval()


@pytest.fixture(scope="module")
def score_net() -> ScoreNetMultiPair:
    return randomize_(ScoreNetMultiPair(), seed=1).eval()


def _pairs(n: int, side: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.rand(n, 6, side, side, generator=g), torch.rand(n, 6, side, side, generator=g)


# -- the format -------------------------------------------------------------------------------------------------


def test_public_names_are_pinned_and_sorted() -> None:
    import foundationpose.quant as quant

    assert quant.__all__ == sorted(quant.__all__, key=str)
    assert all(hasattr(quant, name) for name in quant.__all__)
    assert {"load_fp8_networks", "quantize_for_inference", "load_scales", "compare_precisions"} <= set(quant.__all__)


def test_e4m3_grid_is_the_format() -> None:
    grid, _ = e4m3_grid()
    assert grid.numel() == 253  # 256 codes - 2 NaNs - the duplicate zero
    assert float(grid.max()) == E4M3_MAX == 448.0 and float(grid[grid > 0].min()) == 2.0**-9  # smallest subnormal
    # 3 mantissa bits: 8 values per binade above the subnormals
    assert int(((grid >= 1) & (grid < 2)).sum()) == 8


def test_the_cast_rounds_to_nearest_even_and_saturates() -> None:
    """quantize_e4m3 equals the grid search of the reference on random values, exact midpoints and overflow."""
    grid, _ = e4m3_grid()
    mid = ((grid[1:] + grid[:-1]) / 2).to(torch.float32)
    wide = torch.randn(50_000, generator=_gen(0)) * torch.logspace(-4, 3, 50_000)
    x = torch.cat([wide, mid, torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, 0.0])])
    got = quantize_e4m3(x, torch.tensor(1.0))
    assert got.dtype == FP8_DTYPE
    assert not torch.isnan(got.float()).any()
    assert torch.equal(got.to(torch.float64), round_to_e4m3(x))
    assert got.float()[-6:].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, 0.0]


def test_weight_scales_map_each_channel_amax_to_448() -> None:
    w = torch.randn(8, 4, 3, 3, generator=_gen(1)) * torch.logspace(-3, 2, 8)[:, None, None, None]
    w[3] = 0.0
    scale = weight_scales(w)
    assert scale.shape == (8,) and scale.dtype == torch.float32
    q = quantize_e4m3(w, 1.0 / scale[:, None, None, None]).float()
    amax_q = q.abs().flatten(1).amax(1)
    assert torch.equal(amax_q[[0, 1, 2, 4, 5, 6, 7]], torch.full((7,), 448.0))
    assert float(scale[3]) == 1.0 and float(amax_q[3]) == 0.0


# -- layers vs their reference twins -------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(3,), (2, 5), (1, 16)])
def test_fp8_linear_emulation_equals_the_reference(lead: tuple[int, ...]) -> None:
    linear = nn.Linear(64, 48)
    nn.init.normal_(linear.weight, std=0.2, generator=_gen(2))
    layer = Fp8Linear(linear, input_scale=3.0 / 448)
    x = torch.randn(*lead, 64, generator=_gen(3))  # some |x| > 3: saturates, as deployed
    got = layer(x)
    want = fp8_linear_reference(x, linear.weight, layer.weight_scale, layer.input_scale, linear.bias)
    assert torch.isfinite(got).all()
    # E4M3 products are exact in float32; the only difference is float32 summation of 64 terms and the
    # float32 scale / bias epilogue: measured max 1.0e-7 of the output's largest magnitude (CPU, float32).
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize(("stride", "padding", "kernel"), [(1, 1, 3), (2, 1, 3), (2, 3, 7)])
def test_fp8_conv_emulation_equals_the_reference(stride: int, padding: int, kernel: int) -> None:
    conv = nn.Conv2d(16, 32, kernel, stride=stride, padding=padding)
    layer = Fp8Conv2d(conv, input_scale=2.5 / 448)
    x = torch.randn(2, 16, 12, 10, generator=_gen(4))
    got = layer(x)
    want = fp8_conv2d_reference(x, conv.weight, layer.weight_scale, layer.input_scale, conv.bias,
                                (stride, stride), (padding, padding))
    assert got.shape == want.shape and torch.isfinite(got).all()
    # float32 summation order only: measured max 9.2e-8 of the output's largest magnitude (CPU)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


def test_fp8_layers_stay_close_to_the_float_layers() -> None:
    """The FP8 error is E4M3 rounding: a few percent of the output's RMS, never zero, never wild."""
    conv = nn.Conv2d(64, 64, 3, padding=1)
    x = torch.relu(torch.randn(2, 64, 10, 10, generator=_gen(5)))
    layer = Fp8Conv2d(conv, input_scale=float(x.abs().max()) / 448)
    with torch.no_grad():
        ref = conv(x)
        rel = float((layer(x) - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert 1e-3 < rel < 0.05, rel


def test_quantised_buffers_keep_their_dtypes_through_a_model_cast() -> None:
    layer = nn.Sequential(Fp8Linear(nn.Linear(32, 16), input_scale=0.01)).to(torch.bfloat16)
    fp8 = layer[0]
    assert fp8.weight_fp8.dtype == FP8_DTYPE
    assert fp8.weight_scale.dtype == fp8.out_scale.dtype == fp8.input_scale.dtype == torch.float32
    y = layer(torch.randn(4, 32, generator=_gen(6)).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_kernels_backend_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(RuntimeError, match=r"^precision fp8 cannot run its kernels here: FP8 kernels need a CUDA"):
        fp8_backend_for("cpu", "kernels")
    assert fp8_backend_for("cpu") == "emulate"
    layer = Fp8Linear(nn.Linear(16, 16), input_scale=0.01, backend="kernels")
    with pytest.raises(RuntimeError, match=r"backend 'kernels' needs CUDA tensors"):
        layer(torch.zeros(1, 16))


# -- the inference copy ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_unrolled_networks_equal_the_originals(refine_net: RefineNet, score_net: ScoreNetMultiPair) -> None:
    a, b = _pairs(3, 32, 7)
    unrolled_r, unrolled_s = unroll(refine_net), unroll(score_net)
    assert not any(isinstance(m, (nn.TransformerEncoderLayer, nn.MultiheadAttention)) for m in unrolled_r.modules())
    assert sum(isinstance(m, EncoderLayer) for m in unrolled_r.modules()) == 2
    assert sum(isinstance(m, SelfAttention) for m in unrolled_s.modules()) == 2
    with torch.no_grad():
        for want, got in zip(refine_net(a, b), unrolled_r(a, b), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fused vs unfused fp32: measured 7.5e-8
        torch.testing.assert_close(unrolled_s(a, b, L=3), score_net(a, b, L=3), rtol=0, atol=1e-5)


def test_eligible_layers_of_both_networks(refine_net: RefineNet, score_net: ScoreNetMultiPair) -> None:
    r, s = eligible_layers(inference_copy(refine_net)), eligible_layers(inference_copy(score_net))
    # 14 convolutions (all but the 6-channel first one) + 4 linear layers per transformer head (not the 512 -> 3)
    assert len(r) == 22 and len(s) == 16
    assert "encodeA.0.net.0" not in r and "encodeA.1.net.0" in r and "trans_head.0.self_attn.in_proj" in r
    assert "trans_head.1" not in r and not any(n.startswith("att_cross") for n in s) and "att.in_proj" in s
    assert list(r)[0] == "encodeA.1.net.0"  # forward order


@pytest.mark.slow
def test_a_fully_fp8_network_stays_near_float_without_host_syncs(refine_net: RefineNet) -> None:
    model = inference_copy(refine_net)
    a, b = _pairs(2, 32, 8)
    layers = list(eligible_layers(model))
    amax = observe_input_amax(model, layers, [PairBatch(a, b)])
    quantised = copy_with_fp8(model, {n: amax[n] / 448 for n in layers})
    assert sum(isinstance(m, (Fp8Conv2d, Fp8Linear)) for m in quantised.modules()) == 22
    with torch.no_grad():
        want = model(a, b)
        quantised(a, b)  # warm-up
        with _OpProbe() as probe:
            got = quantised(a, b)
    assert not (set(probe.ops) & _SYNCING), set(probe.ops) & _SYNCING
    for w, g in zip(want, got, strict=True):
        assert torch.isfinite(g).all()
        assert float((g - w).norm() / w.norm()) < 0.25  # every layer rounded to E4M3; random weights, 16 tokens


_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "lift_fresh", "item"}


class _OpProbe(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# -- the kernel path's plumbing, on the CPU where torch has the op -------------------------------------------------


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 2e-3)])
def test_scaled_mm_call_matches_the_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                              tolerance: float) -> None:
    """``_kernels.fp8_linear`` (row-wise ``torch._scaled_mm``: layouts, scale shapes, bias placement) through
    torch's CPU implementation of the op. Tolerances are relative to the output's largest magnitude; measured on
    the CPU: 1.8e-7 (float32), 2.0e-3 (bfloat16: 16-bit output and bias), 2.6e-4 (float16)."""
    from foundationpose.quant import _kernels

    monkeypatch.setattr(_kernels, "_quantize_impl", quantize_e4m3)  # no torch.compile in a unit test
    linear = nn.Linear(64, 48)
    layer = Fp8Linear(linear, input_scale=3.0 / 448)
    x = torch.randn(2, 5, 64, generator=_gen(10)).to(dtype)
    with torch.no_grad():
        got = _kernels.fp8_linear(x, layer)
        want = fp8_linear_reference(x, linear.weight, layer.weight_scale, layer.input_scale, linear.bias)
    assert got.dtype == dtype and got.shape == (2, 5, 48)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tolerance * float(want.abs().max()))


def test_fp8_conv_op_schema_and_shape() -> None:
    """The cuDNN convolution is a custom op with a fake implementation (torch.compile sees one opaque node)."""
    from foundationpose.quant import _kernels  # noqa: F401  (registers the op)

    x = torch.zeros(2, 16, 9, 8, device="meta", dtype=FP8_DTYPE)
    w = torch.zeros(32, 16, 3, 3, device="meta", dtype=FP8_DTYPE)
    scale = torch.zeros(32, device="meta")
    y = torch.ops.foundationpose.fp8_conv2d(x, w, scale, scale, [2, 2], [1, 1], torch.float16)
    assert y.shape == (2, 32, 5, 4) and y.dtype == torch.float16
    assert y.is_contiguous(memory_format=torch.channels_last)


# -- CUDA: the library kernels -----------------------------------------------------------------------------------


@needs_fp8_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scaled_mm_linear_matches_the_reference(dtype: torch.dtype) -> None:
    linear = nn.Linear(512, 1536).cuda()
    layer = Fp8Linear(linear, input_scale=4.0 / 448, backend="kernels").cuda()
    x = torch.randn(2, 400, 512, device="cuda").to(dtype)
    got = layer(x)
    want = fp8_linear_reference(x.cpu(), linear.weight.cpu(), layer.weight_scale.cpu(), layer.input_scale.cpu(),
                                linear.bias.cpu())
    assert got.dtype == dtype and torch.isfinite(got).all()
    # 16-bit output rounding (2^-8 relative for bf16) and the 16-bit bias dominate the difference.
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@needs_fp8_gpu
@pytest.mark.cuda
def test_cudnn_fp8_conv_matches_the_reference() -> None:
    pytest.importorskip("cudnn", reason="the cuDNN frontend (pip install nvidia-cudnn-frontend) is not installed")
    conv = nn.Conv2d(128, 256, 3, stride=2, padding=1).cuda()
    layer = Fp8Conv2d(conv, input_scale=3.0 / 448, backend="kernels").cuda()
    x = torch.relu(torch.randn(4, 128, 40, 40, device="cuda")).half().contiguous(memory_format=torch.channels_last)
    got = layer(x)
    want = fp8_conv2d_reference(x.cpu(), conv.weight.cpu(), layer.weight_scale.cpu(), layer.input_scale.cpu(),
                                conv.bias.cpu(), (2, 2), (1, 1))
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@needs_fp8_gpu
@pytest.mark.cuda
def test_fp8_network_is_capturable_in_a_cuda_graph(refine_net: RefineNet) -> None:
    pytest.importorskip("cudnn", reason="the cuDNN frontend (pip install nvidia-cudnn-frontend) is not installed")
    model = inference_copy(refine_net).cuda()
    a, b = (t.cuda().contiguous(memory_format=torch.channels_last) for t in _pairs(4, 160, 9))
    layers = list(eligible_layers(model))
    amax = observe_input_amax(model, layers, [PairBatch(a, b)])
    quantised = copy_with_fp8(model, {n: amax[n] / 448 for n in layers}, backend="kernels").half()
    a16, b16 = a.half(), b.half()
    with torch.no_grad():
        for _ in range(2):  # warm-up: cuDNN plans, compiled quantisation, cuBLASLt
            eager = quantised(a16, b16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = quantised(a16, b16)
        graph.replay()
        torch.cuda.synchronize()
    for e, c in zip(eager, captured, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)  # same kernels, same inputs
