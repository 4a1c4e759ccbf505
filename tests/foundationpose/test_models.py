"""RefineNet / ScoreNetMultiPair: checkpoint format (spec 4.6), sizes (4.5), behaviour (4.1-4.4, 6.1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from foundationpose.models import (
    PositionalEmbedding,
    RefineNet,
    RefinerHWC,
    ScoreNetMultiPair,
    ScorerHWC,
    fold_batchnorm,
    randomize_,
)
from foundationpose.models.blocks import self_attention
from foundationpose.models.fold import PaddedInputConv, pad_input_channels

DATA = Path(__file__).parent / "data"


def _table(name: str) -> list[tuple[str, list[int], str, str]]:
    """(key, shape, dtype, kind) rows transcribed from spec 4.6.1 / 4.6.2."""
    rows = []
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#"):
            continue
        key, shape, dtype, kind = line.split("\t")
        dims = [int(d) for d in shape.strip("[]").split(",") if d]
        rows.append((key, dims, dtype, kind))
    return rows


@pytest.fixture(scope="module")
def refine_net() -> RefineNet:
    return randomize_(RefineNet(), seed=0).eval()


@pytest.fixture(scope="module")
def score_net() -> ScoreNetMultiPair:
    return randomize_(ScoreNetMultiPair(), seed=0).eval()


def _crops(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 6, 160, 160) float32 NCHW pair, values in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 6, 160, 160, generator=g), torch.rand(n, 6, 160, 160, generator=g)


@pytest.mark.parametrize(
    ("cls", "table", "n_keys"),
    [(RefineNet, "state_dict_refinenet.txt", 134), (ScoreNetMultiPair, "state_dict_scorenet.txt", 116)],
)
def test_state_dict_equals_the_spec_table(cls: type[nn.Module], table: str, n_keys: int) -> None:
    model = cls()
    rows = _table(table)
    assert len(rows) == n_keys
    got = [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()]
    assert got == [(k, shape, dtype) for k, shape, dtype, _ in rows]  # keys, shapes, dtypes and order
    params = {name for name, _ in model.named_parameters()}
    assert params == {k for k, _, _, kind in rows if kind == "param"}
    buffers = {name for name, _ in model.named_buffers()}
    assert buffers == {k for k, _, _, kind in rows if kind == "buffer"}


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_and_buffer_counts_match_spec_4_5() -> None:
    refine, score = RefineNet(), ScoreNetMultiPair()
    assert _n_params(refine) == 16_830_406
    assert _n_params(score) == 15_773_121
    assert _n_params(refine.encodeA) == _n_params(score.encoderA) == 684_480
    assert _n_params(refine.encodeAB) == _n_params(score.encoderAB) == 12_986_880
    assert _n_params(refine.trans_head) == _n_params(refine.rot_head) == 1_579_523
    assert _n_params(score.att) == _n_params(score.att_cross) == 1_050_624
    assert _n_params(score.linear) == 513
    for model, n_bytes in ((refine, 68_175_248), (score, 63_946_108)):
        assert sum(b.numel() for b in model.buffers()) == 213_391
        assert sum(v.numel() * v.element_size() for v in model.state_dict().values()) == n_bytes


def test_positional_table_is_the_sinusoid_of_spec_4_1() -> None:
    pe = PositionalEmbedding().pe
    assert pe.shape == (1, 400, 512) and pe.dtype == torch.float32
    for p, i in ((0, 0), (1, 0), (7, 3), (399, 100), (250, 255)):
        angle = p * 10000.0 ** (-2 * i / 512)
        assert pe[0, p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[0, p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    tokens = torch.zeros(2, 5, 512)
    assert torch.equal(PositionalEmbedding()(tokens), pe[:, :5].expand(2, 5, 512))
    with pytest.raises(ValueError, match=r"^401 tokens exceed the positional table \(400\)"):
        PositionalEmbedding()(torch.zeros(1, 401, 512))


@pytest.mark.slow
def test_refiner_output_shapes_and_moderate_values(refine_net: RefineNet) -> None:
    a, b = _crops(2, seed=1)
    with torch.no_grad():
        trans, rot = refine_net(a, b)
    assert trans.shape == rot.shape == (2, 3)
    assert trans.dtype == rot.dtype == torch.float32
    assert torch.isfinite(trans).all() and torch.isfinite(rot).all()
    # random weights behave like trained ones: O(1) outputs (measured max ~0.9 at batch 4)
    assert trans.abs().max() < 10 and rot.abs().max() < 10
    assert not torch.allclose(trans[0], trans[1])  # the outputs depend on the input


def test_encoder_activations_leave_fp16_headroom(refine_net: RefineNet) -> None:
    """Random BN statistics keep activations bounded (measured max ~30 vs fp16 max 65504)."""
    peaks: list[float] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: peaks.append(float(out.abs().max())))
        for m in (*refine_net.encodeA, *refine_net.encodeAB)
    ]
    try:
        a, b = _crops(1, seed=2)
        with torch.no_grad():
            refine_net(a, b)
    finally:
        for h in hooks:
            h.remove()
    assert len(peaks) == 9
    assert max(peaks) < 1000
    assert min(peaks) > 0.5  # not flushed towards zero either


@pytest.mark.slow
def test_siamese_encoder_concatenates_rendered_first(refine_net: RefineNet) -> None:
    a, b = _crops(1, seed=3)
    seen: list[torch.Tensor] = []
    hook = refine_net.encodeAB.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            refine_net(a, b)
            feat_a, feat_b = refine_net.encodeA(a), refine_net.encodeA(b)
    finally:
        hook.remove()
    (x,) = seen
    assert x.shape == (1, 256, 40, 40)
    torch.testing.assert_close(x[:, :128], feat_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x[:, 128:], feat_b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_scorer_shapes_and_set_handling(score_net: ScoreNetMultiPair) -> None:
    a, b = _crops(2, seed=4)
    with torch.no_grad():
        one_set = score_net(a, b)  # L=None: one set of 2
        explicit = score_net(a, b, L=2)
        singles = score_net(a, b, L=1)  # two sets of one
        alone = score_net(a[:1], b[:1])
    assert one_set.shape == explicit.shape == (1, 2)
    assert singles.shape == (2, 1)
    assert torch.isfinite(one_set).all()
    torch.testing.assert_close(one_set, explicit, rtol=0, atol=0)
    # a set of one scores each pair independently of the rest of the batch
    torch.testing.assert_close(singles[0], alone[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^L must divide the batch: got N=2, L=3$"):
        score_net(a, b, L=3)


@pytest.mark.slow
def test_scorer_score_depends_on_the_whole_set(score_net: ScoreNetMultiPair) -> None:
    a, b = _crops(3, seed=5)
    with torch.no_grad():
        with_1 = score_net(a[[0, 1]], b[[0, 1]])[0, 0]
        with_2 = score_net(a[[0, 2]], b[[0, 2]])[0, 0]
        alone = score_net(a[:1], b[:1])[0, 0]
    # the same pair 0 gets a different logit in a different set (cross-attention, spec 4.4);
    # measured differences ~0.01-0.02 with seed-0 random weights
    assert abs(float(with_1 - with_2)) > 1e-3
    assert abs(float(with_1 - alone)) > 1e-3


def test_self_attention_equals_torch_multihead_attention(score_net: ScoreNetMultiPair) -> None:
    x = torch.randn(2, 7, 512, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours = self_attention(score_net.att, x)
        ref = score_net.att(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_hwc_adapters_equal_the_nchw_networks(refine_net: RefineNet, score_net: ScoreNetMultiPair) -> None:
    a, b = _crops(2, seed=7)
    a_hwc = a.permute(0, 2, 3, 1).contiguous()  # (N, 160, 160, 6)
    b_hwc = b.permute(0, 2, 3, 1).contiguous()
    with torch.no_grad():
        trans, rot = RefinerHWC(refine_net)(a_hwc, b_hwc)
        trans_ref, rot_ref = refine_net(a, b)
        scores = ScorerHWC(score_net)(a_hwc, b_hwc)
        logits = score_net(a, b)
    # channels-last vs contiguous convolutions differ in summation order only
    torch.testing.assert_close(trans, trans_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rot, rot_ref, rtol=1e-5, atol=1e-5)
    assert scores.shape == (2, 1) and scores.dtype == torch.float32
    torch.testing.assert_close(scores[:, 0], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_randomize_is_deterministic_per_seed() -> None:
    sd0 = randomize_(ScoreNetMultiPair(), seed=0).state_dict()
    sd0_again = randomize_(ScoreNetMultiPair(), seed=0).state_dict()
    sd1 = randomize_(ScoreNetMultiPair(), seed=1).state_dict()
    assert all(torch.equal(sd0[k], sd0_again[k]) for k in sd0)
    differing = [k for k in sd0 if not torch.equal(sd0[k], sd1[k])]
    # everything random differs; only the fixed table and the counters are equal
    assert set(sd0) - set(differing) == {"pos_embed.pe"} | {
        k for k in sd0 if k.endswith("num_batches_tracked")
    }
    running_var = sd0["encoderAB.2.net.1.running_var"]
    assert (running_var > 0).all() and not torch.allclose(running_var, torch.ones_like(running_var))


@pytest.mark.slow
def test_fold_batchnorm_keeps_the_function_and_removes_every_batch_norm(
    refine_net: RefineNet, score_net: ScoreNetMultiPair
) -> None:
    a, b = _crops(3, seed=5)
    folded_refiner, folded_scorer = fold_batchnorm(refine_net), fold_batchnorm(score_net)
    for folded in (folded_refiner, folded_scorer):
        assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in refine_net.modules())  # the original is untouched
    with torch.no_grad():
        trans, rot = refine_net(a, b)
        trans_f, rot_f = folded_refiner(a, b)
        scores, scores_f = score_net(a, b, L=3), folded_scorer(a, b, L=3)
    # float32 rounding of the folded weights only (the outputs are O(1))
    for ref, got in ((trans, trans_f), (rot, rot_f), (scores, scores_f)):
        assert not torch.equal(ref, got) or ref.abs().max() == 0  # really a different computation
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_fold_batchnorm_refuses_a_batch_norm_it_cannot_place() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="batch norms outside ConvBNReLU/ResBlock remain"):
        fold_batchnorm(model)


@pytest.mark.slow
def test_load_networks_runs_the_official_modules_on_the_cpu(tmp_path: Path) -> None:
    """The CPU is the reference: no fold, no padding, float32, whatever the speed settings say."""
    from foundationpose.networks import load_networks
    from foundationpose.runtime import RuntimeConfig
    from foundationpose.weights import write_weights

    root = write_weights(tmp_path, randomize_(RefineNet(), seed=1), randomize_(ScoreNetMultiPair(), seed=2))
    nets = load_networks(RuntimeConfig(device="cpu", weights=root, max_batch=2), "cpu")
    assert nets.precision == "fp32" and nets.track_refiner is nets.refiner
    for core in (nets.refiner, nets.scorer):
        assert any(isinstance(m, nn.BatchNorm2d) for m in core.module.modules())
        assert not any(isinstance(m, PaddedInputConv) for m in core.module.modules())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast path applies on CUDA only")
def test_load_networks_takes_the_fast_path_on_cuda(tmp_path: Path) -> None:
    from foundationpose.networks import load_networks
    from foundationpose.runtime import RuntimeConfig
    from foundationpose.weights import write_weights

    root = write_weights(tmp_path, randomize_(RefineNet(), seed=1), randomize_(ScoreNetMultiPair(), seed=2))
    fast = load_networks(RuntimeConfig(weights=root, max_batch=2, compile=False), "cuda")
    plain = load_networks(RuntimeConfig(weights=root, max_batch=2, precision="fp32", compile=False), "cuda")
    for core in (fast.refiner, fast.scorer, fast.track_refiner):
        assert not any(isinstance(m, nn.BatchNorm2d) for m in core.module.modules())
        assert any(isinstance(m, PaddedInputConv) for m in core.module.modules())
        assert next(core.module.parameters()).dtype == torch.float16
    g = torch.Generator().manual_seed(3)
    inputs = {"render_input": torch.rand(2, 160, 160, 6, generator=g).cuda(),
              "transf_input": torch.rand(2, 160, 160, 6, generator=g).cuda()}
    ref, got = plain.refiner.infer(inputs), fast.refiner.infer(inputs)
    for name in ("trans", "rot"):  # half precision: the fp16 tolerance of the reference's autocast
        torch.testing.assert_close(got[name], ref[name], rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_pad_input_channels_keeps_the_function_with_an_8_channel_first_conv(
    refine_net: RefineNet, score_net: ScoreNetMultiPair
) -> None:
    a, b = _crops(2, seed=9)
    for net, call in ((refine_net, lambda m: m(a, b)), (score_net, lambda m: (m(a, b, L=2),))):
        padded = pad_input_channels(fold_batchnorm(net))
        encoder = getattr(padded, "encodeA", None) or padded.encoderA
        first = encoder[0].net[0]
        assert isinstance(first, PaddedInputConv) and first.conv.in_channels == 8
        assert torch.count_nonzero(first.conv.weight[:, 6:]) == 0
        with torch.no_grad():
            for ref, got in zip(call(net), call(padded), strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="has no encodeA/encoderA"):
        pad_input_channels(nn.Sequential(nn.Conv2d(6, 4, 3)))
