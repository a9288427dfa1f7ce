"""What each GPU operation of one rank waited for: the previous work on its stream and, through
CUDA events, work on other streams (NVIDIA's "device dependency edges", mechanised).

Frames (integer ns on the session timeline):
- ``ops`` (:func:`gpu_ops`): one row per GPU operation, sorted by (start, end); an operation's
  id (``op_id``, ``dep_op``) is its row index. Columns: pid, device_id, stream_id,
  correlation_id, start, end, kind (:data:`KIND`: "compute", "graph", "nodes", "collective",
  "copy"), transfer (a host<->device or peer copy). A node-traced CUDA-graph replay is one op
  ("nodes": the span of its kernels): its nodes share the launch's correlationId and the trace
  shows no dependency between them.
- ``waits``: cudaStreamWaitEvent records (``Trace.syncs``): pid, device_id, stream_id (the
  waiting stream), correlation_id, event_sync_id.
- ``records``: cudaEventRecord records (``Trace.events``): pid, device_id, stream_id (the
  recording stream), correlation_id, event_sync_id.

A kernel-dense capture has millions of operations and tens of millions of CUDA calls, so the
per-operation work is sorts, binary searches and gathers by row index on numpy arrays; joins
and window functions run only on the few rows that CUDA events involve.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.model.correlation import CallIndex
from traceclf.model.trace import DEVICE_TO_HOST, HOST_TO_DEVICE

# ("graph": a graph-level traced replay; "nodes": the span of a node-traced replay's kernels)
COMPUTE_KINDS = ("compute", "graph", "nodes")
KIND = pl.Enum(["compute", "graph", "nodes", "collective", "copy"])
TRANSFER_DIRECTIONS = (*HOST_TO_DEVICE, *DEVICE_TO_HOST, "PtoP")
MAX_RELAY_HOPS = 8  # event waits relayed through this many streams are followed
NO_EVENT = 0xFFFFFFFF  # eventId / eventSyncId of a sync record that names no event
KEY = ("pid", "device_id", "stream_id")
STREAM_WAIT = r"(?i)StreamWaitEvent"  # cudaStreamWaitEvent / cuStreamWaitEvent
NULL = np.iinfo(np.int64).min  # sorts first, as polars sorts nulls
BLOCK = 1 << 20  # entries per block where whole-capture temporaries are not needed


def stream_waits(syncs: pl.DataFrame, calls: CallIndex) -> pl.DataFrame:
    """The cudaStreamWaitEvent rows of ``syncs``: named so by the CUDA call they came from
    (nsys 2025.3 gives cudaStreamSynchronize the same syncType), or, without the CUDA API,
    by syncType 2 with an event."""
    if syncs.is_empty():
        return syncs
    api_name = calls.column("name", syncs["pid"], syncs["correlation_id"])
    is_wait = (
        pl.when(pl.col("api_name").is_not_null())
        .then(pl.col("api_name").cast(pl.String).str.contains(STREAM_WAIT))
        .otherwise((pl.col("sync_type") == 2) & (pl.col("event_id") != NO_EVENT))
    )
    return syncs.with_columns(api_name=api_name).filter(is_wait).drop("api_name")


def gpu_ops(
    kern: pl.DataFrame,
    is_comm: pl.Series,
    graphs: pl.DataFrame,
    copies: pl.DataFrame,
    since: int | None = None,
    ordered: bool = True,
) -> pl.DataFrame:
    """Every GPU operation of one rank that ends after ``since`` as one row (see module
    doc); ``is_comm`` flags the communication kernels of ``kern``. Node-traced graph kernels
    collapse into one op per replay. ``ordered=False``: the rows as the parts come (kernels,
    graph nodes, graphs, copies), for a caller that gathers only the columns it keeps in
    :func:`start_end_order` itself."""
    cols = ["pid", "device_id", "stream_id", "correlation_id", "start", "end"]
    schema = {c: pl.Int64 for c in cols} | {c: pl.Int32 for c in ("pid", "device_id", "stream_id")}
    node = pl.col("graph_node_id").is_not_null()
    after = pl.col("end") > since if since is not None else pl.lit(True)
    kern = kern.select(*cols, "graph_node_id").with_columns(_comm=is_comm)
    eager = (
        kern.lazy()
        .filter(after & ~node)
        .select(
            *cols,
            kind=pl.when("_comm")
            .then(pl.lit("collective", KIND))
            .otherwise(pl.lit("compute", KIND)),
            transfer=pl.lit(False),
        )
    )
    nodes = (
        kern.lazy()
        .filter(after & node)
        .sort("start")
        .group_by("pid", "correlation_id")
        .agg(
            pl.col("device_id").first(),
            pl.col("stream_id").first(),
            pl.col("start").min(),
            pl.col("end").max(),
        )
        .select(*cols, kind=pl.lit("nodes", KIND), transfer=pl.lit(False))
    )
    replays = (
        graphs.lazy()
        .filter(after)
        .select(*cols, kind=pl.lit("graph", KIND), transfer=pl.lit(False))
    )
    moved = (
        copies.lazy()
        .filter(after)
        .select(
            *cols,
            kind=pl.lit("copy", KIND),
            transfer=pl.col("direction").is_in(TRANSFER_DIRECTIONS),
        )
    )
    typed = schema | {"kind": KIND, "transfer": pl.Boolean}
    ops = (
        pl.concat([f.cast(typed) for f in (eager, nodes, replays, moved)])  # type: ignore[arg-type]
        .with_columns(pl.col("device_id", "stream_id").fill_null(-1))
        .collect()
    )
    order = start_end_order(ops["start"].to_numpy(), ops["end"].to_numpy()) if ordered else None
    return ops if order is None else ops[pl.Series(order)]


def start_end_order(start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """Rows in (start, end) order, ties in row order; None when they already are. Each part
    of the operations comes in start order, so this is a merge of a few sorted runs on two
    columns, not a sort of every column of millions of rows."""
    if len(start) < 2:
        return None
    later = start[1:] > start[:-1]
    if bool(np.all(later | ((start[1:] == start[:-1]) & (end[1:] >= end[:-1])))):
        return None
    return np.lexsort((end, start))  # (stable: ties keep their row order)


def resolve_arrays(
    ops: pl.DataFrame,
    waits: pl.DataFrame,
    records: pl.DataFrame,
    rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each of ``ops`` waited for, as arrays by operation id (the critical path reads
    them so: no frame of millions of rows built only to be taken apart again): ``dep_end``
    (when the last of its dependencies finished: the previous operation on its stream, or
    the work behind a CUDA event it waits for; NULL if none), ``dep_op`` (the operation that finished then, -1 if none; int32 when
    ids fit), ``unresolved_wait`` (it waits for an event whose record is not in the export).

    Each stream is read in issue order (correlationId: one counter per process, so it orders
    launches, waits and records across threads). An event's completion is the last work
    enqueued on its recording stream before the record, following waits on that stream
    (relayed dependencies) up to MAX_RELAY_HOPS streams away. Records are joined to waits by
    (pid, eventSyncId), never by the reused event handle.

    The entries (operations, waits, records) are sorted by (pid, device, stream,
    correlationId, type): a *segment* is one operation and the waits and records after it on
    its stream. An operation depends on the whole previous segment of its stream (the latest
    completion in it, and the operation that completed then); a record completes with the part
    of its segment before it. Almost every segment is a lone operation, whose completion is its
    own end: only the segments that hold a wait or a record are swept row by row.

    ``rows``: operation i is row ``rows[i]`` of ``ops`` (operations not yet in (start, end)
    order: the few columns read here are gathered, rather than every column beforehand)."""
    n = ops.height

    def by_id(values: np.ndarray) -> np.ndarray:
        return values if rows is None else values[rows]

    waits_e, records_e = _events(waits), _events(records)
    cols = ["pid", "device_id", "stream_id", "correlation_id"]
    parts = [ops.select(cols), waits_e.select(cols), records_e.select(cols)]
    etype = np.concatenate(
        [
            np.zeros(n, np.int8),
            np.ones(waits_e.height, np.int8),
            np.full(records_e.height, 2, np.int8),
        ]
    )

    def column(name: str) -> np.ndarray:
        values = [p[name].cast(pl.Int64).fill_null(NULL).to_numpy() for p in parts]
        return np.concatenate([by_id(values[0]), *values[1:]])

    def constant(name: str) -> bool:
        both = pl.concat([p.select(name).cast(pl.Int64) for p in parts]).to_series()
        return not both.null_count() and both.min() == both.max()

    # (a key that one value fills, as pid and device usually do in a rank's trace, orders
    # nothing and starts no stream: it is left out rather than sorted and compared)
    stream = [column(c) for c in KEY if not constant(c)]
    order = np.lexsort((etype, column("correlation_id"), *reversed(stream)))
    first = np.zeros(len(order), bool)
    first[:1] = True
    for key in stream:
        key = key[order]
        first[1:] |= key[1:] != key[:-1]
    del stream
    if len(order) == n:  # no wait or record: every segment is one operation
        return _stream_predecessors(order, first, by_id(ops["end"].to_numpy()))
    etype = etype[order]
    seg = np.cumsum((etype == 0) | first) - 1
    # entries of segments that hold a wait or a record: swept row by row
    event_seg = np.zeros(int(seg[-1]) + 1 if len(seg) else 0, bool)
    event_seg[seg[etype > 0]] = True
    in_sub = event_seg[seg]
    sub_rows = np.flatnonzero(in_sub)
    sub = pl.DataFrame(
        {
            "row": sub_rows,
            "seg": seg[sub_rows],
            "first": first[sub_rows],
            "etype": etype[sub_rows],
            "ref": order[sub_rows],  # op row, or n + wait, or n + waits + record
        }
    )
    ends = by_id(ops["end"].to_numpy())
    op_ref = np.where(sub["etype"].to_numpy() == 0, sub["ref"].to_numpy(), 0)
    sub = _attach_events(sub, n, waits_e, records_e).with_columns(
        op_end=_nullable(ends[op_ref] if n else op_ref, sub["etype"].to_numpy() == 0)
    )
    # Per segment: latest completion, the op that completed then, any unresolved wait.
    # A lone operation's segment is the operation itself.
    seg_end = np.full(len(event_seg), -1, np.int64)
    seg_op = np.full(len(event_seg), -1, np.int64)
    seg_unres = np.zeros(len(event_seg), bool)
    lone = np.flatnonzero(~in_sub & (etype == 0))
    lone_op = order[lone]
    seg_end[seg[lone]] = ends[lone_op]
    seg_op[seg[lone]] = np.where(ends[lone_op] >= 0, lone_op, -1)
    sub = _relay(sub)
    last = sub.group_by("seg").agg(pl.all().sort_by("row").last())
    seg_ids = last["seg"].to_numpy()
    cm = last["cm"].to_numpy()
    seg_end[seg_ids] = np.where(cm >= 0, cm, -1)
    seg_op[seg_ids] = last["prod"].fill_null(-1).to_numpy()
    seg_unres[seg_ids] = last["unres"].to_numpy()
    # Each operation reads the previous segment of its stream.
    op_rows = np.flatnonzero(etype == 0)
    op_ids = order[op_rows]
    back = ~first[op_rows]
    prev = np.where(back, seg[op_rows] - 1, 0)
    dep_end = np.full(n, NULL, np.int64)
    dep_op = np.full(n, -1, np.int32 if n < 2**31 else np.int64)
    unresolved = np.zeros(n, bool)
    has_end = back & (seg_end[prev] >= 0)
    dep_end[op_ids] = np.where(has_end, seg_end[prev], NULL)
    dep_op[op_ids] = np.where(back, seg_op[prev], -1)
    unresolved[op_ids] = back & seg_unres[prev]
    return dep_end, dep_op, unresolved


