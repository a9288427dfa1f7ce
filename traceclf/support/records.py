"""Frozen dataclasses rebuilt from JSON-shaped data (a cache read back from disk), every value
checked against the field's type hint on the way in: a cache written by another version, or
damaged, raises ValueError instead of reaching the code that trusts the types."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def from_json(cls: type[T], data: object) -> T:
    """``cls`` (a dataclass) from ``data`` (what ``dataclasses.asdict`` made of one, through
    JSON: tuples came back as lists): nested dataclasses rebuilt, tuples restored, every
    field present and of its declared type. ValueError otherwise."""
    return _value(cls, data, cls.__name__)


def _value(hint: Any, value: object, where: str) -> Any:
    if hint is Any or hint is object:
        return value
    if dataclasses.is_dataclass(hint):
        return _record(hint, value, where)  # type: ignore[arg-type]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _value(option, value, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: {type(value).__name__} is not {hint}")
    if hint is type(None):
        return _exactly(value is None, value, where, "null")
    if hint in (int, float):  # a JSON number; never a boolean
        ok = isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
        return _exactly(ok, value, where, hint.__name__)
    if hint in (str, bool):
        return _exactly(isinstance(value, hint), value, where, hint.__name__)
    container = origin or hint
    if container is dict:
        _exactly(isinstance(value, dict), value, where, "a mapping")
        if not args:
            return value
        return {
            _value(args[0], k, where): _value(args[1], v, f"{where}[{k!r}]")
            for k, v in value.items()  # type: ignore[union-attr]
        }
    if container in (list, tuple):
        _exactly(isinstance(value, (list, tuple)), value, where, "a list")
        item = args[0] if args else Any
        items = [_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]  # type: ignore[arg-type]
        return tuple(items) if container is tuple else items
    raise ValueError(f"{where}: no rule for {hint}")


def _record(cls: type, value: object, where: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: not a mapping")
    names = [f.name for f in dataclasses.fields(cls)]
    if set(value) != set(names):
        raise ValueError(f"{where}: fields {sorted(value)} instead of {names}")
    hints = _hints(cls)
    return cls(**{n: _value(hints[n], value[n], f"{where}.{n}") for n in names})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _exactly(ok: bool, value: object, where: str, what: str) -> Any:
    if not ok:
        raise ValueError(f"{where}: {type(value).__name__} where {what} belongs")
    return value
