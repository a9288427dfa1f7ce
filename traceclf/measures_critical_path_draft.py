"""Critical-path accounting of one rank (draft; moves to traceclf/measures/critical_path.py).

NVIDIA's method for Megatron-Bridge traces (per-step device budget, compute-absent time split
into launch-starved / blocking / dependency-stalled, blocking vs exposed communication),
mechanised over polars frames: sorts, joins and cumulative maxima, no loop over events.

Frames (integer ns on the session timeline):
- ``ops``: one row per GPU operation: op_id, pid, device_id, stream_id, correlation_id, start,
  end, kind ("compute", "graph", "collective", "copy"), transfer (a host<->device or peer copy).
  A node-traced CUDA-graph replay is one op (its nodes share the launch's correlationId).
- ``waits``: cudaStreamWaitEvent records: pid, device_id, stream_id (the waiting stream),
  correlation_id, event_sync_id.
- ``records``: cudaEventRecord records (CUPTI_ACTIVITY_KIND_CUDA_EVENT): pid, device_id,
  stream_id (the recording stream), correlation_id, event_sync_id.
- ``launches``: CUDA API calls: pid, correlation_id, start, end.
"""

from __future__ import annotations

import polars as pl

from traceclf import intervals

COMPUTE_KINDS = ("compute", "graph")
TRANSFER_DIRECTIONS = ("HtoD", "DtoH", "PtoP", "UVM_HtoD", "UVM_DtoH")
# Producer class of a blocking interval, from the kind of the operation that finished last.
PRODUCER_CLASS = {
    "collective": "collective",
    "copy": "copy",
    "compute": "compute",
    "graph": "compute",
}
# Interval classes of compute-absent time; they partition it.
CLASSES = (
    "launch_starved",
    "blocking_collective",
    "blocking_copy",
    "blocking_compute",
    "blocking_host_sync",
    "dependency_stalled",
    "unresolved",
)
MAX_RELAY_HOPS = 8  # event waits relayed through this many streams are followed
NO_EVENT = 0xFFFFFFFF  # eventSyncId of a sync record that names no event
KEY = ("pid", "device_id", "stream_id")


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
        .with_columns(seg=(pl.col("etype") == 0).cast(pl.Int32).cum_sum().over(KEY))
        .with_columns(wait_end=pl.lit(-1, sid), wait_op=pl.lit(None, sid))
    )
    record_keys = entries.filter(pl.col("etype") == 2).select("pid", "event_sync_id", "row")
    wait_keys = entries.filter(pl.col("etype") == 1).select("row", "pid", "event_sync_id")
    for _ in range(MAX_RELAY_HOPS + 1):
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
    matched = wait_keys.join(
        record_keys.select("pid", "event_sync_id"), on=["pid", "event_sync_id"], how="semi"
    )
    swept = _sweep(
        entries.with_columns(
            unresolved=(pl.col("etype") == 1) & ~pl.col("row").is_in(matched["row"].implode())
        )
    )
    deps = swept.filter(pl.col("etype") == 0).select(
        "op_id", "dep_end", "dep_op", "unresolved_wait"
    )
    return ops.join(deps, on="op_id", how="left").with_columns(
        pl.col("unresolved_wait").fill_null(False)
    )


def _sweep(entries: pl.DataFrame) -> pl.DataFrame:
    """Per entry, the latest completion among what precedes it on its stream since the last
    operation before it (that operation included): cumulative max within each segment (an op
    and the waits/records after it), read one row back."""
    seg = [*KEY, "seg"]
    has_unres = "unresolved" in entries.columns
    cand_end = (
        pl.when(pl.col("etype") == 0)
        .then(pl.col("end"))
        .when(pl.col("etype") == 1)
        .then(pl.col("wait_end"))
        .otherwise(pl.lit(-1))
    )
    cand_op = (
        pl.when(pl.col("etype") == 0)
        .then(pl.col("op_id"))
        .when(pl.col("etype") == 1)
        .then(pl.col("wait_op"))
    )
    out = entries.with_columns(cand_end=cand_end.fill_null(-1), cand_op=cand_op).with_columns(
        cm=pl.col("cand_end").cum_max().over(seg)
    )
    out = out.with_columns(
        prod=pl.when((pl.col("cand_end") == pl.col("cm")) & (pl.col("cm") >= 0))
        .then(pl.col("cand_op"))
        .forward_fill()
        .over(seg),
        **(
            {"unres_cm": pl.col("unresolved").cast(pl.Int8).cum_max().over(seg)}
            if has_unres
            else {}
        ),
    )
    shifted = {
        "dep_end": pl.col("cm").shift(1).over(list(KEY)),
        "dep_op": pl.col("prod").shift(1).over(list(KEY)),
    }
    if has_unres:
        shifted["unresolved_wait"] = (pl.col("unres_cm").shift(1).over(list(KEY)) == 1).fill_null(
            False
        )
    return out.with_columns(**shifted).with_columns(
        dep_end=pl.when(pl.col("dep_end") >= 0).then(pl.col("dep_end"))
    )


