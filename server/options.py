"""Settings declared once: a dataclass field carries its help, default and group, and either a command-line option
(with its ``FP_*`` environment variable) or a key of the settings file (``--config FILE``) is generated from it.

    port: int = setting(8000, "listen port", group="essentials")
    max_sessions: int = setting(1024, "live sessions at most", group="sessions", in_file=True)

gives ``--port`` (``FP_PORT``) in the group *essentials* of ``--help``, and the key ``max_sessions`` of the TOML
settings file. Every setting has one way in: an option is not a file key and a file key has no option and no
variable (a variable named after a file key is refused, so it is never silently ignored). Precedence of an option:
flag > environment variable > default. An option's type comes from its default (bool: an ``--x`` / ``--no-x``
switch; int; float; str) unless ``parse`` says how to read the text (paths, sizes, optional numbers); a file key's
type comes from its field's annotation. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_ENV", "GROUPS", "ConfigFileError", "add_settings", "env_name", "file_keys", "flag_name",
           "optional", "parse_bool", "read_config_file", "setting", "settings_of_namespace"]

# --help lists the groups in this order; the essentials first
GROUPS = {
    "essentials": "essentials",
    "engine": "engine (how the networks run)",
    "algorithm": "algorithm size",
    "limits": "limits",
    "scaling": "scaling",
    "operations": "operations",
    "sessions": "sessions and admission",
    "objects": "object limits",
    "serve": "Ray Serve",
}
CONFIG_ENV = "FP_CONFIG"  # the variable of --config
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
# a file key's annotation (without "| None") -> (what the file must hold, its name in an error, conversion)
_FILE_TYPES: dict[str, tuple[tuple[type, ...], str, Callable[[Any], Any]]] = {
    "bool": ((bool,), "true or false", bool),
    "int": ((int,), "an integer", int),
    "float": ((int, float), "a number", float),
    "str": ((str,), "a string", str),
    "Path": ((str,), "a path (string)", Path),
}


class ConfigFileError(ValueError):
    """The settings file cannot be read, or holds an unknown key or a value of the wrong type."""


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected 1/0/true/false, got {text!r}")


def optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, with an empty text meaning None (the setting's automatic value)."""

    def read(text: str) -> Any:
        return None if str(text).strip() == "" else parse(text)

    read.__name__ = getattr(parse, "__name__", "value")
    return read


def setting(default: Any = dataclasses.MISSING, help: str = "", *, group: str, flag: str | None = None,  # noqa: A002
            in_file: bool = False, parse: Callable[[str], Any] | None = None, default_text: str | None = None,
            choices: Iterable[str] | None = None, metavar: str | None = None, repr: bool = True) -> Any:  # noqa: A002
    """A dataclass field that is also a command-line option, or with ``in_file`` a settings-file key (see the module
    docstring).

    flag: the option's name without dashes, when it differs from the field's (``--objects`` for ``objects_dir``).
    parse: text -> value (default: from the default's type). default_text: the default as ``--help`` shows it.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}")
    if in_file and (flag is not None or parse is not None or metavar is not None):
        raise ValueError("a settings-file key is named after its field and typed by its annotation: no flag, parse "
                         "or metavar")
    meta = {"help": help, "group": group, "flag": flag, "in_file": in_file, "parse": parse,
            "default_text": default_text, "choices": tuple(choices) if choices is not None else None,
            "metavar": metavar}
    return dataclasses.field(default=default, repr=repr, metadata={"option": meta})


def _declared(cls: type) -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def _options(cls: type) -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    return [(f, meta) for f, meta in _declared(cls) if not meta["in_file"]]


def file_keys(classes: Iterable[type]) -> dict[str, tuple[type, dataclasses.Field]]:
    """key -> (class, field) of every settings-file key of ``classes``."""
    return {f.name: (cls, f) for cls in classes for f, meta in _declared(cls) if meta["in_file"]}


def flag_name(f: dataclasses.Field) -> str:
    """``--max-upload-mb`` of an option's field (its ``flag``, else its name)."""
    return "--" + (f.metadata["option"]["flag"] or f.name).replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    """``FP_MAX_UPLOAD_MB``: the flag's name in capitals."""
    return "FP_" + flag_name(f)[2:].replace("-", "_").upper()


def _reader(f: dataclasses.Field, meta: dict[str, Any]) -> Callable[[str], Any]:
    if meta["parse"] is not None:
        return meta["parse"]
    default = f.default
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, (int, float, str)):
        return type(default)
    return str


