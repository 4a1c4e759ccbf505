"""Settings declared once: a dataclass field carries its help, default, group and command-line flag, and the
``FP_*`` environment variable and the argparse option are generated from it.

    port: int = setting(8000, "listen port", group="essentials", shown=True)

gives ``--port`` (``FP_PORT``) in the group *essentials* of ``--help``; a setting not ``shown`` is listed by
``--help-all`` only (every setting is accepted either way). Precedence: flag > environment variable > default.
The field's type comes from its default (bool: an ``--x`` / ``--no-x`` switch; int; float; str) unless ``parse``
says how to read the text (paths, sizes, optional numbers). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["GROUPS", "add_settings", "env_name", "flag_name", "optional", "parse_bool", "setting",
           "settings_of_namespace"]

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
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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
            shown: bool = False, parse: Callable[[str], Any] | None = None, default_text: str | None = None,
            choices: Iterable[str] | None = None, metavar: str | None = None, repr: bool = True) -> Any:  # noqa: A002
    """A dataclass field that is also a command-line option (see the module docstring).

    flag: the option's name without dashes, when it differs from the field's (``--objects`` for ``objects_dir``).
    parse: text -> value (default: from the default's type). default_text: the default as ``--help`` shows it.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}")
    meta = {"help": help, "group": group, "flag": flag, "shown": shown, "parse": parse, "default_text": default_text,
            "choices": tuple(choices) if choices is not None else None, "metavar": metavar}
    return dataclasses.field(default=default, repr=repr, metadata={"option": meta})


def _options(cls: type) -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    """``--max-upload-mb`` of a field (its ``flag``, else its name)."""
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


def _default_text(f: dataclasses.Field, meta: dict[str, Any]) -> str:
    if meta["default_text"] is not None:
        return meta["default_text"]
    if f.default is dataclasses.MISSING:
        return "required"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if f.default is None:
        return "unset"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def add_settings(parser: argparse.ArgumentParser, classes: Iterable[type], environ: Mapping[str, str], *,
                 show_all: bool) -> None:
    """Add one option per setting of ``classes`` to ``parser``, grouped, its default from ``environ`` when its
    variable is set there (a value that does not parse is the parser's error). Settings not ``shown`` are hidden
    from ``--help`` unless ``show_all``."""
    fields = [item for cls in classes for item in _options(cls)]
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, title in GROUPS.items():
        if any(meta["group"] == name and (show_all or meta["shown"]) for _, meta in fields):
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
        visible = show_all or meta["shown"]
        text = f"{meta['help']} ({env}; default {_default_text(f, meta)})" if visible else argparse.SUPPRESS
        target = groups.get(meta["group"], parser) if visible else parser
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
        if isinstance(f.default, bool) and meta["parse"] is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=read, metavar=meta["metavar"] or flag_name(f)[2:].split("-")[-1].upper())
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
                kwargs.pop("metavar")
        target.add_argument(flag_name(f), **kwargs)


def settings_of_namespace(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s settings in parsed ``args`` (fields without an option are left out)."""
    return {f.name: getattr(args, f.name) for f, _ in _options(cls) if hasattr(args, f.name)}


def parse_path(text: str) -> Path:
    return Path(text)
