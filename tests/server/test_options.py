"""The command line of ``python -m server`` and ``python -m server.serve``: every option it accepts is shown by
``--help`` (at most 25 for ``python -m server``), every option has one ``FP_*`` variable, and the rarer settings are
keys of the ``--config`` TOML file only (unknown keys, wrong types and misplaced settings refused, naming them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from server.cli import build_parser, config_from_args
from server.config import ServerConfig
from server.options import env_name, file_keys, flag_name
from server.serve.settings import ServeSettings, settings_from_args

# what the project's check counts in `python -m server --help`
HELP_OPTION = re.compile(r"^\s{2,6}(-[a-zA-Z], )?--[a-z0-9][a-z0-9-]*", re.MULTILINE)
# options that exist no more: A/B experiments whose winners are code, internal constants, and --help-all
REMOVED = ("--track-inline", "--track-stage-in-caller", "--track-driver-launch", "--track-step-in-batcher",
           "--track-batch-ladder", "--register-graphs", "--ingest-submit-in-loop", "--ingest-decode-inline",
           "--ingest-balance", "--prepare-track", "--gc-freeze", "--fast", "--register-sms", "--track-max-graphs",
           "--decode-threads", "--sweep-interval-s", "--track-batches-in-flight", "--switch-interval-ms",
           "--help-all")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def _option_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata and not f.metadata["option"]["in_file"]]


@pytest.mark.parametrize(("classes", "most"), [((ServerConfig,), 25), ((ServerConfig, ServeSettings), 28)])
def test_every_accepted_option_is_shown_by_help(classes, most):
    parser = build_parser({}, classes=classes)
    actions = _options(parser)
    assert all(a.help is not argparse.SUPPRESS and a.help for a in actions), \
        [a.option_strings for a in actions if a.help is argparse.SUPPRESS or not a.help]
    text = parser.format_help()
    for action in actions:
        for flag in action.option_strings:
            assert re.search(rf"^\s+(-h, )?{re.escape(action.option_strings[0])}\b", text, re.MULTILINE) and \
                flag in text, flag
    # one option per setting of the classes, plus --help and --config; counted as the project's check counts them
    expected = {flag_name(f) for cls in classes for f in _option_fields(cls)} | {"--help", "--config"}
    assert {next(s for s in a.option_strings if s.startswith("--")) for a in actions} == expected
    shown = {m.group(0).strip().split(", ")[-1] for m in HELP_OPTION.finditer(text)}
    assert shown == expected and len(actions) == len(expected) <= most, sorted(shown)


def test_python_m_server_accepts_at_most_25_options():
    actions = _options(build_parser({}))
    assert 20 <= len(actions) <= 25, [a.option_strings for a in actions]
    text = build_parser({}).format_help()
    for group in ("essentials:", "engine (how the networks run):", "algorithm size:", "limits:", "scaling:",
                  "operations:"):
        assert f"\n{group}\n" in text, group
    assert text.index("--objects") < text.index("--backend") < text.index("--hypotheses") < text.index("--config")


@pytest.mark.parametrize("flag", [*REMOVED, "--obj", "--max-up", "--hypo"])  # removed, or abbreviations
def test_removed_options_are_refused(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser({}).parse_args(["--objects", str(tmp_path), flag, "1"])
    assert exit_.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
    help_text = build_parser({}, classes=(ServerConfig, ServeSettings)).format_help()
    assert not re.search(rf"{re.escape(flag)}(?![\w-])", help_text), flag


def test_every_option_has_one_variable_named_after_its_flag_and_file_keys_have_none():
    seen = set()
    for f in _option_fields(ServerConfig) + _option_fields(ServeSettings):
        env = env_name(f)
        assert env == "FP_" + flag_name(f)[2:].replace("-", "_").upper() and env not in seen
        seen.add(env)
    assert {"FP_OBJECTS", "FP_MAX_UPLOAD_MB", "FP_HYPOTHESES", "FP_API_KEY", "FP_INGEST_WORKERS"} <= seen
    keys = file_keys([ServerConfig, ServeSettings])
    assert {"max_sessions", "warmup", "max_objects_mb", "num_cpus"} <= set(keys)
    assert not {"FP_" + key.upper() for key in keys} & seen
    assert not {key for key in keys if "--" + key.replace("_", "-") in {flag_name(f) for f in
                                                                        _option_fields(ServerConfig)}}


def test_a_variable_named_after_a_file_key_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--objects", str(tmp_path)], {"FP_MAX_SESSIONS": "10"})
    err = capsys.readouterr().err
    assert "FP_MAX_SESSIONS: settings-file keys have no environment variable" in err and "max_sessions = ..." in err


# -- the settings file --------------------------------------------------------------------------------------------
def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, (int, float)) else json.dumps(str(value))


def test_a_settings_file_sets_its_keys(tmp_path):
    path = tmp_path / "fp.toml"
    path.write_text("# sessions\nmax_sessions = 10\nsession_ttl_s = 30  # an integer where a number is expected\n"
                    'recovery = "on"\nwarmup = false\ntrust_weights_file = true\nmax_objects_mb = 512\n'
                    "max_register_cost = 1000000\n")
    config, _ = config_from_args(["--objects", str(tmp_path), "--config", str(path), "--port", "9000"], {})
    assert (config.max_sessions, config.session_ttl_s, config.recovery, config.warmup) == (10, 30.0, "on", False)
    assert isinstance(config.session_ttl_s, float) and config.port == 9000
    assert config.runtime().trust_weights_file is True
    assert config.object_limits.max_total_bytes == 512 * 2**20 and config.object_limits.max_register_cost == 1_000_000
    default, _ = config_from_args(["--objects", str(tmp_path)], {})
    assert (default.max_sessions, default.warmup, default.recovery) == (1024, True, "auto")


def test_every_file_key_reads_back_its_default(tmp_path):
    """Each key's type has a reader: a file holding every default (but the unset ones) gives the default config."""
    keys = file_keys([ServerConfig])
    lines = [f"{key} = {_toml(f.default)}" for key, (_, f) in keys.items() if f.default is not None]
    assert len(lines) >= 15
    path = tmp_path / "defaults.toml"
    path.write_text("\n".join(lines) + "\n")
    config, _ = config_from_args(["--objects", str(tmp_path), "--config", str(path)], {})
    assert config == ServerConfig(objects_dir=tmp_path)


