"""The host wall: what the CPU side does per step (launches, synchronising calls, allocator
calls) and why the GPU is idle (launch-bound, after a sync, waiting on input, other)."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.host_nvtx import host_ranges, nvtx_cover
from traceclf.measures.hostframes import in_window, loading_gaps
from traceclf.measures.window import RankWindow
from traceclf.model.trace import HOST_TO_DEVICE

MEASURES: dict[str, str] = {
    "sync_calls_per_step": "cudaStream/Device/EventSynchronize and blocking cudaMemcpy per step "
    "(the calls of the analysed steps, not those made while the GPU runs the window)",
    "alloc_calls_per_step": "cudaMalloc/cudaFree (and driver equivalents) per step (the calls "
    "of the analysed steps)",
    "free_calls_per_step": "those of alloc_calls_per_step that free device memory (taxonomy "
    "cuda_api.free)",
    "launch_calls_per_step": "kernel and graph launch calls per step (the calls of the analysed "
    "steps)",
    "median_launch_us": "median duration of a launch call of the analysed steps on the host",
    "short_kernel_frac": "kernels shorter than the median launch call",
    "idle_launch_frac": "idle time in gaps while the host was issuing CUDA calls: gaps under 1 "
    "ms, or longer ones CUDA calls cover half of, in which a call ran (launch-bound); the host "
    "spends the gap in the calls or in its own code between them (host attribution splits the "
    "two)",
    "idle_sync_frac": "idle time right after a synchronising call returned, or half filled by "
    "synchronising calls or cudaMalloc/cudaFree (which synchronise the device) the host sat in "
    "(sync-bound)",
    "idle_after_wait_frac": "the part of idle_sync_frac in gaps where a call that only waits "
    "(cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize; taxonomy cuda_api "
    "wait) returned: what removing needless syncs wins back (blocking copies left out)",
    "idle_input_frac": "idle gaps >= 1 ms with CUDA calls covering < half of them and evidence "
    "of data loading: an NVTX data range over the gap, the gap ends with a host->device copy "
    "of >= 1 MiB (the next batch), or the launching thread's samples in the gap show "
    "data-loading frames (input-bound)",
    "idle_input_copy_frac": "the part of idle_input_frac in gaps that end with a host->device "
    "copy of the next batch (>= 1 MiB, recurring in half of the steps or more)",
    "idle_input_nvtx_frac": "the part of idle_input_frac in gaps an NVTX data-loading range "
    "covers at least half of (null: the export holds no NVTX range)",
    "idle_input_samples_frac": "the part of idle_input_frac in gaps where the launching "
    "thread's samples show data-loading frames (null: no CPU or Python samples captured; a gap "
    "may show several signs: the three parts can add up to more than idle_input_frac)",
    "idle_host_frac": "idle gaps >= 1 ms with CUDA calls covering < half of them and no "
    "evidence of data loading: the host is busy elsewhere (see idle_nvtx for what NVTX says)",
    "idle_host_nvtx_frac": "the part of idle_input_frac + idle_host_frac that an NVTX range "
    "(other than steps and forward/backward/optimizer phases) on the process covers",
    "idle_graph_frac": "idle time inside node-traced CUDA-graph replays, between their kernels "
    "(device-side scheduling and dependencies between graph nodes: the host launched the whole "
    "graph; 0 without node-level graph tracing)",
    "idle_other_frac": "remaining idle time (host work between launches, profiler flushes, "
    "unattributed)",
    "alloc_idle_frac": "GPU idle time while the host is inside cudaMalloc/cudaFree (what the "
    "allocator calls cost the GPU; the calls themselves can last longer, waiting for it)",
    "nvtx_ranges_per_launch": "NVTX ranges the process opened per kernel or graph launch "
    "call, both counted by their start over the window's spans, step ranges and "
    "forward/backward/optimizer phases left out (null where the process opened no NVTX range "
    "or launched nothing): one or more is per-operator instrumentation (PyTorch's emit_nvtx, "
    "pyprof), whose ranges cost the host time on every op",
    "wait_call_frac": "time the host spends inside the analysed steps' calls that only wait "
    "(cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize; taxonomy cuda_api "
    "wait), the union over its threads, per step (the steps' calls, as sync_calls_per_step "
    "counts them: not a sync after the loop that the GPU window overlaps): all that removing "
    "them gives back to a host that sets the pace (at most 1: waits that reach past the "
    "window count up to its length)",
}
CALL_MEASURES = (
    "sync_calls_per_step",
    "alloc_calls_per_step",
    "free_calls_per_step",
    "launch_calls_per_step",
    "median_launch_us",
    "short_kernel_frac",
    "alloc_idle_frac",
    "wait_call_frac",
    "nvtx_ranges_per_launch",
)
CAUSE = pl.Enum(IDLE_CAUSES)  # (millions of gaps: a byte each, not a string)
INPUT_GAP_NS = 1_000_000  # a host that makes no CUDA call for >= 1 ms is doing other work
SYNC_SLACK_NS = 20_000  # a sync returns this soon after the GPU drains
LONGEST_GAPS = 200  # idle gaps listed one by one per rank, longest first (the histogram counts all)
BATCH_COPY_BYTES = 1 << 20  # a host->device copy this big after a gap is the next batch
# ... when such gaps recur: in at least this share of the steady steps (one upload before the
# loop, a checkpoint restore, is setup, not an input pipeline)
BATCH_RECUR_SHARE = 0.5
# The signs that make a long gap count as loading, as bits of idle_gaps' ``signs``: the next
# batch's copy at its end, an NVTX data-loading range over it, loader frames in its samples.
INPUT_SIGNS = {"copy": 1, "nvtx": 2, "samples": 4}
CALL_BLOCK = 1 << 20  # CUDA calls per block of the host-coverage count


def calls(w: RankWindow) -> dict[str, float | None]:
    """Per-step counts of the host's CUDA calls; unknown (null), not zero, when the CUDA API
    was not traced."""
    if not w.host_traced:
        return dict.fromkeys(CALL_MEASURES)
    api, kern, n_steps = w.step_calls(), w.kern, w.n_steps  # the calls of the window's steps
    launches = api.filter(pl.col("is_launch"))
    launch_ns = launches["end"] - launches["start"]
    launch_median = float(launch_ns.median()) if len(launches) else None
    durations = kern["end"] - kern["start"]
    return {
        "sync_calls_per_step": len(api.filter(pl.col("is_sync"))) / n_steps,
        "alloc_calls_per_step": len(api.filter(pl.col("is_alloc"))) / n_steps,
        "free_calls_per_step": len(api.filter(pl.col("is_free"))) / n_steps,
        "launch_calls_per_step": len(launches) / n_steps,
        "median_launch_us": launch_median / 1e3 if launch_median is not None else None,
        "short_kernel_frac": (
            float((durations < launch_median).mean())
            if launch_median is not None and len(kern)
            else None
        ),
        # (the calls made while the GPU runs the window: they can leave it idle)
        "alloc_idle_frac": w.uncovered(w.api.filter(pl.col("is_alloc")), w.layers.work) / w.wall,
        # (the calls whole may reach past the window, a wait outlast the steps: at most all
        # of it, which is all removing them could give back)
        "wait_call_frac": min(_waited(w), w.wall) / w.wall,
        "nvtx_ranges_per_launch": _nvtx_per_launch(w),
    }


def _nvtx_per_launch(w: RankWindow) -> float | None:
    """NVTX ranges opened per launch call, both counted by their start over the window's spans
    (the same stretch of the host's clock for both), step ranges and forward/backward/
    optimizer phases left out (a loop of one launch a step is not instrumented finely):
    per-operator instrumentation opens one or more per launch, and its cost on the host may
    be what the GPU waits for. Null where the process opened no NVTX range."""
    if w.trace.nvtx.is_empty():
        return None
    launch = w.flagged.filter(pl.col("is_launch").fill_null(False))["start"].to_numpy()
    launches = int(in_window(w, launch).sum())
    if not launches:
        return None
    return int(in_window(w, host_ranges(w)["start"].to_numpy()).sum()) / launches


def _waited(w: RankWindow) -> int:
    """ns the host spends inside the analysed steps' calls that only wait (a union over its
    threads; the calls whole: a step's host time, not clipped to the GPU's window)."""
    mask = w.step_call_mask & w.flagged["is_wait"].fill_null(False).to_numpy()
    return intervals.Busy.of(w.trace.api.select("start", "end").filter(pl.Series(mask))).total


def idle(gaps: pl.DataFrame, w: RankWindow) -> dict[str, float | None]:
    """Share of the window idle for each cause (gaps from :func:`idle_gaps`)."""
    # (one column summed per cause: no copy of the millions of gaps' rows)
    ns = gaps.select(
        **{cause: pl.col("dur").filter(pl.col("cause") == cause).sum() for cause in IDLE_CAUSES}
    ).row(0, named=True)
    out: dict[str, float | None] = {
        f"idle_{cause}_frac": float(ns[cause]) / w.wall for cause in IDLE_CAUSES
    }
    out["idle_host_nvtx_frac"] = float(gaps["nvtx_ns"].sum()) / w.wall
    # (which sign made the input gaps count as loading: the evidence names each)
    signs = gaps.select(
        **{
            name: pl.col("dur")
            .filter((pl.col("cause") == "input") & (pl.col("signs").and_(bit) > 0))
            .sum()
            for name, bit in INPUT_SIGNS.items()
        }
    ).row(0, named=True)
    # (unknown, not zero, where the export lacks the sign's source: no NVTX, no samples)
    sources = set(w.trace.host_sources)
    captured = {"copy": True, "nvtx": "nvtx" in sources}
    captured["samples"] = bool(sources & {"sampling", "python_sampling"})
    out |= {
        f"idle_input_{name}_frac": float(signs[name]) / w.wall if captured[name] else None
        for name in INPUT_SIGNS
    }
    out["idle_after_wait_frac"] = _after_wait(gaps, w)
    return out


def _after_wait(gaps: pl.DataFrame, w: RankWindow) -> float | None:
    """Share of the window idle in "sync" gaps in which a call that only waits returned (a
    cudaDeviceSynchronize after every kernel); null when the CUDA API was not traced. The call
    returns inside the gap, no slack: one that returned while the GPU still ran something (a
    blocking copy issued right after it) did not leave the GPU idle, the copy did."""
    if not w.host_traced:
        return None
    sync = gaps.filter(pl.col("cause") == "sync")
    if sync.is_empty():
        return 0.0
    ends = np.sort(w.api.filter(pl.col("is_wait").fill_null(False))["end"].to_numpy())
    hit = _returned_in(ends, sync["start"].to_numpy(), sync["end"].to_numpy(), slack=0)
    return float(sync["dur"].filter(pl.Series(hit)).sum()) / w.wall


def idle_gaps(w: RankWindow) -> pl.DataFrame:
    """Idle stretches of the GPU with their host-side cause (docs/measures.md) and, for the
    long ones, the NVTX range the host was in (``nvtx``, ``activity``, ``nvtx_ns``). A gap
    inside a node-traced CUDA-graph replay is the graph's ("graph": the host had launched all
    of it); every other cause is "other" when the CUDA API was not traced, since the causes
    are read from it."""
    calls = w.api if w.host_traced else None
    layers = w.layers
    idle_start, idle_end = layers.work.gaps(intervals.spans_of(w.spans))
    gaps = pl.DataFrame(
        {"start": idle_start, "end": idle_end}, schema={"start": pl.Int64, "end": pl.Int64}
    ).with_columns(dur=pl.col("end") - pl.col("start"))
    schema = {
        "start": pl.Int64,
        "end": pl.Int64,
        "dur": pl.Int64,
        "cause": CAUSE,
        "nvtx": pl.String,
        "activity": pl.String,
        "nvtx_ns": pl.Int64,
        "signs": pl.UInt8,  # what made a long gap count as loading: INPUT_SIGNS bits
    }
    if gaps.is_empty():
        return pl.DataFrame(schema=schema)
    # (gaps are maximal and a replay's span ends on its kernels: a gap is inside one or none)
    in_graph = pl.Series(
        w.node_replays.covered(gaps["start"].to_numpy(), gaps["end"].to_numpy()) > 0
    )
    if calls is None:
        return gaps.with_columns(
            cause=pl.when(in_graph).then(pl.lit("graph", CAUSE)).otherwise(pl.lit("other", CAUSE)),
            nvtx=pl.lit(None, pl.String),
            activity=pl.lit(None, pl.String),
            nvtx_ns=pl.lit(0, pl.Int64),
            signs=pl.lit(0, pl.UInt8),
        ).select(list(schema))
    gstart, gend = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    dur = gend - gstart
    profiler = layers.profiler  # (all of a gap is idle)
    api_ns, calls_in = _host_cover(calls, gstart, gend)
    # Flags, not the counts and ns they are read from: millions of gaps (a byte a gap each)
    gaps = gaps.with_columns(
        long=pl.Series((dur >= INPUT_GAP_NS) & (api_ns * 2 < dur)),
        any_call=pl.Series(calls_in > 0),
    )
    del api_ns, calls_in
    flushed = intervals.covered_by_runs(profiler.start, profiler.end, gstart, gend) * 2 >= dur
    gaps = gaps.with_columns(
        after_sync=_after_sync(calls, gstart, gend, dur), profiler_flush=pl.Series(flushed)
    )
    del dur, flushed
    gaps = _attribute_nvtx(gaps, w)
    # the launching thread's samples in a long gap showing data loading (hostframes.py)
    long = np.flatnonzero(gaps["long"].to_numpy())
    loading = np.zeros(gaps.height, bool)
    loading[long] = loading_gaps(w, gstart[long], gend[long])
    # a big copy after the gap is the next batch only where batches recur, and a named host
    # activity (compile, checkpoint, ...) over the gap says what the host did instead
    batch = pl.col("batch_copy") & pl.col("activity").is_null() & _recurs(gaps, w)
    ranged = (pl.col("activity") == "data").fill_null(False)
    sampled = pl.Series(loading)
    data = ranged | batch | sampled
    signs = pl.sum_horizontal(
        pl.when(sign).then(pl.lit(bit, pl.UInt8)).otherwise(pl.lit(0, pl.UInt8))
        for sign, bit in zip((batch, ranged, sampled), INPUT_SIGNS.values(), strict=True)
    )
    return gaps.with_columns(
        signs=pl.when(pl.col("long")).then(signs).otherwise(pl.lit(0, pl.UInt8)),
        cause=pl.when(pl.col("profiler_flush"))
        .then(pl.lit("other", CAUSE))  # a profiler flush, not the host's doing
        .when(in_graph)
        .then(pl.lit("graph", CAUSE))
        .when(pl.col("long") & data)
        .then(pl.lit("input", CAUSE))
        .when(pl.col("long"))
        .then(pl.lit("host", CAUSE))
        .when(pl.col("after_sync"))
        .then(pl.lit("sync", CAUSE))
        .when(pl.col("any_call"))
        .then(pl.lit("launch", CAUSE))
        .otherwise(pl.lit("other", CAUSE)),
    ).select(list(schema))


def _recurs(gaps: pl.DataFrame, w: RankWindow) -> bool:
    """Whether gaps that end with a big host->device copy recur: in at least BATCH_RECUR_SHARE
    of the steady steps (by the step their end falls in). Without steps nothing recurs."""
    if w.steps.source == "none" or not w.steps.count:
        return False
    ends = gaps.filter("batch_copy")["end"].to_numpy()
    starts = np.sort(w.steps.steady["gpu_start"].to_numpy())
    if not len(ends) or not len(starts):
        return False
    step = np.searchsorted(starts, ends, side="right") - 1
    return len(np.unique(step[step >= 0])) >= BATCH_RECUR_SHARE * w.n_steps


def _host_cover(
    calls: pl.DataFrame, gstart: np.ndarray, gend: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per gap: ns of host coverage by the CUDA calls in it, clipped to it (those begun inside,
    and those begun before it still running: a launch loading its module lazily can span a
    gap), and how many. Calls by blocks: tens of millions at once were an ``--all-steps`` peak."""
    api_ns = np.zeros(len(gstart))  # (float: exact for integer ns below 2**53)
    count = np.zeros(len(gstart), np.int64)
    starts, ends = calls["start"].to_numpy(), calls["end"].to_numpy()
    for lo in range(0, len(starts), CALL_BLOCK):
        start, end = starts[lo : lo + CALL_BLOCK], ends[lo : lo + CALL_BLOCK]
        # the gaps the block's calls can start in: a slice (calls and gaps in start order),
        # so the search runs over a block's worth of gaps, not every gap of the window
        g0 = max(int(np.searchsorted(gstart, start.min(), side="right")) - 1, 0)
        g1 = int(np.searchsorted(gstart, start.max(), side="right"))
        idx = intervals.rank_sorted(gstart[g0:g1], start, side="right")
        idx += g0 - 1  # the gap each call starts in or after (-1: before the first)
        inside = idx >= 0
        inside &= start < np.take(gend, idx, mode="clip")
        idx = idx[inside]
        if not len(idx):
            continue
        # the calls of a block (in start order) fall in a run of gaps: count over those only
        first = int(idx.min())
        covered = np.minimum(end[inside], gend[idx]) - start[inside]
        part = np.bincount(idx - first, weights=covered)
        api_ns[first : first + len(part)] += part
        count[first : first + len(part)] += np.bincount(idx - first, minlength=len(part))
    reach = np.minimum(intervals.reach_before(calls, gstart), gend)
    return api_ns + (reach - gstart), count + (reach > gstart)


