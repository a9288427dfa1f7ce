"""Gain ceilings of the proposed fixes (NVIDIA's method, "Estimate gain without double
counting"; docs/judgement.md, "Gain ceilings").

A fix's ``recovers`` entry in rules/fixes.yaml says what it can win back at most and on what
assumption: R = ``frac`` × T of a T ms step, taken from interval classes ``from``, the step
no shorter than ``floor_ms`` after the fix, so the step after is max(T - R, floor) and the
throughput gain at most T / (T - R) - 1. Each ceiling states its assumption (``assumes``) and
the measured numbers that bound it (``bound_by``). Where nothing in the trace bounds how fast
the fixed work would run (``multiplier`` false: no message sizes for an all-to-all), it says
"up to R ms" and gives no multiplier. A change that makes each step do more work (unit
``sample``) or adds GPUs (unit ``gpu``) is not a shorter step: its gain is counted in that
unit and never added to the others.

Ceilings add only over disjoint classes: two classes are disjoint when neither's path is a
prefix of the other's (``compute-absent/blocking/comm`` and ``compute-absent/launch-starved``
are; ``compute-absent`` and ``compute-absent/launch-starved`` are not). Fixes that draw on one
class list each other in ``shares_with``: the same time, not additive."""

from __future__ import annotations

from typing import Any

from traceclf.rulebook.entries import Fix


def ceiling(fix: Fix, env: dict[str, Any]) -> dict | None:
    """The fix's ceiling (docs/report-contract.md, ``fixes[].ceiling``); null numbers when the
    measures it needs are unknown, None when the fix declares nothing it recovers."""
    r = fix.recovers
    if r is None:
        return None
    step = env.get("step_time_ms")
    known_step = _number(step) and step > 0
    frac = r.frac.value(env) if r.frac is not None else None
    recoverable = min(max(float(frac), 0.0), 1.0) * step if _number(frac) and known_step else None
    floor = r.floor_ms.value(env) if r.floor_ms is not None else None
    floor = float(floor) if _number(floor) and floor > 0 else None
    if recoverable is not None and floor is not None and r.unit != "sample":
        recoverable = max(step - max(step - recoverable, floor), 0.0)
    stated = r.multiplier is None or r.multiplier.holds(env)
    if r.unit == "step":
        gain = _gain(step, recoverable) if stated else None
    else:
        times = r.gain.value(env) if stated and r.gain is not None else None
        gain = round(float(times) - 1, 4) if _number(times) and times > 0 else None
    after = floor if r.unit == "sample" else step - recoverable if recoverable is not None else None
    return {
        "recoverable_ms": _round(recoverable) if r.unit != "sample" else None,
        "throughput_gain": gain,
        "unit": r.unit,
        "from": " + ".join(r.classes),
        "assumes": r.assumes.render(env),
        # (a null value bounds nothing)
        "bound_by": {n: _fact(env[n]) for n in r.bound_by if env.get(n) is not None},
        "floor_ms": _round(floor),
        "step_after_ms": _round(after),
        "shares_with": [],
    }


def mark_shared(fixes: list[dict]) -> None:
    """Fill each ceiling's ``shares_with``: the other fixes whose time comes from an interval
    class that is not disjoint from one of its own (their ceilings do not add up)."""
    blocks = [(f["id"], _classes(f["ceiling"])) for f in fixes if f.get("ceiling")]
    for fix in fixes:
        if fix.get("ceiling"):
            mine = _classes(fix["ceiling"])
            fix["ceiling"]["shares_with"] = [
                other
                for other, theirs in blocks
                if other != fix["id"] and not all(_disjoint(a, b) for a in mine for b in theirs)
            ]


def combined(fixes: list[dict], step_ms: float | None) -> dict:
    """The most the proposed fixes can recover together without counting an interval twice:
    only ceilings per step with a number; classes taken largest first, each only if disjoint
    from every class taken (so per class only the largest counts); the step after them no
    shorter than the highest floor of those taken. A fix drawing on several classes counts as
    one block. No multiplier when one of those taken has none (nothing bounds it)."""
    blocks = [
        (c["recoverable_ms"], _classes(c), fix["id"], c)
        for fix in fixes
        if (c := fix.get("ceiling") or {}).get("unit", "step") == "step"
        and c.get("recoverable_ms") is not None
    ]
    taken: list[tuple[float, tuple[str, ...], str, dict]] = []
    for block in sorted(blocks, key=lambda b: -b[0]):
        if all(_disjoint(a, b) for a in block[1] for t in taken for b in t[1]):
            taken.append(block)
    total = sum(b[0] for b in taken)
    floors = [b[3]["floor_ms"] for b in taken if b[3].get("floor_ms") is not None]
    if taken and floors and _number(step_ms):
        total = max(step_ms - max(step_ms - total, max(floors)), 0.0)
    stated = all(b[3].get("throughput_gain") is not None for b in taken)
    return {
        "recoverable_ms": _round(total) if taken else None,
        "throughput_gain": _gain(step_ms, total) if taken and stated else None,
        "from": [c for b in taken for c in b[1]],
        "fixes": [b[2] for b in taken],
        "floor_ms": _round(max(floors)) if floors else None,
    }


def order_key(fix: dict) -> float:
    """Larger ceilings first within a wall; fixes without one (or counted in samples) last."""
    ms = (fix.get("ceiling") or {}).get("recoverable_ms")
    return -ms if ms is not None else float("inf")


def _classes(c: dict) -> tuple[str, ...]:
    return tuple(c["from"].split(" + "))


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


def _round(v: float | None) -> float | None:
    """ms to the µs, and a ceiling under 1 ms to 4 significant digits: the combined ceiling
    sums them, and 0.038 for 0.0385 ms gave ×3.63 beside the fix's own ×3.7."""
    if v is None:
        return None
    return float(f"{v:.4g}") if abs(v) < 1 else round(v, 3)


def _fact(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
