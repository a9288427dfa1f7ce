"""What a host sample or OS runtime call was doing, from its frames: the top user frame (the
innermost frame of the program, not of the system or of a library) and whether the stack shows
data loading. The patterns are the taxonomy's ``host_frames`` (rules/hostside.yaml); they run
once per distinct frame, never per sample.

- Python samples (nsys ``--python-sampling``): the innermost frame whose file is not a library
  (``python_library``: site-packages, the standard library), else the innermost frame; named
  ``function (file name)``.
- Native frames (CPU samples, OS runtime callchains): the innermost resolved frame whose module
  is not the system's (``system_module``: libc, the loader, the kernel, the profiler's own);
  named ``symbol (module name)``.
- Data loading: any frame of the stack whose ``function file`` (Python) or ``symbol module``
  (native) matches ``data_loading``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.model.taxonomy import Taxonomy

if TYPE_CHECKING:
    from traceclf.measures.window import RankWindow

FRAME_NAME_CHARS = 160  # a C++ symbol can run to kilobytes: names are cut for the report
NO_USER_FRAME = "[no user frame]"  # a CPU sample whose frames are all the system's


def python_samples(frames: pl.DataFrame, taxonomy: Taxonomy) -> pl.DataFrame:
    """One row per Python sample of ``frames`` (``py_frames``): start, global_tid, ``what``
    (its top user frame), ``leaf`` (its innermost frame), ``running`` and ``data_loading``."""
    schema = {
        "start": pl.Int64,
        "global_tid": pl.Int64,
        "what": pl.String,
        "leaf": pl.String,
        "running": pl.Boolean,
        "data_loading": pl.Boolean,
    }
    if frames.is_empty():
        return pl.DataFrame(schema=schema)
    patterns = taxonomy.host_frames
    distinct = (
        frames.select("function", "file")
        .unique()
        .with_columns(
            text=pl.concat_str(
                pl.col("function").cast(pl.String), pl.col("file").cast(pl.String), separator=" "
            )
        )
        .with_columns(
            library=pl.col("file").cast(pl.String).str.contains(patterns["python_library"]),
            loading=pl.col("text").fill_null("").str.contains(patterns["data_loading"]),
            name=_named(pl.col("function"), _basename(pl.col("file"))),
        )
        .drop("text")
    )
    rows = frames.join(distinct, on=["function", "file"], how="left")
    return (
        rows.sort("sample", "depth")
        .group_by("sample", maintain_order=True)
        .agg(
            pl.col("start").first(),
            pl.col("global_tid").first(),
            what=pl.coalesce(
                pl.col("name").filter(~pl.col("library").fill_null(False)).first(),
                pl.col("name").first(),
            ),
            leaf=pl.col("name").first(),
            running=(pl.col("state").cast(pl.String).first() == "Running").fill_null(False),
            data_loading=pl.col("loading").fill_null(False).any(),
        )
        .select(list(schema))
    )


def native_stacks(callchains: pl.DataFrame, source: str, taxonomy: Taxonomy) -> pl.DataFrame:
    """Per callchain id of ``source`` ("sampling" or "osrt"): ``what`` (its top user frame:
    null when every frame is the system's) and ``data_loading``."""
    schema = {"id": pl.Int64, "what": pl.String, "data_loading": pl.Boolean}
    chains = (
        callchains.filter(pl.col("source") == source) if not callchains.is_empty() else callchains
    )
    if chains.is_empty():
        return pl.DataFrame(schema=schema)
    patterns = taxonomy.host_frames
    distinct = (
        chains.select("symbol", "module")
        .unique()
        .with_columns(
            text=pl.concat_str(
                pl.col("symbol").cast(pl.String), pl.col("module").cast(pl.String), separator=" "
            ).fill_null("")
        )
        .with_columns(
            system=pl.col("module")
            .cast(pl.String)
            .fill_null("")
            .str.contains(patterns["system_module"]),
            loading=pl.col("text").str.contains(patterns["data_loading"]),
            name=_named(pl.col("symbol"), _basename(pl.col("module"))),
        )
        .drop("text")
    )
    user = ~pl.col("system") & ~pl.col("unresolved").fill_null(False)
    return (
        chains.join(distinct, on=["symbol", "module"], how="left")
        .sort("id", "depth")
        .group_by("id", maintain_order=True)
        .agg(
            what=pl.col("name").filter(user).first(),
            data_loading=pl.col("loading").fill_null(False).any(),
        )
        .select(list(schema))
    )


def cpu_samples(
    samples: pl.DataFrame, callchains: pl.DataFrame, taxonomy: Taxonomy
) -> pl.DataFrame:
    """One row per CPU sample: start, global_tid, ``what`` (its top user frame, or
    :data:`NO_USER_FRAME`) and ``data_loading``."""
    schema = {
        "start": pl.Int64,
        "global_tid": pl.Int64,
        "what": pl.String,
        "data_loading": pl.Boolean,
    }
    if samples.is_empty():
        return pl.DataFrame(schema=schema)
    stacks = native_stacks(callchains, "sampling", taxonomy)
    return (
        samples.join(stacks, left_on="sample_id", right_on="id", how="left")
        .with_columns(
            what=pl.col("what").fill_null(NO_USER_FRAME),
            data_loading=pl.col("data_loading").fill_null(False),
        )
        .select(list(schema))
    )


def _basename(col: pl.Expr) -> pl.Expr:
    return col.cast(pl.String).str.extract(r"([^/]*)$", 1)


def _named(function: pl.Expr, where: pl.Expr) -> pl.Expr:
    """``function (where)``, cut to :data:`FRAME_NAME_CHARS` characters."""
    name = pl.concat_str(
        function.cast(pl.String).fill_null("?"),
        pl.lit(" ("),
        where.fill_null("?"),
        pl.lit(")"),
    )
    return name.str.slice(0, FRAME_NAME_CHARS)


def launching_threads(w: RankWindow, gstart: np.ndarray, gend: np.ndarray) -> np.ndarray:
    """Per idle gap: the thread (global tid) whose CUDA call launched the GPU work that ends
    it, found by correlationId; where none is found (the window's last gap), the thread that
    ends most gaps (when none does, the one that made most CUDA calls); -1 without a CUDA API
    trace."""
    out = np.full(len(gstart), -1, np.int64)
    trace = w.trace
    if not len(gstart) or trace.api.is_empty():
        return out
    # the work starting where a gap ends (of several that start together, the first launched),
    # taken from each frame on its own, its three columns only: no copy of every kernel, nor
    # of a launch-bound window's millions of kernels' every column
    ending = _merged_by_start(
        [
            _starting_at(f.select("start", "pid", "correlation_id"), gend).select(
                pl.col("start").cast(pl.Int64),
                pl.col("pid").cast(pl.Int64),
                pl.col("correlation_id").cast(pl.Int64),
            )
            # (the capture's, not the window's: the last gap ends where the next step's
            # first work starts, which is the window's end)
            for f in (trace.kernels, trace.graph_executions, trace.copies)
            if not f.is_empty()
        ]
    )
    # of several that start together, the first launched (then the lowest pid): in start
    # order, the few that share one sorted again (a sort by two keys of millions of rows cost
    # ~1 s); their order no longer matters, each gap is found by its end
    starts = ending["start"].to_numpy()
    same = starts[1:] == starts[:-1]
    tie = np.zeros(len(starts), bool)
    tie[1:] = same
    tie[:-1] |= same
    if tie.any():
        first = (
            ending.filter(pl.Series(tie))
            .sort("start", "correlation_id", "pid")
            .unique("start", keep="first", maintain_order=True)
        )
        ending = pl.concat([ending.filter(pl.Series(~tie)), first])
    tids = trace.call_index.column("global_tid", ending["pid"], ending["correlation_id"])
    found = pl.DataFrame({"end": ending["start"], "tid": tids.cast(pl.Int64)}).drop_nulls()
    if not found.is_empty():
        at = np.searchsorted(gend, found["end"].to_numpy())
        out[at] = found["tid"].to_numpy()
    known = out[out >= 0]
    if len(known):  # the thread that ends most gaps (of a tie, the lowest id)
        counts = pl.Series("tid", known).value_counts(name="n")
        out[out < 0] = int(counts.sort(["n", "tid"], descending=[True, False])["tid"][0])
    else:
        calls = trace.api["global_tid"].drop_nulls()
        out[:] = int(calls.mode()[0]) if len(calls) else -1
    return out


def _merged_by_start(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """``parts`` (start, pid, correlation_id) as one frame in start order: merged, where each
    is in start order already (the trace's frames are), rather than joined and sorted, which
    held three copies of a launch-bound window's millions of rows (0.3 GB of the kernel-dense
    input's ``--all-steps`` run); sorted where one is not."""
    if not parts:
        return pl.DataFrame(schema={"start": pl.Int64, "pid": pl.Int64, "correlation_id": pl.Int64})
    if not all(part["start"].is_sorted() for part in parts):
        return pl.concat(parts).sort("start")
    merged = parts[0].set_sorted("start")
    for part in parts[1:]:
        merged = merged.merge_sorted(part.set_sorted("start"), key="start")
    return merged


def _starting_at(rows: pl.DataFrame, times: np.ndarray) -> pl.DataFrame:
    """The rows that start at one of ``times`` (sorted): by binary search, not a hash set of
    a window's millions of gap ends."""
    start = rows["start"].cast(pl.Int64).fill_null(-1).to_numpy()
    at = np.searchsorted(times, start).clip(max=len(times) - 1)
    return rows.filter(pl.Series(times[at] == start))


def loading_gaps(w: RankWindow, gstart: np.ndarray, gend: np.ndarray) -> np.ndarray:
    """Per gap: whether the launching thread was loading data in it — at least
    ``data_loading_share`` of its samples there (nsys's Python samples when the export has
    them, else CPU samples; at least ``min_samples``) show a data-loading frame
    (``host_frames.data_loading``)."""
    out = np.zeros(len(gstart), bool)
    trace, tax = w.trace, w.taxonomy
    if not len(gstart) or (trace.py_frames.is_empty() and trace.samples.is_empty()):
        return out
    sampled = (
        python_samples(trace.py_frames, tax)
        if not trace.py_frames.is_empty()
        else cpu_samples(trace.samples, trace.callchains, tax)
    )
    threads = launching_threads(w, gstart, gend)
    at = samples_in(sampled["start"].to_numpy(), gstart, gend)
    mine = at >= 0
    mine[mine] &= sampled["global_tid"].to_numpy()[mine] == threads[at[mine]]
    if not mine.any():
        return out
    n = np.bincount(at[mine], minlength=len(gstart))
    loading = np.bincount(
        at[mine], weights=sampled["data_loading"].to_numpy()[mine], minlength=len(gstart)
    )
    limits = tax.host_attribution
    return (n >= limits["min_samples"]) & (loading >= limits["data_loading_share"] * n)


def samples_in(times: np.ndarray, gstart: np.ndarray, gend: np.ndarray) -> np.ndarray:
    """The gap (disjoint, sorted) each instant falls in, or -1."""
    at = np.searchsorted(gstart, times, side="right") - 1
    inside = (at >= 0) & (times < gend[np.maximum(at, 0)])
    return np.where(inside, at, -1)


def in_window(w: RankWindow, times: np.ndarray) -> np.ndarray:
    """Whether each instant of ``times`` falls inside the window's spans."""
    spans = intervals.spans_of(w.spans)
    los = np.array([lo for lo, _ in spans], np.int64)
    his = np.array([hi for _, hi in spans], np.int64)
    return samples_in(times, los, his) >= 0
