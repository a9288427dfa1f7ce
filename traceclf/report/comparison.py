"""A comparison of runs as data (``traceclf compare``; made by :mod:`traceclf.compare`): each
side's step statistics, the verdict with its noise band, the measures that moved and why the
runs may not be comparable. Renderers read these objects (traceclf/render/compared.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from traceclf.report.breakdown import Breakdown, comparison_tables
from traceclf.support.pandas_frames import to_pandas
from traceclf.support.units import fmt_bytes, fmt_ms, fmt_us, pct, signed_pct


@dataclass
class Run:
    """One side of a comparison: where it came from and its step statistics."""

    source: str
    bound: str | None  # None: traceclf abstained on this run
    confidence: float | None
    step_mean_ms: float | None
    step_median_ms: float | None
    step_cv: float | None
    steps_used: int
    step_source: str
    ranks: int
    gpus: list[str]
    report_version: int | None = None
    abstain_reason: str | None = None
    graph_tracing: str | None = None  # "graph" | "node" | None (no CUDA graphs)
    # what the confidence is made of (classification.confidence_basis): the bound's share of
    # the step and the factors of the window's reliability
    confidence_explained: float | None = None
    confidence_factors: dict[str, float] = field(default_factory=dict)

    @property
    def standard_error_ms(self) -> float | None:
        """The standard error of the mean step time; None when it cannot be known: fewer than
        2 steps, or a CV no step times can have (negative, or above sqrt(n): n non-negative
        times spread at most that much), as a damaged or edited report holds. Such a CV
        loses the noise band whatever its size (infinite or 1e300 alike)."""
        n, cv = self.steps_used, self.step_cv
        if self.step_mean_ms is None or cv is None or n < 2 or not 0 <= cv <= math.sqrt(n):
            return None
        return cv * self.step_mean_ms / math.sqrt(n)


@dataclass
class MeasureChange:
    key: str
    label: str
    unit: str
    before: float | None
    after: float | None
    change: float | None  # points for fractions, relative for the rest; None: from zero
    material: bool

    def cells(self) -> tuple[str, str, str, str]:
        """The row every format shows: ('exposed communication', '97%', '12%', '-85.0 pp')."""
        return (self.label, self.value(self.before), self.value(self.after), self.delta())

    def describe(self) -> str:
        """'exposed communication 97% → 12% (-85.0 pp)' (docs/api.md)."""
        label, before, after, delta = self.cells()
        return f"{label} {before} → {after} ({delta})"

    def value(self, v: float | None) -> str:
        if v is None:
            return "–"
        if self.unit == "frac":
            return pct(v)
        if self.unit == "bytes":
            return fmt_bytes(v)
        if self.unit == "us":
            return fmt_us(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    def delta(self) -> str:
        if self.change is None:
            return "new" if self.after else "gone"
        if self.unit == "frac":
            return f"{100 * self.change:+.1f} pp"
        ratio = 1 + self.change
        if ratio >= 10:  # +575300% reads worse than ×5754
            return f"×{_factor(ratio)}"
        if 0 < ratio <= 0.1:
            return f"÷{_factor(1 / ratio)}"
        return f"{100 * self.change:+.0f}%"


@dataclass
class Comparison:
    before: Run
    after: Run
    threshold: float
    verdict: str  # "regression" | "improvement" | "no significant change" | "inconclusive"
    summary: str
    step_change_ms: float | None
    step_change_frac: float | None
    median_change_frac: float | None
    noise_ms: float | None
    bound_changed: bool
    measures: list[MeasureChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why the runs may not be comparable
    # What explains the result besides the measures: applied fixes and proposals that changed.
    explanations: list[str] = field(default_factory=list)
    # What changed inside the step: kernels, phases, idle, communication, reconciliation
    breakdown: Breakdown = field(default_factory=Breakdown)

    @property
    def regression(self) -> bool:
        return self.verdict == "regression"

    @property
    def conclusive(self) -> bool:
        """False when the comparison cannot be made (the CLI exits 3; ``summary`` says why)."""
        return self.verdict != "inconclusive"

    @property
    def comparable(self) -> bool:
        return not self.notes

    @property
    def moved(self) -> list[MeasureChange]:
        return [m for m in self.measures if m.material]

    @property
    def tracing_changed(self) -> bool:
        b, a = self.before.graph_tracing, self.after.graph_tracing
        return b is not None and a is not None and b != a

    @property
    def noise_frac(self) -> float | None:
        if self.noise_ms is None or not self.before.step_mean_ms:
            return None
        return self.noise_ms / self.before.step_mean_ms

    def to_dict(self) -> dict:
        data = asdict(self)
        del data["breakdown"]
        data |= {
            "regression": self.regression,
            "comparable": self.comparable,
            "conclusive": self.conclusive,
            "noise_frac": self.noise_frac,
        }
        return data | self.breakdown.to_dict()

    def tables(self) -> dict:
        """The comparison as polars frames by name: ``measures`` (every measure compared),
        ``kernels``, ``phases``, ``idle``, ``communication`` and ``reconciliation``."""
        return comparison_tables([asdict(m) for m in self.measures], self.breakdown)

    def __repr__(self) -> str:
        """One line (a notebook cell shows this, not every kernel)."""
        change = (
            f" ({signed_pct(self.step_change_frac)})" if self.step_change_frac is not None else ""
        )
        return (
            f"<Comparison {Path(self.before.source).name} → {Path(self.after.source).name}: "
            f"{self.verdict}, step {fmt_ms(self.before.step_mean_ms)} → "
            f"{fmt_ms(self.after.step_mean_ms)}{change}; {len(self.breakdown.kernels)} kernels, "
            f"{len(self.moved)} measures moved>"
        )

    def to_pandas(self, table: str = "kernels"):
        """One of :meth:`tables` as a pandas DataFrame (``pip install 'traceclf[pandas]'``)."""
        return to_pandas(self.tables(), table)


@dataclass
class MultiComparison:
    """A baseline against several candidates: one :class:`Comparison` each."""

    baseline: str
    comparisons: list[Comparison]

    @property
    def regression(self) -> bool:
        return any(c.regression for c in self.comparisons)

    @property
    def conclusive(self) -> bool:
        return all(c.conclusive for c in self.comparisons)

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline,
            "regression": self.regression,
            "conclusive": self.conclusive,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


def _factor(ratio: float) -> str:
    return f"{ratio:,.0f}" if ratio >= 100 else f"{ratio:.3g}"
