"""The host wall: what the CPU side does per step (launches, synchronising calls, allocator
calls) and why the GPU is idle (launch-bound, after a sync, waiting on input, other)."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import timeline
from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "sync_calls_per_step": "cudaStream/Device/EventSynchronize and blocking cudaMemcpy per step",
    "alloc_calls_per_step": "cudaMalloc/cudaFree (and driver equivalents) per step",
    "launch_calls_per_step": "kernel and graph launch calls per step",
    "median_launch_us": "median duration of a launch call on the host",
    "short_kernel_frac": "kernels shorter than the median launch call",
    "idle_launch_frac": "idle time while the host was issuing CUDA calls (launch-bound)",
    "idle_sync_frac": "idle time right after a synchronising call returned (sync-bound)",
    "idle_input_frac": "idle gaps >= 1 ms with CUDA calls covering < half of them (input-bound)",
    "idle_other_frac": "remaining idle time (host work between launches, profiler flushes, "
    "unattributed)",
}
CALL_MEASURES = (
    "sync_calls_per_step",
    "alloc_calls_per_step",
    "launch_calls_per_step",
    "median_launch_us",
    "short_kernel_frac",
)
IDLE_CAUSES = ("launch", "sync", "input", "other")
INPUT_GAP_NS = 1_000_000  # a host that makes no CUDA call for >= 1 ms is doing other work
SYNC_SLACK_NS = 20_000  # a sync returns this soon after the GPU drains


def calls(w: RankWindow) -> dict[str, float | None]:
    """Per-step counts of the host's CUDA calls; unknown (null), not zero, when the CUDA API
    was not traced."""
    if not w.host_traced:
        return dict.fromkeys(CALL_MEASURES)
    api, kern, n_steps = w.api, w.kern, w.n_steps
    launches = api.filter(pl.col("is_launch"))
    launch_ns = launches["end"] - launches["start"]
    launch_median = float(launch_ns.median()) if len(launches) else None
    durations = kern["end"] - kern["start"]
    return {
        "sync_calls_per_step": len(api.filter(pl.col("is_sync"))) / n_steps,
        "alloc_calls_per_step": len(api.filter(pl.col("is_alloc"))) / n_steps,
        "launch_calls_per_step": len(launches) / n_steps,
        "median_launch_us": launch_median / 1e3 if launch_median is not None else None,
        "short_kernel_frac": (
            float((durations < launch_median).mean())
            if launch_median is not None and len(kern)
            else None
        ),
    }


def idle(gaps: pl.DataFrame, w: RankWindow) -> dict[str, float]:
    """Share of the window idle for each cause (gaps from :func:`idle_gaps`)."""
    return {
        f"idle_{cause}_frac": float(gaps.filter(pl.col("cause") == cause)["dur"].sum()) / w.wall
        for cause in IDLE_CAUSES
    }


def idle_gaps(w: RankWindow) -> pl.DataFrame:
    """Idle stretches of the GPU with their host-side cause (docs/measures.md); all "other"
    when the CUDA API was not traced, since the causes are read from it."""
    tl = w.timeline
    calls = w.api if w.host_traced else None
    idle = tl.filter((pl.col("compute") == 0) & (pl.col("comm") == 0) & (pl.col("copy") == 0))
    gaps = timeline.union(idle.select("start", "end")).with_columns(
        dur=pl.col("end") - pl.col("start")
    )
    schema = {"start": pl.Int64, "end": pl.Int64, "dur": pl.Int64, "cause": pl.String}
    if gaps.is_empty():
        return pl.DataFrame(schema=schema)
    if calls is None:
        return gaps.with_columns(cause=pl.lit("other")).select(list(schema))
    gstart, gend = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    profiled = idle.filter(pl.col("profiler") > 0)
    pidx = np.searchsorted(gstart, profiled["start"].to_numpy(), side="right") - 1
    profiler_ns = np.bincount(pidx, weights=profiled["dur"].to_numpy(), minlength=len(gaps))
    start, end = calls["start"].to_numpy(), calls["end"].to_numpy()
    # Host coverage: CUDA calls that start inside a gap, clipped to it.
    idx = np.searchsorted(gstart, start, side="right") - 1
    inside = (idx >= 0) & (start < gend[np.maximum(idx, 0)])
    idx_in = idx[inside]
    covered = np.minimum(end[inside], gend[idx_in]) - start[inside]
    api_ns = np.bincount(idx_in, weights=covered, minlength=len(gaps))
    n_calls = np.bincount(idx_in, minlength=len(gaps))
    # A synchronising call that returns at (or just before) the start of a gap drained the queue.
    sync_end = end[calls["is_sync"].fill_null(False).to_numpy()]
    sidx = np.searchsorted(gstart - SYNC_SLACK_NS, sync_end, side="right") - 1
    synced = (sidx >= 0) & (sync_end <= gend[np.maximum(sidx, 0)])
    after_sync = np.zeros(len(gaps), dtype=bool)
    after_sync[sidx[synced]] = True
    gaps = gaps.with_columns(
        api_ns=pl.Series(api_ns),
        calls=pl.Series(n_calls),
        after_sync=pl.Series(after_sync),
        profiler_ns=pl.Series(profiler_ns),
    )
    return gaps.with_columns(
        cause=pl.when(pl.col("profiler_ns") * 2 >= pl.col("dur"))
        .then(pl.lit("other"))  # a profiler flush, not the host's doing
        .when((pl.col("dur") >= INPUT_GAP_NS) & (pl.col("api_ns") * 2 < pl.col("dur")))
        .then(pl.lit("input"))
        .when(pl.col("after_sync"))
        .then(pl.lit("sync"))
        .when(pl.col("calls") > 0)
        .then(pl.lit("launch"))
        .otherwise(pl.lit("other"))
    ).select(list(schema))
