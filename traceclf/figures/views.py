"""Figures tied to the timeline: one representative steady-state step per rank as lanes of GPU
work and NVTX phases, and device memory over the capture. Same conventions as :mod:`.draw`
(plain report data in, a matplotlib Figure out, ValueError when there is nothing to draw)."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from traceclf.figures.style import (
    MAX_RANK_PANELS,
    WALL_COLORS,
    WIDTH_IN,
    ReportFigure,
    figure_title,
    light_grid,
)

LANES = (  # step_lanes key, label, colour
    ("compute", "compute (kernels, graph replays)", WALL_COLORS["compute"]),
    ("communication", "communication", WALL_COLORS["communication"]),
    ("copies", "copies / memsets", WALL_COLORS["memory"]),
    ("forward", "NVTX forward (GPU work it launched)", "#4c72b0"),
    ("backward", "NVTX backward (GPU work it launched)", "#8172b2"),
    ("optimizer", "NVTX optimizer (GPU work it launched)", "#937860"),
)
# memory figure: drawn when the capture comes near the GPU's capacity, or when allocations
# move inside the steady state; a flat line far below capacity says nothing
MEMORY_NEAR_CAPACITY = 0.25
MEMORY_SWING = 0.05


def step_lanes(series: Sequence[dict]) -> Figure:
    """Per rank, the steady step nearest the median step time as lanes: compute,
    communication, copies, and the GPU span of each NVTX phase found."""
    ranks = [s for s in series if (s.get("step_lanes") or {}).get("lanes")][:MAX_RANK_PANELS]
    if not ranks:
        raise ValueError("no representative step in this report: the lanes need steady steps")
    lanes = [
        (key, label, color)
        for key, label, color in LANES
        if any(key in s["step_lanes"]["lanes"] for s in ranks)
    ]
    fig = ReportFigure(
        figsize=(WIDTH_IN, 1.2 + (0.35 * len(lanes) + 0.6) * len(ranks)), layout="constrained"
    )
    axes = fig.subplots(len(ranks), 1, squeeze=False)[:, 0]
    for ax, rank in zip(axes, ranks, strict=True):
        view = rank["step_lanes"]
        for row, (key, _label, color) in enumerate(lanes):
            spans = view["lanes"].get(key) or []
            # a merged stretch of short kernels is drawn as pale as it is idle
            ax.broken_barh(
                [(s / 1e6, max(e - s, 1) / 1e6) for s, e, _b in spans],
                (row - 0.38, 0.76),
                facecolors=[to_rgba(color, _occupancy(s, e, b)) for s, e, b in spans],
                linewidth=0,
            )
        ax.set_yticks(range(len(lanes)), [k for k, _l, _c in lanes], fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # compute on top
        ax.set_xlim(0, (view["end_ns"] - view["start_ns"]) / 1e6)
        ax.set_ylabel(f"rank {rank['rank']}")
        ax.set_title(
            f"step {view['index']}: {(view['end_ns'] - view['start_ns']) / 1e6:.3g} ms (median "
            f"{view['median_ns'] / 1e6:.3g} ms), from t = {view['start_ns'] / 1e9:.3f} s",
            loc="left",
            fontsize=9,
            color="#555555",
        )
        light_grid(ax, "x")
    axes[-1].set_xlabel("time since the step's start on the GPU (ms); paler = partly idle")
    fig.suptitle(
        "One steady-state step per rank (the one nearest the median step time)",
        fontsize=13,
        fontweight="bold",
    )
    fig.legend(
        handles=[Patch(facecolor=c, label=label) for _k, label, c in lanes],
        loc="outside lower center",
        ncols=2,
        frameon=False,
        fontsize=9,
    )
    return fig


def _occupancy(start: int, end: int, busy: int) -> float:
    return min(max(busy / max(end - start, 1), 0.08), 1.0)


def has_memory_story(series: Sequence[dict]) -> bool:
    """Whether a memory figure says something: allocations come near the GPU's capacity, or
    move by a noticeable share of their peak inside the steady state."""
    for s in series:
        memory = s.get("memory") or {}
        points = memory.get("points") or []
        if not points:
            continue
        peak = max(v for _t, v in points)
        capacity = memory.get("capacity_bytes")
        if capacity and peak >= MEMORY_NEAR_CAPACITY * capacity:
            return True
        lo, hi = (memory.get("window_ns") or [0, 0])[:2]
        inside = [v for t, v in points if lo <= t <= hi]
        if peak and inside and max(inside) - min(inside) >= MEMORY_SWING * peak:
            return True
    return False


def memory(series: Sequence[dict]) -> Figure:
    """Device memory allocated over the capture per rank (from CUDA memory events), the GPU's
    capacity and the steady-state window shaded."""
    ranks = [s for s in series if (s.get("memory") or {}).get("points")][:MAX_RANK_PANELS]
    if not ranks:
        raise ValueError("no memory events in this trace (CUDA_GPU_MEMORY_USAGE_EVENTS)")
    fig = ReportFigure(figsize=(WIDTH_IN, 4.2), layout="constrained")
    ax = fig.add_subplot()
    drawn: list[list] = []
    for s in ranks:
        points = s["memory"]["points"]
        if points in drawn:  # ranks of one process group share the same events
            continue
        drawn.append(points)
        ax.step(
            [t / 1e9 for t, _v in points],
            [v / 1e9 for _t, v in points],
            where="post",
            linewidth=1.4,
            label=f"rank {s['rank']}",
        )
    capacity = next((s["memory"].get("capacity_bytes") for s in ranks), None)
    if capacity:
        ax.axhline(capacity / 1e9, color="#c62828", linestyle="--", linewidth=1, label="capacity")
    window = ranks[0]["memory"].get("window_ns")
    if window and window[1] > window[0]:
        ax.axvspan(
            window[0] / 1e9, window[1] / 1e9, color="#e0e0e0", zorder=0, label="steady state"
        )
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time in the capture (s, as nsys shows it)")
    ax.set_ylabel("allocated device memory (GB)")
    light_grid(ax, "y")
    figure_title(
        fig,
        "Device memory over the capture",
        "allocations minus frees since the first memory event (caching-allocator reservations)",
    )
    fig.legend(loc="outside lower center", ncols=min(len(drawn) + 2, 5), frameon=False, fontsize=9)
    return fig
