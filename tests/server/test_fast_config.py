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
    assert (config.fast, config.service.track_max_graphs) == (False, 128)  # defaults: autocast, 128 graphs
    assert config.service.track_batch_ladder == "fine"
    assert config_from_args(["--objects", "o", "--track-batch-ladder", "pow2"], {})[0].service.track_batch_ladder == "pow2"
    assert config_from_args(["--objects", "o"], {"FP_TRACK_BATCH_LADDER": "pow2"})[0].service.track_batch_ladder == "pow2"
    assert config_from_args(["--objects", "o", "--fast"], {})[0].fast is True
    assert config_from_args(["--objects", "o"], {"FP_FAST": "1"})[0].fast is True
    assert config_from_args(["--objects", "o", "--no-fast"], {"FP_FAST": "1"})[0].fast is False
    assert config_from_args(["--objects", "o", "--track-max-graphs", "12"], {})[0].service.track_max_graphs == 12


def test_track_max_graphs_below_one_object_and_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # the fine ladder's 10 batch sizes need 10 entries
        config_from_args(["--objects", "o", "--track-max-graphs", "9"], {})
    assert exit_info.value.code == 2
    assert ("track_max_graphs must hold the 10 batch sizes (1, 2, 3, 4, 6, 8, 10, 12, 14, 16) of one (object, image "
            "size) at track_max_batch=16; got 9") in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # pow2: 1, 2, 4, 8, 16 need 5
        config_from_args(["--objects", "o", "--track-batch-ladder", "pow2", "--track-max-graphs", "4"], {})
    assert ("track_max_graphs must hold the 5 batch sizes (1, 2, 4, 8, 16) of one (object, image size) at "
            "track_max_batch=16; got 4") in capsys.readouterr().err
    assert config_from_args(["--objects", "o", "--track-batch-ladder", "pow2", "--track-max-graphs", "5"],
                            {})[0].service.track_max_graphs == 5
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--objects", "o", "--track-batch-ladder", "halves"], {})
    assert exit_info.value.code == 2
    assert "invalid choice: 'halves'" in capsys.readouterr().err


def test_batch_ladders_bound_the_padding() -> None:
    from foundationpose.service import ServiceConfig
    from foundationpose.service.track_graph_lane import graph_batch_sizes

    assert graph_batch_sizes(16) == (1, 2, 3, 4, 6, 8, 10, 12, 14, 16)
    assert graph_batch_sizes(16, "pow2") == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(64) == (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(12, "pow2") == (1, 2, 4, 8, 12) and graph_batch_sizes(1) == (1,)
    for max_batch in range(1, 130):  # fine: at most one padded row up to 16, under a fifth of the rows above
        sizes = graph_batch_sizes(max_batch)
        assert sizes[-1] == max_batch and list(sizes) == sorted(set(sizes))
        for n in range(1, max_batch + 1):
            padded = next(b for b in sizes if b >= n)
            assert padded - n <= (1 if padded <= 16 else padded / 5), (max_batch, n, padded)
    with pytest.raises(ValueError, match=r"^ladder must be one of \('fine', 'pow2'\), got 'halves'$"):
        graph_batch_sizes(16, "halves")
    with pytest.raises(ValueError, match=r"^max_batch must be >= 1, got 0$"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match=r"^track_batch_ladder must be one of \('fine', 'pow2'\), got 'x'$"):
        ServiceConfig(track_batch_ladder="x")


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