def compute_gaps(ops: pl.DataFrame, window: tuple[int, int]) -> pl.DataFrame:
    """Stretches of ``window`` with no compute (kernel or graph replay) on any stream."""
    lo, hi = window
    busy = intervals.union(intervals.clip(ops.filter(pl.col("kind").is_in(COMPUTE_KINDS)), window))
    edges = pl.concat(
        [
            pl.DataFrame({"end": [lo]}, schema={"end": pl.Int64}),
            busy.select("end"),
        ]
    ).with_columns(next_start=pl.concat([busy["start"], pl.Series([hi], dtype=pl.Int64)]))
    return edges.select(start="end", end="next_start").filter(pl.col("end") > pl.col("start"))


PIECE_SCHEMA = {"start": pl.Int64, "end": pl.Int64, "cls": pl.String, "producer_op": pl.Int64}


def attribute_gaps(
    gaps: pl.DataFrame,
    ops: pl.DataFrame,
    launches: pl.DataFrame,
    host_syncs: pl.DataFrame | None = None,
    max_hops: int = 64,
) -> pl.DataFrame:
    """Split each compute-absent gap into disjoint pieces (start, end, cls, producer_op) of
    the classes in CLASSES. K is the compute operation that ended the gap (the first to start
    at or after its end).

    - Until K's launch call returned, K was not issued: launch_starved, except while the host
      sat in a synchronising call (``host_syncs``: start, end): then it was waiting for the
      GPU, and the time is attributed to the work it waited for (the last GPU operation that
      finished before the call returned, walked back as below) and to the call's own return
      latency (blocking_host_sync).
    - After K was issued, the critical path is walked back from K through what each operation
      waited for (``resolve_dependencies``): the time a producer ran is ``blocking_<class>``
      of that producer (collective, copy, compute); the time between a producer's (or K's)
      readiness and its start is dependency_stalled (issued, dependencies done, not running:
      queueing, another process on the GPU, a dependency the export does not show).
    - unresolved: no compute follows in the trace, K's launch call is not in the export (CUDA
      API not traced: launch-starved and stalled cannot be told apart), or a chain longer than
      ``max_hops``.
    """
    launch = launches.select("pid", "correlation_id", launch_end="end").unique(
        ["pid", "correlation_id"], keep="first"
    )
    info = ops.join(launch, on=["pid", "correlation_id"], how="left").select(
        "op_id", "kind", "start", "end", "launch_end", "dep_end", "dep_op"
    )
    nxt = (
        info.filter(pl.col("kind").is_in(COMPUTE_KINDS))
        .sort("start", pl.col("launch_end").fill_null(2**62))
        .unique("start", keep="first", maintain_order=True)
        .select(k_start="start", cur="op_id")
    )
    g = (
        gaps.sort("end")
        .join_asof(nxt, left_on="end", right_on="k_start", strategy="forward")
        .join(
            info.select(cur="op_id", k_launch="launch_end", k_dep="dep_end", nxt_op="dep_op"),
            on="cur",
            how="left",
        )
    )
    known = pl.col("k_launch").is_not_null()
    issued = pl.max_horizontal("start", pl.col("k_launch").clip(upper_bound=pl.col("end")))
    g = g.with_columns(
        lo=pl.when(known).then(issued).otherwise(pl.col("start")),
        stalled=pl.when(known).then(pl.lit("dependency_stalled")).otherwise(pl.lit("unresolved")),
    ).with_columns(
        ready=pl.max_horizontal("k_dep", "k_launch")
        .clip(pl.col("lo"), pl.col("end"))
        .fill_null(pl.col("lo"))
    )
    followed = g.filter(pl.col("cur").is_not_null())
    pieces = [
        g.filter(pl.col("cur").is_null()).select("start", "end", cls=pl.lit("unresolved")),
        followed.select(start="ready", end="end", cls="stalled"),
    ]
    starved = followed.filter(known).select("start", end="lo")
    host_pieces, sync_seeds = _split_host_syncs(starved, host_syncs, info)
    pieces += host_pieces
    seeds = [
        followed.select("lo", "stalled", t="ready", nxt_op="nxt_op"),
        sync_seeds,
    ]
    pieces += _walk(pl.concat(seeds, how="vertical_relaxed"), info, max_hops)
    return (
        pl.concat(
            [p.select(*(c for c in PIECE_SCHEMA if c in p.columns)) for p in pieces],
            how="diagonal_relaxed",
        )
        .cast(PIECE_SCHEMA)  # type: ignore[arg-type]
        .select(list(PIECE_SCHEMA))
        .filter(pl.col("end") > pl.col("start"))
        .sort("start")
    )


