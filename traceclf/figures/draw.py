"""Figures of a report, drawn with matplotlib's non-interactive Agg backend.

Each function takes plain report data (``report.series``, the per-rank list the analysis
stores: ``step_breakdown``, ``idle_gaps``, ``gpu_metrics``) and returns a
:class:`matplotlib.figure.Figure`, so the HTML report and a notebook draw the same pictures.
A function raises ``ValueError`` when the report holds nothing for it to draw;
:func:`report_figures` only draws what the report has data for.

Colours follow the walls everywhere: memory magenta, communication teal, host orange/yellow,
compute green, idle grey.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from traceclf.figures.style import (
    MAX_RANK_PANELS,
    WALL_COLORS,
    WIDTH_IN,
    ReportFigure,
    figure_title,
    light_grid,
)
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.support.units import pct

STEP_PARTS = (  # step_breakdown key, legend label, colour
    ("compute", "compute (incl. overlapped comm)", WALL_COLORS["compute"]),
    ("exposed_comm", "exposed communication", WALL_COLORS["communication"]),
    ("copy", "copies / memsets", WALL_COLORS["memory"]),
    ("idle", "idle", WALL_COLORS["idle"]),
)
# Host causes in shades of the host wall's orange, unattributed grey. Keyed by every cause of
# IDLE_CAUSES (a cause without a style fails here, at import, not as a figure that leaves idle
# time out), in their order.
IDLE_CAUSE_LOOK = {
    "launch": ("launch-bound", "#d9650b"),
    "sync": ("after a sync", "#f5a623"),
    "input": ("input (no CUDA calls)", "#f7d154"),
    "host": ("host busy elsewhere (no CUDA calls)", "#8a4b12"),
    "graph": ("inside a CUDA-graph replay", "#b0845a"),
    "other": ("other / unattributed", WALL_COLORS["idle"]),
}
IDLE_CAUSE_STYLE = tuple((cause, *IDLE_CAUSE_LOOK[cause]) for cause in IDLE_CAUSES)
GPU_METRICS = (  # metric key (traceclf.ingest.devices.METRIC_NAMES), label, colour, line style
    ("sm_active", "SM Active", "#1b5e20", "-"),
    ("sm_issue", "SM Issue", "#66bb6a", "--"),
    ("tensor_active", "Tensor Active", "#5e35b1", "-"),
)
MAX_STEP_TICKS = 30
# Past this many steps one bar per step costs seconds per thousand steps and draws bars
# narrower than a pixel: consecutive steps are averaged into this many bars instead.
MAX_STEP_BARS = 300


def report_figures(series: Sequence[dict]) -> dict[str, Figure]:
    """Every figure that carries information for this report, by name (``FIGURES`` in
    drawing order; :func:`informative` decides which)."""
    from traceclf.figures import views

    draw = {
        "step_timeline": step_timeline,
        "step_lanes": views.step_lanes,
        "comm_overlap": comm_overlap,
        "idle_gaps": idle_gaps,
        "memory": views.memory,
        "gpu_metrics": gpu_metrics,
    }
    return {name: draw[name](series) for name in informative(series)}


FIGURES = ("step_timeline", "step_lanes", "comm_overlap", "idle_gaps", "memory", "gpu_metrics")
# Below these shares of the step a figure of that part shows a sliver: it is left out.
MIN_COMM_SHARE = 0.01
MIN_IDLE_SHARE = 0.02


def informative(series: Sequence[dict]) -> list[str]:
    """The figures worth drawing: the step timeline and one step's lanes when there are steady
    steps; communication overlap when communication takes >= MIN_COMM_SHARE of the step; idle
    gaps when the GPU idles >= MIN_IDLE_SHARE of it (or no steps were found to say); memory
    when allocations come near capacity or move in the steady state; GPU metrics when sampled."""
    from traceclf.figures import views

    steps = _has_steps(series)
    step_ns = sum(_step_total(r) for s in series for r in s.get("step_breakdown") or [])
    idle_ns = sum(r["idle"] for s in series for r in s.get("step_breakdown") or [])
    shown = {
        "step_timeline": steps,
        "step_lanes": any((s.get("step_lanes") or {}).get("lanes") for s in series),
        "comm_overlap": steps and _comm_ns(series) >= MIN_COMM_SHARE * step_ns,
        "idle_gaps": _gap_ns(series) > 0 and (not steps or idle_ns >= MIN_IDLE_SHARE * step_ns),
        "memory": views.has_memory_story(series),
        "gpu_metrics": any(s.get("gpu_metrics") for s in series),
    }
    return [name for name in FIGURES if shown[name]]


def _gap_ns(series: Sequence[dict]) -> int:
    return sum(
        sum(s["idle_gaps"].get(f"{cause}_ns") or [])
        for s in series
        if s.get("idle_gaps")
        for cause, _l, _c in IDLE_CAUSE_STYLE
    )


def _step_total(row: dict) -> int:
    return sum(row[key] for key, _l, _c in STEP_PARTS)


def step_timeline(series: Sequence[dict]) -> Figure:
    """Stacked bars per steady step and rank: compute, exposed communication, copies, idle."""
    ranks = [s for s in series if s.get("step_breakdown")][:MAX_RANK_PANELS]
    if not ranks:
        raise ValueError("no steps in this report: the step timeline needs steady steps")
    panel_in = 1.9 if len(ranks) <= 4 else 1.4  # many ranks: keep the figure on a screen
    fig = ReportFigure(figsize=(WIDTH_IN, 1.3 + panel_in * len(ranks)), layout="constrained")
    axes = fig.subplots(len(ranks), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    grouped = 1
    for ax, rank in zip(axes, ranks, strict=True):
        rows = rank["step_breakdown"]
        bars, size = _step_bars(rows)
        grouped = max(grouped, size)
        x = [b["index"] for b in bars]
        bottom = [0.0] * len(bars)
        for key, _label, color in STEP_PARTS:
            ms = [b[key] / 1e6 for b in bars]
            ax.bar(x, ms, bottom=bottom, color=color, width=0.8 * size)
            bottom = [b + v for b, v in zip(bottom, ms, strict=True)]
        if size > 1:  # the spread the averaging hides: min-max step time of each group
            ax.vlines(
                x,
                [b["min"] / 1e6 for b in bars],
                [b["max"] / 1e6 for b in bars],
                color="#333333",
                linewidth=0.6,
            )
        ax.set_ylabel(f"rank {rank['rank']}\nstep time (ms)")
        ax.set_title(_step_summary(rows), loc="right", fontsize=9, color="#555555")
        if len(x) <= MAX_STEP_TICKS:
            ax.set_xticks(x)
        else:  # one tick per step would overlap; integer ticks only
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        light_grid(ax, "y")
    label = "steady-state step (index in the trace)"
    if grouped > 1:
        label += f"; each bar: mean of {grouped} consecutive steps, line: their min–max step time"
    axes[-1].set_xlabel(label)
    figure_title(fig, "Where each steady-state step goes", _more_ranks(series, len(ranks)))
    _legend(fig, [(label, color) for _k, label, color in STEP_PARTS])
    return fig


def _step_bars(rows: Sequence[dict]) -> tuple[list[dict], int]:
    """One bar per step, or, past MAX_STEP_BARS steps, one per group of consecutive steps:
    the mean of each part, the group's middle index and its min/max step time."""
    size = -(-len(rows) // MAX_STEP_BARS)  # ceil
    if size <= 1:
        return list(rows), 1
    bars = []
    for start in range(0, len(rows), size):
        group = rows[start : start + size]
        totals = [sum(r[key] for key, _l, _c in STEP_PARTS) for r in group]
        bar = {key: sum(r[key] for r in group) / len(group) for key, _l, _c in STEP_PARTS}
        bar |= {
            "index": (group[0]["index"] + group[-1]["index"]) / 2,
            "min": min(totals),
            "max": max(totals),
        }
        bars.append(bar)
    return bars, size


def idle_gaps(series: Sequence[dict]) -> Figure:
    """GPU idle time per step by gap length (log-spaced bins), split by host-side cause."""
    ranks = [s for s in series if s.get("idle_gaps")]
    if not ranks:
        raise ValueError("no idle-gap histogram in this report")
    edges = ranks[0]["idle_gaps"]["edges_ns"]
    per_step, counts = _idle_per_step(ranks)
    used = [i for i, n in enumerate(counts) if n] or [0]
    bins = list(range(used[0], used[-1] + 1))
    total_ns = sum(sum(v) for v in per_step.values())
    unit, scale = _time_unit(total_ns)

    fig = ReportFigure(figsize=(WIDTH_IN, 4.6), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(bins)
    for cause, _label, color in IDLE_CAUSE_STYLE:
        heights = [per_step[cause][i] / scale for i in bins]
        ax.bar(
            range(len(bins)),
            heights,
            bottom=bottom,
            color=color,
            width=0.85,
            edgecolor="white",
            linewidth=0.5,
        )
        bottom = [b + v for b, v in zip(bottom, heights, strict=True)]
    for pos, i in enumerate(bins):  # how many gaps make up each bar: few long or many short
        if counts[i]:
            ax.annotate(
                _count(counts[i]),
                (pos, bottom[pos]),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                color="#555555",
            )
    ax.set_xticks(range(len(bins)), [_bin_label(edges, i) for i in bins], rotation=30, ha="right")
    ax.set_xlabel("idle gap length")
    per = "per step" if _has_steps(ranks) else "in the window (no steps found)"
    ax.set_ylabel(f"idle time {per.split(' (')[0]} ({unit})")
    ax.set_ylim(0, max(bottom) * 1.15 or 1)  # room for the count labels above the bars
    light_grid(ax, "y")
    step_ns = _mean_step_ns(ranks)
    share = f" ({pct(total_ns / step_ns)} of the step)" if step_ns else ""
    figure_title(
        fig,
        f"GPU idle gaps by length and cause: {total_ns / scale:.3g} {unit} {per}" + share,
        "numbers above bars: gaps in the bin over the "
        + ("steady state" if _has_steps(ranks) else "window")
        + (f", {len(ranks)} ranks (time is the mean per rank)" if len(ranks) > 1 else ""),
    )
    # five causes on one row would run past the figure's edges
    _legend(fig, [(label, color) for _c, label, color in IDLE_CAUSE_STYLE], ncols=3)
    return fig


def _idle_per_step(ranks: Sequence[dict]) -> tuple[dict[str, list[float]], list[int]]:
    """Idle ns per step (mean over ranks) per cause and bin, and gap counts per bin (all
    ranks). Without steps the whole window counts as one step."""
    n_bins = len(ranks[0]["idle_gaps"]["edges_ns"]) + 1
    per_step = {cause: [0.0] * n_bins for cause, _l, _c in IDLE_CAUSE_STYLE}
    counts = [0] * n_bins
    for rank in ranks:
        hist, steps = rank["idle_gaps"], max(len(rank.get("step_breakdown") or []), 1)
        for cause in per_step:
            for i in range(n_bins):
                per_step[cause][i] += hist[f"{cause}_ns"][i] / steps / len(ranks)
                counts[i] += hist[cause][i]
    return per_step, counts


def _mean_step_ns(ranks: Sequence[dict]) -> float:
    rows = [r for s in ranks for r in s.get("step_breakdown") or []]
    return sum(r[key] for r in rows for key, _l, _c in STEP_PARTS) / len(rows) if rows else 0.0


def comm_overlap(series: Sequence[dict]) -> Figure:
    """Per rank, mean ms per step of compute alone, communication hidden under compute, and
    exposed communication: how much of the communication the overlap actually hides."""
    ranks = [s for s in series if s.get("step_breakdown")]
    if not ranks:
        raise ValueError("no steps in this report: the overlap figure needs steady steps")
    parts = [_overlap_parts(s["step_breakdown"]) for s in ranks]
    labels = [str(s["rank"]) for s in ranks]
    bars = (
        ("compute alone", WALL_COLORS["compute"], None),
        ("communication hidden under compute", "#8fd3da", "//"),
        ("exposed communication", WALL_COLORS["communication"], None),
    )
    fig = ReportFigure(figsize=(WIDTH_IN, 1.9 + 0.55 * len(ranks)), layout="constrained")
    ax = fig.add_subplot()
    y = list(range(len(ranks)))
    left = [0.0] * len(ranks)
    for k, (_label, color, hatch) in enumerate(bars):
        widths = [p[k] for p in parts]
        ax.barh(
            y,
            widths,
            left=left,
            color=color,
            hatch=hatch,
            edgecolor="white",
            linewidth=0.5,
            height=0.6,
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for row, (_alone, hidden, exposed) in enumerate(parts):
        comm = hidden + exposed
        note = f"{100 * hidden / comm:.0f}% of comm hidden" if comm else "no communication"
        ax.annotate(
            note,
            (left[row], row),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    ax.set_yticks(y, labels)
    ax.set_ylabel("rank")
    ax.invert_yaxis()  # rank 0 on top, as in the step timeline
    ax.set_xlabel("time per step (ms, mean over steady steps)")
    ax.set_xlim(0, max(left) * 1.25 or 1)  # room for the note right of the longest bar
    light_grid(ax, "x")
    figure_title(fig, "Communication vs compute overlap", "idle time and copies left out")
    _legend(fig, [(label, color) for label, color, _h in bars], hatches=[h for _l, _c, h in bars])
    return fig


def gpu_metrics(series: Sequence[dict]) -> Figure:
    """SM Active, SM Issue and Tensor Active (%) over the steady-state window. The metrics
    are GPU-wide, so the first rank that has them is drawn; step starts are marked."""
    rank = next((s for s in series if s.get("gpu_metrics")), None)
    if rank is None:
        raise ValueError("no GPU metrics in this trace (capture with --gpu-metrics-devices)")
    fig = ReportFigure(figsize=(WIDTH_IN, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for name, label, color, style in GPU_METRICS:
        points = rank["gpu_metrics"].get(name)
        if points:
            ax.plot(
                [t / 1e6 for t, _v in points],
                [v for _t, v in points],
                style,
                color=color,
                label=label,
                linewidth=1.3,
            )
    steps = rank.get("step_breakdown") or []
    if steps:
        origin = steps[0]["step_start"]
        for row in steps[1:]:
            ax.axvline((row["step_start"] - origin) / 1e6, color="#cccccc", linewidth=0.8, zorder=0)
    ax.set_ylim(0, 105)
    ax.set_xlim(left=0)
    light_grid(ax, "y")
    ax.set_xlabel("time since the start of the steady state (ms)")
    ax.set_ylabel("GPU metric (%)")
    figure_title(
        fig,
        "GPU metrics over the steady state",
        "GPU-wide samples from nsys; grey lines: step starts",
    )
    fig.legend(loc="outside lower center", ncols=3, frameon=False)
    return fig


def _overlap_parts(rows: list[dict]) -> tuple[float, float, float]:
    """Mean ms per step of (compute alone, comm under compute, exposed comm). ``compute``
    in the breakdown already includes the comm that ran under it."""
    n = len(rows)
    hidden = sum(r["comm_total"] - r["exposed_comm"] for r in rows) / n / 1e6
    compute = sum(r["compute"] for r in rows) / n / 1e6
    exposed = sum(r["exposed_comm"] for r in rows) / n / 1e6
    return max(compute - hidden, 0.0), hidden, exposed


def _has_steps(series: Sequence[dict]) -> bool:
    return any(s.get("step_breakdown") for s in series)


def _comm_ns(series: Sequence[dict]) -> int:
    return sum(r["comm_total"] for s in series for r in s.get("step_breakdown") or [])


def _legend(
    fig: Figure,
    entries: list[tuple[str, str]],
    hatches: list[str | None] | None = None,
    ncols: int | None = None,
) -> None:
    """The legend under the figure: one row of ``entries``, or rows of ``ncols``."""
    hatches = hatches or [None] * len(entries)
    handles = [
        Patch(facecolor=color, edgecolor="white", hatch=hatch, label=label)
        for (label, color), hatch in zip(entries, hatches, strict=True)
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=ncols or len(handles),
        frameon=False,
        fontsize=9,
    )


def _more_ranks(series: Sequence[dict], shown: int) -> str | None:
    total = sum(1 for s in series if s.get("step_breakdown"))
    return f"first {shown} of {total} ranks" if total > shown else None


def _time_unit(ns: float) -> tuple[str, float]:
    """The unit that keeps a total readable: not 0.005 ms, not 2.88e+03 ms."""
    if ns < 1e5:
        return "µs", 1e3
    return ("ms", 1e6) if ns < 1e9 else ("s", 1e9)


def _step_summary(rows: list[dict]) -> str:
    """'mean 115 ms/step: compute 2%, exposed communication 97%, ...' for one rank."""
    total = sum(r[key] for r in rows for key, _l, _c in STEP_PARTS) or 1
    shares = ", ".join(
        f"{key.replace('_', ' ')} {pct(sum(r[key] for r in rows) / total)}"
        for key, _l, _c in STEP_PARTS
    )
    return f"mean {total / len(rows) / 1e6:.3g} ms/step: {shares}"


def _bin_label(edges: Sequence[float], i: int) -> str:
    if i == 0:
        return "< " + " ".join(_duration(edges[0]))
    if i == len(edges):
        return "≥ " + " ".join(_duration(edges[-1]))
    (lo, lo_unit), (hi, hi_unit) = _duration(edges[i - 1]), _duration(edges[i])
    return f"{lo}–{hi} {hi_unit}" if lo_unit == hi_unit else f"{lo} {lo_unit}–{hi} {hi_unit}"


def _duration(ns: float) -> tuple[str, str]:
    """(number, unit) with at most three digits: 3.2 µs, 316 µs, 1 ms."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale * 0.9999:  # the edges are floats: 999.99… ns is 1 µs
            v = ns / scale
            return (f"{v:.2g}" if v < 10 else f"{v:.0f}"), unit
    return f"{ns:.0f}", "ns"


def _count(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)
