"""What each GPU operation of one rank waited for: the previous work on its stream and, through
CUDA events, work on other streams (NVIDIA's "device dependency edges", mechanised).

Frames (integer ns on the session timeline):
- ``ops`` (:func:`gpu_ops`): one row per GPU operation: op_id, pid, device_id, stream_id,
  correlation_id, start, end, kind ("compute", "graph", "collective", "copy"), transfer (a
  host<->device or peer copy). A node-traced CUDA-graph replay is one op: its nodes share the
  launch's correlationId and the trace shows no dependency between them.
- ``waits``: cudaStreamWaitEvent records (``Trace.syncs``): pid, device_id, stream_id (the
  waiting stream), correlation_id, event_sync_id.
- ``records``: cudaEventRecord records (``Trace.events``): pid, device_id, stream_id (the
  recording stream), correlation_id, event_sync_id.
"""

from __future__ import annotations

import polars as pl

COMPUTE_KINDS = ("compute", "graph")
TRANSFER_DIRECTIONS = ("HtoD", "DtoH", "PtoP", "UVM_HtoD", "UVM_DtoH")
MAX_RELAY_HOPS = 8  # event waits relayed through this many streams are followed
NO_EVENT = 0xFFFFFFFF  # eventId / eventSyncId of a sync record that names no event
KEY = ("pid", "device_id", "stream_id")
STREAM_WAIT = r"(?i)StreamWaitEvent"  # cudaStreamWaitEvent / cuStreamWaitEvent


def stream_waits(syncs: pl.DataFrame, api: pl.DataFrame) -> pl.DataFrame:
    """The cudaStreamWaitEvent rows of ``syncs``: named so by the CUDA call they came from
    (nsys 2025.3 gives cudaStreamSynchronize the same syncType), or, without the CUDA API,
    by syncType 2 with an event."""
    keys = ["pid", "correlation_id"]
    calls = api.select(*keys, "name").join(syncs.select(keys), on=keys, how="semi")
    named = syncs.join(
        calls.select(*keys, api_name=pl.col("name").cast(pl.String)).unique(keys),
        on=keys,
        how="left",
    )
    is_wait = (
        pl.when(pl.col("api_name").is_not_null())
        .then(pl.col("api_name").str.contains(STREAM_WAIT))
        .otherwise((pl.col("sync_type") == 2) & (pl.col("event_id") != NO_EVENT))
    )
    return named.filter(is_wait).drop("api_name")


def gpu_ops(kern: pl.DataFrame, graphs: pl.DataFrame, copies: pl.DataFrame) -> pl.DataFrame:
    """Every GPU operation of one rank as one row (see module doc). ``kern`` is classified
    (``is_comm``); node-traced graph kernels collapse into one op per replay."""
    cols = ["pid", "device_id", "stream_id", "correlation_id", "start", "end"]
    eager = kern.filter(pl.col("graph_node_id").is_null()).select(
        *cols,
        kind=pl.when(pl.col("is_comm")).then(pl.lit("collective")).otherwise(pl.lit("compute")),
        transfer=pl.lit(False),
    )
    nodes = (
        kern.filter(pl.col("graph_node_id").is_not_null())
        .sort("start")
        .group_by("pid", "correlation_id")
        .agg(
            pl.col("device_id").first(),
            pl.col("stream_id").first(),
            pl.col("start").min(),
            pl.col("end").max(),
        )
        .select(*cols, kind=pl.lit("graph"), transfer=pl.lit(False))
    )
    replays = graphs.select(*cols, kind=pl.lit("graph"), transfer=pl.lit(False))
    moved = copies.select(
        *cols, kind=pl.lit("copy"), transfer=pl.col("direction").is_in(TRANSFER_DIRECTIONS)
    )
    schema = {c: pl.Int64 for c in cols} | {"kind": pl.String, "transfer": pl.Boolean}
    return (
        pl.concat([f.cast(schema) for f in (eager, nodes, replays, moved)])  # type: ignore[arg-type]
        .with_columns(pl.col("device_id", "stream_id").fill_null(-1))
        .sort("start", "end")
        .with_row_index("op_id")
        .with_columns(pl.col("op_id").cast(pl.Int64))
    )


