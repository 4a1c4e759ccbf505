"""FP8 calibration and its file: scales beside the weights, refused when missing or stale, the calibrate and deltas
commands end to end on tiny random weights (CPU), the output-delta units, and the precision comparison."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.errors import WeightsError
from foundationpose.quant import (
    SCALES_FILE,
    Fp8Scales,
    LayerScale,
    compare_precisions,
    eligible_layers,
    inference_copy,
    load_scales,
    quantize_for_inference,
    read_scales,
    scales_path,
    write_scales,
)
from foundationpose.quant.calibrate import PairBatch, observe_input_amax, output_delta
from foundationpose.quant.modules import Fp8Conv2d, Fp8Linear
from foundationpose.quant.scales import layer_kind, weights_fingerprint
from foundationpose.weights import REFINER_RUN, SCORER_RUN, load_refiner, load_scorer, write_random_weights

DEMO_MESH = BUNDLED_SEQUENCE_DIR / "mesh" / "textured_simple.obj"
TINY = ["--device", "cpu", "--renderer", "cpu", "--crop-size", "32", "--frame-size", "96", "128",
        "--refiner-batches", "2", "--refiner-batch", "4", "--hypotheses-per-scene", "2", "--scorer-batches", "2",
        "--set-size", "4", "--sensitivity-batches", "1", "--heldout-batches", "1"]


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_weights(tmp_path_factory.mktemp("weights"), seed=3)


@pytest.fixture(scope="module")
def refiner(weights_root: Path) -> nn.Module:
    return load_refiner(weights_root)


def _scales_for(net: nn.Module, network: str, fp8: bool = True) -> Fp8Scales:
    """Scales of every eligible layer with a made-up activation scale (no calibration: file-format tests)."""
    layers = tuple(LayerScale(name=name, kind=layer_kind(m), weight_shape=tuple(m.weight.shape), input_amax=4.0,
                              input_scale=4.0 / 448, fp8=fp8)
                   for name, m in eligible_layers(inference_copy(net)).items())
    return Fp8Scales(network=network, weights_sha256=weights_fingerprint(net), layers=layers)


# -- the file --------------------------------------------------------------------------------------------------


def test_scales_round_trip_beside_the_checkpoint(tmp_path: Path, refiner: nn.Module) -> None:
    scales = _scales_for(refiner, "refiner")
    path = write_scales(tmp_path, scales)
    assert path == tmp_path / REFINER_RUN / SCALES_FILE == scales_path(tmp_path, "refiner")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == "foundationpose-fp8-scales" and data["version"] == 1 and data["network"] == "refiner"
    assert read_scales(path) == scales
    assert scales_path(tmp_path, "scorer") == tmp_path / SCORER_RUN / SCALES_FILE


def test_missing_scales_name_the_command_that_writes_them(weights_root: Path, refiner: nn.Module) -> None:
    with pytest.raises(WeightsError, match=r"^precision fp8 needs calibrated FP8 scales for the refiner, and .*"
                                           r"fp8_scales\.json does not exist\..*python -m foundationpose\.train calibrate "
                                           r"--weights .* --mesh"):
        load_scales(weights_root, "refiner", refiner)


def test_scales_of_other_weights_are_refused(tmp_path: Path, refiner: nn.Module) -> None:
    scales = _scales_for(refiner, "refiner")
    write_scales(tmp_path, Fp8Scales(network="refiner", weights_sha256="0" * 64, layers=scales.layers))
    with pytest.raises(WeightsError, match=r"was calibrated for other refiner weights .*recalibrate"):
        load_scales(tmp_path, "refiner", refiner)


@pytest.mark.slow
def test_scales_of_other_layers_are_refused(tmp_path: Path, refiner: nn.Module) -> None:
    good = _scales_for(refiner, "refiner")
    first, second, *rest = good.layers
    renamed = LayerScale(name="encodeA.9.conv1", kind=first.kind, weight_shape=first.weight_shape,
                         input_amax=1.0, input_scale=1.0 / 448, fp8=True)
    reshaped = LayerScale(name=second.name, kind=second.kind, weight_shape=(1, 2, 3, 3), input_amax=1.0,
                          input_scale=1.0 / 448, fp8=True)
    write_scales(tmp_path, Fp8Scales(network="refiner", weights_sha256=good.weights_sha256,
                                     layers=(renamed, reshaped, *rest)))
    with pytest.raises(WeightsError) as info:
        load_scales(tmp_path, "refiner", refiner)
    message = str(info.value)
    assert "1 missing layer(s): encodeA.1.net.0" in message
    assert "1 unknown layer(s): encodeA.9.conv1" in message
    assert "1 mis-shaped layer(s): encodeA.2.conv1 (scales conv2d [1, 2, 3, 3], network conv2d [128, 128, 3, 3])" in message
    with pytest.raises(WeightsError, match=r"^FP8 scales of the refiner does not match the refiner network"):
        quantize_for_inference(refiner, read_scales(scales_path(tmp_path, "refiner")))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(version=99), r"scales file version 99; this code reads version 1: recalibrate"),
    (lambda d: d.update(format="other"), r"not an FP8 scales file"),
    (lambda d: d["layers"]["encodeA.1.net.0"].pop("input_scale"), r"malformed FP8 scales file \(KeyError"),
    (lambda d: d["layers"]["encodeA.1.net.0"].update(input_scale=-1.0), r"malformed FP8 scales file .*> 0"),
])
def test_unreadable_scales_are_weights_errors(tmp_path: Path, refiner: nn.Module, edit, match: str) -> None:  # noqa: ANN001
    path = write_scales(tmp_path, _scales_for(refiner, "refiner"))
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(WeightsError, match=match):
        read_scales(path)


@pytest.mark.slow
def test_quantize_for_inference_swaps_exactly_the_fp8_layers(refiner: nn.Module) -> None:
    scales = _scales_for(refiner, "refiner")
    half = Fp8Scales(network="refiner", weights_sha256=scales.weights_sha256,
                     layers=tuple(LayerScale(**{**{f: getattr(lay, f) for f in LayerScale.__slots__}, "fp8": i % 2 == 0})
                                  for i, lay in enumerate(scales.layers)))
    model = quantize_for_inference(refiner, half)
    fp8 = {name for name, m in model.named_modules() if isinstance(m, (Fp8Conv2d, Fp8Linear))}
    assert fp8 == {lay.name for lay in half.fp8_layers} and len(fp8) == 11
    assert all(m.backend == "emulate" for m in model.modules() if isinstance(m, (Fp8Conv2d, Fp8Linear)))
    assert not any(isinstance(m, (Fp8Conv2d, Fp8Linear)) for m in refiner.modules())  # the loaded net is untouched


# -- calibration pieces ------------------------------------------------------------------------------------------


def test_observed_amax_is_the_largest_input_magnitude() -> None:
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16))

    class Wrap(nn.Module):  # the networks' call signature: (a, b)
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.net(a + b),)

    a1, a2 = torch.tensor([[1.0, -7.0, 2.0, 0.5]]), torch.tensor([[3.0, 2.0, -9.5, 0.0]])
    zeros = torch.zeros(1, 4)
    amax = observe_input_amax(Wrap(), ["net.0", "net.1"], [PairBatch(a1, zeros), PairBatch(a2, zeros)])
    assert amax["net.0"] == 9.5
    with torch.no_grad():
        assert math.isclose(amax["net.1"], float(torch.cat([model[0](a1), model[0](a2)]).abs().max()), rel_tol=1e-6)


def test_output_delta_units() -> None:
    """Refiner: translation in diameters (0.5 x the output, spec 2.7), rotation in degrees; scorer: set-relative."""
    trans, rot = torch.zeros(2, 3), torch.zeros(2, 3)
    moved = trans + torch.tensor([[0.02, 0.0, 0.0], [0.0, 0.0, 0.0]])
    turned = rot + torch.tensor([[0.0, 0.0, 0.0], [math.atanh(0.1), 0.0, 0.0]])  # tanh -> 0.1 x 20 deg = 2 deg
    delta = output_delta("refiner", (trans, rot), (moved, turned))
    assert math.isclose(delta["trans_diameters"], 0.005, rel_tol=1e-6) and math.isclose(delta["trans_diameters_max"], 0.01, rel_tol=1e-6)
    assert math.isclose(delta["rot_deg"], 1.0, rel_tol=1e-5) and math.isclose(delta["rot_deg_max"], 2.0, rel_tol=1e-5)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    swapped = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    d = output_delta("scorer", (logits,), (swapped,))
    assert d["top1_agreement"] == 0.0
    assert math.isclose(d["logit_rms_over_set_std"], math.sqrt(0.5) / float(logits.std()), rel_tol=1e-6)


def test_compare_precisions_states_the_costs_against_the_limits() -> None:
    def report(success: float, adds_mm: float, seq_adds_mm: float) -> dict:
        return {"views": {"register_success_rate": success, "adds_m": {"mean": adds_mm / 1000}, "add_m": {"mean": 0.01}},
                "sequence": {"adds_m": {"mean": seq_adds_mm / 1000}, "add_m": {"mean": 0.02}, "success_rate": 1.0,
                             "drift": {"add_last_minus_first_m": 0.001}}}

    out = compare_precisions({"fp16": report(0.95, 4.0, 3.0), "fp8": report(0.945, 4.6, 3.2),
                              "fp8_bad": report(0.90, 5.5, 3.0)})
    fp8, bad = out["precisions"]["fp8"], out["precisions"]["fp8_bad"]
    assert math.isclose(fp8["register_success_points"], 0.5, abs_tol=1e-9)
    assert math.isclose(fp8["views_adds_mean_mm"], 0.6, abs_tol=1e-9) and math.isclose(fp8["sequence_adds_mean_mm"], 0.2, abs_tol=1e-9)
    assert fp8["within_limits"] is True and bad["within_limits"] is False
    assert compare_precisions({"fp16": {}, "fp8": {}})["precisions"]["fp8"]["within_limits"] is None
    with pytest.raises(ValueError, match=r"^compare_precisions: no report for the baseline 'fp16'"):
        compare_precisions({"fp8": {}})


# -- the commands, end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_calibrate_then_load_then_deltas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m foundationpose.train calibrate`` writes both files; fp8 then loads; ``deltas`` reports."""
    from foundationpose.quant.cli import main as quant_main
    from foundationpose.train.cli import main as train_main

    root = write_random_weights(tmp_path / "w", seed=5)
    assert train_main(["calibrate", "--weights", str(root), "--mesh", str(DEMO_MESH), *TINY]) == 0
    summary = json.loads(capsys.readouterr().out)
    for network, run in (("refiner", REFINER_RUN), ("scorer", SCORER_RUN)):
        path = root / run / SCALES_FILE
        assert summary["networks"][network]["scales"] == str(path)
        scales = read_scales(path)
        assert len(scales.layers) == (22 if network == "refiner" else 16)
        assert all(lay.input_scale > 0 and lay.input_amax > 0 and lay.sensitivity for lay in scales.layers)
        assert all(lay.reason for lay in scales.layers if not lay.fp8)  # every 16-bit layer says why
        assert scales.calibration["samples"] == 8  # 2 batches x 4 hypotheses (refiner) or 1 set of 4 (scorer)
        assert scales.calibration["config"]["crop_size"] == 32 and scales.calibration["mesh"] == str(DEMO_MESH)
        held = scales.deltas["heldout"]
        assert all(math.isfinite(v) for v in held.values())
    refiner, scorer = load_refiner(root), load_scorer(root)
    for network, net in (("refiner", refiner), ("scorer", scorer)):
        quantize_for_inference(net, load_scales(root, network, net))  # loads: names, shapes, fingerprint agree
    assert quant_main(["deltas", "--weights", str(root), "--mesh", str(DEMO_MESH), *TINY]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["networks"]["refiner"]["layers"]
    names = [r["name"] for r in rows]
    assert names.index("encodeA.0") < names.index("encodeAB.4") < names.index("trans_head.0")  # forward order
    assert all(r["rel_rms"] is None or r["rel_rms"] >= 0 for r in rows)
    assert set(report["networks"]["scorer"]["outputs"]) >= {"logit_rms_over_set_std", "top1_agreement"}


def test_calibrate_command_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from foundationpose.quant.cli import main

    assert main(["calibrate", "--weights", str(tmp_path / "none"), "--mesh", str(DEMO_MESH), "--device", "cpu"]) == 1
    assert capsys.readouterr().err.startswith("WeightsError: weights root does not exist")


def test_train_cli_forwards_calibrate(capsys: pytest.CaptureFixture[str]) -> None:
    from foundationpose.train.cli import main

    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--help"])
    assert info.value.code == 0
    assert "usage: python -m foundationpose.train calibrate" in capsys.readouterr().out


@pytest.mark.slow
def test_fp8_networks_run_in_the_torch_inference_core(tmp_path: Path, weights_root: Path) -> None:
    """What the network loader does for precision fp8: both FP8 copies in NHWC adapters inside torch cores."""
    from deploy_core.infer import make_infer_core
    from foundationpose.models import RefinerHWC, ScorerHWC
    from foundationpose.networks import REFINER_INPUTS, REFINER_OUTPUTS, SCORER_INPUTS, SCORER_OUTPUTS
    from foundationpose.quant import fp8_core_precision, load_fp8_networks

    root = Path(shutil.copytree(weights_root, tmp_path / "weights"))
    refiner, scorer = load_refiner(root), load_scorer(root)
    with pytest.raises(WeightsError, match=r"^precision fp8 needs calibrated FP8 scales for the refiner"):
        load_fp8_networks(root, refiner, scorer)
    for net, network in ((refiner, "refiner"), (scorer, "scorer")):
        write_scales(root, _scales_for(net, network))
    fp8_refiner, fp8_scorer = load_fp8_networks(root, refiner, scorer)
    common = dict(max_batch=4, device="cpu", precision=fp8_core_precision("cpu"), channels_last=True)
    cores = (make_infer_core("torch", module=RefinerHWC(fp8_refiner), inputs=REFINER_INPUTS,
                             outputs=REFINER_OUTPUTS, name="refiner", **common),
             make_infer_core("torch", module=ScorerHWC(fp8_scorer), inputs=SCORER_INPUTS,
                             outputs=SCORER_OUTPUTS, name="scorer", **common))
    g = torch.Generator().manual_seed(11)
    crops = {"render_input": torch.rand(2, 160, 160, 6, generator=g),
             "transf_input": torch.rand(2, 160, 160, 6, generator=g)}
    trans_rot, scores = cores[0].infer(crops), cores[1].infer(crops)
    assert trans_rot["trans"].shape == (2, 3) and scores["scores"].shape == (2, 1)
    assert all(torch.isfinite(t).all() for t in (*trans_rot.values(), *scores.values()))
    with torch.no_grad():
        want = RefinerHWC(fp8_refiner)(crops["render_input"], crops["transf_input"])
    torch.testing.assert_close(trans_rot["trans"], want[0], rtol=0, atol=1e-6)  # the same module, same inputs
