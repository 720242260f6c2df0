"""The ``actorproxy run`` flags, generated from the settings tree, and a config built from them.

One argument group per section of :class:`~actorproxy.config.ProxyConfig`,
one flag per field (its name with dashes, or the ``flags`` of its metadata),
the help text from the field's metadata. A value comes from, first to last:
the command line, the ``--config`` TOML file, the field's environment
variable, the field's default. The tree is then built by one cattrs converter
that refuses unknown keys and wrong types, so a typo in a config file is an
error naming its path, never a silently ignored setting.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import cattrs
from cattrs.v import format_exception

from .config import SECTIONS, ProxyConfig, config_converter

_SEP = "."


def _flags(field: attrs.Attribute[Any]) -> tuple[str, ...]:
    return tuple(field.metadata.get("flags") or ()) or ("--" + field.name.replace("_", "-"),)


def _inner(hint: Any) -> Any:
    """``X`` for ``X | None``; the hint itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


class _AppendSplit(argparse.Action):
    """Repeatable, comma-separated list flag (``--backend-url a,b --backend-url c``)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        current = list(getattr(namespace, self.dest, None) or [])
        current.extend(part.strip() for part in str(values).split(",") if part.strip())
        setattr(namespace, self.dest, current)


#: Title of the group of the flags that other systems' command lines use (fields marked ``compat``).
COMPAT_GROUP = (
    "compatibility (the Dressage proxy's, the Claw-R1 gateway's and the in-process proxy's flags; docs/migrating.md)"
)


def add_settings_arguments(parser: argparse.ArgumentParser) -> Any:
    """Add ``--config`` and one argument group per settings section to ``parser``.

    Fields marked ``compat`` go to a last "compatibility" group, which is returned.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a TOML file of settings, by section ([engines], [trajectory], ...; see docs/configuration.md); "
        "flags override it",
    )
    later: list[tuple[str, attrs.Attribute[Any], Any]] = []
    for section, kind in SECTIONS.items():
        hints = typing.get_type_hints(kind)
        group = parser.add_argument_group(kind.__doc__)
        for field in attrs.fields(kind):
            dest, hint = f"{section}{_SEP}{field.name}", _inner(hints[field.name])
            if field.metadata.get("compat"):
                later.append((dest, field, hint))
            else:
                _add_field(group, dest, field, hint)
    compat = parser.add_argument_group(COMPAT_GROUP)
    for dest, field, hint in later:
        _add_field(compat, dest, field, hint)
    return compat


def _add_field(group: Any, dest: str, field: attrs.Attribute[Any], hint: Any) -> None:
    help_text = str(field.metadata.get("help", ""))
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        shown = "from the environment"
    else:
        shown = "none" if default is None else ("on" if default is True else "off" if default is False else default)
    kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {shown})"}
    if hint is not bool and typing.get_origin(hint) is not Literal:
        kwargs["metavar"] = field.metadata.get("metavar") or field.name.upper()
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is Literal:
        kwargs["choices"] = list(typing.get_args(hint))
    elif typing.get_origin(hint) is tuple:
        kwargs["action"] = _AppendSplit
    elif hint in (int, float):
        kwargs["type"] = hint
    group.add_argument(*_flags(field), **kwargs)


def settings_from_namespace(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings the command line gave, as a ``{section: {field: value}}`` tree."""
    tree: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        section, sep, name = dest.partition(_SEP)
        if sep and section in SECTIONS:
            tree.setdefault(section, {})[name] = value
    return tree


def load_config_file(path: str) -> dict[str, dict[str, Any]]:
    """A TOML settings file as a tree (checked when the config is built)."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    for section, values in data.items():
        if section not in SECTIONS:
            raise ValueError(f"--config {path}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: [{section}] must be a table")
    return data


def _from_environment(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    tree: dict[str, dict[str, Any]] = {}
    for section, kind in SECTIONS.items():
        hints = typing.get_type_hints(kind)
        for field in attrs.fields(kind):
            for variable in field.metadata.get("env") or ():
                if environ.get(variable):
                    value = _env_value(variable, environ[variable], hints[field.name])
                    tree.setdefault(section, {})[field.name] = value
                    break
    return tree


def _env_value(variable: str, text: str, hint: Any) -> Any:
    """An environment variable's text as the field's type (a bad number is a one-line error)."""
    kind = _inner(hint)
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(f"${variable}: expected a number, got {text!r}") from None
    if kind is bool:
        return text.strip().lower() not in ("0", "false", "no", "off", "")
    return text


def build_config(
    flags: Mapping[str, Mapping[str, Any]],
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ProxyConfig:
    """The config from flags over a config file over the environment over ``defaults`` over the tree's.

    Raises ``ValueError`` with one line naming the setting and what is wrong.
    """
    layers = [{k: dict(v) for k, v in (defaults or {}).items()}]
    layers.append(_from_environment(os.environ if environ is None else environ))
    if config_file is not None:
        layers.append(load_config_file(config_file))
    layers.append({k: dict(v) for k, v in flags.items()})
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    return structure_config(merged)


def structure_config(tree: Mapping[str, Any]) -> ProxyConfig:
    """A :class:`ProxyConfig` from a plain tree, with strict types and one-line errors."""
    converter = _strict(config_converter())
    try:
        return converter.structure(dict(tree), ProxyConfig)
    except cattrs.ClassValidationError as exc:
        raise ValueError("; ".join(_messages(exc))) from None


def _messages(exc: cattrs.ClassValidationError) -> list[str]:
    found: list[str] = []
    def describe(error: BaseException, kind: Any) -> str:
        if isinstance(error, ValueError) and str(error):
            return str(error)  # our validators' own words ("--max-sessions must be positive, got 0")
        return format_exception(error, kind)

    for line in cattrs.transform_error(exc, path="settings", format_exception=describe):
        message, _, where = line.partition(" @ ")
        setting = where.removeprefix("settings.").split(".")[-1] if where else ""
        flag = "--" + setting.replace("_", "-") if setting else "settings"
        found.append(message if message.startswith("--") else f"{flag}: {message}")
    return found or [str(exc)]


def _strict(converter: cattrs.Converter) -> cattrs.Converter:
    """Refuse what Python would coerce: ``"false"`` for a bool, ``1.5`` or ``true`` for an int; name a choice's
    choices (a ``Literal`` setting: ``--log-format``, ``--processing-heartbeats``)."""

    def _bool(value: Any, _t: Any) -> bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")

    def _int(value: Any, _t: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"expected an integer, got {value!r}")

    def _float(value: Any, _t: Any) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"expected a number, got {value!r}")

    def _str(value: Any, _t: Any) -> str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")

    def _literal(value: Any, t: Any) -> Any:
        choices = typing.get_args(t)
        if value in choices and type(value) in {type(c) for c in choices}:  # (not True for 1)
            return value
        raise ValueError(f"expected one of {', '.join(map(repr, choices))}, got {value!r}")

    def _is_literal(t: Any) -> bool:
        return typing.get_origin(t) is Literal

    converter.register_structure_hook_func(_is_literal, _literal)
    converter.register_structure_hook(bool, _bool)
    converter.register_structure_hook(int, _int)
    converter.register_structure_hook(float, _float)
    converter.register_structure_hook(str, _str)
    return converter


def help_groups() -> Sequence[str]:
    """The argument-group titles, in order (for docs and tests)."""
    return [kind.__doc__ or name for name, kind in SECTIONS.items()]