def _split_host_syncs(
    starved: pl.DataFrame, host_syncs: pl.DataFrame | None, info: pl.DataFrame
) -> tuple[list[pl.DataFrame], pl.DataFrame]:
    """Launch-starved intervals minus the time the host sat in a synchronising call; for each
    such stretch [s0, s1], the GPU operation it waited for (the last to finish by s1) seeds a
    walk, and the time after that operation finished is the call's return latency."""
    seeds_schema = {"lo": pl.Int64, "stalled": pl.String, "t": pl.Int64, "nxt_op": pl.Int64}
    if host_syncs is None or host_syncs.is_empty() or starved.is_empty():
        return [starved.with_columns(cls=pl.lit("launch_starved"))], pl.DataFrame(
            schema=seeds_schema
        )
    lo, hi = int(starved["start"].min()), int(starved["end"].max())
    tl = intervals.timeline({"ls": starved, "sync": host_syncs.select("start", "end")}, (lo, hi))
    in_ls = tl.filter(pl.col("ls") > 0)
    free = in_ls.filter(pl.col("sync") == 0).select("start", "end", cls=pl.lit("launch_starved"))
    held = intervals.union(in_ls.filter(pl.col("sync") > 0).select("start", "end"))
    finished = info.select(x_end="end", x_op="op_id").sort("x_end")
    held = (
        held.sort("end")
        .join_asof(finished, left_on="end", right_on="x_end", strategy="backward")
        .with_columns(x_end=pl.col("x_end").clip(pl.col("start"), pl.col("end")))
    )
    latency = held.select(start=pl.col("x_end").fill_null(pl.col("start")), end="end").with_columns(
        cls=pl.lit("blocking_host_sync")
    )
    seeds = held.filter(pl.col("x_op").is_not_null()).select(
        lo="start", stalled=pl.lit("dependency_stalled"), t="x_end", nxt_op="x_op"
    )
    return [free, latency], seeds.cast(seeds_schema)  # type: ignore[arg-type]


