"""The verdict's title and headline: the bound, what it takes, and how sure that is, in one
figure with its factors (docs/judgement.md, "Confidence"), or why traceclf abstained."""

from __future__ import annotations

import math

from traceclf.report.contract import Report
from traceclf.support.units import pct

CONFIDENCE_WORDS = ((0.75, "high"), (0.5, "medium"), (0.0, "low"))


def verdict_title(report: Report) -> str:
    """'COMPUTE-bound' or 'No verdict' (traceclf abstained)."""
    return "No verdict" if report.abstained else f"{report.bound.upper()}-bound"


def verdict_line(report: Report) -> str:
    """The headline under the title: what the bound takes and how sure that is, in one figure
    with its factors (docs/judgement.md, "Confidence"), or why traceclf abstained."""
    cls = report.classification
    if report.abstained:
        return f"traceclf abstains: {cls.get('abstain_reason') or 'the trace cannot support a verdict'}"
    confidence = cls.get("confidence")
    word = next((w for floor, w in CONFIDENCE_WORDS if (confidence or 0) >= floor), "low")
    basis = cls.get("confidence_basis") or {}
    explained, reliability = basis.get("explained", 0), basis.get("reliability", 0)
    factors = [v for v in (basis.get("factors") or {}).values() if v < 1]
    # as many decimals as the products printed need to hold (0.79 = 1.00 × 0.80 does not)
    d = max(_places(confidence or 0, [explained, reliability]), _places(reliability, factors))
    why = (
        f" = {explained:.{d}f} of the step explained × "
        f"{reliability:.{d}f} window reliability{_factors(report, d)}"
        if basis
        else ""
    )
    headline = cls.get("headline") or ""
    conf = f"confidence {word}: {confidence:.{d}f}{why}" if confidence is not None else ""
    return "; ".join(p for p in (headline, conf) if p)


def _places(total: float, factors: list[float]) -> int:
    """Decimals (2 to 4) at which the rounded ``factors`` multiply to the rounded ``total``."""
    for d in (2, 3):
        if round(math.prod(round(f, d) for f in factors), d) == round(total, d):
            return d
    return 4


def _factors(report: Report, d: int = 2) -> str:
    """The factors that lower the window's reliability, in words: ' (recurring-kernel steps
    ×0.80, spread 7.0% ×0.93)', or '' when none does (``d`` decimals)."""
    basis = report.classification.get("confidence_basis") or {}
    factors = basis.get("factors") or {}
    steps = report.steps or {}
    words = {
        "anchor": f"steps from {ANCHOR_WORDS.get(steps.get('source'), steps.get('source'))}",
        "steps": f"{steps.get('used', 0)} steady steps",
        "spread": f"step spread {pct(steps.get('cv'))}",
        "second_anchor": "a second anchor disagrees",
        "graph_replays": "kernels hidden inside graph-level traced replays",
        "capture_distortion": "the capture may have changed the verdict",
    }
    parts = [f"{words.get(k, k)} ×{v:.{d}f}" for k, v in factors.items() if v < 1]
    return f" ({', '.join(parts)})" if parts else ""


ANCHOR_WORDS = {
    "nvtx": "NVTX ranges",
    "graph": "graph launches",
    "pattern": "a recurring kernel",
    "mixed": "different anchors per rank",
    "none": "nowhere (the whole capture)",
}
