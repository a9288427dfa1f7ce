"""Where the GPU's idle time went on the host, from every source the capture holds
(docs/judgement.md, "What the host was doing"; the report's ``host_attribution``).

Every ns of every idle gap of the window goes to one source, the first in this order that
accounts for it, so nothing is counted twice:

1. ``profiler``: nsys's own work on the process (``PROFILER_OVERHEAD``);
2. ``nvtx``: a long gap's time under a host activity's NVTX ranges, at any depth, or else
   the innermost range covering at least half of it (as ``idle_nvtx``);
3. ``cuda_api``: a CUDA call of the process, by class (module loading, JIT compilation,
   allocator, pinned host allocation, synchronisation, launch, other);
4. ``osrt``: an OS runtime call of the gap's launching thread (the thread whose call launched
   the work that ends the gap), by call name;
5. ``python_sampling``: what is left of the gaps of one idle cause on one launching thread,
   split by its Python samples there (nsys samples Python at wall-clock intervals, blocked or
   not), by top user frame;
6. ``sched``: the launching thread not running (scheduled out);
7. ``sampling``: what is left, split by the thread's CPU samples there (taken only while it
   runs), by top user frame;
8. ``unattributed``: the rest.

Samples estimate: a pool of time split in proportion to the samples that fall in it, and only
from ``host_attribution.min_samples`` samples on (rules/hostside.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from traceclf.measures.claims import Pieces
from traceclf.measures.host_nvtx import NVTX_COUNTERS, long_gaps, nvtx_cover
from traceclf.measures.hostframes import (
    NO_USER_FRAME,
    cpu_samples,
    launching_threads,
    native_stacks,
    python_samples,
    samples_in,
)
from traceclf.measures.idle_claims import IdleClaims
from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import by_name
from traceclf.support.cpus import second_lane

MEASURES: dict[str, str] = {
    "profiler_overhead_frac": "nsys's own work on the process (PROFILER_OVERHEAD: CUPTI buffer "
    "flushes, injection) in the window, whatever the GPU does meanwhile (null without the "
    "table)",
    "idle_unattributed_frac": "idle time that no host source of the capture accounts for "
    "(host_attribution's unattributed row)",
    "idle_host_sources_frac": "the part of idle_host_frac that OS runtime calls, samples or "
    "scheduling of the launching thread account for (host_attribution)",
}
SOURCES = (
    "profiler",
    "nvtx",
    "cuda_api",
    "osrt",
    "python_sampling",
    "sched",
    "sampling",
    "unattributed",
)
# CUDA call classes, the first that a call is of wins (taxonomy cuda_api patterns)
CUDA_CLASSES = (
    ("module", "module loading"),
    ("jit", "JIT compilation"),
    ("alloc", "allocator"),
    ("host_alloc", "pinned host allocation"),
    ("sync", "synchronisation"),
    ("launch", "launch"),
)
PER_SOURCE = 5  # "what" rows per source; the rest are summed as "other"
NATIVE_TOP = 3  # hottest native functions named beside Python frames


@dataclass
class HostAttribution:
    """The rank's ``host_attribution`` rows and the measures read from them."""

    rows: list[dict]
    measures: dict[str, float | None]


def attribute(w: RankWindow, gaps: pl.DataFrame, activities: list[dict]) -> HostAttribution:
    """The host attribution of the window's idle ``gaps`` (:func:`host.idle_gaps`);
    ``activities``: their :func:`~traceclf.measures.host_nvtx.activity_cover`."""
    wall, steps = w.wall, w.n_steps
    # (unknown, not zero, when the export has no PROFILER_OVERHEAD table)
    recorded = "PROFILER_OVERHEAD" in w.trace.tables and wall
    overhead = {"profiler_overhead_frac": w.layers.profiler.total / wall if recorded else None}
    idle_ns = int(gaps["dur"].sum()) if gaps.height else 0
    if not idle_ns:
        return HostAttribution(
            [], overhead | {"idle_unattributed_frac": 0.0, "idle_host_sources_frac": 0.0}
        )
    gstart, gend = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    # (the gaps' launching threads, which only the thread sources read: found beside the
    # claims of the sources before them)
    lane = second_lane("traceclf-launching-threads")
    finding = lane.submit(launching_threads, w, gstart, gend)
    cause = gaps["cause"].to_physical().to_numpy()
    # (owners as 32-bit gap numbers: a third less of every copy of millions of pieces)
    owner = np.arange(len(gstart), dtype=np.int32 if len(gstart) < 1 << 31 else np.int64)
    claims = IdleClaims((gstart.copy(), gend.copy(), owner), cause)
    details: dict[tuple[str, str], dict] = {}

    _profiler(w, claims)
    _nvtx(w, gaps, activities, claims, details)
    _cuda_api(w, claims, details)
    threads = finding.result()
    _osrt(w, threads, claims, details)
    _sampled(w, "python_sampling", threads, cause, claims, details)
    _sched(w, threads, claims)
    _sampled(w, "sampling", threads, cause, claims, details)
    claims.record("unattributed", ["unattributed"], *claims.left())

    claimed = pl.concat(claims.parts).filter(pl.col("ns") > 0)
    host_gaps = claimed.filter(pl.col("cause") == "host")
    from_sources = host_gaps.filter(
        pl.col("source").is_in(["osrt", "python_sampling", "sched", "sampling"])
    )["ns"].sum()
    unattributed = claimed.filter(pl.col("source") == "unattributed")["ns"].sum()
    return HostAttribution(
        _rows(claimed, details, idle_ns, steps),
        overhead
        | {
            "idle_unattributed_frac": unattributed / wall,
            "idle_host_sources_frac": from_sources / wall,
        },
    )