def _walk(seeds: pl.DataFrame, info: pl.DataFrame, max_hops: int) -> list[pl.DataFrame]:
    """Walk critical paths back from ``seeds`` (lo, stalled, t, nxt_op: time [lo, t] is left
    to explain and nxt_op is the operation that finished at t), one hop per iteration for all
    of them at once: the producer's run is blocking by its class, the wait between its
    readiness and its start is ``stalled``, then on to what it waited for."""
    pieces: list[pl.DataFrame] = []
    walk = seeds.filter((pl.col("t") > pl.col("lo")) & pl.col("nxt_op").is_not_null())
    for _ in range(max_hops):
        if walk.is_empty():
            break
        walk = (
            walk.select("lo", "stalled", "t", cur="nxt_op")
            .join(info.rename({"op_id": "cur"}), on="cur", how="left")
            .with_columns(run_from=pl.col("start").clip(pl.col("lo"), pl.col("t")))
            .with_columns(
                ready=pl.max_horizontal("dep_end", "launch_end")
                .clip(pl.col("lo"), pl.col("run_from"))
                .fill_null(pl.col("lo")),
                cls=pl.concat_str(
                    pl.lit("blocking_"),
                    pl.col("kind").replace_strict(PRODUCER_CLASS, default="compute"),
                ),
            )
        )
        pieces += [
            walk.select(start="run_from", end="t", cls="cls", producer_op="cur"),
            walk.select(start="ready", end="run_from", cls="stalled"),
        ]
        walk = walk.select("lo", "stalled", t="ready", nxt_op="dep_op").filter(
            (pl.col("t") > pl.col("lo")) & pl.col("nxt_op").is_not_null()
        )
    if not walk.is_empty():  # a chain longer than max_hops: say so rather than guess
        pieces.append(walk.select(start="lo", end="t", cls=pl.lit("unresolved")))
    return pieces


BLOCKING = ("blocking_collective", "blocking_copy", "blocking_compute", "blocking_host_sync")
BUDGET_COLUMNS = (
    "iteration",
    "device_busy",
    "non_transfer_busy",
    "compute_busy",
    "compute_absent",
    "occupied_not_computing",
    "exposed_comm",
    "exposed_copy",
    "launch_starved",
    "blocking",
    *BLOCKING,
    "dependency_stalled",
    "residual",
)


def step_budget(
    ops: pl.DataFrame, pieces: pl.DataFrame, window: tuple[int, int], step_starts: list[int]
) -> pl.DataFrame:
    """Per step (``step_starts``; one row for the whole window without steps), ns of: the
    iteration; device busy (any kernel, graph replay, copy, memset); non-transfer busy (without
    communication kernels and host<->device or peer copies); compute busy (compute kernels and
    graph replays); compute-absent (iteration - compute busy); occupied-not-computing (device
    busy - compute busy); exposed communication and copies (for comparison with blocking); and
    compute-absent split into the classes of ``attribute_gaps``. The residual is what the
    split leaves of compute-absent: the unresolved pieces, measured, not absorbed."""
    kind = pl.col("kind")
    layers = {
        "compute": ops.filter(kind.is_in(COMPUTE_KINDS)),
        "comm": ops.filter(kind == "collective"),
        "xfer": ops.filter((kind == "copy") & pl.col("transfer")),
        "local": ops.filter((kind == "copy") & ~pl.col("transfer")),
    } | {cls: pieces.filter(pl.col("cls") == cls) for cls in CLASSES}
    starts = sorted({s for s in step_starts if window[0] <= s < window[1]} | {window[0]})
    tl = intervals.timeline(layers, window, cuts=starts).sort("start")
    c, k, x, o = (pl.col(n) > 0 for n in ("compute", "comm", "xfer", "local"))

    def ns(cond: pl.Expr) -> pl.Expr:
        return pl.col("dur").filter(cond).sum()

    per = (
        tl.join_asof(
            pl.DataFrame({"step_start": starts}, schema={"step_start": pl.Int64}),
            left_on="start",
            right_on="step_start",
            strategy="backward",
        )
        .group_by("step_start")
        .agg(
            iteration=pl.col("dur").sum(),
            device_busy=ns(c | k | x | o),
            non_transfer_busy=ns(c | o),
            compute_busy=ns(c),
            exposed_comm=ns(k & ~c),
            exposed_copy=ns((x | o) & ~c & ~k),
            **{cls: ns(pl.col(cls) > 0) for cls in CLASSES},
        )
        .sort("step_start")
    )
    return (
        per.with_columns(
            compute_absent=pl.col("iteration") - pl.col("compute_busy"),
            occupied_not_computing=pl.col("device_busy") - pl.col("compute_busy"),
            blocking=pl.sum_horizontal(*BLOCKING),
        )
        .with_columns(
            residual=pl.col("compute_absent")
            - pl.col("launch_starved")
            - pl.col("blocking")
            - pl.col("dependency_stalled")
        )
        .select("step_start", *BUDGET_COLUMNS)
    )
