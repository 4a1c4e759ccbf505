"""How the server's engine settings reach the library: ServerConfig.runtime() is the library's RuntimeConfig (its
defaults, the fastest measured, but for what the settings name: --eager turns capture off, --no-compile
torch.compile; trust_weights_file is a key of the settings file), and the register frames in flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundationpose.runtime import RuntimeConfig
from server.cli import config_from_args


def _runtime(argv: list[str], environ: dict | None = None) -> RuntimeConfig:
    return config_from_args(["--objects", "o", *argv], environ or {})[0].runtime()


def _settings_file(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "fp.toml"
    path.write_text(text)
    return ["--config", str(path)]


def test_the_engine_settings_are_the_librarys_runtime_config(tmp_path) -> None:
    assert _runtime([]) == RuntimeConfig()  # no flag: the library's defaults, compile cache folder included
    assert _runtime(["--device", "cpu", "--backend", "onnxruntime", "--precision", "fp32", "--renderer", "cpu"]) == \
        RuntimeConfig(device="cpu", backend="onnxruntime", precision="fp32", renderer="cpu")
    assert _runtime(["--eager"]).capture is False and _runtime(["--no-compile"]).compile is False
    assert _runtime([], {"FP_EAGER": "1", "FP_COMPILE": "0"}) == RuntimeConfig(capture=False, compile=False)
    assert _runtime(["--compile-cache", str(tmp_path)]).compile_cache == tmp_path
    assert _runtime(["--weights", str(tmp_path), *_settings_file(tmp_path, "trust_weights_file = true\n")]) == \
        RuntimeConfig(weights=tmp_path, trust_weights_file=True)


def test_register_frames_in_flight_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = config_from_args(["--objects", "o", "--device", "cpu"], {})
    # auto frames in flight: 2 stage by stage (the CPU rasteriser), 4 where registers are captured
    assert config.service.frames_in_flight == 2 and config.register_capacity == 0  # admission: twice that
    triton = ["--objects", "o", "--renderer", "triton"]
    assert config_from_args(triton, {})[0].service.frames_in_flight == 4
    assert config_from_args([*triton, "--eager"], {})[0].service.frames_in_flight == 2
    assert config_from_args([*triton, "--backend", "onnxruntime"], {})[0].service.frames_in_flight == 2
    three = _settings_file(tmp_path, "frames_in_flight = 3\n")
    assert config_from_args([*triton, *three], {})[0].service.frames_in_flight == 3
    with pytest.raises(SystemExit):
        config_from_args(["--objects", "o", *_settings_file(tmp_path, "frames_in_flight = 0\n")], {})
    assert "frames_in_flight must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args(["--objects", "o", *_settings_file(tmp_path, 'frames_in_flight = "two"\n')], {})
    assert "frames_in_flight must be an integer, got 'two'" in capsys.readouterr().err