def _profiler(w: RankWindow, claims: IdleClaims) -> None:
    overhead = w.trace.overhead
    if overhead.is_empty() or not {"start", "end", "name"} <= set(overhead.columns):
        return
    whats, label = _labels(overhead["name"].cast(pl.String).fill_null("nsys overhead"))
    claims.take("profiler", whats, *_arrays(overhead), label=label)


def _nvtx(
    w: RankWindow, gaps: pl.DataFrame, activities: list[dict], claims: IdleClaims, details: dict
) -> None:
    """The long gaps' time under a host activity's NVTX ranges (``activities``, as
    ``idle_nvtx`` counts it: at any depth, a compiler's nested passes do not each cover half
    of a gap), named as there; then, in gaps of no activity, the innermost range covering at
    least half of the gap."""
    long = long_gaps(gaps)
    for row in activities:
        what = row["name"] + (f" → {row['detail']}" if row["detail"] else "")
        claims.take("nvtx", what, row["lo"], row["hi"])
        details[("nvtx", what)] = {"gaps": row["gaps"], "activity": row["activity"]}
        if row["ranges"]:
            details[("nvtx", what)]["ranges"] = row["ranges"]
    named = long.filter(pl.col("nvtx").is_not_null() & pl.col("activity").is_null())
    cover = nvtx_cover(named.select("start", "end", "dur"), w)
    if cover.is_empty():
        return
    cover = cover.join(named.select("start", "end"), on="start").with_columns(
        what=pl.col("nvtx").str.replace_all(NVTX_COUNTERS, "").str.strip_chars(" ,")
    )
    lo = np.maximum(cover["start"].to_numpy(), cover["r_start"].to_numpy())
    hi = np.minimum(cover["end"].to_numpy(), cover["r_end"].to_numpy())
    whats, label = _labels(cover["what"])
    claims.take("nvtx", whats, lo, hi, label=label)
    for (what,), rows in cover.group_by("what"):
        details[("nvtx", str(what))] = {"gaps": rows.height, "activity": None}