def _after_sync(
    calls: pl.DataFrame, gstart: np.ndarray, gend: np.ndarray, dur: np.ndarray
) -> pl.Series:
    """Per gap: whether a synchronising call drained the queue before it, or the host sat in
    one (or in an allocation) through it."""
    # A host blocked in a synchronising call (a blocking copy staging pageable memory, a sync
    # on other work) or in cudaMalloc/cudaFree (which synchronise the device) for half of a
    # gap stalled the GPU; it was not launching
    blocked = pl.col("is_alloc") | pl.col("is_sync").fill_null(False)
    filled = intervals.covered(calls.filter(blocked), gstart, gend)
    filled = np.multiply(filled, 2, out=filled) >= dur
    # A synchronising call that returns inside a gap, or at most SYNC_SLACK_NS before it starts,
    # drained the queue. Every such gap counts: with kernels of a few µs the next gap starts
    # within the slack too, and must not take the sync away from the gap it returned in.
    sync_end = np.sort(calls.filter(pl.col("is_sync").fill_null(False))["end"].to_numpy())
    return pl.Series(_returned_in(sync_end, gstart, gend, SYNC_SLACK_NS) | filled)


def _returned_in(ends: np.ndarray, gstart: np.ndarray, gend: np.ndarray, slack: int) -> np.ndarray:
    """Per gap: whether one of the calls ending at ``ends`` (sorted) returned inside it or at
    most ``slack`` ns before it started."""
    # first call returning since then (the slack moved onto the few calls, not every gap)
    nxt = intervals.rank_sorted(ends + slack, gstart, side="left")
    returned = nxt < len(ends)
    returned[returned] = ends[nxt[returned]] <= gend[returned]
    return returned


