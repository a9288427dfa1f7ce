"""Host pauses: stretches of a step's host time with no CUDA call on any thread of the process
(garbage collection stops every Python thread), and how much of the spread of step times they
account for. What tells host jitter with a cause (a pause) from a spread that is the
host's own launch work."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from traceclf.measures.intervals import BLOCK, Busy, is_sorted
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
    return nvtx.filter(w.taxonomy.host_activity_of(nvtx["text"]).is_not_null()).select(
        "start", "end"
    )


def long_gaps(
    start: np.ndarray,
    end: np.ndarray,
    spans: Sequence[tuple[int, int]],
    min_ns: int,
    block: int = BLOCK,
) -> tuple[np.ndarray, np.ndarray]:
    """``Busy.of_arrays(start, end).gaps(spans)`` where it holds those at least ``min_ns``
    long (and perhaps some shorter, cut by a span's edge): the gaps of the union with every
    stretch between the intervals shorter than ``min_ns`` filled in. That coarse union's runs
    are found block by block from the intervals' reach (that of those before each one, in
    start order): millions of CUDA calls make millions of runs, and their union with its
    running sums held half a GB to give the few pauses of a step (:func:`pauses`).

    Intervals of no length cover nothing and split no stretch, as in :class:`Busy`."""
    start, end = np.asarray(start), np.asarray(end)
    if not is_sorted(start):
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
    real = end > start
    if not real.all():
        start, end = start[real], end[real]
    start, end = start.astype(np.int64, copy=False), end.astype(np.int64, copy=False)
    # a coarse run begins at the first interval and at each one that starts at least min_ns
    # past the reach of those before it, where the run before ends
    run_start, run_end = [start[:1]], []
    reach = None
    for a in range(0, len(start), block):
        s, e = start[a : a + block], end[a : a + block]
        before = np.maximum.accumulate(e)
        prior = np.empty(len(s), np.int64)
        if reach is None:
            prior[0] = s[0]  # (the first interval begins the first run)
        else:
            np.maximum(before, reach, out=before)
            prior[0] = reach
        prior[1:] = before[:-1]
        wide = s - prior >= min_ns
        run_end.append(prior[wide])
        run_start.append(s[wide])
        reach = int(before[-1])
    if reach is not None:
        run_end.append(np.array([reach], np.int64))
    return Busy(np.concatenate(run_start), np.concatenate(run_end or [start[:0]])).gaps(spans)