def _cuda_api(w: RankWindow, claims: IdleClaims, details: dict) -> None:
    calls = w.api
    if calls.is_empty():
        return
    tax = w.taxonomy
    labels = [label for _, label in CUDA_CLASSES] + ["other CUDA call"]
    kind = pl.lit(len(CUDA_CLASSES), pl.Int8)
    # from the last class to the first, so that the first a call is of is what stays
    for i, (key, _) in reversed(list(enumerate(CUDA_CLASSES))):
        kind = pl.when(pl.col(key).fill_null(False)).then(pl.lit(i, pl.Int8)).otherwise(kind)
    # (the patterns run once per distinct name, not once per call; a byte per call)
    names = (
        calls.select("name")
        .unique()
        .with_columns(**{key: tax.is_api(key) for key, _ in CUDA_CLASSES})
        .select("name", kind=kind)
    )
    # a byte per call (one lookup pass over millions of calls, not one per class); each
    # class's bounds are gathered when it claims, not every class's held at once
    kind = by_name(calls.select("name"), names)["kind"].fill_null(-1).to_numpy()
    lo, hi = _arrays(calls)
    start, end, _gaps = claims.pieces
    # (the calls touching the gaps and the idle time in them, per name, for the rows'
    # details, found beside the claims: both only read the pieces as they are now)
    touched = second_lane("traceclf-cuda-calls").submit(
        _idle_in_calls, calls["name"], lo, hi, start, end
    )
    taken = claims.take_in_order("cuda_api", labels, lo, hi, kind)
    # per class, the calls touching the gaps and the name with the most idle time in its calls
    # (of equals, the first by name; not the most frequent: 20 cudaMemcpyAsync calls of 0.15 ms
    # named a row whose 177 ms were 10 cudaHostAlloc and 10 cudaFreeHost calls), from the
    # sums per name (a name is of one class), not a filter of every call per class
    counts = (
        touched.result()
        .join(names, on="name")
        .with_columns(pl.col("name").cast(pl.String))
        .sort(["kind", "ns", "name"], descending=[False, True, False])
        .group_by("kind", maintain_order=True)
        .agg(calls=pl.col("n").sum(), top_call=pl.col("name").first())
    )
    found = {row[0]: row[1:] for row in counts.iter_rows()}
    for i, label in enumerate(labels):
        if label in taken:
            n, top = found.get(i, (0, None))
            details[("cuda_api", label)] = {"calls": n, "top_call": top}


def _osrt(w: RankWindow, threads: np.ndarray, claims: IdleClaims, details: dict) -> None:
    calls = w.trace.osrt
    if calls.is_empty():
        return
    tax = w.taxonomy
    stacks = native_stacks(w.trace.callchains, "osrt", tax)
    calls = calls.join(stacks, left_on="callchain_id", right_on="id", how="left")
    classes = (
        calls.select("name")
        .unique()
        .with_columns(call_class=tax.osrt_class())
        .select(pl.col("name").cast(pl.String), "call_class")
    )
    class_of = dict(zip(classes["name"].to_list(), classes["call_class"].to_list(), strict=True))
    for tid in np.unique(threads):
        mine = calls.filter(pl.col("global_tid") == int(tid))
        if mine.is_empty():
            continue
        lo, hi = _arrays(mine)
        part = claims.split_touched(threads[claims.held[2]] == tid, lo, hi)
        hit = pl.Series(_touching(lo, hi, part.pieces[0], part.pieces[1]))
        names = mine["name"].cast(pl.String).fill_null("?")
        whats, codes = _labels(names)
        taken = part.take("osrt", whats, lo, hi, label=codes)
        claims.join(part)
        # the calls touching the gaps, per name: how many, and their most frequent top frame
        # (one pass over the thread's calls, not one filter of them per name)
        touching = {
            name: (calls_n, top)
            for name, calls_n, top in mine.select("what", name=names)
            .filter(hit)
            .group_by("name")
            .agg(pl.len(), pl.col("what").drop_nulls().mode().sort().first())
            .iter_rows()
        }
        for label in sorted(taken):
            entry = details.setdefault(
                ("osrt", label),
                {"calls": 0, "call_class": class_of.get(label), "top_frame": None},
            )
            calls_n, top = touching.get(label, (0, None))
            entry["calls"] += calls_n
            if entry["top_frame"] is None:
                entry["top_frame"] = top


