"""ONNX export of both networks: interface of spec 6.1, checker, ONNX Runtime parity."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from deploy_core.errors import EngineError
from engines.export import PARITY_RTOL, check_onnx, export_onnx, main, make_hwc_modules
from foundationpose.models import RefineNet, RefinerHWC, randomize_
from foundationpose.weights import write_random_weights


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_weights(tmp_path_factory.mktemp("weights"), seed=0)


@pytest.fixture(scope="module")
def exported(weights_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_onnx(weights_root, tmp_path_factory.mktemp("onnx"), opset=17)


def _dims(value_info: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.slow
def test_files_and_interface(exported: dict[str, Path]) -> None:
    assert {name: path.name for name, path in exported.items()} == {
        "refiner": "refiner.onnx",
        "scorer": "scorer.onnx",
    }
    expected_outputs = {"refiner": [("trans", ["N", 3]), ("rot", ["N", 3])], "scorer": [("scores", ["N", 1])]}
    for name, path in exported.items():
        model = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(model)
        assert model.opset_import[0].version == 17
        inputs = [(i.name, _dims(i)) for i in model.graph.input]
        assert inputs == [("render_input", ["N", 160, 160, 6]), ("transf_input", ["N", 160, 160, 6])]
        assert [(o.name, _dims(o)) for o in model.graph.output] == expected_outputs[name]
        for tensor in (*model.graph.input, *model.graph.output):
            assert tensor.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta == {"foundationpose.network": name, "foundationpose.random_weights": "true"}
    assert torch.backends.mha.get_fastpath_enabled()  # the export restored the global flag


@pytest.mark.slow
def test_onnx_runtime_matches_pytorch_at_batch_1_and_4(weights_root: Path, exported: dict[str, Path]) -> None:
    modules = make_hwc_modules(weights_root)
    for name, path in exported.items():
        diffs = check_onnx(path, modules[name], batches=(1, 4))
        assert set(diffs) == {1, 4}
        # fp32 on both sides, summation order only: measured <= 2.2e-6 (CPU, random weights)
        assert max(diffs.values()) < PARITY_RTOL


@pytest.mark.slow
def test_check_detects_a_different_network(weights_root: Path, exported: dict[str, Path]) -> None:
    other = RefinerHWC(randomize_(RefineNet(), seed=1).eval())
    with pytest.raises(
        EngineError, match=r"refiner\.onnx: output trans differs from PyTorch by .* at batch 1 "
    ):
        check_onnx(exported["refiner"], other, batches=(1,))


@pytest.mark.slow
def test_cli_exports_and_checks(
    weights_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engines"
    assert main(["--weights", str(weights_root), "--out", str(out), "--check"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["refiner.onnx", "scorer.onnx"]  # no temporary files left
    assert f"refiner: {out / 'refiner.onnx'}" in capsys.readouterr().out


def test_cli_fails_cleanly_on_bad_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--weights", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("WeightsError: weights root does not exist or is not a directory: ")
    assert not (tmp_path / "out").exists()