def default_text(f: dataclasses.Field) -> str:
    """The default of a setting as ``--help`` and the docs show it."""
    meta = f.metadata["option"]
    if meta["default_text"] is not None:
        return meta["default_text"]
    if f.default is dataclasses.MISSING:
        return "required"
    if isinstance(f.default, bool):
        return ("true" if f.default else "false") if meta["in_file"] else ("on" if f.default else "off")
    if f.default is None:
        return "unset"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def add_settings(parser: argparse.ArgumentParser, classes: Iterable[type], environ: Mapping[str, str]) -> None:
    """Add one option per option setting of ``classes`` to ``parser``, grouped, its default from ``environ`` when
    its variable is set there (a value that does not parse is the parser's error), and ``--config FILE`` when any
    class has settings-file keys. A variable named after a file key is the parser's error."""
    classes = tuple(classes)
    fields = [item for cls in classes for item in _options(cls)]
    keys = file_keys(classes)
    misplaced = sorted(f"FP_{key.upper()}" for key in keys if f"FP_{key.upper()}" in environ)
    if misplaced:
        parser.error(f"{', '.join(misplaced)}: settings-file keys have no environment variable; write them in the "
                     f"file of --config ({CONFIG_ENV}) as {', '.join(v[3:].lower() + ' = ...' for v in misplaced)}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, title in GROUPS.items():
        if any(meta["group"] == name for _, meta in fields) or (name == "operations" and keys):
            groups[name] = parser.add_argument_group(title)
    for f, meta in fields:
        read = _reader(f, meta)
        env = env_name(f)
        default: Any = None if f.default is dataclasses.MISSING else f.default
        if env in environ:
            try:
                default = read(environ[env])
            except ValueError as exc:
                parser.error(f"{env}={environ[env]!r}: {exc}")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                                  "help": f"{meta['help']} ({env}; default {default_text(f)})"}
        if isinstance(f.default, bool) and meta["parse"] is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=read, metavar=meta["metavar"] or flag_name(f)[2:].split("-")[-1].upper())
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
                kwargs.pop("metavar")
        groups[meta["group"]].add_argument(flag_name(f), **kwargs)
    if keys:
        config = environ.get(CONFIG_ENV)
        groups["operations"].add_argument(
            "--config", dest="config", type=Path, default=Path(config) if config else None, metavar="FILE",
            help=f"TOML settings file of what has no option: sessions and admission, object limits, time-outs "
                 f"(keys: the settings' names; docs/operations.md lists them) ({CONFIG_ENV}; default unset)")


def settings_of_namespace(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s options in parsed ``args`` (fields without an option are left out)."""
    return {f.name: getattr(args, f.name) for f, _ in _options(cls) if hasattr(args, f.name)}


def _file_value(path: Path, key: str, f: dataclasses.Field, value: Any) -> Any:
    base = str(f.type).replace(" | None", "").strip()
    if base not in _FILE_TYPES:
        raise TypeError(f"settings-file key {key!r}: no reader for its type {f.type!r}")
    accepted, what, convert = _FILE_TYPES[base]
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        raise ConfigFileError(f"{path}: {key} must be {what}, got {value!r}")
    choices = f.metadata["option"]["choices"]
    if choices is not None and value not in choices:
        raise ConfigFileError(f"{path}: {key} must be one of {', '.join(choices)}; got {value!r}")
    return convert(value)


def read_config_file(path: Path, classes: Iterable[type]) -> dict[type, dict[str, Any]]:
    """class -> {field: value} of the settings-file keys in the TOML file ``path``. Raises :class:`ConfigFileError`
    naming the file and the key when the file cannot be read or parsed, holds a key that is not a settings-file key
    of ``classes`` (the message lists the valid ones) or a value of the wrong type."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as the package tomli (the server extras install it there)
        import tomli as tomllib
    classes = tuple(classes)
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as exc:
        raise ConfigFileError(f"cannot read the settings file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path} is not valid TOML: {exc}") from exc
    keys = file_keys(classes)
    options = {f.name: flag_name(f) for cls in classes for f, _ in _options(cls)}
    options.update({flag_name(f)[2:].replace("-", "_"): flag_name(f) for cls in classes for f, _ in _options(cls)})
    out: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for key, value in table.items():
        if key in options:
            raise ConfigFileError(f"{path}: {key} is set by the option {options[key]} (or its variable FP_"
                                  f"{options[key][2:].replace('-', '_').upper()}), not in the settings file")
        if key not in keys:
            raise ConfigFileError(f"{path}: unknown key {key!r}; the keys are: {', '.join(sorted(keys))}")
        cls, f = keys[key]
        out[cls][f.name] = _file_value(path, key, f, value)
    return out


def parse_path(text: str) -> Path:
    return Path(text)