def _sampled(
    w: RankWindow,
    source: str,
    threads: np.ndarray,
    cause: np.ndarray,
    claims: IdleClaims,
    details: dict,
) -> None:
    """Split what is left of the gaps of each (launching thread, idle cause) among the
    thread's samples that fall in it, by their top user frame."""
    trace, tax = w.trace, w.taxonomy
    if source == "python_sampling":
        sampled = python_samples(trace.py_frames, tax)
    else:
        sampled = cpu_samples(trace.samples, trace.callchains, tax).with_columns(
            leaf=pl.lit(None, pl.String)
        )
    if sampled.is_empty():  # (before the pieces: reading them cuts out a pending claim)
        return
    start, end, owner = claims.pieces
    if not len(start):
        return
    at = samples_in(sampled["start"].to_numpy(), start, end)
    gap = np.where(at >= 0, owner[np.maximum(at, 0)], -1)
    inside = (at >= 0) & (sampled["global_tid"].to_numpy() == threads[np.maximum(gap, 0)])
    if not inside.any():
        return
    key = ["thread", "cause"]
    hits = sampled.filter(pl.Series(inside)).with_columns(
        thread=pl.Series(threads[gap[inside]]), cause=pl.Series(cause[gap[inside]])
    )
    pools = (
        hits.group_by(key)
        .agg(n=pl.len())
        .filter(pl.col("n") >= tax.host_attribution["min_samples"])
    )
    if pools.is_empty():
        return
    pieces = pl.DataFrame(
        {"gap": owner, "ns": end - start, "thread": threads[owner], "cause": cause[owner]}
    ).join(pools.with_columns(taken=pl.lit(True)), on=key, how="left", maintain_order="left")
    taken = pieces["taken"].fill_null(False).to_numpy()
    shares = (
        hits.join(pools, on=key)
        .group_by(*key, "what")
        .agg(
            k=pl.len(),
            n=pl.col("n").first(),
            loading=pl.col("data_loading").sum(),
            leaf=pl.col("leaf").drop_nulls().mode().sort().first(),
        )
    )
    # each gap's part of its pool, split by the pool's samples per top user frame
    split = (
        pieces.filter(pl.col("taken").fill_null(False))
        .group_by("gap", *key)
        .agg(pl.col("ns").sum())
        .join(shares.select(*key, "what", "k", "n"), on=key)
        .with_columns(ns=(pl.col("ns") * pl.col("k") / pl.col("n")).round().cast(pl.Int64))
    )
    whats, label = _labels(split["what"])
    claims.record(source, whats, split["gap"].to_numpy(), split["ns"].to_numpy(), label)
    summary = shares.group_by("what").agg(
        samples=pl.col("k").sum(),
        loading=pl.col("loading").sum(),
        # (of the pools' leaves, the one of most samples: the same whatever their order)
        leaf=pl.col("leaf").sort_by("k", "leaf", descending=[True, False]).drop_nulls().first(),
    )
    native = (
        _native_beside(w, hits.join(pools, on=key), (start, end, owner), threads)
        if source == "python_sampling"
        else {}
    )
    for row in summary.iter_rows(named=True):
        entry = {"samples": int(row["samples"]), "data_loading_samples": int(row["loading"])}
        if row["leaf"] is not None:
            entry["innermost_frame"] = row["leaf"]
        if native.get(row["what"]):
            entry["hottest_native"] = native[row["what"]]
        details[(source, str(row["what"]))] = entry
    claims.pieces = (start[~taken], end[~taken], owner[~taken])


def _native_beside(
    w: RankWindow,
    hits: pl.DataFrame,
    pieces: Pieces,
    threads: np.ndarray,
) -> dict[str, list[dict]]:
    """Per top Python frame: the hottest native functions of the CPU samples (taken in the
    same stretches) whose nearest Python sample on their thread is in that frame — what the
    Python code ran underneath (numpy, a decoder, a tokenizer)."""
    trace = w.trace
    if trace.samples.is_empty():
        return {}
    native = cpu_samples(trace.samples, trace.callchains, w.taxonomy)
    start, end, owner = pieces
    at = samples_in(native["start"].to_numpy(), start, end)
    gap = np.where(at >= 0, owner[np.maximum(at, 0)], -1)
    inside = (at >= 0) & (native["global_tid"].to_numpy() == threads[np.maximum(gap, 0)])
    if not inside.any():
        return {}
    python = hits.select("start", "global_tid", python_what="what").sort("start")
    near = (
        native.filter(pl.Series(inside))
        .sort("start")
        .filter(pl.col("what") != NO_USER_FRAME)
        .join_asof(python, on="start", by="global_tid", strategy="nearest", check_sortedness=False)
        .drop_nulls("python_what")
        .group_by("python_what", "what")
        .agg(samples=pl.len())
        .sort(["samples", "what"], descending=[True, False])
        .group_by("python_what", maintain_order=True)
        .head(NATIVE_TOP)
    )
    out: dict[str, list[dict]] = {}
    for row in near.iter_rows(named=True):
        out.setdefault(row["python_what"], []).append(
            {"frame": row["what"], "samples": int(row["samples"])}
        )
    return out


