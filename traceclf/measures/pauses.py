"""Host pauses: stretches of a step's host time with no CUDA call on any thread of the process
(garbage collection stops every Python thread), and how much of the spread of step times they
account for. What tells host jitter with a cause (a pause) from a spread that is the
host's own launch work."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from traceclf.measures.intervals import BLOCK, Busy, union_sorted
from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "host_pause_ms": "ms per steady step the host spent in pauses: stretches of the step's NVTX "
    "range of 1 ms or more with no CUDA call on any thread of the process and no NVTX range "
    "of a known host activity (data loading, compile, ...) over half of them (null without "
    "NVTX step ranges or the CUDA API trace)",
    "host_pause_max_ms": "the longest such pause in any steady step (null as host_pause_ms)",
    "step_spread_pause_frac": "how much of the spread of the steady step times the host "
    "pauses account for: 1 - var(step time - its pauses) / var(step time), at least 0 (pauses "
    "that make the slow steps slow: near 1; a spread in the host's own launch work: near 0; "
    "null with fewer than 3 steps, or as host_pause_ms)",
}
PAUSE_NS = 1_000_000  # a host that makes no CUDA call for >= 1 ms is doing other work


def pauses(w: RankWindow) -> dict[str, float | None]:
    """The host pause measures of the analysed steady steps found on the host (NVTX)."""
    out: dict[str, float | None] = dict.fromkeys(MEASURES)
    steps = w.steps.steady.filter(
        pl.col("cpu_start").is_not_null() & (pl.col("cpu_end") > pl.col("cpu_start"))
    ).sort("cpu_start")
    if not w.host_traced or w.steps.source != "nvtx" or steps.is_empty():
        return out
    lo, hi = steps["cpu_start"].to_numpy(), steps["cpu_end"].to_numpy()
    api = w.trace.api
    spans = list(zip(lo.tolist(), hi.tolist(), strict=True))
    # (the stretches without a call that may hold a pause: not the union of every call)
    start, end = long_gaps(api["start"].to_numpy(), api["end"].to_numpy(), spans, PAUSE_NS)
    named = Busy.of(_activity_ranges(w)).covered(start, end)
    pause = (end - start >= PAUSE_NS) & (named * 2 < end - start)
    start, end = start[pause], end[pause]
    step = np.searchsorted(lo, start, side="right") - 1  # (nested ranges are outermost)
    per_step = np.bincount(step, weights=end - start, minlength=len(steps))
    out["host_pause_ms"] = float(per_step.mean()) / 1e6
    out["host_pause_max_ms"] = float((end - start).max()) / 1e6 if len(start) else 0.0
    # the step times the statistics use (complete, not outliers)
    used = steps["complete"].to_numpy() & ~steps["outlier"].to_numpy()
    durations = steps["duration"].to_numpy().astype(np.float64)[used]
    if len(durations) >= 3 and durations.var() > 0:
        rest = durations - per_step[used]  # the step time without its pauses
        out["step_spread_pause_frac"] = max(0.0, 1 - float(rest.var() / durations.var()))
    return out


def _activity_ranges(w: RankWindow) -> pl.DataFrame:
    """The process's NVTX ranges of a known host activity (taxonomy ``host_activities``):
    a stretch they cover is that activity, not a pause."""
    nvtx = w.trace.nvtx
    texts = nvtx.select("text").unique().with_columns(activity=w.taxonomy.host_activity())
    named = texts.filter(pl.col("activity").is_not_null())["text"].implode()
    return nvtx.filter(pl.col("text").is_in(named)).select("start", "end")


def long_gaps(
    start: np.ndarray,
    end: np.ndarray,
    spans: Sequence[tuple[int, int]],
    min_ns: int,
    block: int = BLOCK,
) -> tuple[np.ndarray, np.ndarray]:
    """``Busy.of_arrays(start, end).gaps(spans)`` where it holds those at least ``min_ns``
    long (and perhaps some shorter), without the union itself: a gap of the spans is a piece
    of a stretch no interval covers, so only the stretches at least ``min_ns`` long are cut
    by the spans. They are found block by block from the intervals' reach (those before each
    one, in start order): millions of CUDA calls make millions of runs, and their union with
    its running sums held half a GB to give the few pauses of a step (:func:`pauses`).

    Intervals of no length cover nothing and split no stretch, as in :class:`Busy`. Spans
    that overlap give what :meth:`Busy.gaps` gives only where both keep the same pieces."""
    start, end = np.asarray(start), np.asarray(end)
    if len(start) > 1 and not bool(np.all(start[1:] >= start[:-1])):
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
    real = end > start
    if not real.all():
        start, end = start[real], end[real]
    start, end = start.astype(np.int64, copy=False), end.astype(np.int64, copy=False)
    # stretches no interval covers: before the first, after the last, and between each
    # interval and the reach of those before it, where it starts past that reach
    lo_parts = [np.array([np.iinfo(np.int64).min], np.int64)]
    hi_parts = [start[:1]]
    reach = np.iinfo(np.int64).min
    for a in range(0, len(start), block):
        s, e = start[a : a + block], end[a : a + block]
        before = np.maximum.accumulate(e)
        np.maximum(before, reach, out=before)
        prior = np.empty(len(s), np.int64)
        prior[0] = reach if a else s[0]  # (the very first: the stretch before it, below)
        prior[1:] = before[:-1]
        wide = s - prior >= min_ns
        lo_parts.append(prior[wide])
        hi_parts.append(s[wide])
        reach = int(before[-1])
    if len(start):
        lo_parts.append(np.array([reach], np.int64))
        hi_parts.append(np.array([np.iinfo(np.int64).max], np.int64))
    else:  # (nothing covers anything: the one stretch is all time)
        hi_parts = [np.array([np.iinfo(np.int64).max], np.int64)]
    gap_lo, gap_hi = np.concatenate(lo_parts), np.concatenate(hi_parts)
    starts, ends = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for lo, hi in spans:
        a = int(np.searchsorted(gap_hi, lo, side="right"))  # first stretch ending after lo
        b = int(np.searchsorted(gap_lo, hi, side="left"))  # ... starting before hi
        edge = np.maximum(gap_lo[a:b], lo)
        nxt = np.minimum(gap_hi[a:b], hi)
        keep = nxt > edge
        starts.append(edge[keep])
        ends.append(nxt[keep])
    gs = starts[1] if len(starts) == 2 else np.concatenate(starts)
    ge = ends[1] if len(ends) == 2 else np.concatenate(ends)
    return union_sorted(gs, ge) if len(spans) > 1 else (gs, ge)
