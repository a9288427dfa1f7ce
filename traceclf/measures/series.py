"""The small series the report's figures are drawn from, computed per rank while its trace is
loaded (the report keeps them in ``series``): the per-step breakdown, the idle-gap histogram
and the GPU metrics over the window."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.compute import METRICS_OF_INTEREST
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.window import RankWindow

GAP_BINS_NS = [1_000 * 10 ** (i / 2) for i in range(15)]  # 1 µs .. 10 s, half-decade steps


def step_breakdown(w: RankWindow) -> list[dict]:
    """Per steady step: ns of compute, exposed communication, exposed copies and idle."""
    steady = w.steps.steady
    if steady.is_empty():
        return []
    # Each steady step runs to the next one's start (the last to the window's end); a step
    # with no time inside the window's spans has no row.
    steps = steady.select("index", step_start="gpu_start").sort("step_start")
    starts = steps["step_start"].to_numpy()
    last = max(int(w.window[1]), int(starts[-1]))
    bounds = np.append(starts, last)
    spans = intervals.spans_of(w.spans)
    busy = w.layers

    def within(layer) -> np.ndarray:
        return layer.within(bounds, spans)

    compute, kernels, work = within(busy.compute), within(busy.compute_comm), within(busy.work)
    inside = intervals.within_spans(bounds, spans)
    per = steps.with_columns(
        compute=pl.Series(compute),
        exposed_comm=pl.Series(kernels - compute),
        copy=pl.Series(work - kernels),
        idle=pl.Series(inside - work),
        comm_total=pl.Series(within(busy.comm)),
        _inside=pl.Series(inside),
    )
    return per.filter(pl.col("_inside") > 0).drop("_inside").sort("index").to_dicts()


def gap_histogram(gaps: pl.DataFrame) -> dict[str, list]:
    """Count and total time of idle gaps per cause in log-spaced length bins
    (bin i holds gaps in [edges[i-1], edges[i]); bin 0 is below 1 µs)."""
    n_bins = len(GAP_BINS_NS) + 1
    binned = (
        gaps.with_columns(
            bin=pl.lit(pl.Series(GAP_BINS_NS)).search_sorted(pl.col("dur"), side="right")
        )
        .group_by("cause", "bin")
        .agg(count=pl.len(), time=pl.col("dur").sum())
    )
    out: dict[str, list] = {"edges_ns": GAP_BINS_NS}
    for cause in IDLE_CAUSES:
        rows = binned.filter(pl.col("cause") == cause)
        counts, time = [0] * n_bins, [0] * n_bins
        for b, c, t in rows.select("bin", "count", "time").iter_rows():  # <= 16 rows
            counts[b], time[b] = int(c), int(t)
        out[cause] = counts
        out[f"{cause}_ns"] = time
    return out


def metric_series(
    metrics: pl.DataFrame, window: intervals.Spans, points: int = 400
) -> dict[str, list]:
    """GPU metrics averaged into ``points`` bins over the window (from its first to its last
    ns: a window of several spans shows no samples between them), per metric."""
    inside = metrics.filter(
        intervals.inside("timestamp", window)
        & pl.col("metric").is_in(list(METRICS_OF_INTEREST.values()))
    )
    if inside.is_empty():
        return {}
    spans = intervals.spans_of(window)
    window = (spans[0][0], spans[-1][1])
    width = max((window[1] - window[0]) // points, 1)
    binned = (
        inside.with_columns(bin=((pl.col("timestamp") - window[0]) // width))
        .group_by("metric", "bin")
        .agg(pl.col("value").mean())
        .sort("bin")
    )
    out: dict[str, list] = {}
    # sorted, so the report's JSON is the same from run to run
    for (metric,), rows in sorted(binned.group_by(["metric"]), key=lambda g: str(g[0][0])):
        out[str(metric)] = [
            [int(b * width), round(float(v), 2)]
            for b, v in zip(rows["bin"], rows["value"], strict=True)
        ]
    return out


LANE_POINTS = 1500  # intervals per lane: finer than any figure draws one step


def step_lanes(w: RankWindow, phase_spans: pl.DataFrame) -> dict:
    """One representative steady step (the one whose duration is nearest the median) as lanes
    of [start, end, busy] (ns from the step's start; busy: ns covered inside): ``compute``
    (kernels and graph replays), ``communication``, ``copies`` and each NVTX phase's GPU span
    (``phase_spans`` from :func:`traceclf.measures.phases.projected`). Intervals closer than
    1/LANE_POINTS of the step are merged (busy keeps their real coverage), so a step of 10k
    kernels stays at most LANE_POINTS rows."""
    steady = w.steps.steady.filter(~pl.col("outlier")) if w.steps.count else None
    if steady is None or steady.is_empty():
        return {}
    median = steady["duration"].median()
    step = steady.sort((pl.col("duration") - median).abs(), "index").row(0, named=True)
    lo, hi = int(step["gpu_start"]), int(step["gpu_start"]) + int(step["duration"])
    resolution = max((hi - lo) // LANE_POINTS, 1)
    layers = {
        "compute": w.compute,
        "communication": w.comm,
        "copies": w.copies.select("start", "end"),
    } | {
        phase: phase_spans.filter(pl.col("phase") == phase).select("start", "end")
        for phase in phase_spans["phase"].unique(maintain_order=True).to_list()
    }
    lanes = {}
    for name, df in layers.items():
        merged = _merge_close(intervals.clip(df, (lo, hi)), resolution)
        lanes[name] = [[int(s) - lo, int(e) - lo, int(b)] for s, e, b in merged.iter_rows()]
    return {
        "index": int(step["index"]),
        "start_ns": lo,
        "end_ns": hi,
        "median_ns": int(median),
        "lanes": lanes,
    }


def _merge_close(df: pl.DataFrame, gap: int) -> pl.DataFrame:
    """The union of the intervals with gaps shorter than ``gap`` ns closed, as (start, end,
    busy): ``busy`` keeps the ns actually covered, so a merged stretch of short kernels reads
    as partly busy, never as solid work."""
    merged = intervals.union(df)
    if merged.is_empty():
        return merged.with_columns(busy=pl.lit(0, pl.Int64))
    return (
        merged.with_columns(
            group=(pl.col("start") - pl.col("end").shift(1) >= gap).fill_null(True).cum_sum()
        )
        .group_by("group", maintain_order=True)
        .agg(
            pl.col("start").min(), pl.col("end").max(), busy=(pl.col("end") - pl.col("start")).sum()
        )
        .select("start", "end", "busy")
    )


MEMORY_POINTS = 400


def memory_series(memory: pl.DataFrame, capacity: int | None, window: tuple[int, int]) -> dict:
    """Device memory allocated over the capture (``memory``: CUDA_GPU_MEMORY_USAGE_EVENTS of
    the device's own memory kinds, :func:`traceclf.measures.memory.device_memory`:
    allocations minus frees since the first event), ``MEMORY_POINTS`` bins of [time ns,
    highest level in the bin (bytes)], summed over the devices of the process, with the GPU's
    capacity and the steady-state window; {} without memory events."""
    if memory.is_empty():
        return {}
    memory = memory.sort("start")
    start = memory["start"].to_numpy()
    level = np.cumsum(memory["delta"].fill_null(0).to_numpy())  # (the loader drops nulls)
    lo, hi = int(start[0]), int(start[-1])
    width = max((hi - lo) // MEMORY_POINTS, 1)
    # the events in time order, so each bin's are consecutive: its highest level is a
    # reduction over its run (millions of events of the whole capture, no grouping)
    bins = (start - lo) // width
    first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    top = np.maximum.reduceat(level, first)
    return {
        "points": [[lo + int(b) * width, int(v)] for b, v in zip(bins[first], top, strict=True)],
        "capacity_bytes": capacity,
        "window_ns": [int(window[0]), int(window[1])],
        "events": len(memory),
    }
