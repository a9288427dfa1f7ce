"""What one rank's capture holds, before any wall is judged (the report's ``capture`` block,
docs/judgement.md): how much GPU work, whether it repeats, the evidence of a training loop (the
judge decides whether it is one: :mod:`traceclf.judge.abstention`), how CUDA graphs were
traced, whether GPU metrics and NCCL payloads are there, how much of the capture the window
covers, and the kernels that run only outside it."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.hostframes import in_window, samples_in
from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow, optimizer_ranges
from traceclf.model.taxonomy import by_name, match_counts
from traceclf.model.trace import DEVICE_TO_HOST, HOST_TO_DEVICE
from traceclf.steps.find import step_ranges


def capture_facts(w: RankWindow) -> dict:
    trace = w.trace
    # a sampled trace holds the analysed steps only: the loader measured the capture
    lo, hi = trace.capture_span or trace.span
    capture_ns = max(hi - lo, 1)
    work = _gpu_work_ns(w)
    kernels = trace.kernels
    training = _training_evidence(w)
    repeating = w.steps.source != "none"
    # NVTX step ranges are CPU time: without the CUDA API trace (correlation ids) they cannot
    # be placed on the GPU, so steps come from elsewhere or not at all; the report says why.
    # (The taxonomy's step pattern: a --step-range that matches nothing is warned about apart.)
    nvtx_steps = step_ranges(trace.nvtx, w.taxonomy.nvtx["step"])
    return {
        "gpu_work_ms": round(work / 1e6, 4),
        "capture_ms": round(capture_ns / 1e6, 4),
        "kernels": trace.capture_rows.get("kernels", len(kernels)),
        "graph_replays": len(trace.graph_executions),
        "window_share_of_capture": round(min(w.wall / capture_ns, 1.0), 4),
        "read_path": trace.read_path,
        "graph_trace_mode": graph_trace_mode(w),
        "gpu_metrics": not trace.metrics_of_gpu((w.gpu or {}).get("gpu_id")).is_empty(),
        "nccl_payload": trace.nccl_payload,
        "repeating": repeating,
        "training_evidence": training,
        "unusable_rows": dict(getattr(trace, "unusable_rows", {}) or {}),
        "pid_from_calls": trace.pid_from_calls,
        "cuda_api_traced": w.host_traced,
        "nvtx_step_ranges": 0 if nvtx_steps is None else len(nvtx_steps),
        "host_sources": list(trace.host_sources),
        "host_notes": dict(trace.host_notes),
        "diagnostics": diagnostics(
            trace.diagnostics, w.taxonomy, _rank_pid(trace), trace.processes
        ),
        # nsys's own work on the process over the whole capture (the window's share is the
        # measure profiler_overhead_frac): start-up, flushes, injection
        "profiler_overhead_ms": round(Busy.of(trace.overhead).total / 1e6, 4)
        if not trace.overhead.is_empty()
        else 0.0,
        "python_process": _python_process(w),
        "kernels_outside": kernels_outside(w),
        "copies_outside": copies_outside(w),
    }


# A kernel that never runs in the window is named when it holds this share of the capture's
# kernel time: a benchmark's second phase (1050 tiled GEMMs after 1050 naive ones, 42% of
# the kernel time) was outside the window and named nowhere.
OUTSIDE_SHARE = 0.1
OUTSIDE_SHOWN = 3


def kernels_outside(w: RankWindow) -> list[dict]:
    """The kernels (by short name) that run only outside the window and hold at least
    :data:`OUTSIDE_SHARE` of the capture's kernel time, largest first: ``name``, ``ms``,
    ``share``. None of a step-sampled read (it holds the analysed steps' kernels alone) nor
    with graph-level tracing (the window's kernels are hidden in the replays)."""
    trace = w.trace
    if trace.read_path != "whole" or graph_trace_mode(w) == "graph" or trace.kernels.is_empty():
        return []
    kernels = trace.kernels
    inside = in_window(w, kernels["start"].to_numpy())
    # (grouped by the categorical name, the few groups made strings after: not a string per
    # kernel of a whole capture's millions, 3x the time)
    per = (
        kernels.select(
            name=pl.coalesce(pl.col("short_name"), pl.col("name")),
            ns=pl.col("end") - pl.col("start"),
            inside=pl.Series(inside),
        )
        .group_by("name")
        .agg(pl.col("ns").sum(), pl.col("inside").any())
        .with_columns(pl.col("name").cast(pl.String))
    )
    total = int(per["ns"].sum())
    if not total:
        return []
    alone = (
        per.filter(~pl.col("inside") & (pl.col("ns") >= OUTSIDE_SHARE * total))
        .sort(["ns", "name"], descending=[True, False])
        .head(OUTSIDE_SHOWN)
    )
    return [
        {"name": name, "ms": round(ns / 1e6, 4), "share": round(ns / total, 4)}
        for name, ns in alone.select("name", "ns").iter_rows()
    ]


def copies_outside(w: RankWindow) -> dict | None:
    """The host<->device copies that run outside every step found (not only the window's: a
    warm-up step's copies are the steps' own kind), where they hold at least
    :data:`OUTSIDE_SHARE` of the capture's GPU work (kernels, graph-level replays, copies and
    memsets summed): ``ms``, ``share``; a benchmark's setup and read-back (69% of a public
    CUTLASS run's GPU time, which a window of its timed loop said nothing of). None
    otherwise, and for a step-sampled read (it holds the analysed steps' rows alone)."""
    trace = w.trace
    if trace.read_path != "whole":
        return None
    # (graph-level replays hide their kernels: their time is the GPU work they hold)
    work = _durations(trace.kernels) + _durations(trace.graphs) + _durations(trace.copies)
    host = trace.copies.filter(pl.col("direction").is_in([*HOST_TO_DEVICE, *DEVICE_TO_HOST]))
    starts = host["start"].to_numpy()
    steps = w.steps.table.drop_nulls(["gpu_start", "gpu_end"]).sort("gpu_start")
    in_steps = (
        samples_in(starts, steps["gpu_start"].to_numpy(), steps["gpu_end"].to_numpy()) >= 0
        if steps.height
        else np.zeros(len(starts), bool)
    )
    outside = host.filter(pl.Series(~in_window(w, starts) & ~in_steps))
    ns = _durations(outside)
    if not work or ns < OUTSIDE_SHARE * work:
        return None
    return {"ms": round(ns / 1e6, 4), "share": round(ns / work, 4)}


def _durations(rows: pl.DataFrame) -> int:
    return int((rows["end"] - rows["start"]).sum()) if rows.height else 0


DIAGNOSTICS_SHOWN = 20  # messages that matter, at most (each text cut by the loader)


def diagnostics(
    messages: pl.DataFrame, taxonomy, pid: int | None, processes: pl.DataFrame
) -> list[dict]:
    """nsys's warnings and errors that matter (the taxonomy's ``diagnostics`` kinds: dropped
    or lost data, a cut capture, CUPTI errors, what could not be collected), of the rank's
    process ``pid`` or of the capture as a whole (no traced process: the daemon, the
    analysis), each once; every error is kept (kind "error" when no entry names it)."""
    if messages.is_empty() or not {"severity", "text", "pid"} <= set(messages.columns):
        return []
    others = processes["pid"].filter(processes["pid"] != pid) if pid is not None else None
    mine = pl.lit(True) if others is None else ~pl.col("pid").is_in(others.implode())
    kept = (
        messages.filter(pl.col("severity").is_in(["warning", "error"]) & mine.fill_null(True))
        .with_columns(kind=taxonomy.diagnostic_kind("text"))
        .with_columns(
            kind=pl.when(pl.col("kind").is_null() & (pl.col("severity") == "error"))
            .then(pl.lit("error"))
            .otherwise("kind")
        )
        .filter(pl.col("kind").is_not_null())
        .unique(["kind", "text"], keep="first", maintain_order=True)
        .head(DIAGNOSTICS_SHOWN)
    )
    return [
        {"severity": r["severity"], "source": r["source"], "kind": r["kind"], "text": r["text"]}
        for r in kept.iter_rows(named=True)
    ]


def _rank_pid(trace) -> int | None:
    pids = trace.rank_pids
    return pids[0] if len(pids) == 1 else None


def _python_process(w: RankWindow) -> bool:
    """Whether the rank's process runs Python: its name or one of its threads' (a process
    started through ``env`` keeps its main thread's "python3"), or nsys's Python samples."""
    trace, pid = w.trace, _rank_pid(w.trace)
    processes, threads = trace.processes, trace.threads
    if pid is not None:
        processes = processes.filter(pl.col("pid") == pid)
        threads = threads.filter(pl.col("pid") == pid) if not threads.is_empty() else threads
    names = pl.concat(
        [
            processes["process_name"].cast(pl.String),
            threads["thread_name"].cast(pl.String)
            if not threads.is_empty()
            else pl.Series([], dtype=pl.String),
        ]
    ).drop_nulls()
    pattern = w.taxonomy.host_frames["python_process"]
    return bool(names.str.contains(pattern).any()) or not trace.py_frames.is_empty()


def _gpu_work_ns(w: RankWindow) -> int:
    """ns during which the trace's GPU work (kernels, graph replays, copies) runs: the window's
    busy time plus that of the few rows outside the window (warm-up, tail), rather than a
    union of every kernel again. Node-traced graph replays count the gaps between their nodes
    in the window's layers, not here: those traces take the union of every row."""
    trace = w.trace
    frames = (trace.kernels, trace.graphs, trace.copies)
    if trace.kernels["graph_node_id"].is_not_null().any():
        return Busy.of(*frames).total
    around = intervals.complement(w.spans)
    outside = [intervals.clip(f.select("start", "end"), around) for f in frames]
    return w.layers.work.total + Busy.of(*outside).total


def graph_trace_mode(w: RankWindow) -> str:
    """ "graph" (replays are GRAPH_TRACE rows, their kernels hidden), "node" (kernels inside
    graphs are rows with a graph node id) or "none" (no CUDA graph replayed)."""
    if not w.trace.graphs.is_empty():
        return "graph"
    if w.trace.kernels["graph_node_id"].is_not_null().any():
        return "node"
    return "none"


def optimizer_kernel_count(w: RankWindow, names: pl.DataFrame) -> int:
    """Kernels of the rank's whole capture that are the optimizer's: of the optimizer family
    by name, or launched inside an optimizer NVTX range and not communication; ``names`` is
    the capture's kernels, row for row, with ``optimizer`` and ``is_comm`` flags."""
    named = names["optimizer"].fill_null(False)
    ranges = optimizer_ranges(w.trace, w.taxonomy)
    if ranges.is_empty() or w.trace.kernels.is_empty():
        return int(named.sum())
    inside = pl.Series(w.trace.launched_within(w.trace.kernels, ranges))
    return int((named | (inside & ~names["is_comm"].fill_null(False))).sum())


def _training_evidence(w: RankWindow) -> dict:
    """Counts behind ``training_loop`` (judge/abstention.py), over what was read of the rank:
    the whole capture (graph-level traced runs show their backward and optimizer kernels only
    in the eager warm-up before capture), or a long capture's analysed steps, kernels and NVTX
    ranges alike."""
    trace, patterns = w.trace, w.taxonomy.training
    # the patterns run once per distinct name (a few hundred), not once per kernel (millions)
    flags = w.taxonomy.classify(trace.kernels.select("name").unique()).with_columns(
        optimizer=pl.col("family") == "optimizer",
        backward=pl.col("name").cast(pl.String).str.contains(patterns["backward_kernel"]),
        framework=pl.col("name").cast(pl.String).str.contains(patterns["framework_kernel"]),
    )
    names = by_name(
        trace.kernels.select("name", dur=pl.col("end") - pl.col("start")),
        flags.select("name", "optimizer", "backward", "framework", "is_comm"),
    )
    autograd = trace.threads.filter(
        pl.col("thread_name").str.contains(patterns["autograd_thread"])
    )["global_tid"]
    # kernels launched from an autograd thread (the launch found by correlationId)
    launcher = trace.launch_column("global_tid", trace.kernels)
    autograd_launches = int(launcher.is_in(autograd.implode()).sum())
    backward_ranges, optimizer_ranges, moe_ranges = match_counts(
        trace.nvtx["text"],
        [patterns["backward_nvtx"], w.taxonomy.nvtx["optimizer"], w.taxonomy.moe["nvtx"]],
    )
    total = int(names["dur"].sum())
    return {
        "backward_kernels": int(names["backward"].sum()),
        "autograd_launches": autograd_launches,
        "backward_ranges": backward_ranges,
        # optimizer kernels as the window counts them (window.py: _optimizer_family): named so,
        # or launched inside an optimizer NVTX range (communication excepted)
        "optimizer_kernels": optimizer_kernel_count(w, names),
        "optimizer_ranges": optimizer_ranges,
        "framework_kernel_frac": (
            round(int(names.filter("framework")["dur"].sum()) / total, 4) if total else None
        ),
        # mixture-of-experts routing: kernels or NVTX ranges named for it (taxonomy `moe`)
        "moe_kernels": int(
            flags.filter(pl.col("name").cast(pl.String).str.contains(w.taxonomy.moe["kernel"]))
            .join(names.select("name"), on="name")
            .height
        ),
        "moe_ranges": moe_ranges,
    }