def _sched(w: RankWindow, threads: np.ndarray, claims: IdleClaims) -> None:
    """The launching thread scheduled out: from each switch-out to the thread's next
    switch-in (a switch-in with no switch-out read before it says nothing of when it left)."""
    sched = w.trace.sched
    if sched.is_empty():
        return
    out = (
        sched.sort("global_tid", "start")
        .with_columns(
            end=pl.col("start").shift(-1).over("global_tid"),
            back_in=pl.col("running").shift(-1).over("global_tid"),
        )
        .filter(~pl.col("running") & pl.col("back_in").fill_null(False))
        .with_columns(
            what=pl.concat_str(
                pl.lit("thread not running ("), pl.col("block").cast(pl.String), pl.lit(")")
            ).fill_null("thread not running")
        )
    )
    for tid in np.unique(threads):
        mine = out.filter(pl.col("global_tid") == int(tid))
        if mine.is_empty():
            continue
        part = claims.split(threads[claims.pieces[2]] == tid)
        whats, codes = np.unique(mine["what"].to_numpy().astype(str), return_inverse=True)
        part.take("sched", whats.tolist(), *_arrays(mine), label=codes)
        claims.join(part)


def _rows(claimed: pl.DataFrame, details: dict, idle_ns: int, steps: int) -> list[dict]:
    """One row per (source, what), in the sources' order, the largest first within one; at
    most :data:`PER_SOURCE` per source (the rest summed as "other")."""
    totals = claimed.group_by("source", "what").agg(pl.col("ns").sum())
    out = []
    for source in SOURCES:
        mine = totals.filter(pl.col("source") == source).sort(
            ["ns", "what"], descending=[True, False]
        )
        shown = mine.head(PER_SOURCE)
        rest = mine.slice(PER_SOURCE)
        for row in shown.iter_rows(named=True):
            out.append(_row(source, row["what"], row["ns"], idle_ns, steps, details))
        if rest.height:
            detail = {"whats": rest.height}
            out.append(
                _row(source, "other", int(rest["ns"].sum()), idle_ns, steps, {})
                | {"detail": detail}
            )
    return out


def _row(source: str, what: str, ns: int, idle_ns: int, steps: int, details: dict) -> dict:
    return {
        "source": source,
        "what": what,
        "ms_per_step": round(ns / 1e6 / steps, 4),
        "frac_of_idle": round(ns / idle_ns, 4),
        "detail": details.get((source, what), {}),
    }


def _labels(names: pl.Series) -> tuple[list[str], np.ndarray]:
    """The distinct names, sorted, and each row's index among them (what ``np.unique`` with
    ``return_inverse`` gives, in polars: numpy sorts millions of Python strings one by one)."""
    names = names.cast(pl.String).fill_null("?")
    whats = names.unique().sort()
    return whats.to_list(), whats.search_sorted(names, side="left").to_numpy()


def _arrays(rows: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    return rows["start"].to_numpy(), rows["end"].to_numpy()


def _idle_in_calls(
    names: pl.Series, lo: np.ndarray, hi: np.ndarray, start: np.ndarray, end: np.ndarray
) -> pl.DataFrame:
    """Per name (``names``, one per call [lo, hi)), how many calls touch the idle pieces
    [start, end) (disjoint, sorted) and the idle time inside them: :data:`CALL_BLOCK` calls at
    a time, each block against the pieces between its first start and its last end (memory
    follows a block, not a window's millions of calls several times over)."""
    parts = []
    for a in range(0, len(lo), CALL_BLOCK):
        b = min(a + CALL_BLOCK, len(lo))
        call_lo, call_hi = lo[a:b], hi[a:b]
        # (a piece before these ends by the earliest call's start, one after starts at or
        # after the latest call's end: neither touches a call of the block)
        p = int(np.searchsorted(end, call_lo.min(), side="right"))
        q = int(np.searchsorted(start, call_hi.max(), side="left"))
        touching = _touching(call_lo, call_hi, start[p:q], end[p:q])
        if not touching.any():
            continue
        ns = Busy(start[p:q], end[p:q]).covered(call_lo[touching], call_hi[touching])
        parts.append(
            pl.DataFrame({"name": names.slice(a, b - a).filter(pl.Series(touching)), "ns": ns})
            .group_by("name")
            .agg(n=pl.len(), ns=pl.col("ns").sum())
        )
    if not parts:
        return pl.DataFrame(schema={"name": names.dtype, "n": pl.get_index_type(), "ns": pl.Int64})
    return pl.concat(parts).group_by("name").agg(pl.col("n").sum(), pl.col("ns").sum())


CALL_BLOCK = 1 << 20  # calls whose idle time :func:`_idle_in_calls` finds at once


def _touching(lo: np.ndarray, hi: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Whether each interval [lo, hi) overlaps one of the disjoint sorted pieces [start, end)."""
    if not len(start):
        return np.zeros(len(lo), bool)
    i = np.searchsorted(start, hi, side="left") - 1
    return (i >= 0) & (end[np.maximum(i, 0)] > lo)
