"""YAML into keyword-only dataclasses, with ``key.sub=value`` overrides from the command line.

Every key is checked against the dataclass fields and every value against the field's type, so a
typo or a wrong value stops the run before it starts with one line that names the key and what
would work::

    cfg = load_config(TrainConfig, "job.yaml", ["max_steps=100", "model.n_layer=2"])

Values are read with ``yaml.safe_load`` (never arbitrary objects); override values are YAML too
(``key=null``, ``key=true``, ``key=[0.9,0.95]``). A number must be finite (``.nan`` and ``.inf``
are refused).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from accumix.errors import ConfigError

T = TypeVar("T")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    """The keys a config dataclass accepts."""
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            items = {int: "integers", float: "numbers", bool: "true/false values",
                     str: "strings"}.get(args[0], _type_name(args[0]))
            return f"a list of {items}, e.g. [x,y]"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` as the type ``hint`` says, or a ConfigError naming ``key``."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        if float in options and isinstance(value, float) and not math.isfinite(value):
            return _coerce(value, float, key)  # its own message: a finite number
        for option in options:  # the first that takes it: int before float keeps 8 an int
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} is invalid; use {_type_name(hint)}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed:
            return value
        raise ConfigError(
            f"{key}={value!r} is invalid; use one of {', '.join(str(a) for a in allowed)}"
        )
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping of {', '.join(field_names(hint))}")
        return from_dict(hint, value, prefix=f"{key}.")
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
            if isinstance(value, str) and args[0] is str:
                # loggers=mlflow and loggers=csv,mlflow mean the lists a user would bracket
                value = [part.strip() for part in value.split(",")]
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{key}={value!r} is invalid; use a list of "
                                  f"{_type_name(args[0])}")
            return tuple(_coerce(v, args[0], key) for v in value)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} is invalid; use a list {_type_name(hint)}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # .nan, .inf: no setting means them
                raise ConfigError(f"{key}={value!r} is invalid; use a finite number")
            return number
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"config field {key} has an unsupported type {hint!r}")
    raise ConfigError(f"{key}={value!r} is invalid; use {_type_name(hint)}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Builds the dataclass ``cls`` from a mapping, checking keys and values.

    Nested dataclass fields take a mapping of their own keys; keys that are left out keep the
    field's default (a nested default keeps its other values).

    Args:
        cls: a dataclass whose field types are ``int``, ``float``, ``bool``, ``str``, ``None``
            unions, ``Literal``, fixed-length ``tuple`` or dataclasses.
        data: the values.
        prefix: the dotted path of ``cls`` inside the whole config, for messages.

    Returns:
        The instance (its ``__post_init__`` checks ran).

    Raises:
        ConfigError: an unknown key (the message lists the valid ones) or a bad value.
    """
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            where = f"in {prefix[:-1]}" if prefix else "at the top level"
            raise ConfigError(
                f"unknown key {prefix}{key!s} {where}; valid keys: {', '.join(fields)}"
            )
    values: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        field = fields[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            default = (field.default if field.default is not dataclasses.MISSING
                       else field.default_factory())  # type: ignore[misc]
            nested = {k: _coerce(v, _hints(hint)[k], f"{prefix}{name}.{k}")
                      for k, v in _check_keys(hint, value, f"{prefix}{name}.").items()}
            values[name] = _replace(default, nested, f"{prefix}{name}")
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}")
    return _build(cls, values, prefix[:-1])


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    names = field_names(cls)
    for key in data:
        if key not in names:
            raise ConfigError(
                f"unknown key {prefix}{key!s} in {prefix[:-1]}; valid keys: {', '.join(names)}"
            )
    return data


def _replace(default: Any, values: dict[str, Any], where: str) -> Any:
    try:
        return dataclasses.replace(default, **values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # a dataclass's own check, e.g. GPTConfig's
        raise ConfigError(f"{where}: {exc}") from None


def _build(cls: type[T], values: dict[str, Any], where: str) -> T:
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where + ': ' if where else ''}{exc}") from None


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}`` (values read as YAML).

    Raises:
        ConfigError: an item without ``=`` or with an empty key.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {item!r} is invalid; write key=value, e.g. max_steps=100")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # not YAML: take the text as it is
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r} sets a key inside {part}, which is a value")
            node = child
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``extra`` merged in, nested mappings key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty file: ``{}``).

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return data


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: Iterable[str] = ()) -> T:
    """The config ``cls`` from an optional YAML file and ``key=value`` overrides (applied last).

    Every key is checked against the dataclass's fields (nested dataclasses are sections:
    ``model.n_layer=2``) and every value against the field's type; values are YAML, read with
    ``yaml.safe_load``.

    Args:
        cls: a keyword-only dataclass whose fields are ints, floats, bools, strings, None,
            ``Literal`` words, tuples of those, or dataclasses of the same kind.
        path: a YAML file of keys (None: the defaults).
        overrides: ``key=value`` strings, dotted for sections, applied after the file.

    Returns:
        An instance of ``cls``.

    Raises:
        ConfigError: an unknown key (the message lists the valid ones), a value of the wrong
            type, a file that is missing or not a YAML mapping, an override without ``=``.

    Example:
        ```python
        from dataclasses import dataclass

        import accumix as ax


        @dataclass(kw_only=True, frozen=True)
        class Job:
            lr: float = 1e-3
            steps: int = 100


        job = ax.load_config(Job, None, ["steps=20"])
        assert job == Job(steps=20)
        ```
    """
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, merge(data, parse_overrides(overrides)))


def to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as plain YAML-able values (tuples become lists)."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))
