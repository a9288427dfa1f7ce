"""The steady-state window as a Chrome/Perfetto trace-event file (``--export-trace out.json``):
open it in https://ui.perfetto.dev or chrome://tracing next to the report.

One process track per rank (``pid`` = the report's rank number, named "rank N · pid P ·
file"), and in it one thread track per CUDA stream ("stream S": kernels, graph replays, copies
and memsets) and one per host thread with NVTX ranges ("NVTX · thread T"). Every event is a
complete event (``"ph": "X"``) with ``ts``/``dur`` in µs on the export's own clock — the seconds
nsys shows, so "open in nsys at t = X s" in the report is the same X here. Ranks of different
exports keep their own clocks (see ``cross_rank.clock`` in the report for their offsets).

Names come from the trace (kernel names short and full, NVTX text and domains): they go
through :func:`traceclf.support.escape.visible` (control characters written out); JSON quoting
is the encoder's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from traceclf.support.version import __version__

if TYPE_CHECKING:
    from traceclf.model.trace import Trace
    from traceclf.report.contract import Report

NVTX_TID_BASE = 1_000_000  # host-thread tracks after the stream tracks, never the same tid


def trace_json(reports: list[Report], traces: dict[str, Trace]) -> tuple[str, int]:
    """The trace-event document for the ranks of ``reports`` (one job, or several runs) as JSON
    text, and its number of events, reading each rank's events from ``traces`` (``ranks[].file``
    -> its loaded trace). Events are written by polars frame by frame, never held as Python
    objects. Track ``pid`` is the rank number (numbered on across runs)."""
    meta: list[dict] = []
    chunks: list[str] = []
    count = 0
    ranks = [
        (f"run {i} · " if len(reports) > 1 else "", rank)
        for i, report in enumerate(reports, 1)
        for rank in report.ranks
    ]
    for r, (run, rank) in enumerate(ranks):
        trace = traces[rank["file"]]
        lo, hi = (rank.get("steps") or {}).get("window_ns") or trace.span
        pid = int(rank["pid"])
        gpu, nvtx = _gpu_events(trace, pid, (lo, hi)), _nvtx_events(trace, pid, (lo, hi))
        name = f"{run}rank {rank['rank']} · pid {pid} · {Path(rank['file']).name}"
        meta += [_meta("process_name", r, 0, name), _meta("process_sort_index", r, 0, r)]
        streams = {s for frame in gpu for s in frame["tid"].unique().to_list()}
        for stream in sorted(streams):
            meta += [
                _meta("thread_name", r, stream, f"stream {stream}"),
                _meta("thread_sort_index", r, stream, stream),
            ]
        for tid, thread in nvtx.select("tid", "thread").unique().sort("tid").iter_rows():
            meta += [
                _meta("thread_name", r, tid, f"NVTX · thread {thread}"),
                _meta("thread_sort_index", r, tid, tid),
            ]
        for frame in (*gpu, nvtx.drop("thread")):
            if frame.is_empty():
                continue
            frame = frame.with_columns(pid=pl.lit(r, pl.Int64)).sort("ts")
            chunks.append(frame.select(*EVENT_COLUMNS).write_json()[1:-1])
            count += len(frame)
    other = {
        "generator": f"traceclf {__version__}",
        "content": "steady-state window of each rank; ts in µs on each export's clock",
        "bounds": [report.bound for report in reports],
    }
    events = ",".join([json.dumps(m, ensure_ascii=False) for m in meta] + chunks)
    text = (
        f'{{"traceEvents":[{events}],"displayTimeUnit":"ms",'
        f'"otherData":{json.dumps(other, ensure_ascii=False)}}}\n'
    )
    return text, count


EVENT_COLUMNS = ("name", "cat", "ph", "ts", "dur", "pid", "tid", "args")


def write_trace(
    reports: list[Report],
    path: str | Path,
    *,
    inputs: Iterable[Path] = (),
    use_cache: bool = True,
    cache_dir: Path | None = None,
) -> int:
    """Load each export of ``reports`` again (through the cache), write the trace-event file to
    ``path`` atomically (never onto an input) and return the number of events."""
    from traceclf.ingest.cache import open_trace
    from traceclf.support.atomic import write_output

    traces = {
        file: open_trace(file, use_cache=use_cache, cache_dir=cache_dir)
        for file in dict.fromkeys(r["file"] for report in reports for r in report.ranks)
    }
    text, count = trace_json(reports, traces)
    write_output(path, text, inputs=inputs)
    return count


def _gpu_events(trace: Trace, pid: int, window: tuple[int, int]) -> list[pl.DataFrame]:
    """Kernels, graph replays, and copies and memsets of one process overlapping the window:
    one frame per kind, each with its own ``args``."""
    kernels = _inside(trace.kernels, pid, window).with_columns(
        full_name=pl.col("name").cast(pl.String)
    )
    kernels = _made_visible(kernels, "full_name").select(
        name=pl.col("short_name").cast(pl.String).fill_null(pl.col("name").cast(pl.String)),
        cat=pl.lit("kernel"),
        start="start",
        end="end",
        tid="stream_id",
        args=pl.struct(
            "correlation_id",
            grid=pl.col("grid_blocks"),
            block=pl.col("block_threads"),
            full_name="full_name",
        ),
    )
    graphs = _inside(trace.graphs, pid, window).select(
        name=pl.format("CUDA graph {}", pl.col("graph_id")),
        cat=pl.lit("graph"),
        start="start",
        end="end",
        tid="stream_id",
        args=pl.struct("correlation_id", "graph_id"),
    )
    copies = _inside(trace.copies, pid, window).select(
        name=pl.format("{} {}", pl.col("op"), pl.col("direction").fill_null("")),
        cat=pl.col("op").cast(pl.String),
        start="start",
        end="end",
        tid="stream_id",
        args=pl.struct("correlation_id", "bytes"),
    )
    return [_complete(f) for f in (kernels, graphs, copies) if not f.is_empty()]


def _nvtx_events(trace: Trace, pid: int, window: tuple[int, int]) -> pl.DataFrame:
    """NVTX ranges of one process overlapping the window, one track per host thread."""
    ranges = _inside(trace.nvtx, pid, window)
    if ranges.is_empty():
        return _empty().with_columns(thread=pl.lit(None, pl.Int64))
    threads = ranges["tid"].unique().sort().to_list()
    track = {t: NVTX_TID_BASE + i for i, t in enumerate(threads)}
    ranges = _made_visible(ranges.with_columns(pl.col("domain").cast(pl.String)), "domain")
    return _complete(
        ranges.select(
            name=pl.col("text").cast(pl.String).fill_null("<unnamed range>"),
            cat=pl.lit("nvtx"),
            start="start",
            end="end",
            tid=pl.col("tid").replace_strict(track, return_dtype=pl.Int64),
            args=pl.struct(domain=pl.col("domain").cast(pl.String)),
            thread=pl.col("tid").cast(pl.Int64),
        )
    )


def _inside(df: pl.DataFrame, pid: int, window: tuple[int, int]) -> pl.DataFrame:
    if df.is_empty():
        return df
    lo, hi = window
    return df.filter((pl.col("pid") == pid) & (pl.col("start") < hi) & (pl.col("end") > lo))


def _made_visible(df: pl.DataFrame, column: str) -> pl.DataFrame:
    """``df`` with the text of ``column`` made visible (control characters written out), once
    per distinct value."""
    from traceclf.support.escape import visible

    values = df.select(column).unique()
    shown = values.with_columns(_shown=pl.col(column).map_elements(visible, return_dtype=pl.String))
    return (
        df.join(shown, on=column, how="left", nulls_equal=True)
        .with_columns(pl.col("_shown").alias(column))
        .drop("_shown")
    )


def _complete(df: pl.DataFrame) -> pl.DataFrame:
    """Complete events with µs times; names made visible once per distinct name."""
    return (
        _made_visible(df, "name")
        .with_columns(
            ph=pl.lit("X"),
            ts=(pl.col("start") / 1e3).round(3),
            dur=((pl.col("end") - pl.col("start")).clip(lower_bound=0) / 1e3).round(3),
            tid=pl.col("tid").cast(pl.Int64),
        )
        .drop("start", "end")
    )


def _empty() -> pl.DataFrame:
    return pl.DataFrame(
        schema={
            "name": pl.String,
            "cat": pl.String,
            "ph": pl.String,
            "ts": pl.Float64,
            "dur": pl.Float64,
            "tid": pl.Int64,
            "args": pl.Struct({}),
        }
    )


def _meta(kind: str, pid: int, tid: int, value: str | int) -> dict:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    from traceclf.support.escape import visible

    return {
        "name": kind,
        "ph": "M",
        "pid": pid,
        "tid": tid,
        "args": {key: visible(value) if isinstance(value, str) else value},
    }
