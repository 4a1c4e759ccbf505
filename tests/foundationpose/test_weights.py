"""Checkpoint loading (strict, readable errors) and deterministic random weights (spec 2.9, 4.6)."""

from __future__ import annotations

import argparse
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from foundationpose.errors import WeightsError
from foundationpose.models import RefineNet, ScoreNetMultiPair, randomize_
from foundationpose.weights import (
    REFINER_CONFIG,
    REFINER_RUN,
    SCORER_CONFIG,
    SCORER_RUN,
    ensure_weights,
    is_random_weights,
    load_refiner,
    load_scorer,
    write_random_weights,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_weights(tmp_path_factory.mktemp("weights"), seed=0)


@pytest.fixture(scope="module")
def refiner_state() -> dict[str, torch.Tensor]:
    return randomize_(RefineNet(), seed=0).state_dict()


def _assert_same_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    loaded = model.state_dict()
    assert list(loaded) == list(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_official_layout_is_written(root: Path) -> None:
    for run, reference in ((REFINER_RUN, REFINER_CONFIG), (SCORER_RUN, SCORER_CONFIG)):
        assert (root / run / "model_best.pth").is_file()
        config = yaml.safe_load((root / run / "config.yml").read_text(encoding="utf-8"))
        marker = config.pop("random_weights")
        assert marker["seed"] == 0
        assert config == dict(reference)  # spec 2.9 values, e.g. input_resize [160, 160]
    checkpoint = torch.load(root / REFINER_RUN / "model_best.pth", weights_only=True)
    assert set(checkpoint) == {"model"} and len(checkpoint["model"]) == 134


@pytest.mark.slow
def test_load_round_trip_from_root_and_run_dir(root: Path, refiner_state: dict[str, torch.Tensor]) -> None:
    for path in (root, root / REFINER_RUN, root / REFINER_RUN / "model_best.pth"):
        model = load_refiner(path, device="cpu")
        assert isinstance(model, RefineNet) and not model.training
        _assert_same_tensors(model, refiner_state)
    scorer = load_scorer(str(root), device=torch.device("cpu"))
    assert isinstance(scorer, ScoreNetMultiPair) and not scorer.training
    _assert_same_tensors(scorer, randomize_(ScoreNetMultiPair(), seed=0).state_dict())


@pytest.mark.slow
def test_load_plain_state_dict_and_model_subdict(
    tmp_path: Path, refiner_state: dict[str, torch.Tensor]
) -> None:
    plain = tmp_path / "plain.pth"
    torch.save(refiner_state, plain)
    _assert_same_tensors(load_refiner(plain), refiner_state)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"model": refiner_state, "epoch": 3}, wrapped)
    _assert_same_tensors(load_refiner(wrapped), refiner_state)
    parallel = tmp_path / "parallel.pth"  # saved from DataParallel
    torch.save({f"module.{k}": v for k, v in refiner_state.items()}, parallel)
    _assert_same_tensors(load_refiner(parallel), refiner_state)


