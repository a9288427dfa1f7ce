"""The step change of a comparison as a waterfall: the baseline's mean step, each part's change
(the kernels that moved most, the other kernels, idle, and what is left unexplained) as a bar
from where the previous one ended, and the candidate's mean step. Takes plain numbers (the
reconciliation of :mod:`traceclf.compare.parts`), so that any renderer draws the same."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from traceclf.figures.style import WALL_COLORS, WIDTH_IN, ReportFigure, figure_title, light_grid
from traceclf.support.escape import visible

SLOWER, FASTER = "#c62828", WALL_COLORS["compute"]  # a part that adds time, one that saves it
TOTAL = "#5c6bc0"


def step_waterfall(before_ms: float, parts: Sequence[tuple[str, float]], after_ms: float) -> Figure:
    """Bars: ``before_ms``, then each ``(label, change)`` of ``parts`` (ms per step, adding up
    to ``after_ms - before_ms``), then ``after_ms``. ``ValueError`` without parts."""
    if not parts:
        raise ValueError("no parts of a step change to draw")
    # (kernel names come from traces: control characters written out, "$" never mathtext)
    labels = ["before", *(visible(label) for label, _ in parts), "after"]
    fig = ReportFigure(figsize=(WIDTH_IN, 0.45 * len(labels) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    level = before_ms
    y = list(range(len(labels)))[::-1]  # top to bottom, in reading order
    ax.barh(y[0], before_ms, color=TOTAL)
    for i, (_, change) in enumerate(parts, start=1):
        left = min(level, level + change)
        ax.barh(y[i], abs(change), left=left, color=SLOWER if change > 0 else FASTER)
        ax.annotate(
            f"{change:+.3g} ms",
            (max(level, level + change), y[i]),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
        level += change
    ax.barh(y[-1], after_ms, color=TOTAL)
    for i, value in ((0, before_ms), (len(labels) - 1, after_ms)):
        ax.annotate(
            f"{value:.3g} ms",
            (value, y[i]),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(y, labels, fontsize=9, parse_math=False)
    ax.set_xlabel("ms per step (mean of the steady steps)")
    light_grid(ax, "x")
    ax.margins(x=0.15)
    figure_title(fig, "Where the step change comes from")
    return fig
