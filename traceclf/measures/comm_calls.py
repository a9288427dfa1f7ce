"""Which NCCL call launched each communication kernel, from NCCL's own NVTX ranges and their
payloads (the trace's ``nccl`` frame): the communicator, the message size NCCL reports and,
for grouped point-to-point calls, how many ranks the group sent to.

NCCL launches a collective's kernel inside the range of its call (``ncclAllReduce`` ...), on the
calling thread. Grouped calls (``ncclGroupStart``; ``ncclSend``/``ncclRecv`` per peer;
``ncclGroupEnd``: PyTorch's ``all_to_all_single`` with uneven splits, pipeline send/recv) launch
one kernel inside ``ncclGroupEnd``: its communicator and bytes are those of the sends and
receives since the group started. A kernel no payload names takes the communicator of the other
kernels of its stream when they have exactly one (PyTorch runs each communicator on a stream of
its own). Nothing here is guessed beyond that: a kernel with neither keeps nulls.
"""

from __future__ import annotations

import polars as pl

from traceclf.model.trace import Trace

# NCCL's grouping calls (NVTX ranges of the NCCL domain, no payload)
GROUP_START, GROUP_END = "ncclGroupStart", "ncclGroupEnd"
# calls of a group whose bytes are summed: what one rank sends, and what it receives
SEND, RECV = "ncclSend", "ncclRecv"
GROUPED = "ncclGroupEnd"  # the call a grouped kernel is attributed to
CALL_COLUMNS = {
    "correlation_id": pl.Int64,
    "comm_id": pl.UInt64,
    "call": pl.String,
    "msg_bytes": pl.Int64,  # NCCL's "Message size [bytes]"; a group: max(sent, received)
    "peers": pl.Int64,  # a group: distinct ranks it sent or received from (itself included)
    "nranks": pl.Int64,  # ranks of the communicator (from its creation, in this process)
}


def kernel_calls(trace: Trace, comm: pl.DataFrame) -> pl.DataFrame:
    """One row per communication kernel of ``comm`` (pid, correlation_id, stream_id) that the
    payloads name (:data:`CALL_COLUMNS`); empty without payload values."""
    nccl = trace.nccl
    if nccl.is_empty() or comm.is_empty() or "comm_id" not in nccl.columns:
        return pl.DataFrame(schema=CALL_COLUMNS)
    calls = trace.call_index
    launches = (
        comm.select(
            "correlation_id",
            "stream_id",
            start=calls.column("start", comm["pid"], comm["correlation_id"]),
            global_tid=calls.column("global_tid", comm["pid"], comm["correlation_id"]),
        )
        .drop_nulls("start")
        .unique("correlation_id")
        .sort("start")
    )
    sized = nccl.filter(pl.col("bytes").is_not_null() & pl.col("comm_id").is_not_null())
    direct = _inside(launches, sized.filter(~pl.col("call").is_in([SEND, RECV])))
    grouped = _grouped(launches, sized, trace.nvtx)
    found = pl.concat([direct, grouped.join(direct, on="correlation_id", how="anti")])
    found = _by_stream(launches, found).join(_sizes(nccl), on="comm_id", how="left")
    return found.select(pl.col(c).cast(t) for c, t in CALL_COLUMNS.items())


def _inside(launches: pl.DataFrame, ranges: pl.DataFrame) -> pl.DataFrame:
    """Launches made inside a payload range on their thread (NCCL's calls do not nest)."""
    if ranges.is_empty():
        return pl.DataFrame(schema=CALL_COLUMNS)
    spans = ranges.select("start", "global_tid", "call", "comm_id", "bytes", r_end="end")
    return _launched_within(launches, spans, "start", "r_end").select(
        "correlation_id",
        "comm_id",
        "call",
        msg_bytes="bytes",
        peers=pl.lit(None, pl.Int64),
        nranks=pl.lit(None, pl.Int64),
    )


def _launched_within(
    launches: pl.DataFrame, spans: pl.DataFrame, start: str, end: str
) -> pl.DataFrame:
    """Each launch joined to the span (columns ``start``, ``end``) it was made inside on its
    thread: spans on one thread do not nest, so the latest one starting before the launch is
    the only candidate."""
    return launches.join_asof(
        spans.sort(start),
        left_on="start",
        right_on=start,
        by="global_tid",
        strategy="backward",
        check_sortedness=False,
    ).filter(pl.col("start") <= pl.col(end))


