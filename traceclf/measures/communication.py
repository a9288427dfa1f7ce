"""The communication wall: communication kernels by collective kind, and how much of each
no compute hides (exposed)."""

from __future__ import annotations

import polars as pl

from traceclf.measures import intervals
from traceclf.measures.comm_calls import kernel_calls
from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow

# Kinds a kernel name cannot settle (NCCL's one SendRecv kernel serves all-to-all and P2P;
# rules/kernels.yaml): the NVTX ranges around the launch decide them when present.
REFINED_KINDS = ["send_recv_or_all_to_all", "send_recv", "other"]

# Collective kinds of data/tensor parallelism (gradient reduction, parameter gathers, TP
# collectives): what overlapping DP/TP communication can hide.
DP_TP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")

MEASURES: dict[str, str] = {
    "a2a_frac": "union of all-to-all kernels (EP dispatch/combine)",
    "a2a_exposed_frac": "all-to-all time with no compute kernel running",
    "dp_tp_exposed_frac": "union of all-reduce, reduce-scatter, all-gather, broadcast and reduce "
    "kernels (DP/TP collectives) with no compute kernel running",
}


def all_comm(w: RankWindow) -> pl.DataFrame:
    """The rank's communication kernels of the whole capture (not only the window: matching
    across ranks needs their order from the start, and a kernel that blocks the window may
    start before it), classified, kinds refined (:func:`refine_kinds`), in start order."""
    kernels = w.trace.kernels
    # the patterns run once per distinct name; only communication kernels are classified
    names = w.taxonomy.classify(kernels.select("name").unique())
    comm_names = names.filter(pl.col("is_comm"))["name"].implode()
    kern = w.taxonomy.classify(
        kernels.select("name", "pid", "stream_id", "correlation_id", "start", "end").filter(
            pl.col("name").is_in(comm_names)
        )
    )
    return refine_kinds(kern, w).sort("start")


def by_kind(w: RankWindow, comm: pl.DataFrame) -> dict[str, dict[str, float]]:
    """Per collective kind of ``comm`` (the window's communication kernels, kinds refined):
    share of the window, exposed share, kernel count, libraries."""
    out: dict[str, dict[str, float]] = {}
    for (kind,), rows in comm.group_by(["comm_kind"]):
        busy, exposed = _busy_exposed(w, rows)
        out[str(kind)] = {
            "frac": round(busy / w.wall, 4),
            "exposed_frac": round(exposed / w.wall, 4),
            "kernels": len(rows),
            "libraries": sorted(rows["comm_library"].drop_nulls().unique().to_list()),
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["frac"]))


def a2a(kinds: dict[str, dict[str, float]]) -> dict[str, float]:
    row = kinds.get("all_to_all", {})
    return {"a2a_frac": row.get("frac", 0.0), "a2a_exposed_frac": row.get("exposed_frac", 0.0)}


def dp_tp_exposed(w: RankWindow, comm: pl.DataFrame) -> dict[str, float]:
    """Exposed share of the step in DP/TP collectives: one union over their kinds (kernels of
    two kinds running at once count once)."""
    rows = comm.filter(pl.col("comm_kind").cast(pl.String).is_in(DP_TP_KINDS))
    return {"dp_tp_exposed_frac": _busy_exposed(w, rows)[1] / w.wall}


def _busy_exposed(w: RankWindow, rows: pl.DataFrame) -> tuple[int, int]:
    """ns of the window in which one of ``rows`` runs, and of those with no compute running."""
    running = Busy.of(intervals.clip(rows.select("start", "end"), w.spans))
    return running.total, running.total - w.layers.compute.overlap(running)


def refine_kinds(comm: pl.DataFrame, w: RankWindow) -> pl.DataFrame:
    """NCCL runs all-to-all and P2P through one SendRecv kernel; the NVTX ranges around the
    launching call say which it was. Sources are tried strongest first (rules/kernels.yaml:
    PyTorch's ``nccl:all_to_all`` before NCCL's own ``ncclAlltoAll``); within one source the
    ranges do not nest, so the latest one starting before the launch is the only candidate.
    Where no range names it, NCCL's payloads can: a group of sends and receives that reaches
    every rank of its communicator is an all-to-all, one that reaches fewer is send/recv.

    Adds the NCCL call behind each kernel (:func:`traceclf.measures.comm_calls.kernel_calls`:
    ``comm_id``, ``call``, ``msg_bytes``, ``peers``, ``nranks``; nulls where no payload says)."""
    calls = kernel_calls(w.trace, comm)
    comm = comm.join(calls, on="correlation_id", how="left")
    by_peers = (
        pl.when(pl.col("peers") >= pl.col("nranks"))
        .then(pl.lit("all_to_all"))
        .when(pl.col("peers").is_not_null() & pl.col("nranks").is_not_null())
        .then(pl.lit("send_recv"))
    )
    named = _nvtx_kinds(comm, w)
    if named is not None:
        comm = comm.join(named, on="correlation_id", how="left")
    else:
        comm = comm.with_columns(nvtx_kind=pl.lit(None, pl.String))
    return comm.with_columns(
        comm_kind=pl.when(pl.col("comm_kind").is_in(REFINED_KINDS))
        .then(pl.coalesce("nvtx_kind", by_peers, pl.col("comm_kind").cast(pl.String)))
        .otherwise(pl.col("comm_kind").cast(pl.String))
        .cast(comm.schema["comm_kind"])
    ).drop("nvtx_kind")


def _nvtx_kinds(comm: pl.DataFrame, w: RankWindow) -> pl.DataFrame | None:
    """(correlation_id, nvtx_kind) of the kernels a collective NVTX range names, strongest
    source first; None when no range names any."""
    trace = w.trace
    if comm.is_empty() or trace.nvtx.is_empty():
        return None
    calls = trace.call_index  # the call that launched each kernel, by correlationId
    launches = (
        comm.select(
            "correlation_id",
            calls.column("start", comm["pid"], comm["correlation_id"]),
            calls.column("global_tid", comm["pid"], comm["correlation_id"]),
        )
        .drop_nulls("start")
        .unique("correlation_id")
        .sort("start")
    )
    found = []
    for source in w.taxonomy.collective_sources:
        ranges = (
            w.collective_ranges.filter(pl.col("source") == source)
            .select("start", "global_tid", "nvtx_kind", nvtx_end="end")
            .sort("start")
        )
        if ranges.is_empty():
            continue
        found.append(
            launches.join_asof(
                ranges, on="start", by="global_tid", strategy="backward", check_sortedness=False
            )
            .filter(pl.col("start") <= pl.col("nvtx_end"))
            .select("correlation_id", pl.col("nvtx_kind").alias(source))
            .unique("correlation_id")
        )
    if not found:
        return None
    tagged = comm.select("correlation_id").unique()
    for table in found:
        tagged = tagged.join(table, on="correlation_id", how="left")
    return tagged.select("correlation_id", nvtx_kind=pl.coalesce([t.columns[1] for t in found]))