def _stream_predecessors(
    order: np.ndarray, first: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`resolve_arrays` when the streams hold operations only: each depends on the one
    before it on its stream (``order``: operations in stream order; ``first``: the first of
    its stream). Done in blocks of BLOCK entries, so that the temporaries stay small."""
    n = len(order)
    dep_end = np.full(n, NULL, np.int64)
    dep_op = np.full(n, -1, np.int32 if n < 2**31 else np.int64)
    for lo in range(1, n, BLOCK):
        hi = min(lo + BLOCK, n)
        back = np.flatnonzero(~first[lo:hi]) + lo
        me, prev = order[back], order[back - 1]
        end = ends[prev]
        done = end >= 0
        dep_end[me] = np.where(done, end, NULL)
        dep_op[me] = np.where(done, prev, -1)
    return dep_end, dep_op, np.zeros(n, bool)


def _nullable(values: np.ndarray, valid: np.ndarray) -> pl.Series:
    return pl.select(pl.when(pl.Series(valid)).then(pl.Series(values))).to_series()


def _events(df: pl.DataFrame) -> pl.DataFrame:
    """Waits or records with the columns the sweep reads, eventSyncId NO_EVENT as null."""
    base = ["pid", "device_id", "stream_id", "correlation_id"]
    if df.is_empty():
        return pl.DataFrame(schema={c: pl.Int64 for c in (*base, "event_sync_id")})
    return (
        df.select(*base, "event_sync_id")
        .cast({c: pl.Int64 for c in (*base, "event_sync_id")})
        .with_columns(
            pl.col("device_id", "stream_id").fill_null(-1),
            event_sync_id=pl.when(pl.col("event_sync_id") == NO_EVENT)
            .then(None)
            .otherwise(pl.col("event_sync_id")),
        )
    )


def _attach_events(
    sub: pl.DataFrame, n: int, waits: pl.DataFrame, records: pl.DataFrame
) -> pl.DataFrame:
    """The swept entries with their pid and eventSyncId (waits, records), whether a wait's
    record is in the export (``matched``; ``unresolved`` when not), and wait_end/wait_op,
    filled in by :func:`_relay`."""
    events = pl.concat(
        [waits.select("pid", "event_sync_id"), records.select("pid", "event_sync_id")]
    )
    ev = pl.when(pl.col("etype") > 0).then(pl.col("ref").cast(pl.Int64) - n)
    sub = sub.with_columns(ev=ev)
    if events.height:
        sub = sub.with_columns(
            pid=events["pid"].gather(sub["ev"]),
            event_sync_id=events["event_sync_id"].gather(sub["ev"]),
        )
    else:
        sub = sub.with_columns(pid=pl.lit(None, pl.Int64), event_sync_id=pl.lit(None, pl.Int64))
    recorded = (
        sub.filter(pl.col("etype") == 2)
        .select("pid", "event_sync_id")
        .drop_nulls()
        .unique()
        .with_columns(_rec=pl.lit(True))
    )
    sub = sub.join(recorded, on=["pid", "event_sync_id"], how="left", maintain_order="left")
    matched = (pl.col("etype") == 1) & pl.col("_rec").fill_null(False)
    return sub.with_columns(
        matched=matched,
        unresolved=(pl.col("etype") == 1) & ~matched,
        wait_end=pl.lit(-1, pl.Int64),
        wait_op=pl.lit(None, pl.Int64),
    ).drop("_rec", "ev")


def _relay(sub: pl.DataFrame) -> pl.DataFrame:
    """Sweep the event segments; waits take the completion of their record, which may itself
    follow waits on its stream: one more round per relay hop, until nothing changes."""
    if sub.is_empty():
        return sub.with_columns(
            cm=pl.lit(None, pl.Int64), prod=pl.lit(None, pl.Int64), unres=pl.lit(False)
        )
    rounds = MAX_RELAY_HOPS + 1 if bool(sub["matched"].any()) else 0
    for _ in range(rounds):
        swept = _sweep(sub)
        completion = (
            swept.filter(pl.col("etype") == 2)
            .sort("row")
            .select("pid", "event_sync_id", "dep_end", "dep_op")
            .unique(["pid", "event_sync_id"], keep="last", maintain_order=True)
        )
        is_wait = pl.col("etype") == 1
        updated = (
            sub.join(completion, on=["pid", "event_sync_id"], how="left", maintain_order="left")
            .with_columns(
                wait_end=pl.when(is_wait)
                .then(pl.col("dep_end").fill_null(-1))
                .otherwise("wait_end"),
                wait_op=pl.when(is_wait)
                .then(pl.coalesce("dep_op", "wait_op"))
                .otherwise("wait_op"),
            )
            .drop("dep_end", "dep_op")
        )
        changed = not updated["wait_end"].equals(sub["wait_end"])
        sub = updated
        if not changed:
            break
    return _sweep(sub)


def _sweep(sub: pl.DataFrame) -> pl.DataFrame:
    """Per entry of the event segments (in stream order): the latest completion in its segment
    up to it (``cm``: an operation's end, a wait's record's completion), the entry that
    completed then (``prod``: the last to reach that maximum), whether an unresolved wait came
    before it in the segment (``unres``); and, read one row back, what a record completes with
    (``dep_end``, ``dep_op``)."""
    cand_end = (
        pl.when(pl.col("etype") == 0)
        .then(pl.col("op_end"))
        .when(pl.col("etype") == 1)
        .then(pl.col("wait_end"))
        .otherwise(pl.lit(-1))
        .fill_null(-1)
    )
    cand_op = pl.when(pl.col("etype") == 0).then(pl.col("ref").cast(pl.Int64)).otherwise("wait_op")
    out = (
        sub.sort("row")
        .with_columns(cand_end=cand_end, cand_op=cand_op)
        .with_columns(cm=pl.col("cand_end").cum_max().over("seg"))
        .with_columns(
            prod=pl.when((pl.col("cand_end") == pl.col("cm")) & (pl.col("cand_end") >= 0))
            .then("cand_op")
            .forward_fill()
            .over("seg"),
            unres=pl.col("unresolved").cum_max().over("seg"),
        )
    )
    back = ~pl.col("first")
    return out.with_columns(
        dep_end=pl.when(back & (pl.col("cm").shift(1) >= 0)).then(pl.col("cm").shift(1)),
        dep_op=pl.when(back).then(pl.col("prod").shift(1)),
    ).drop("cand_end", "cand_op")
