"""How the server's engine settings start the networks (built without loading them): on CUDA with the torch backend
the fast path by default (what the old ``--fast`` turned on), ``--eager`` without captured steps, ``--no-compile``
without torch.compile; the library's defaults elsewhere. And the register frames in flight."""

from __future__ import annotations

import pytest
import torch

from server import state as state_module
from server.cli import config_from_args
from server.state import ServerState


def _network(argv: list[str]):
    return ServerState(config_from_args(["--objects", "o", *argv], {})[0])._network_config()


def test_the_fast_path_is_the_default_on_cuda_and_the_library_default_elsewhere(monkeypatch: pytest.MonkeyPatch):
    assert _network(["--device", "cpu"]) is None  # the CPU runs the reference path
    monkeypatch.setattr(state_module, "resolve_device", lambda device: torch.device("cuda"))  # no network is loaded
    net = _network(["--track-max-batch", "32"])
    assert (net.cast_model, net.channels_last, net.compile, net.compile_track) == (True, True, True, True)
    assert (net.fold_batchnorm, net.pad_input_channels) == (True, True)
    assert net.track_graph_batches == (1, 2, 4, 8, 16, 32)  # up to --track-max-batch
    plain = _network(["--no-compile"])
    assert (plain.cast_model, plain.compile, plain.compile_track) == (True, False, False)
    eager = _network(["--eager"])
    assert eager.track_graph_batches == () and eager.cast_model
    assert _network(["--backend", "onnxruntime"]) is None  # the torch backend's rewrites only


def test_register_frames_in_flight_default(capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = config_from_args(["--objects", "o"], {})
    # auto frames in flight: 2 stage by stage (nvdiffrast, the default renderer), 4 where registers are captured
    assert config.service.frames_in_flight == 2 and config.register_capacity == 0  # admission: twice that
    triton = ["--objects", "o", "--renderer", "triton"]
    assert config_from_args(triton, {})[0].service.frames_in_flight == 4
    assert config_from_args([*triton, "--backend", "onnxruntime"], {})[0].service.frames_in_flight == 2
    assert config_from_args([*triton, "--frames-in-flight", "3"], {})[0].service.frames_in_flight == 3
    assert config_from_args(triton, {"FP_FRAMES_IN_FLIGHT": "1"})[0].service.frames_in_flight == 1
    with pytest.raises(SystemExit):
        config_from_args(["--objects", "o", "--frames-in-flight", "0"], {})
    assert "frames_in_flight must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args(["--objects", "o", "--frames-in-flight", "two"], {})
    assert "invalid int value: 'two'" in capsys.readouterr().err
