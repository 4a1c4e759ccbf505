"""``python -m server --fast`` and ``--track-max-graphs``: parsing, validation, and the network config the
fast path starts with (built without loading networks; on the CPU the flag is ignored with a warning)."""

from __future__ import annotations

import logging

import pytest
import torch

from server import state as state_module
from server.cli import config_from_args
from server.state import ServerState


def test_fast_flag_environment_and_track_max_graphs() -> None:
    config, _ = config_from_args(["--objects", "o"], {})
    assert (config.fast, config.service.track_max_graphs) == (False, 64)  # defaults: autocast, 64 graphs
    assert config_from_args(["--objects", "o", "--fast"], {})[0].fast is True
    assert config_from_args(["--objects", "o"], {"FP_FAST": "1"})[0].fast is True
    assert config_from_args(["--objects", "o", "--no-fast"], {"FP_FAST": "1"})[0].fast is False
    assert config_from_args(["--objects", "o", "--track-max-graphs", "12"], {})[0].service.track_max_graphs == 12


def test_track_max_graphs_below_one_object_and_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # batch sizes 1, 2, 4, 8, 16 need 5 entries
        config_from_args(["--objects", "o", "--track-max-graphs", "4"], {})
    assert exit_info.value.code == 2
    assert ("track_max_graphs must hold the 5 batch sizes (1, 2, 4, 8, 16) of one (object, image size) at "
            "track_max_batch=16; got 4") in capsys.readouterr().err


def test_fast_network_config_on_cuda_and_ignored_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    config, _ = config_from_args(["--objects", "o", "--fast", "--device", "cpu", "--track-max-batch", "32"], {})
    with caplog.at_level(logging.WARNING, logger="server.state"):
        assert ServerState(config)._fast_network_config() is None
    assert "--fast applies to the torch backend on CUDA; ignored with backend=torch on cpu" in caplog.text
    assert ServerState(config_from_args(["--objects", "o"], {})[0])._fast_network_config() is None  # off: defaults

    monkeypatch.setattr(state_module, "resolve_device", lambda device: torch.device("cuda"))  # no network is loaded
    net = ServerState(config)._fast_network_config()
    assert net is not None
    assert (net.cast_model, net.channels_last, net.compile, net.compile_track) == (True, True, True, True)
    assert (net.fold_batchnorm, net.pad_input_channels) == (True, True)
    assert net.track_graph_batches == (1, 2, 4, 8, 16, 32)  # up to --track-max-batch
    onnx, _ = config_from_args(["--objects", "o", "--fast", "--backend", "onnxruntime"], {})
    assert ServerState(onnx)._fast_network_config() is None  # torch only


def test_register_graphs_flag_environment_and_frames_in_flight_default(capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = config_from_args(["--objects", "o"], {})
    assert config.estimator.register_graphs is None  # auto: captured where they can be
    # auto frames in flight: 2 stage by stage (nvdiffrast, the default renderer), 4 where registers are captured
    assert config.service.frames_in_flight == 2 and config.register_capacity == 0  # admission: twice that
    triton = ["--objects", "o", "--renderer", "triton"]
    assert config_from_args(triton, {})[0].service.frames_in_flight == 4
    assert config_from_args([*triton, "--backend", "onnxruntime"], {})[0].service.frames_in_flight == 2
    assert config_from_args([*triton, "--frames-in-flight", "3"], {})[0].service.frames_in_flight == 3
    assert config_from_args(triton, {"FP_FRAMES_IN_FLIGHT": "1"})[0].service.frames_in_flight == 1
    assert config_from_args(["--objects", "o", "--register-graphs", "off"], {})[0].estimator.register_graphs is False
    assert config_from_args(["--objects", "o"], {"FP_REGISTER_GRAPHS": "on"})[0].estimator.register_graphs is True
    for bad, message in (("maybe", "invalid choice: 'maybe'"),):
        with pytest.raises(SystemExit):
            config_from_args(["--objects", "o", "--register-graphs", bad], {})
        assert message in capsys.readouterr().err
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            config_from_args(["--objects", "o", "--frames-in-flight", bad], {})
        assert f"--frames-in-flight must be 'auto' or an integer >= 1, got {bad if bad == '0' else repr(bad)}" \
            in capsys.readouterr().err
