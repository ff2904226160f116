"""Typed conversion of YAML-shaped values into config dataclasses, with errors that name the
field's path and say what was expected: a typo or a wrong type is a one-line start-up error,
never a traceback (`scoring: {weights: {lod: 0.5}}`, `request_timeout_s: "ten"`).

Supported field types: bool, int, float, str, `X | None`, `tuple[X, ...]`, `dict[str, X]`,
`Literal[...]`, and nested dataclasses (whose unknown keys are errors)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin, get_type_hints

from router.core.errors import ConfigError

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def fail(path: str, problem: str) -> ConfigError:
    return ConfigError(f"config field {path}: {problem}", param=path)


def convert(raw: Any, tp: Any, path: str) -> Any:
    """`raw` (from YAML, JSON or the environment) as a value of type `tp`."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(raw, get_args(tp), path)
    if origin is Literal:
        if raw not in get_args(tp):
            choices = ", ".join(str(a) for a in get_args(tp))
            raise fail(path, f"{raw!r} is not one of {choices}")
        return raw
    if origin is tuple:
        return _tuple(raw, get_args(tp)[0], path)
    if origin is dict:
        return _dict(raw, get_args(tp)[1], path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return build(tp, raw, path)
    if tp is Any:
        return raw
    return _scalar(raw, tp, path)


def build(cls: type[Any], raw: Any, path: str, base: Any = None) -> Any:
    """A dataclass from a mapping; keys it does not know are errors that list the known ones.
    Fields not given keep `base`'s value (or the dataclass default)."""
    if not isinstance(raw, Mapping):
        raise fail(path or cls.__name__, f"expected a mapping of fields, got {_show(raw)}")
    hints = get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        what = f"config field {path}: unknown key(s)" if path else "unknown config field(s):"
        raise ConfigError(
            f"{what} {', '.join(unknown)}; known: {', '.join(sorted(known))}",
            param=f"{path}.{unknown[0]}" if path else unknown[0],
        )
    values = {k: convert(v, hints[k], f"{path}.{k}" if path else str(k)) for k, v in raw.items()}
    try:  # a dataclass may check its own values in __post_init__
        if base is not None:
            return dataclasses.replace(base, **values)
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise fail(path or cls.__name__, str(exc)) from None


def _union(raw: Any, options: tuple[Any, ...], path: str) -> Any:
    if raw is None:
        if type(None) in options:
            return None
        raise fail(path, "must not be empty")
    real = [o for o in options if o is not type(None)]
    errors = []
    for option in real:
        try:
            return convert(raw, option, path)
        except ConfigError as err:
            errors.append(err)
    raise errors[0]


def _tuple(raw: Any, item: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(raw, (list, tuple)):
        raise fail(path, f"expected a list, got {_show(raw)}")
    return tuple(convert(v, item, f"{path}[{i}]") for i, v in enumerate(raw))


def _dict(raw: Any, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise fail(path, f"expected a mapping, got {_show(raw)}")
    return {str(k): convert(v, value, f"{path}.{k}") for k, v in raw.items()}


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _scalar(raw: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    else:
        raise TypeError(f"config type {tp!r} at {path} is not supported")
    raise fail(path, f"expected {_NAMES[tp]}, got {_show(raw)}")


def _show(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."
