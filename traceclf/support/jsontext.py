"""JSON text for people and for tools at once: indented, but every row (a list or an object
that holds only numbers, strings, booleans and nulls) on one line; and JSON that every parser
reads: a number that is not finite (NaN, ±infinity, which Python would write as the invalid
``NaN``/``Infinity``) is written as ``null``, the contract's "unknown".

A long ``--all-steps`` report is mostly such rows (one per step of every series). Writing each
on its own line keeps the file a few thousand lines instead of tens of thousands, diffs stay
one line per step, and the rows go through the C encoder: Python's indenting encoder is pure
Python and was most of re-analysing a cached 2 GB export.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def dumps(data: Any, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> str:
    """``json.dumps(data, indent=indent, default=default)``, each row on one line (the same
    JSON value either way), numbers that are not finite as ``null``."""
    if default is not None:
        default = _finite_default(default)
    if indent is None:
        return json.dumps(_finite(data), default=default, allow_nan=False)
    rows: list[str] = []
    # a fresh nonce per call: a string read from a trace cannot spell a placeholder
    tag = f"\x00{os.urandom(8).hex()}:"
    encode = _row_encoder(default)

    def fold(value: Any) -> Any:
        if isinstance(value, dict):
            if value and _scalars(value.values()):
                return _row(value)
            return {k: fold(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if value and _scalars(value):
                return _row(value)
            return [fold(v) for v in value]
        return _finite(value)

    def _row(value: Any) -> str:
        try:  # (rows are mostly finite: the scan for NaN only when one is there)
            rows.append(encode(value))
        except ValueError:
            rows.append(encode(_finite(value)))
        return f"{tag}{len(rows) - 1}"

    text = json.dumps(fold(data), indent=indent, default=default, allow_nan=False)
    placeholder = re.compile(re.escape(json.dumps(tag)[:-1]) + r'(\d+)"')
    return placeholder.sub(lambda m: rows[int(m[1])], text)


def _scalars(values: Any) -> bool:
    """Whether every value is a string, number, boolean or null (the types' set first: the
    test runs once per row of a long report)."""
    return _SCALAR_TYPES.issuperset(map(type, values)) or all(
        isinstance(v, _SCALARS) for v in values
    )


def _row_encoder(default: Callable[[Any], Any] | None) -> Callable[[Any], str]:
    """``json.dumps(value, separators=(", ", ": "), allow_nan=False, default=default)``, made
    once: ``JSONEncoder.encode`` builds its C encoder anew on every call, which cost more than
    the encoding of a long report's hundred thousand short rows."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # (an interpreter without the C accelerator)
        return json.JSONEncoder(separators=(", ", ": "), allow_nan=False, default=default).encode
    encoder = make(
        None, default or _unserialisable, json.encoder.encode_basestring_ascii,
        None, ": ", ", ", False, False, False,
    )  # fmt: skip
    return lambda value: "".join(encoder(value, 0))


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite made None (in containers too)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _finite_default(default: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``default`` whose results (a numpy scalar's ``.item()``) are made finite as well."""
    return lambda value: _finite(default(value))