def _attribute_nvtx(gaps: pl.DataFrame, w: RankWindow) -> pl.DataFrame:
    """For each long gap: the innermost NVTX range of the process that covers at least half
    of it (``nvtx``, its ``activity`` from the taxonomy, the ns it covers), and whether the gap
    ends with a big host->device copy (``batch_copy``: the next batch going in)."""
    long = gaps.filter("long").select("start", "end", "dur")
    best = nvtx_cover(long, w).drop("r_start", "r_end")
    # the capture's copies, not the window's: the last gap ends where the next step's copy
    # starts, which is the window's end
    batch = w.trace.copies.filter(
        pl.col("direction").is_in(HOST_TO_DEVICE) & (pl.col("bytes") >= BATCH_COPY_BYTES)
    )["start"]
    # the few long gaps' ranges put in place by position (gaps are in start order), not by a
    # join that copies every column of millions of gaps
    at = pl.Series(np.searchsorted(gaps["start"].to_numpy(), best["start"].to_numpy()))
    named = {
        name: pl.repeat(None, gaps.height, dtype=best.schema[name], eager=True)
        .scatter(at, best[name])
        .alias(name)
        for name in ("nvtx", "activity")
    }
    nvtx_ns = pl.repeat(0, gaps.height, dtype=pl.Int64, eager=True).scatter(at, best["nvtx_ns"])
    return gaps.with_columns(
        *named.values(),
        nvtx_ns=nvtx_ns,
        batch_copy=pl.col("long") & pl.col("end").is_in(batch.implode()),
    )


