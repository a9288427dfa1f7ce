"""The steady-state window as a Chrome/Perfetto trace-event file (``--export-trace out.json``):
open it in https://ui.perfetto.dev or chrome://tracing next to the report.

One process track per rank (``pid`` = the report's rank number, named "rank N · pid P ·
file"), and in it one thread track per CUDA stream ("stream S": kernels, graph replays, copies
and memsets, each with ``args.stream``, ``args.correlation``, ``args.device``), one per host
thread with NVTX ranges ("NVTX · thread T") and one per host thread whose CUDA calls launched
that work ("CUDA API · thread T"), flow arrows from each call to its work, and the GPU metrics
of the rank's GPU as counter tracks. Slices are complete events (``"ph": "X"``) with
``ts``/``dur`` in µs on the export's own clock — the seconds nsys shows, so "open in nsys at t
= X s" in the report is the same X here. Ranks of different exports keep their own clocks (see
``cross_rank.clock`` in the report for their offsets).

The layout is PyTorch profiler's (Kineto's), which Holistic Trace Analysis reads: it wants one
file per rank with the rank in ``distributedInfo``, so a trace of several ranks also goes out
one rank a file (:func:`per_rank_folder`). docs/report-contract.md states the format.

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
API_TID_BASE = 2_000_000  # CUDA API calls of a host thread: a track of their own
FLOW_ID_STRIDE = 1 << 32  # flow ids: correlation id + the process track's index times this
METRIC_LABELS = {"sm_active": "SM active %", "sm_issue": "SM issue %",
                 "tensor_active": "tensor active %"}  # fmt: skip
EVENT_COLUMNS = ("name", "cat", "ph", "ts", "dur", "pid", "tid", "args")


def trace_json(
    reports: list[Report], traces: dict[str, Trace], *, ranks: list[tuple[str, dict]] | None = None
) -> tuple[str, int]:
    """The trace-event document for the ranks of ``reports`` (one job, or several runs) as JSON
    text, and its number of events, reading each rank's events from ``traces`` (``ranks[].file``
    -> its loaded trace). Events are written by polars frame by frame, never held as Python
    objects. Track ``pid`` is the rank number (numbered on across runs). ``ranks`` (label, rank)
    narrows it to those ranks; a document of one rank says which in ``distributedInfo``, where
    Holistic Trace Analysis reads it."""
    meta: list[dict] = []
    chunks: list[str] = []
    count = 0
    if ranks is None:
        ranks = rank_tracks(reports)
    for r, (run, rank) in enumerate(ranks):
        trace = traces[rank["file"]]
        lo, hi = (rank.get("steps") or {}).get("window_ns") or trace.span
        pid, track = int(rank["pid"]), int(rank["rank"]) if len(ranks) == 1 else r
        gpu = _gpu_events(trace, pid, (lo, hi))
        nvtx = _nvtx_events(trace, pid, (lo, hi))
        api, flows = _launch_events(trace, pid, gpu, r * FLOW_ID_STRIDE)
        counters = _counter_events(trace, pid, (lo, hi))
        name = f"{run}rank {rank['rank']} · pid {pid} · {Path(rank['file']).name}"
        meta += [_meta("process_name", track, 0, name), _meta("process_sort_index", track, 0, r)]
        streams = {s for frame in gpu for s in frame["tid"].unique().to_list()}
        for stream in sorted(streams):
            meta += [
                _meta("thread_name", track, stream, f"stream {stream}"),
                _meta("thread_sort_index", track, stream, stream),
            ]
        for label, frame in (("NVTX", nvtx), ("CUDA API", api)):
            for tid, thread in frame.select("tid", "thread").unique().sort("tid").iter_rows():
                meta += [
                    _meta("thread_name", track, tid, f"{label} · thread {thread}"),
                    _meta("thread_sort_index", track, tid, tid),
                ]
        for frame in (*gpu, nvtx.drop("thread"), api.drop("thread")):
            if frame.is_empty():
                continue
            frame = frame.with_columns(pid=pl.lit(track, pl.Int64)).sort("ts")
            chunks.append(frame.select(*EVENT_COLUMNS).write_json()[1:-1])
            count += len(frame)
        for frame in (*flows, counters):
            if not frame.is_empty():
                chunks.append(frame.with_columns(pid=pl.lit(track, pl.Int64)).write_json()[1:-1])
                count += len(frame)
    other = {
        "generator": f"traceclf {__version__}",
        "content": "steady-state window of each rank; ts in µs on each export's clock",
        "bounds": [report.bound for report in reports],
    }
    head = ""
    if len(ranks) == 1:  # (HTA finds the rank by the pattern '"rank": N': the space matters)
        job = next(rep for rep in reports if ranks[0][1] in rep.ranks)
        info = {"rank": int(ranks[0][1]["rank"]), "world_size": len(job.ranks)}
        head = f'"distributedInfo":{json.dumps(info)},'
    events = ",".join([json.dumps(m, ensure_ascii=False) for m in meta] + chunks)
    text = (
        f'{{{head}"traceEvents":[{events}],"displayTimeUnit":"ms",'
        f'"otherData":{json.dumps(other, ensure_ascii=False)}}}\n'
    )
    return text, count


def rank_tracks(reports: list[Report]) -> list[tuple[str, dict]]:
    """(label, rank) of every rank of ``reports``: the label names the run when there are
    several."""
    return [
        (f"run {i} · " if len(reports) > 1 else "", rank)
        for i, report in enumerate(reports, 1)
        for rank in report.ranks
    ]


def per_rank_folder(path: str | Path) -> Path:
    """Where the one-file-per-rank copies of a trace with several ranks go: ``trace.json`` ->
    ``trace.hta/`` (Holistic Trace Analysis reads one file per rank from a folder)."""
    path = Path(path)
    return path.with_name(f"{path.stem if path.suffix == '.json' else path.name}.hta")


def write_trace(
    reports: list[Report],
    path: str | Path,
    *,
    inputs: Iterable[Path] = (),
    use_cache: bool = True,
    cache_dir: Path | None = None,
) -> int:
    """Load each export of ``reports`` again (through the cache), write the trace-event file to
    ``path`` atomically (never onto ``inputs`` or the reports' own inputs) and return its
    number of events. With several ranks, also one file per rank into
    :func:`per_rank_folder` (``rank<N>.json``; several runs: ``run<i>/rank<N>.json``), written
    together with it, for Holistic Trace Analysis.

    A report names each export as text (:func:`~traceclf.support.escape.path_text`: a byte
    that is not UTF-8 written out as ``\\xff``): the file is the one of ``inputs`` so named."""
    from traceclf.ingest.cache import open_trace
    from traceclf.support.atomic import written_together
    from traceclf.support.escape import path_text

    # (the caller's paths last: the files a report names as text are those, where both name one)
    inputs = [*(path for report in reports for path in report.input_files()), *inputs]
    named = {path_text(p): p for p in inputs}
    traces = {
        file: open_trace(named.get(file, file), use_cache=use_cache, cache_dir=cache_dir)
        for file in dict.fromkeys(r["file"] for report in reports for r in report.ranks)
    }
    text, count = trace_json(reports, traces)
    tracks = rank_tracks(reports)
    with written_together(inputs) as files:
        files.add(path, text, named=True)
        if len(tracks) > 1:
            from traceclf.export.files import make_folder

            folder = per_rank_folder(path)
            for i, report in enumerate(reports, 1):
                sub = folder / f"run{i}" if len(reports) > 1 else folder
                files.made(make_folder(sub))  # (removed on failure, if still empty)
                for rank in report.ranks:
                    one, _ = trace_json([report], traces, ranks=[("", rank)])
                    files.add(sub / f"rank{rank['rank']}.json", one)
    return count


def _gpu_events(trace: Trace, pid: int, window: tuple[int, int]) -> list[pl.DataFrame]:
    """Kernels, graph replays, and copies and memsets of one process overlapping the window:
    one frame per kind, each with its own ``args``. Every one carries ``stream``,
    ``correlation`` and ``device`` in ``args``, the fields by which Holistic Trace Analysis
    (and PyTorch's profiler traces) tell GPU work and link it to the call that launched it."""
    gpu_args = {
        "stream": pl.col("stream_id").cast(pl.Int64),
        "correlation": pl.col("correlation_id"),
        "device": pl.col("device_id").cast(pl.Int64),
    }
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
            **gpu_args,
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
        args=pl.struct(**gpu_args, graph_id="graph_id"),
    )
    copies = _inside(trace.copies, pid, window).select(
        name=pl.format("{} {}", pl.col("op"), pl.col("direction").fill_null("")),
        cat=pl.format("gpu_{}", pl.col("op").cast(pl.String)),
        start="start",
        end="end",
        tid="stream_id",
        args=pl.struct(**gpu_args, bytes="bytes"),
    )
    return [_complete(f) for f in (kernels, graphs, copies) if not f.is_empty()]


def _launch_events(
    trace: Trace, pid: int, gpu: list[pl.DataFrame], flow_base: int
) -> tuple[pl.DataFrame, list[pl.DataFrame]]:
    """The CUDA API calls that launched the GPU work of ``gpu`` (one track per host thread,
    ``args.correlation``), and an arrow from each call to its work: flow events ``"ph": "s"``
    on the call and ``"f"`` (binding to the enclosing slice) on the kernel, both with ``id`` =
    ``flow_base`` + the correlation id."""
    work = pl.concat(
        [f.select("ts", "tid", corr=pl.col("args").struct.field("correlation")) for f in gpu]
        or [pl.DataFrame(schema={"ts": pl.Float64, "tid": pl.Int64, "corr": pl.Int64})]
    ).drop_nulls("corr")
    api = trace.api
    if work.is_empty() or api.is_empty():
        return _empty().with_columns(thread=pl.lit(None, pl.Int64)), []
    calls = (
        api.filter(pl.col("pid") == pid)
        .join(work.select(correlation_id="corr").unique(), on="correlation_id", how="semi")
        .with_columns(thread=(pl.col("global_tid") % (1 << 24)).cast(pl.Int64))
    )
    threads = calls["thread"].unique().sort().to_list()
    track = {t: API_TID_BASE + i for i, t in enumerate(threads)}
    calls = calls.with_columns(tid=pl.col("thread").replace_strict(track, return_dtype=pl.Int64))
    events = _complete(
        calls.select(
            name=pl.col("name").cast(pl.String),
            cat=pl.lit("cuda_runtime"),
            start="start",
            end="end",
            tid="tid",
            args=pl.struct(correlation="correlation_id"),
            thread="thread",
        )
    )
    ends = work.join(
        events.select("tid", "ts", corr=pl.col("args").struct.field("correlation")),
        on="corr",
        suffix="_call",
    ).unique("corr", keep="first")
    flow = {"cat": pl.lit("ac2g"), "name": pl.lit("ac2g"), "id": pl.col("corr") + flow_base}
    return events, [
        ends.select(ph=pl.lit("s"), ts="ts_call", tid="tid_call", **flow).sort("ts"),
        ends.select(ph=pl.lit("f"), ts="ts", tid="tid", bp=pl.lit("e"), **flow).sort("ts"),
    ]


def _counter_events(trace: Trace, pid: int, window: tuple[int, int]) -> pl.DataFrame:
    """The GPU-metric samples of the process's GPU in the window as counter tracks (``"ph":
    "C"``), one per metric: ``args.value`` in %."""
    metrics = trace.gpu_metrics
    if metrics.is_empty():
        return pl.DataFrame()
    gpu = trace.gpu_of(pid)
    lo, hi = window
    samples = trace.metrics_of_gpu(gpu["gpu_id"] if gpu else None).filter(
        pl.col("timestamp").is_between(lo, hi)
    )
    return samples.sort("timestamp").select(
        name=pl.col("metric").cast(pl.String).replace(METRIC_LABELS),
        cat=pl.lit("gpu_metric"),
        ph=pl.lit("C"),
        ts=(pl.col("timestamp") / 1e3).round(3),
        tid=pl.lit(0, pl.Int64),
        args=pl.struct(value=pl.col("value").cast(pl.Float64).round(2)),
    )


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
