"""What every format of ``traceclf compare`` shows about the runs themselves, as strings: the
step-time table, the bound line, each run's line, and one row per candidate against a
baseline. Names come from traces and reports: each renderer escapes these strings."""

from __future__ import annotations

from pathlib import Path

from traceclf.report.comparison import Comparison, MultiComparison, Run
from traceclf.support.units import counted, fmt_ms, pct, signed_pct

MANY_COLUMNS = ("candidate", "step before", "step after", "change", "verdict", "bound")


def many_rows(result: MultiComparison) -> list[tuple[str, ...]]:
    return [
        (
            Path(c.after.source).name,
            fmt_ms(c.before.step_mean_ms),
            fmt_ms(c.after.step_mean_ms),
            signed_pct(c.step_change_frac),
            c.verdict,
            f"{bound(c.before)} → {bound(c.after)}" if c.bound_changed else bound(c.after),
        )
        for c in result.comparisons
    ]


def step_rows(result: Comparison) -> list[tuple[str, str, str, str]]:
    b, a = result.before, result.after
    noise = f"±{fmt_ms(result.noise_ms)}" if result.noise_ms is not None else "–"
    noise_frac = f" (±{result.noise_frac:.1%})" if result.noise_frac is not None else ""
    return [
        (
            "mean",
            fmt_ms(b.step_mean_ms),
            fmt_ms(a.step_mean_ms),
            signed_pct(result.step_change_frac),
        ),
        (
            "median",
            fmt_ms(b.step_median_ms),
            fmt_ms(a.step_median_ms),
            signed_pct(result.median_change_frac),
        ),
        ("spread (CV)", pct(b.step_cv), pct(a.step_cv), ""),
        ("steady steps", str(b.steps_used), str(a.steps_used), ""),
        ("noise band", "", "", noise + noise_frac),
    ]


def moved_title(result: Comparison) -> str:
    """The heading of the measures that moved: of an inconclusive comparison they say how the
    runs differ, not what a change did."""
    if result.conclusive:
        return "Measures that moved"
    return "Measures that differ (inconclusive comparison: how the runs differ, not a change)"


def bound_line(result: Comparison) -> str:
    """'Bound unchanged: compute (confidence 0.79 → 0.52: step spread ×0.99 → ×0.85).'"""
    b, a = result.before, result.after
    why = _confidence_moves(b, a)
    confidence = f"confidence {_conf(b)} → {_conf(a)}{f': {why}' if why else ''}"
    if result.bound_changed:
        return f"Bound changed: {bound(b)} → {bound(a)} ({confidence})."
    return f"Bound unchanged: {bound(a)} ({confidence})."


# The factors of a confidence (classification.confidence_basis.factors) in words
FACTOR_WORDS = {
    "anchor": "step anchor",
    "steps": "steady steps",
    "spread": "step spread",
    "second_anchor": "second anchor",
    "graph_replays": "graph-level replays",
    "capture_distortion": "capture distortion",
}


def _confidence_moves(b: Run, a: Run) -> str:
    """What moved the confidence between the runs, where it moved: the bound's share of the
    step ('explained') and each factor of the window's reliability whose value differs at two
    decimals (a factor one run lacks counts as 1)."""
    if _conf(b) == _conf(a):
        return ""
    moves = []
    shares = (b.confidence_explained, a.confidence_explained)
    if None not in shares and f"{shares[0]:.2f}" != f"{shares[1]:.2f}":
        moves.append(f"explained {shares[0]:.2f} → {shares[1]:.2f}")
    before, after = b.confidence_factors, a.confidence_factors
    for key in dict.fromkeys([*before, *after]):
        x, y = before.get(key, 1.0), after.get(key, 1.0)
        if f"{x:.2f}" != f"{y:.2f}":
            moves.append(f"{FACTOR_WORDS.get(key, key)} ×{x:.2f} → ×{y:.2f}")
    return ", ".join(moves)


def bound(r: Run) -> str:
    return r.bound or "no verdict (abstained)"


def run_line(r: Run) -> str:
    return (
        f"{f'{r.bound}-bound' if r.bound else 'no verdict'}, "
        f"{counted(r.ranks, 'rank')}, "
        f"{', '.join(r.gpus) or 'unknown GPU'}, steps from {r.step_source or 'none'}"
    )


def _conf(r: Run) -> str:
    return f"{r.confidence:.2f}" if r.confidence is not None else "–"