def longest_gaps(gaps: pl.DataFrame, w: RankWindow, n: int = LONGEST_GAPS) -> list[dict]:
    """The ``n`` longest idle gaps of the window (from :func:`idle_gaps`), longest first (ties:
    earlier first), one by one as ``nsys analyze``'s gpu_gaps lists them: ``start_ns`` (the
    export's clock), ``duration_ns``, ``cause``, and ``nvtx``: the innermost NVTX range of the
    process open at the middle of the gap, other than a step range (``None`` when none)."""
    if not gaps.height:  # (a window the GPU never leaves idle)
        return []
    order = {"by": ["dur", "start"], "descending": [True, False]}
    # the n longest: every gap as long as the n-th longest (ties included), then sorted; one
    # column's top_k, not a two-key top_k of millions of gaps (15x slower)
    shortest = gaps["dur"].top_k(n).min()
    top = (
        gaps.filter(pl.col("dur") >= shortest)
        .select("start", "dur", "cause")
        .sort(**order)
        .head(n)
        .select(
            "start",
            "dur",
            pl.col("cause").cast(pl.String),
            mid=pl.col("start") + pl.col("dur") // 2,
        )
    )
    step_names = w.steps.table["name"].unique().implode()
    # (the ranges open at one of the few middles, found by a test of each before the join:
    # an inequality join sorts every range of the capture, millions with PyTorch's op ranges)
    mids = top["mid"].to_list()
    ranges = w.trace.nvtx.filter(
        pl.any_horizontal([(pl.col("start") <= m) & (pl.col("end") > m) for m in mids])
        & ~pl.col("text").is_in(step_names)
    ).select("text", "start", "end")
    top = top.with_columns(nvtx=pl.Series(_innermost_at(ranges, mids), dtype=pl.String))
    return [
        {"start_ns": start, "duration_ns": dur, "cause": cause, "nvtx": nvtx}
        for start, dur, cause, nvtx in top.select("start", "dur", "cause", "nvtx").iter_rows()
    ]


def _innermost_at(ranges: pl.DataFrame, at: list[int]) -> list[str | None]:
    """The text of the innermost of ``ranges`` (the latest to start; of those, the first to
    end) open at each instant of ``at`` (a few hundred): a pass over the ranges per instant,
    never a frame of instants × ranges (200,000 nested ranges made one of 6 GB)."""
    ranges = ranges.sort(["start", "end", "text"], descending=[True, False, False])
    start, end, text = ranges["start"].to_numpy(), ranges["end"].to_numpy(), ranges["text"]
    out: list[str | None] = [None] * len(at)
    for i, t in enumerate(at if len(ranges) else []):
        open_now = (start <= t) & (end > t)
        first = int(open_now.argmax())
        out[i] = text[first] if open_now[first] else None
    return out
