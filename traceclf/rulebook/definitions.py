"""The ``definitions:`` section of the rule files: named expressions that rules may use, merged
like rules, each checked against the measures, context names and the definitions before it.
Every problem is a one-line ``TraceError`` naming the file and the definition."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceclf.rulebook.expr import Expr, ExprError
from traceclf.rulebook.yamlfile import section
from traceclf.support.errors import Problems, TraceError


@dataclass(frozen=True)
class Definition:
    name: str
    expr: Expr
    source: Path


def parse_definitions(
    docs: list[list[tuple[Path, dict]]],
    measures: frozenset[str],
    problems: Problems | None = None,
) -> dict[str, Definition]:
    """Named expressions, merged like rules; each may use the ``measures`` (and context
    names) and the definitions before it. Faulty ones go to ``problems`` (without: raised
    together at the end) and the others are still checked."""
    found = problems if problems is not None else Problems()
    merged: dict[str, Definition] = {}
    for files in docs:
        seen: set[str] = set()
        for path, doc in files:
            raw = None
            with found.entry():
                raw = section(doc, "definitions", path, "a mapping of name: expression")
            for name, source in (raw or {}).items():
                with found.entry():
                    merged[name] = _definition(name, source, path, measures, seen)
    earlier = set(measures)  # grown one definition at a time: linear in the definitions
    for d in merged.values():
        for used in sorted(d.expr.names - earlier)[:1]:  # (its first unknown name)
            where = "a later definition" if used in merged else "unknown"
            found.add(TraceError(d.source, f"definition {d.name!r}: uses {used!r} ({where})"))
        earlier.add(d.name)
    if problems is None:
        found.check()
    return merged


def _definition(
    name: Any, source: Any, path: Path, measures: frozenset[str], seen: set[str]
) -> Definition:
    label = f"definition {name!r}"
    if not isinstance(name, str) or not name.isidentifier():
        raise TraceError(path, f"{label}: the name must be an identifier")
    if name in measures or name in seen:
        what = "a measure or context name" if name in measures else "defined twice"
        raise TraceError(path, f"{label}: {what}")
    seen.add(name)
    try:
        return Definition(name, Expr.parse(str(source)), path)
    except ExprError as e:
        raise TraceError(path, f"{label}: {e}") from None