@pytest.mark.parametrize(("text", "message"), [
    ("max_session = 3\n", r"fp\.toml: unknown key 'max_session'; the keys are: .*\bmax_sessions\b.*\bwarmup\b"),
    ('max_sessions = "3"\n', r"fp\.toml: max_sessions must be an integer, got '3'"),
    ("max_sessions = 3.5\n", r"fp\.toml: max_sessions must be an integer, got 3\.5"),
    ("warmup = 0\n", r"fp\.toml: warmup must be true or false, got 0"),
    ("session_ttl_s = true\n", r"fp\.toml: session_ttl_s must be a number, got True"),
    ('recovery = "maybe"\n', r"fp\.toml: recovery must be one of auto, on, off; got 'maybe'"),
    ("port = 9000\n", r"fp\.toml: port is set by the option --port \(or its variable FP_PORT\), not in the settings"),
    ("max_image = '640x480'\n", r"fp\.toml: max_image is set by the option --max-image"),
    ("num_cpus = 2\n", r"fp\.toml: unknown key 'num_cpus'"),  # python -m server.serve's, not python -m server's
    ("[sessions]\nmax_sessions = 3\n", r"fp\.toml: unknown key 'sessions'"),
    ("max_sessions = \n", r"fp\.toml is not valid TOML"),
    ("max_sessions = 0\n", r"max_sessions must be > 0, got 0"),
])
def test_a_bad_settings_file_is_refused_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "fp.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        config_from_args(["--objects", str(tmp_path), "--config", str(path)], {})
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.search(message, err), err


def test_a_missing_settings_file_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--objects", str(tmp_path)], {"FP_CONFIG": str(tmp_path / "absent.toml")})
    assert f"cannot read the settings file {tmp_path / 'absent.toml'}" in capsys.readouterr().err


def test_python_m_server_serve_reads_its_own_keys_and_the_servers(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("num_cpus = 2\nmax_queued_requests = 8\nmax_sessions = 5\napp_name = \"fp2\"\n")
    settings = settings_from_args(["--objects", str(tmp_path), "--device", "cpu", "--config", str(path)])
    assert (settings.num_cpus, settings.max_queued_requests, settings.app_name) == (2.0, 8, "fp2")
    assert settings.server.max_sessions == 5
