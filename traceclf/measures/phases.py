"""Forward, backward and optimizer phases of the step (the ``nvtx`` patterns of
rules/kernels.yaml): their NVTX ranges projected onto the GPU, and how each phase's time splits
into busy and idle by cause.

An NVTX range is CPU time; the GPU work it launched runs later. A phase's GPU span is the first
start to the last end of the kernels, graph replays and copies launched by CUDA calls inside the
range (any thread of the process: PyTorch's autograd thread launches the backward), as for steps.
Spans of consecutive phases may overlap on the GPU (the optimizer's first kernels queue behind
the backward's last ones): each phase starts where the previous one ended, so the phases and
"outside phases" add up to the window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.nvtx_ranges import sd_ms
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import first_match_of

PHASES = ("forward", "backward", "optimizer")
OUTSIDE = "outside phases"
STATES = ("compute", "exposed_comm", "copy")  # busy = their sum (step_breakdown's states)


def labelled(w: RankWindow) -> pl.DataFrame:
    """This rank's NVTX ranges of a phase, each with its ``phase``: the first of PHASES whose
    pattern its text matches (what :func:`projected` projects, and recompute's forward and
    backward ranges: labelled once for both)."""
    nvtx, patterns = w.trace.nvtx, w.taxonomy.nvtx
    label = first_match_of(nvtx["text"], [(p, patterns[p]) for p in PHASES], None)
    return nvtx.with_columns(phase=label).filter(pl.col("phase").is_not_null())


def projected(w: RankWindow, phase_ranges: pl.DataFrame) -> pl.DataFrame:
    """GPU spans (phase, start, end) of the outermost phase ranges of this rank
    (``phase_ranges``: :func:`labelled`), unclipped and sorted by start; empty when no range
    matches a phase pattern or the CUDA API is untraced."""
    schema = {"phase": pl.String, "start": pl.Int64, "end": pl.Int64}
    if phase_ranges.is_empty() or not w.host_traced:
        return pl.DataFrame(schema=schema)
    ranges = phase_ranges.with_row_index("range_id").with_columns(pl.col("range_id").cast(pl.Int64))
    spans = w.trace.gpu_spans(ranges.select("start", "end", "range_id"), "range_id").join(
        ranges.select("range_id", "phase"), on="range_id"
    )
    return spans.select("phase", start="gpu_start", end="gpu_end").sort("start")


def partition(spans: pl.DataFrame, window: intervals.Span) -> pl.DataFrame:
    """Phase spans inside ``window``, made disjoint: each starts no earlier than the previous
    one ended (start order)."""
    inside = intervals.clip(spans, window).sort("start")
    return (
        inside.with_columns(
            start=pl.max_horizontal("start", pl.col("end").cum_max().shift(1).fill_null(0))
        )
        .filter(pl.col("end") > pl.col("start"))
        .select("phase", "start", "end")
    )


def phase_table(w: RankWindow, gaps: pl.DataFrame, spans: pl.DataFrame) -> list[dict]:
    """One row per phase present, plus the time outside any phase: ms per steady step of the
    phase, busy (compute, exposed communication, copies) and idle by cause (``gaps`` from
    :func:`traceclf.measures.host.idle_gaps`), and in how many steady steps it ran (``spans``
    from :func:`projected`)."""
    spans = partition(spans, w.window)
    if spans.is_empty():
        return []
    busy = w.layers
    # (a state is a difference of unions: exposed communication = any kernel - compute)
    states = {
        "compute": (busy.compute, None),
        "exposed_comm": (busy.compute_comm, busy.compute),
        "copy": (busy.work, busy.compute_comm),
    }
    starts, ends = spans["start"].to_numpy(), spans["end"].to_numpy()
    per_span = {
        name: outer.covered(starts, ends) - (inner.covered(starts, ends) if inner else 0)
        for name, (outer, inner) in states.items()
    }
    idle_total = {}
    for name, (lo, hi) in _idle_runs(gaps):  # (one cause's runs at a time: millions of gaps)
        per_span[name] = intervals.covered_by_runs(lo, hi, starts, ends)
        idle_total[name] = int((hi - lo).sum())
    rows = spans.with_columns(
        time=pl.col("end") - pl.col("start"), **{n: pl.Series(v) for n, v in per_span.items()}
    )
    step_starts = w.steps.steady["gpu_start"].sort().to_numpy() if w.steps.count else None
    names = list(per_span)
    table = (
        rows.with_columns(step=_step_of(rows["start"].to_numpy(), step_starts))
        .group_by("phase", "step")
        .agg(pl.col("time").sum(), *(pl.col(n).sum() for n in names))
        .group_by("phase")
        .agg(
            pl.col("time").sum(),
            *(pl.col(n).sum() for n in names),
            squares=(pl.col("time").cast(pl.Float64) ** 2).sum(),
            step=pl.col("step").n_unique(),
        )
    )
    outside = {"phase": OUTSIDE, "time": w.wall - int(table["time"].sum())}
    for name, (outer, inner) in states.items():
        total = outer.total - (inner.total if inner else 0)
        outside[name] = total - int(table[name].sum())
    for name, total in idle_total.items():
        outside[name] = total - int(table[name].sum())
    order = {p: i for i, p in enumerate(PHASES)}
    out = [
        _row(r, w.n_steps)
        for r in sorted(table.to_dicts(), key=lambda r: order.get(r["phase"], len(order)))
    ]
    if outside["time"] > 0:
        out.append(_row(outside | {"step": None, "squares": None}, w.n_steps))
    return out


def _row(r: dict, n_steps: int) -> dict:
    ms = {key: round(r[key] / 1e6 / n_steps, 4) for key in ("time", *STATES)}
    idle = {cause: round(r[f"idle_{cause}"] / 1e6 / n_steps, 4) for cause in IDLE_CAUSES}
    return {
        "phase": r["phase"],
        "ms_per_step": ms["time"],
        # (the time outside any phase has no spread of its own: null)
        "sd_ms": None if r["squares"] is None else sd_ms(r["time"], r["squares"], n_steps),
        "busy_ms": round(sum(ms[s] for s in STATES), 4),
        **{f"{s}_ms": ms[s] for s in STATES},
        "idle_ms": round(sum(idle.values()), 4),
        "idle_by_cause_ms": idle,
        "steps": r["step"],
    }


def _idle_runs(gaps: pl.DataFrame) -> Iterator[tuple[str, tuple[np.ndarray, np.ndarray]]]:
    """The idle gaps of each cause as disjoint sorted runs (start, end arrays), by name."""
    cause = gaps["cause"]
    lo, hi = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    for name in IDLE_CAUSES:
        mine = (cause == name).fill_null(False).to_numpy()
        yield f"idle_{name}", _runs(lo[mine], hi[mine])


def _runs(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [lo, hi) as disjoint sorted runs: the intervals themselves when
    they already are (idle gaps: millions, which a union would sort again), else their union."""
    if len(lo) and bool(np.all(hi > lo)) and bool(np.all(lo[1:] > hi[:-1])):
        return lo, hi
    merged = intervals.union(pl.DataFrame({"start": lo, "end": hi}))
    return merged["start"].to_numpy(), merged["end"].to_numpy()


def _step_of(starts: np.ndarray, step_starts: np.ndarray | None) -> pl.Series:
    """Index of the steady step each phase span starts in (null before the first)."""
    if step_starts is None or not len(step_starts):
        return pl.Series([None] * len(starts), dtype=pl.Int64)
    i = np.searchsorted(step_starts, starts, side="right") - 1
    return pl.Series(np.where(i >= 0, i, -1)).replace(-1, None)
