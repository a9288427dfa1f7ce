"""The ``thresholds:`` section of rule files (rules/thresholds.yaml): every number that decides
a verdict, a straggler, an abstention or a fix, by name. The judge reads the ones it needs
(:mod:`traceclf.judge.vocabulary`), and conditions and templates use them by name like a
measure (docs/rules.md, "Thresholds").

The bundled files name every threshold; a later folder (``--rules``) may set any of them again,
but not add one: a misspelt name would otherwise change nothing, silently.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from traceclf.rulebook.yamlfile import section
from traceclf.support.errors import Problems, TraceError


def parse_thresholds(
    layers: list[list[tuple[Path, dict]]], taken: frozenset[str], problems: Problems
) -> dict[str, int | float]:
    """Every layer's thresholds, later layers over earlier ones; ``taken``: the names of
    measures and context facts, which a threshold must not shadow. A faulty threshold goes to
    ``problems`` and the others are still checked."""
    merged: dict[str, int | float] = {}
    for depth, files in enumerate(layers):
        known = frozenset(merged)
        for path, doc in files:
            raw = None
            with problems.entry():
                raw = section(doc, "thresholds", path, "a mapping of name: number")
            for name, value in (raw or {}).items():
                with problems.entry():
                    merged[name] = _threshold(name, value, path, taken, known if depth else None)
    return merged


def _threshold(
    name: Any, value: Any, path: Path, taken: frozenset[str], known: frozenset[str] | None
) -> int | float:
    label = f"threshold {name!r}"
    if not isinstance(name, str) or not name.isidentifier():
        raise TraceError(path, f"{label}: the name must be an identifier")
    if name in taken:
        raise TraceError(path, f"{label}: a measure or context name")
    if known is not None and name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TraceError(path, f"{label}: no such threshold{hint}; the bundled rules name them all")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise TraceError(path, f"{label}: must be a number, 0 or more")
    return value
