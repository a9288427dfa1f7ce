"""Two parts of a fix entry of a rule file: its ``recovers:``, the gain ceiling as data
(docs/judgement.md, "Gain ceilings"), and its ``preconditions:``, the premises a user checks
before applying it, some of which a capture can contradict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from traceclf.rulebook.expr import Expr, Template

# What a ceiling is counted in: ms of one step (the only unit ceilings add up in), samples per
# second (a change that makes the step do more work, not take less time), or throughput per
# GPU (a change that adds GPUs).
UNITS = ("step", "sample", "gpu")


@dataclass(frozen=True)
class Recovers:
    """What a fix can win back at most, and on what assumption.

    ``frac``: the share of the step it recovers, from the interval classes ``classes`` (paths
    such as ``compute-absent/blocking/comm``; classes whose paths do not nest are disjoint).
    ``floor_ms``: the shortest the step can be after the fix (an input pipeline cannot beat
    its workers). ``gain``: for unit ``sample`` or ``gpu``, the throughput multiplier in that
    unit. ``multiplier``: whether a throughput multiplier can be stated at all (it cannot when
    nothing in the trace bounds how fast the fixed work would run); always, when absent.
    ``assumes``: the assumption in one sentence, rendered with the numbers; ``bound_by``: the
    names whose values bound it, shown with the ceiling."""

    frac: Expr | None
    classes: tuple[str, ...]
    assumes: Template
    bound_by: tuple[str, ...]
    unit: str = "step"
    floor_ms: Expr | None = None
    gain: Expr | None = None
    multiplier: Expr | None = None


@dataclass(frozen=True)
class Precondition:
    """A premise the user checks before applying a fix (the trace cannot show it).
    ``contradicted``: (condition, what the trace shows) pairs, the first that holds says the
    capture shows the opposite (both ranks on one GPU where the premise is an EP group across
    nodes), in a sentence rendered with its numbers. ``when``: the premise is said only where
    it holds (a MoE premise for a MoE run, a framework's for a framework's loop)."""

    text: str
    contradicted: tuple[tuple[Expr, Template], ...] = ()
    when: Expr | None = None


@dataclass(frozen=True)
class Pitfall:
    """A mistake to avoid when applying a fix, said only where ``when`` holds (always
    without one)."""

    text: str
    when: Expr | None = None


class Entry(Protocol):
    """The part of a rule-file entry being parsed (:class:`traceclf.rulebook.entries._Entry`)
    that these parsers use: its raw mapping, typed getters and one-line failure."""

    raw: Any
    label: str

    def fail(self, problem: str) -> None: ...
    def text(self, key: str, default: str | None = None) -> str | None: ...
    def texts(self, key: str) -> tuple[str, ...]: ...
    def names_of(self, key: str) -> tuple[str, ...]: ...
    def expr(self, key: str) -> Expr | None: ...
    def template(self, key: str) -> Template | None: ...
    def part(self, raw: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> Entry: ...


_KEYS = ("from", "frac", "assumes", "bound_by", "unit", "floor_ms", "gain", "multiplier")


def parse_recovers(e: Entry) -> Recovers | None:
    raw = e.raw.get("recovers")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        e.fail("'recovers' must be a mapping (from, frac, assumes, ...)")
    unknown = sorted(str(k) for k in set(raw) - set(_KEYS))
    if unknown:
        e.fail(f"'recovers': unknown field {unknown[0]!r}")
    unit = raw.get("unit", "step")
    if unit not in UNITS:
        e.fail(f"'recovers': 'unit' must be one of {', '.join(UNITS)}")
    needed = {"step": ("frac",), "sample": ("gain",), "gpu": ("frac", "gain")}[unit]
    for key in ("from", "assumes", *needed):
        if raw.get(key) in (None, ""):
            e.fail(f"'recovers': missing {key!r}")
    sub = e.part(raw, (), _KEYS)
    classes = sub.texts("from")
    if not all(c.strip() for c in classes):
        e.fail("'recovers': 'from' must name at least one interval class")
    return Recovers(
        frac=sub.expr("frac"),
        classes=classes,
        assumes=sub.template("assumes"),
        bound_by=sub.names_of("bound_by"),
        unit=unit,
        floor_ms=sub.expr("floor_ms"),
        gain=sub.expr("gain"),
        multiplier=sub.expr("multiplier"),
    )


def parse_preconditions(e: Entry) -> tuple[Precondition, ...]:
    """``preconditions``: each a sentence, or ``{text, when, contradicted: [{when, shows}]}``
    (``when`` and ``contradicted`` optional)."""
    raw = e.raw.get("preconditions") or []
    if not isinstance(raw, list):
        e.fail("'preconditions' must be a list")
    return tuple(_precondition(e, item) for item in raw)


def parse_pitfalls(e: Entry) -> tuple[Pitfall, ...]:
    """``pitfalls``: each a sentence, or ``{text, when}``."""
    raw = e.raw.get("pitfalls") or []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        e.fail("'pitfalls' must be a list")
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append(Pitfall(" ".join(item.split())))
            continue
        if not isinstance(item, dict) or not set(item) <= {"text", "when"} or "text" not in item:
            e.fail("'pitfalls' entries are text or a mapping of text and when")
        sub = e.part(item, ("text",), ("when",))
        out.append(Pitfall(" ".join(sub.text("text").split()), sub.expr("when")))
    return tuple(out)


def _precondition(e: Entry, item: Any) -> Precondition:
    if isinstance(item, str):
        return Precondition(" ".join(item.split()))
    keys = {"text", "contradicted", "when"}
    if not isinstance(item, dict) or not set(item) <= keys or "text" not in item:
        e.fail("'preconditions' entries are text or a mapping of text, when and contradicted")
    sub = e.part(item, ("text",), ("contradicted", "when"))
    text = " ".join(sub.text("text").split())
    if "contradicted" not in item:
        return Precondition(text, when=sub.expr("when"))
    cases = item["contradicted"]
    if not isinstance(cases, list) or not cases:
        e.fail("'preconditions': 'contradicted' must be a list of {when, shows}")
    pairs = []
    for case in cases:
        if not isinstance(case, dict) or set(case) != {"when", "shows"}:
            e.fail("'preconditions': 'contradicted' entries need exactly 'when' and 'shows'")
        part = e.part(case, ("when", "shows"), ())
        pairs.append((part.expr("when"), part.template("shows")))
    return Precondition(text, tuple(pairs), sub.expr("when"))
