"""Gain ceilings of the proposed fixes (NVIDIA's method, "Estimate gain without double
counting"): a fix that recovers R ms of a T ms step lifts throughput by at most
T / (T - R) - 1. R comes from the fix's ``recovers`` entry in rules/fixes.yaml: a share of the
step (an expression over the measures) and the interval class it is taken from. Ceilings are
added only over disjoint classes: two classes are disjoint when neither's path is a prefix of
the other's (``compute-absent/blocking/comm`` and ``compute-absent/launch-starved`` are;
``compute-absent`` and ``compute-absent/launch-starved`` are not)."""

from __future__ import annotations

from typing import Any

from traceclf.rulebook.entries import Fix


def ceiling(fix: Fix, env: dict[str, Any]) -> dict | None:
    """``{"recoverable_ms", "throughput_gain", "from"}`` of one fix; null numbers when the
    measures it needs are unknown, None when the fix declares nothing it recovers."""
    if fix.recovers is None:
        return None
    step = env.get("step_time_ms")
    frac = fix.recovers.frac.value(env)
    recoverable = None
    if _number(frac) and _number(step) and step > 0:
        recoverable = min(max(float(frac), 0.0), 1.0) * step
    return {
        "recoverable_ms": round(recoverable, 3) if recoverable is not None else None,
        "throughput_gain": _gain(step, recoverable),
        "from": " + ".join(fix.recovers.classes),
    }


def combined(fixes: list[dict], step_ms: float | None) -> dict:
    """The most the proposed fixes can recover together without counting an interval twice:
    per interval class the largest R, then classes taken largest first, each only if disjoint
    from every class taken. A fix drawing on several classes counts as one block."""
    blocks: list[tuple[float, tuple[str, ...], str]] = []
    for fix in fixes:
        c = fix.get("ceiling") or {}
        if c.get("recoverable_ms") is not None:
            blocks.append((c["recoverable_ms"], tuple(c["from"].split(" + ")), fix["id"]))
    taken: list[tuple[float, tuple[str, ...], str]] = []
    for block in sorted(blocks, key=lambda b: -b[0]):
        if all(_disjoint(a, b) for a in block[1] for t in taken for b in t[1]):
            taken.append(block)
    total = sum(b[0] for b in taken)
    return {
        "recoverable_ms": round(total, 3) if taken else None,
        "throughput_gain": _gain(step_ms, total) if taken else None,
        "from": [c for b in taken for c in b[1]],
        "fixes": [b[2] for b in taken],
    }


def order_key(fix: dict) -> float:
    """Larger ceilings first within a wall; fixes without one last."""
    ms = (fix.get("ceiling") or {}).get("recoverable_ms")
    return -ms if ms is not None else float("inf")


def _disjoint(a: str, b: str) -> bool:
    pa, pb = a.strip("/").split("/"), b.strip("/").split("/")
    n = min(len(pa), len(pb))
    return pa[:n] != pb[:n]


def _gain(step: Any, recoverable: float | None) -> float | None:
    if recoverable is None or not _number(step) or step <= 0:
        return None
    if recoverable >= step:
        return None  # the whole step: no finite ceiling
    return round(step / (step - recoverable) - 1, 4)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