def _grouped(launches: pl.DataFrame, sized: pl.DataFrame, nvtx: pl.DataFrame) -> pl.DataFrame:
    """Launches inside ``ncclGroupEnd``: the group runs from the latest ``ncclGroupStart``
    before that range on the thread to its end, and its sends and receives say the rest (one
    communicator, or none when the group mixes several)."""
    p2p = sized.filter(pl.col("call").is_in([SEND, RECV]))
    if p2p.is_empty() or nvtx.is_empty():
        return pl.DataFrame(schema=CALL_COLUMNS)
    nccl_ranges = nvtx.filter(pl.col("text").is_in([GROUP_START, GROUP_END]))
    starts = nccl_ranges.filter(pl.col("text") == GROUP_START).select("global_tid", g_start="start")
    ends = nccl_ranges.filter(pl.col("text") == GROUP_END).select("global_tid", "start", "end")
    if starts.is_empty() or ends.is_empty():
        return pl.DataFrame(schema=CALL_COLUMNS)
    groups = (
        ends.sort("start")
        .join_asof(
            starts.sort("g_start"),
            left_on="start",
            right_on="g_start",
            by="global_tid",
            strategy="backward",
            check_sortedness=False,
        )
        .drop_nulls("g_start")
        .select("global_tid", "g_start", g_end="end")
        .sort("g_start")
    )
    members = (
        p2p.sort("start")
        .join_asof(
            groups,
            left_on="start",
            right_on="g_start",
            by="global_tid",
            strategy="backward",
            check_sortedness=False,
        )
        .filter(pl.col("start") <= pl.col("g_end"))
        .group_by("global_tid", "g_start")
        .agg(
            comm_id=pl.col("comm_id").first(),
            comms=pl.col("comm_id").n_unique(),
            sent=pl.col("bytes").filter(pl.col("call") == SEND).sum(),
            received=pl.col("bytes").filter(pl.col("call") == RECV).sum(),
            peers=pl.col("peer").n_unique(),
        )
        .filter(pl.col("comms") == 1)
    )
    spans = groups.join(members, on=["global_tid", "g_start"]).sort("g_start")
    return _launched_within(launches, spans, "g_start", "g_end").select(
        "correlation_id",
        "comm_id",
        call=pl.lit(GROUPED),
        msg_bytes=pl.max_horizontal("sent", "received"),
        peers=pl.col("peers").cast(pl.Int64),
        nranks=pl.lit(None, pl.Int64),
    )


def _by_stream(launches: pl.DataFrame, found: pl.DataFrame) -> pl.DataFrame:
    """Kernels no payload names take the communicator of their stream, when every named kernel
    of that stream has one and the same (no message size: the call is not known)."""
    streams = (
        launches.join(found.select("correlation_id", "comm_id"), on="correlation_id")
        .group_by("stream_id")
        .agg(pl.col("comm_id").unique())
        .filter(pl.col("comm_id").list.len() == 1)
        .select("stream_id", pl.col("comm_id").list.first())
    )
    rest = launches.join(found, on="correlation_id", how="anti").join(streams, on="stream_id")
    inferred = rest.select(
        "correlation_id",
        "comm_id",
        call=pl.lit(None, pl.String),
        msg_bytes=pl.lit(None, pl.Int64),
        peers=pl.lit(None, pl.Int64),
        nranks=pl.lit(None, pl.Int64),
    )
    return pl.concat([found.drop("nranks"), inferred.drop("nranks")], how="vertical_relaxed")


def _sizes(nccl: pl.DataFrame) -> pl.DataFrame:
    """Ranks of each communicator this process created (its creation's payload)."""
    return (
        nccl.filter(pl.col("nranks").is_not_null() & pl.col("comm_id").is_not_null())
        .group_by("comm_id")
        .agg(nranks=pl.col("nranks").max())
    )


def communicator_sizes(trace: Trace) -> dict[int, tuple[int, int | None]]:
    """comm_id -> (ranks of the communicator, this process's rank in it), from the payloads of
    its creation."""
    nccl = trace.nccl
    if nccl.is_empty() or "nranks" not in nccl.columns:
        return {}
    rows = (
        nccl.filter(pl.col("nranks").is_not_null() & pl.col("comm_id").is_not_null())
        .group_by("comm_id")
        .agg(pl.col("nranks").max(), pl.col("rank").drop_nulls().first())
    )
    return {int(c): (int(n), None if r is None else int(r)) for c, n, r in rows.iter_rows()}