def resolve_dependencies(
    ops: pl.DataFrame, waits: pl.DataFrame, records: pl.DataFrame
) -> pl.DataFrame:
    """``ops`` with what each one waited for: ``dep_end`` (when the last of its dependencies
    finished: the previous operation on its stream, or the work behind a CUDA event it waits
    for), ``dep_op`` (the operation that finished then), ``unresolved_wait`` (it waits for an
    event whose record is not in the export).

    Each stream is read in issue order (correlationId: one counter per process, so it orders
    launches, waits and records across threads). An event's completion is the last work
    enqueued on its recording stream before the record, following waits on that stream
    (relayed dependencies) up to MAX_RELAY_HOPS streams away. Records are joined to waits by
    (pid, eventSyncId), never by the reused event handle.
    """
    sid = pl.Int64
    base = ["pid", "device_id", "stream_id", "correlation_id"]

    def events(df: pl.DataFrame, etype: int) -> pl.DataFrame:
        return (
            df.select(*base, "event_sync_id")
            .cast({c: sid for c in (*base, "event_sync_id")})
            .with_columns(pl.col("device_id", "stream_id").fill_null(-1))
            .with_columns(
                etype=pl.lit(etype, pl.Int8),
                end=pl.lit(None, sid),
                op_id=pl.lit(None, sid),
                event_sync_id=pl.when(pl.col("event_sync_id") == NO_EVENT)
                .then(None)
                .otherwise(pl.col("event_sync_id")),
            )
        )

    entries = (
        pl.concat(
            [
                ops.select(
                    *base,
                    event_sync_id=pl.lit(None, sid),
                    etype=pl.lit(0, pl.Int8),
                    end="end",
                    op_id="op_id",
                ),
                events(waits, 1),
                events(records, 2),
            ],
            how="vertical_relaxed",
        )
        .sort(*KEY, "correlation_id", "etype")
        .with_row_index("row")
        .with_columns(first=pl.any_horizontal(pl.col(c) != pl.col(c).shift(1) for c in KEY))
        .with_columns(
            first=pl.col("first").fill_null(True),
            # a segment: one operation and the waits/records after it, on one stream
            seg=((pl.col("etype") == 0) | pl.col("first").fill_null(True)).cum_sum(),
            wait_end=pl.lit(-1, sid),
            wait_op=pl.lit(None, sid),
        )
    )
    record_keys = entries.filter(pl.col("etype") == 2).select("pid", "event_sync_id", "row")
    wait_keys = entries.filter(pl.col("etype") == 1).select("row", "pid", "event_sync_id")
    matched = wait_keys.join(
        record_keys.select("pid", "event_sync_id"), on=["pid", "event_sync_id"], how="semi"
    )
    entries = entries.with_columns(
        unresolved=(pl.col("etype") == 1) & ~pl.col("row").is_in(matched["row"].implode())
    )
    # Waits take the completion of their record, which may itself follow waits on its stream:
    # one more round per relay hop, until nothing changes.
    for _ in range(MAX_RELAY_HOPS + 1 if len(matched) else 0):
        swept = _sweep(entries)
        completion = (
            record_keys.join(swept.select("row", "dep_end", "dep_op"), on="row")
            .drop("row")
            .unique(["pid", "event_sync_id"], keep="last")
        )
        resolved = wait_keys.join(completion, on=["pid", "event_sync_id"], how="left").select(
            "row", new_end=pl.col("dep_end").fill_null(-1), new_op="dep_op"
        )
        updated = entries.join(resolved, on="row", how="left", maintain_order="left").with_columns(
            wait_end=pl.coalesce("new_end", "wait_end"), wait_op=pl.coalesce("new_op", "wait_op")
        )
        changed = not updated["wait_end"].equals(entries["wait_end"])
        entries = updated.drop("new_end", "new_op")
        if not changed:
            break
    deps = (
        _sweep(entries)
        .filter(pl.col("etype") == 0)
        .select("op_id", "dep_end", "dep_op", "unresolved_wait")
    )
    return ops.join(deps, on="op_id", how="left").with_columns(
        pl.col("unresolved_wait").fill_null(False)
    )


def _sweep(entries: pl.DataFrame) -> pl.DataFrame:
    """Per entry, the latest completion among what precedes it on its stream since the last
    operation before it (that operation included), and the operation that completes then:
    a cumulative maximum within each segment, read one row back.

    Segments are contiguous and numbered in order, so one global cumulative maximum of
    ``seg * B + code`` (``code``: the completion's rank, < B) restarts at every segment without
    a window function per group (tens of thousands of groups)."""
    cand_end = (
        pl.when(pl.col("etype") == 0)
        .then(pl.col("end"))
        .when(pl.col("etype") == 1)
        .then(pl.col("wait_end"))
        .otherwise(pl.lit(-1))
        .fill_null(-1)
    )
    cand_op = pl.when(pl.col("etype") == 0).then(pl.col("op_id")).otherwise(pl.col("wait_op"))
    out = entries.with_columns(cand_end=cand_end, cand_op=cand_op).with_columns(
        code=pl.col("cand_end").rank("dense").cast(pl.Int64)
    )
    base = int(out["code"].max() or 0) + 1
    decode = out.select("code", cm="cand_end").unique("code")
    out = (
        out.with_columns(key=pl.col("seg") * base + pl.col("code"))
        .with_columns(cm_key=pl.col("key").cum_max())
        .with_columns(
            code=pl.col("cm_key") - pl.col("seg") * base,
            new=(pl.col("key") == pl.col("cm_key")) & (pl.col("cand_end") >= 0),
            unres=(pl.col("seg") * 2 + pl.col("unresolved").cast(pl.Int64)).cum_max()
            - pl.col("seg") * 2,
        )
        .drop("cm", strict=False)
        .join(decode, on="code", how="left", maintain_order="left")
        .with_columns(
            prod_seg=pl.when("new").then(pl.col("seg")).forward_fill(),
            prod=pl.when("new").then(pl.col("cand_op")).forward_fill(),
        )
        .with_columns(prod=pl.when(pl.col("prod_seg") == pl.col("seg")).then(pl.col("prod")))
    )
    back = ~pl.col("first")  # the row before belongs to the same stream
    return out.with_columns(
        dep_end=pl.when(back & (pl.col("cm").shift(1) >= 0)).then(pl.col("cm").shift(1)),
        dep_op=pl.when(back).then(pl.col("prod").shift(1)),
        unresolved_wait=(back & (pl.col("unres").shift(1) == 1)).fill_null(False),
    )
