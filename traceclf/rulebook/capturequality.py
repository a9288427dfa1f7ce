"""The ``capture:`` section of rule files (rules/hostside.yaml): when the capture itself may have
changed the verdict (profiler overhead, lost or cut data) and what that costs the confidence,
and which capture options would attribute the idle time no host source of the trace accounts
for. A later folder's settings replace the bundled ones; its options replace those of the same
``source``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceclf.rulebook.entries import WALLS, _Entry
from traceclf.rulebook.yamlfile import section
from traceclf.support.errors import TraceError

_KEYS = ("distortions", "distorted_weight", "options_when", "options")


@dataclass(frozen=True)
class Distortion:
    """One way the capture may distort the verdict: when it holds, the report warns, and the
    confidence of a verdict on one of ``walls`` (every wall when empty) is lowered."""

    when: Any  # Expr
    warning: Any  # Template
    # the walls it can make a run look bound by (a host made slower by the capture reads as
    # host-bound, never as compute-bound): the others keep their confidence
    walls: tuple[str, ...] = ()


@dataclass(frozen=True)
class CaptureOption:
    """A capture option that would give the report a host source it lacks."""

    source: str
    option: str
    attributes: str
    when: Any = None  # Expr; None: whenever the source is missing


@dataclass(frozen=True)
class CaptureQuality:
    distortions: tuple[Distortion, ...] = ()
    # the window's reliability is multiplied by this when a distortion holds
    distorted_weight: float = 1.0
    options_when: Any = None  # Expr: when to suggest capture options at all
    options: tuple[CaptureOption, ...] = ()


def parse_capture(docs: list[list[tuple[Path, dict]]], names: frozenset[str]) -> CaptureQuality:
    """The merged ``capture:`` section of every folder's files."""
    settings: dict[str, Any] = {}
    options: dict[str, CaptureOption] = {}
    for files in docs:
        for path, doc in files:
            raw = section(doc, "capture", path, keys=tuple(_KEYS))
            if raw is None:
                continue
            if "distortions" in raw:
                settings["distortions"] = tuple(
                    _distortion(e, path, i, names) for i, e in enumerate(_list(raw, path))
                )
            if "distorted_weight" in raw:
                settings["distorted_weight"] = _weight(raw["distorted_weight"], path)
            if "options_when" in raw:
                entry = _Entry(
                    {"when": raw["options_when"]}, path, "capture", 0, ("when",), (), names
                )
                settings["options_when"] = entry.expr("when")
            for i, e in enumerate(raw.get("options") or []):
                option = _option(e, path, i, names)
                options[option.source] = option
    return CaptureQuality(
        settings.get("distortions", ()),
        settings.get("distorted_weight", 1.0),
        settings.get("options_when"),
        tuple(options.values()),
    )


def _list(raw: dict, path: Path) -> list:
    value = raw.get("distortions")
    if not isinstance(value, list):
        raise TraceError(path, "capture: distortions must be a list")
    return value


def _distortion(raw: Any, path: Path, i: int, names: frozenset[str]) -> Distortion:
    e = _Entry(raw, path, "capture distortion", i, ("when", "warning"), ("walls",), names)
    walls = e.texts("walls")
    unknown = [w for w in walls if w not in WALLS]
    if unknown:
        e.fail(f"walls: {unknown[0]!r} is not one of {', '.join(WALLS)}")
    return Distortion(e.expr("when"), e.template("warning"), walls)


def _option(raw: Any, path: Path, i: int, names: frozenset[str]) -> CaptureOption:
    e = _Entry(raw, path, "capture option", i, ("source", "option", "attributes"), ("when",), names)
    return CaptureOption(
        e.text("source") or "", e.text("option") or "", e.text("attributes") or "", e.expr("when")
    )


def _weight(value: Any, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise TraceError(path, "capture: distorted_weight must be a number in [0, 1]")
    return float(value)