def test_checkpoint_with_python_objects_is_refused_unless_trusted(
    tmp_path: Path, refiner_state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pickled.pth"
    torch.save({"model": refiner_state, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(WeightsError, match=r"not a plain tensor checkpoint .*--trust-weights-file"):
        load_refiner(path)
    with caplog.at_level(logging.WARNING, logger="foundationpose.weights"):
        model = load_refiner(path, trust_file=True)
    _assert_same_tensors(model, refiner_state)
    assert any("full unpickling" in r.getMessage() for r in caplog.records)


def _save(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "broken.pth"
    torch.save({"model": state}, path)
    return path


def test_missing_key_is_named(tmp_path: Path, refiner_state: dict[str, torch.Tensor]) -> None:
    state = dict(refiner_state)
    del state["encodeA.0.net.0.bias"]
    with pytest.raises(
        WeightsError,
        match=r"^refiner checkpoint .*broken\.pth does not match RefineNet "
        r"\(134 keys\): 1 missing key\(s\): encodeA\.0\.net\.0\.bias$",
    ):
        load_refiner(_save(tmp_path, state))


def test_unexpected_key_is_named(tmp_path: Path, refiner_state: dict[str, torch.Tensor]) -> None:
    state = dict(refiner_state)
    state["extra_head.weight"] = torch.zeros(3)
    with pytest.raises(WeightsError, match=r": 1 unexpected key\(s\): extra_head\.weight$"):
        load_refiner(_save(tmp_path, state))


def test_misshaped_key_is_named_with_both_shapes(
    tmp_path: Path, refiner_state: dict[str, torch.Tensor]
) -> None:
    state = dict(refiner_state)
    state["rot_head.1.weight"] = torch.zeros(6, 512)  # the 6-D rotation variant
    with pytest.raises(
        WeightsError,
        match=re.escape("1 mis-shaped key(s): rot_head.1.weight (checkpoint [6, 512], model [3, 512])"),
    ):
        load_refiner(_save(tmp_path, state))


def test_many_problems_are_counted_and_listed_briefly(root: Path, tmp_path: Path) -> None:
    # the scorer's checkpoint is not a refiner: all keys but pos_embed.pe differ (encoderA vs encodeA ...)
    shutil.copy(root / SCORER_RUN / "model_best.pth", tmp_path / "scorer.pth")
    with pytest.raises(WeightsError) as info:
        load_refiner(tmp_path / "scorer.pth")
    message = str(info.value)
    assert "133 missing key(s): encodeA.0.net.0.weight, " in message
    assert "... and 128 more" in message
    assert "115 unexpected key(s): encoderA.0.net.0.weight" in message
    assert "... and 110 more" in message


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"^refiner weights path does not exist: .*nowhere$"):
        load_refiner(tmp_path / "nowhere")
    with pytest.raises(
        WeightsError,
        match=r"^no scorer checkpoint under .*: looked for .*model_best\.pth "
        rf"\(run directory\) and .*{SCORER_RUN}/model_best\.pth \(weights root\)$",
    ):
        load_scorer(tmp_path)


def test_unreadable_checkpoints(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match=r"^cannot read checkpoint .*garbage\.pth: "):
        load_refiner(garbage)
    not_a_dict = tmp_path / "list.pth"
    torch.save([torch.zeros(1)], not_a_dict)
    with pytest.raises(WeightsError, match=r"expected a state_dict \(a mapping of tensors\); got list$"):
        load_refiner(not_a_dict)


def test_config_mismatch_is_reported(root: Path, tmp_path: Path) -> None:
    # loading the scorer's run as the refiner: its config already disagrees (spec 2.9)
    with pytest.raises(
        WeightsError, match=r"does not describe the refiner .*crop_ratio: expected 1\.2, got 1\.1"
    ):
        load_refiner(root / SCORER_RUN)
    run = tmp_path / REFINER_RUN
    shutil.copytree(root / REFINER_RUN, run)
    config = yaml.safe_load((run / "config.yml").read_text(encoding="utf-8"))
    config["c_in"], config["input_resize"] = 4, [128, 128]
    (run / "config.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    with pytest.raises(
        WeightsError,
        match=r"c_in: expected 6, got 4; input_resize: expected \[160, 160\], "
        r"got \[128, 128\]$",
    ):
        load_refiner(tmp_path)


@pytest.mark.slow
def test_random_weights_are_deterministic(root: Path, tmp_path: Path) -> None:
    again = write_random_weights(tmp_path / "again", seed=0)
    for run in (REFINER_RUN, SCORER_RUN):
        assert (again / run / "model_best.pth").read_bytes() == (root / run / "model_best.pth").read_bytes()
    other = randomize_(RefineNet(), seed=1).state_dict()
    loaded = load_refiner(root).state_dict()
    assert not torch.equal(other["encodeA.0.net.0.weight"], loaded["encodeA.0.net.0.weight"])


@pytest.mark.slow
def test_ensure_weights_writes_then_reuses_random_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="foundationpose.weights"):
        got, is_random = ensure_weights(None, cache_dir=cache)
    assert (got, is_random) == (cache, True)
    assert any("poses are meaningless" in r.getMessage() for r in caplog.records)
    checkpoint = cache / REFINER_RUN / "model_best.pth"
    stamp = checkpoint.stat().st_mtime_ns
    assert ensure_weights(None, cache_dir=cache) == (cache, True)
    assert checkpoint.stat().st_mtime_ns == stamp  # reused, not rewritten
    checkpoint.unlink()
    assert ensure_weights(None, cache_dir=cache) == (cache, True)
    assert checkpoint.is_file()  # rewritten when missing
    assert ensure_weights(cache) == (cache, True)  # a given root holding random weights says so
    assert is_random_weights(cache)


def test_ensure_weights_checks_a_given_root(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"^weights root does not exist or is not a directory: "):
        ensure_weights(tmp_path / "nowhere")
    (tmp_path / REFINER_RUN).mkdir()
    (tmp_path / REFINER_RUN / "model_best.pth").write_bytes(b"")
    with pytest.raises(WeightsError, match=rf"lacks .*{SCORER_RUN}/model_best\.pth \(official layout"):
        ensure_weights(tmp_path)
    (tmp_path / SCORER_RUN).mkdir()
    (tmp_path / SCORER_RUN / "model_best.pth").write_bytes(b"")
    assert ensure_weights(tmp_path) == (tmp_path, False)  # no random marker: taken as real weights
