"""What every format says of a gain ceiling (docs/judgement.md, "Gain ceilings"): how much it
wins back and in which unit, the assumption, the measured numbers that bound it, and the
fixes it shares its time with; the combined ceiling of all fixes; and the premises of a fix
that the capture contradicts. Plain strings: the renderers lay them out."""

from __future__ import annotations

from traceclf.report.contract import Report
from traceclf.support.units import fmt_ms, gain

UNIT_WORDS = {"sample": "samples per second", "gpu": "throughput per GPU"}


def ceiling_rows(fix: dict) -> list[tuple[str, str]]:
    """(label, text) rows of a fix's ceiling: "At most", "Assumes", "Bounded by", and "Shares"
    when another proposed fix draws on the same time."""
    c = fix.get("ceiling") or {}
    if not c:
        return []
    rows = [("At most", _at_most(c))]
    if c.get("assumes"):
        rows.append(("Assumes", c["assumes"]))
    if c.get("bound_by"):
        rows.append(("Bounded by", ", ".join(f"{k} {_value(v)}" for k, v in c["bound_by"].items())))
    if c.get("shares_with"):
        rows.append(
            (
                "Shares",
                f"the same time as {', '.join(c['shares_with'])} ({c.get('from')}): not additive",
            )
        )
    return rows


def _at_most(c: dict) -> str:
    unit = c.get("unit", "step")
    ms, times = c.get("recoverable_ms"), c.get("throughput_gain")
    where = f"from {c.get('from') or '–'}"
    if unit == "sample":
        if times is None:
            return f"unknown ({where})"
        return (
            f"{gain(times)} {UNIT_WORDS[unit]} (the step does not get shorter: "
            f"{fmt_ms(c.get('step_after_ms'))} or more); not added to the others"
        )
    if ms is None:
        return f"unknown: a measure it needs is missing ({where})"
    if unit == "gpu":
        per_gpu = "no gain" if times is not None and times <= 0 else gain(times)
        return (
            f"{fmt_ms(ms)} per step of one replica back, on more GPUs: {per_gpu} "
            f"{UNIT_WORDS[unit]} ({where}); not added to the others"
        )
    if times is None:
        return f"up to {fmt_ms(ms)} per step, no throughput figure ({where}; see the assumption)"
    binds = _floor_binds(c.get("floor_ms"), c.get("step_after_ms"))
    floor = f", the step no shorter than {fmt_ms(c['floor_ms'])}" if binds else ""
    return (
        f"{fmt_ms(ms)} per step back, throughput {gain(times)} (ceiling, not a forecast; "
        f"{where}{floor})"
    )


def combined_row(report: Report) -> tuple[str, str] | None:
    """The "Ceiling, all fixes" row: ceilings per step over disjoint classes only."""
    together = getattr(report, "combined_ceiling", None) or {}
    ms = together.get("recoverable_ms")
    if ms is None:
        return None
    classes = ", ".join(together.get("from") or [])
    step = report.metrics.get("step_time_ms")
    after = step - ms if isinstance(step, (int, float)) else None
    floor = (
        f"; the step no shorter than {fmt_ms(together['floor_ms'])}"
        if _floor_binds(together.get("floor_ms"), after)
        else ""
    )
    if together.get("throughput_gain") is None:
        head = f"up to {fmt_ms(ms)} per step back, no throughput figure"
    else:  # ("back": time saved, as each fix's line says, not the step it would leave)
        head = f"{fmt_ms(ms)} per step back, throughput {gain(together['throughput_gain'])} at most"
    return (
        "Ceiling, all fixes",
        f"{head} ({', '.join(together.get('fixes') or [])}; disjoint classes only: "
        f"{classes}{floor}; samples-per-second and per-GPU ceilings not added)",
    )


def _floor_binds(floor_ms: float | None, after_ms: float | None) -> bool:
    """Whether the floor is what the ceiling stopped at: a floor far below what the step
    would be after the fixes (0.3 ms of input work beside a 21 ms step) says nothing there;
    the fix's assumption still states it. (Both numbers are rounded: a µs of slack.)"""
    return floor_ms is not None and after_ms is not None and after_ms <= floor_ms + 0.001


def contradicted_lines(fix: dict) -> list[str]:
    """One sentence per premise the capture contradicts."""
    return [
        f"{p['premise']} The trace shows otherwise: {p['trace_shows']}."
        for p in fix.get("contradicted_premises") or []
    ]


def _value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)
