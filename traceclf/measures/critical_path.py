"""What blocked compute, per step: the device budget of NVIDIA's method for Megatron-Bridge
traces (iteration, device busy, non-transfer busy, compute busy, compute-absent, occupied-not-
computing) and compute-absent time split into launch-starved, blocking (by the producer's
class) and dependency-stalled, with what cannot be resolved reported as a residual.

The split follows each compute-absent gap's critical path back from the compute operation
that ended it (:func:`attribute_gaps`), through the dependencies of
:mod:`traceclf.measures.dependencies`: sorts, joins and one join per hop, never a loop over
events. docs/measures.md ("Critical path") defines every class.
"""

from __future__ import annotations

import polars as pl

from traceclf.measures import dependencies, timeline
from traceclf.measures.dependencies import COMPUTE_KINDS
from traceclf.measures.host import SYNC_SLACK_NS
from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "non_transfer_busy_frac": "union of GPU work other than communication kernels and "
    "host<->device or peer copies",
    "compute_absent_frac": "time no compute kernel or graph replay runs: 1 - compute_frac",
    "occupied_not_computing_frac": "GPU busy with communication or copies only: "
    "gpu_busy_frac - compute_frac",
    "launch_starved_frac": "compute-absent time before the next compute kernel's launch call "
    "returned, the host not waiting in a synchronising call (the host had not issued it)",
    "blocking_frac": "compute-absent time the next compute kernel, already issued, waited for "
    "work it depends on that finished after the gap began (all producer classes)",
    "blocking_comm_frac": "blocking time whose producer is a communication kernel "
    "(recoverable by overlap or a faster exchange; exposed_comm_frac is the upper bound)",
    "blocking_copy_frac": "blocking time whose producer is a memcpy/memset "
    "(exposed_copy_frac is the upper bound)",
    "blocking_compute_frac": "blocking time whose producer is a compute kernel or graph replay",
    "blocking_host_sync_frac": "compute-absent time the host sat in a synchronising call after "
    "the GPU work it waited for had finished (the sync's return latency)",
    "dependency_stalled_frac": "compute-absent time the next compute kernel was issued and its "
    "resolved dependencies done, yet it did not run (queueing, another process on the GPU, a "
    "dependency the export does not show)",
    "attribution_residual_frac": "compute-absent time the split cannot attribute (no compute "
    "follows, CUDA API not traced, chain too long): compute_absent_frac minus the three classes",
    "graph_unresolved_frac": "time inside CUDA-graph replays: their kernels' launches and "
    "dependencies are not in the trace, so gaps inside them cannot be split (counted as compute)",
    "event_waits_unresolved": "cudaStreamWaitEvent calls in the window whose event record "
    "cannot be found by eventSyncId (older exports have none; the reused event handle is "
    "never used instead)",
}
# Producer class of a blocking interval, from the kind of the operation that ran then.
PRODUCER_CLASS = {"collective": "comm", "copy": "copy", "compute": "compute", "graph": "compute"}
BLOCKING = ("blocking_comm", "blocking_copy", "blocking_compute", "blocking_host_sync")
# Classes of compute-absent time: they partition it.
CLASSES = ("launch_starved", *BLOCKING, "dependency_stalled", "unresolved")
PIECE_SCHEMA = {"start": pl.Int64, "end": pl.Int64, "cls": pl.String, "producer_op": pl.Int64}
MAX_HOPS = 64  # longest dependency chain followed inside one gap
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
    "in_graph",
)


def measure(w: RankWindow) -> tuple[dict[str, float | int | None], list[dict]]:
    """The critical-path measures of one rank and its per-step budget (ms per step)."""
    ops, per_step = budget_ns(w)
    total = per_step.drop("step_start").sum().row(0, named=True)
    wall = w.wall

    def frac(col: str) -> float:
        return total[col] / wall

    unresolved = int(ops.filter(timeline.inside("start", w.spans))["unresolved_wait"].sum())
    m: dict[str, float | int | None] = {
        "non_transfer_busy_frac": frac("non_transfer_busy"),
        "compute_absent_frac": frac("compute_absent"),
        "occupied_not_computing_frac": frac("occupied_not_computing"),
        "launch_starved_frac": frac("launch_starved"),
        "blocking_frac": frac("blocking"),
        **{f"{cls}_frac": frac(cls) for cls in BLOCKING},
        "dependency_stalled_frac": frac("dependency_stalled"),
        "attribution_residual_frac": frac("residual"),
        "graph_unresolved_frac": frac("in_graph"),
        "event_waits_unresolved": unresolved,
    }
    if not w.host_traced:  # without launch calls the split is unknown, not zero
        m |= dict.fromkeys(("launch_starved_frac", "dependency_stalled_frac"))
    rows = (per_step.with_columns(pl.col(c) / 1e6 for c in BUDGET_COLUMNS)).to_dicts()
    return m, [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def budget_ns(w: RankWindow) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rank's operations with their dependencies, and the budget of every steady step in
    ns (:func:`step_budget`; one row for the whole window when there are no steps)."""
    ops, api = _rank_ops(w)
    # (the window may be several spans: gaps end at a span's edge, nothing between spans counts)
    gaps = pl.concat([compute_gaps(ops, span) for span in timeline.spans_of(w.spans)])
    keys = ["pid", "correlation_id"]
    launches = api.select(*keys, "end").join(ops.select(keys), on=keys, how="semi")
    pieces = attribute_gaps(gaps, ops, launches, _host_holds(w))
    steps = w.steps.steady["gpu_start"].to_list() if w.steps.count else []
    return ops, step_budget(ops, pieces, w.spans, steps)


def _rank_ops(w: RankWindow) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rank's GPU operations from the window's start on (a producer that matters ends
    inside the window; the compute that ends the last gap may start after it), with their
    dependencies resolved."""
    trace, lo = w.trace, w.window[0]
    cols = ("pid", "device_id", "stream_id", "correlation_id", "start", "end", "graph_node_id")
    kern = w.taxonomy.classify(trace.kernels.filter(pl.col("end") > lo).select(*cols, "name"))
    graphs = trace.graphs.filter(pl.col("end") > lo)
    copies = trace.copies.filter(pl.col("end") > lo)
    ops = dependencies.gpu_ops(kern, graphs, copies)
    waits = dependencies.stream_waits(trace.syncs, trace.api)
    resolved = dependencies.resolve_dependencies(ops, waits, trace.events)
    return resolved, trace.api


def _host_holds(w: RankWindow) -> pl.DataFrame:
    """CUDA calls during which the host waited for the GPU: synchronising calls, and the
    calls of pageable copies (the host stages a pageable copy before the call returns)."""
    pageable = w.copies.filter(pl.col("pageable")).select("correlation_id")
    held = w.api.filter(
        pl.col("is_sync").fill_null(False)
        | pl.col("correlation_id").is_in(pageable["correlation_id"].implode())
    )
    return held.select("start", "end")


def compute_gaps(ops: pl.DataFrame, window: tuple[int, int]) -> pl.DataFrame:
    """Stretches of ``window`` with no compute (kernel or graph replay) on any stream."""
    lo, hi = window
    busy = timeline.union(timeline.clip(ops.filter(pl.col("kind").is_in(COMPUTE_KINDS)), window))
    edges = pl.concat(
        [
            pl.DataFrame({"end": [lo]}, schema={"end": pl.Int64}),
            busy.select("end"),
        ]
    ).with_columns(next_start=pl.concat([busy["start"], pl.Series([hi], dtype=pl.Int64)]))
    return edges.select(start="end", end="next_start").filter(pl.col("end") > pl.col("start"))


def attribute_gaps(
    gaps: pl.DataFrame,
    ops: pl.DataFrame,
    launches: pl.DataFrame,
    host_syncs: pl.DataFrame | None = None,
    max_hops: int = MAX_HOPS,
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
        "op_id",
        "kind",
        "start",
        "end",
        "launch_end",
        "dep_end",
        "dep_op",
        # it also waits for an event whose record the export lacks (nsys <= 2022 wrote no
        # eventSyncId): its wait after its known dependencies is not "stalled" but unexplained
        unres=pl.col("unresolved_wait").fill_null(False)
        if "unresolved_wait" in ops.columns
        else pl.lit(False),
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
            info.select(
                cur="op_id",
                k_launch="launch_end",
                k_dep="dep_end",
                nxt_op="dep_op",
                k_unres="unres",
            ),
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
        followed.select(start="ready", end="end", cls=_stalled_or_unresolved("k_unres")),
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
            [
                p.select(
                    pl.col(c).cast(t) if c in p.columns else pl.lit(None, t).alias(c)
                    for c, t in PIECE_SCHEMA.items()
                )
                for p in pieces
            ]
        )
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
    tl = timeline.timeline({"ls": starved, "sync": host_syncs.select("start", "end")}, (lo, hi))
    in_ls = tl.filter(pl.col("ls") > 0)
    free = in_ls.filter(pl.col("sync") == 0).select("start", "end", cls=pl.lit("launch_starved"))
    held = timeline.union(in_ls.filter(pl.col("sync") > 0).select("start", "end"))
    # The awaited work: the last operation to finish by the time the call returned, or the
    # last one started before it if that ends within SYNC_SLACK_NS after (a pageable copy's
    # last bytes land just after its call returns).
    finished = info.select(x_end="end", x_op="op_id").sort("x_end")
    started = info.select(y_start="start", y_end="end", y_op="op_id").sort("y_start")
    held = (
        held.sort("end")
        .join_asof(finished, left_on="end", right_on="x_end", strategy="backward")
        .with_columns(before=pl.col("end") - 1)
        .join_asof(started, left_on="before", right_on="y_start", strategy="backward")
        .with_columns(
            late=(pl.col("y_end") > pl.col("end"))
            & (pl.col("y_end") <= pl.col("end") + SYNC_SLACK_NS)
        )
        .with_columns(
            x_op=pl.when("late").then("y_op").otherwise("x_op"),
            x_end=pl.when("late").then("y_end").otherwise("x_end"),
        )
        .with_columns(x_end=pl.col("x_end").clip(pl.col("start"), pl.col("end")))
    )
    latency = held.select(start=pl.col("x_end").fill_null(pl.col("start")), end="end").with_columns(
        cls=pl.lit("blocking_host_sync")
    )
    seeds = held.filter(pl.col("x_op").is_not_null()).select(
        lo="start", stalled=pl.lit("dependency_stalled"), t="x_end", nxt_op="x_op"
    )
    return [free, latency], seeds.cast(seeds_schema)  # type: ignore[arg-type]


def _stalled_or_unresolved(unres: str) -> pl.Expr:
    """The class of the wait between an operation's known readiness and its start: "stalled"
    (the walk's class for it), or "unresolved" when it also waited for an event the export
    cannot resolve, which may be what held it."""
    return pl.when(pl.col(unres).fill_null(False)).then(pl.lit("unresolved")).otherwise("stalled")


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
            walk.select(start="ready", end="run_from", cls=_stalled_or_unresolved("unres")),
        ]
        walk = walk.select("lo", "stalled", t="ready", nxt_op="dep_op").filter(
            (pl.col("t") > pl.col("lo")) & pl.col("nxt_op").is_not_null()
        )
    if not walk.is_empty():  # a chain longer than max_hops: say so rather than guess
        pieces.append(walk.select(start="lo", end="t", cls=pl.lit("unresolved")))
    return pieces


def _classes_per_step(
    pieces: pl.DataFrame, starts: list[int], window: tuple[int, int]
) -> pl.DataFrame:
    """ns of each class per step: the pieces are disjoint, so each is cut at the step
    boundaries it spans (rare) and summed, without sweeping a timeline per class."""
    bounds = pl.Series([*starts, window[1]], dtype=pl.Int64)
    cut = (
        timeline.clip(pieces, window)
        .with_columns(
            first=pl.lit(bounds).search_sorted(pl.col("start"), side="right").cast(pl.Int64) - 1,
            last=pl.lit(bounds).search_sorted(pl.col("end"), side="left").cast(pl.Int64) - 1,
        )
        .with_columns(step=pl.int_ranges("first", pl.col("last") + 1))
        .explode("step")
        .with_columns(
            lo=pl.lit(bounds).gather(pl.col("step")), hi=pl.lit(bounds).gather(pl.col("step") + 1)
        )
        .with_columns(
            dur=pl.min_horizontal("end", "hi") - pl.max_horizontal("start", "lo"),
            step_start=pl.col("lo"),
        )
    )
    sums = cut.group_by("step_start").agg(
        **{cls: pl.col("dur").filter(pl.col("cls") == cls).sum() for cls in CLASSES}
    )
    return sums.cast({cls: pl.Int64 for cls in CLASSES})  # type: ignore[arg-type]


def step_budget(
    ops: pl.DataFrame, pieces: pl.DataFrame, window: timeline.Spans, step_starts: list[int]
) -> pl.DataFrame:
    """Per step (from each of ``step_starts``; one row for the window without steps), ns of
    the columns of BUDGET_COLUMNS: the iteration; device busy (kernels, graph replays, copies,
    memsets); non-transfer busy (without communication kernels and host<->device or peer
    copies); compute busy (compute kernels and graph replays); compute-absent (iteration -
    compute busy); occupied-not-computing (device busy - compute busy); exposed communication
    and copies (the upper bounds of blocking); compute-absent split into the classes of
    :func:`attribute_gaps`; the residual (compute-absent minus launch-starved, blocking and
    dependency-stalled: measured, not absorbed); time inside graph replays."""
    kind = pl.col("kind")
    layers = {
        "compute": ops.filter(kind.is_in(COMPUTE_KINDS)),
        "graph": ops.filter(kind == "graph"),
        "comm": ops.filter(kind == "collective"),
        "xfer": ops.filter((kind == "copy") & pl.col("transfer")),
        "local": ops.filter((kind == "copy") & ~pl.col("transfer")),
    }
    spans = timeline.spans_of(window)
    hull = (spans[0][0], spans[-1][1])
    starts = sorted({s for s in step_starts if hull[0] <= s < hull[1]} | {hull[0]})
    steps = pl.DataFrame({"step_start": starts}, schema={"step_start": pl.Int64})
    tl = timeline.timeline(layers, spans, cuts=starts).sort("start")
    c, k, x, o = (pl.col(n) > 0 for n in ("compute", "comm", "xfer", "local"))

    def ns(cond: pl.Expr) -> pl.Expr:
        return pl.col("dur").filter(cond).sum()

    per = (
        tl.join_asof(steps, left_on="start", right_on="step_start", strategy="backward")
        .group_by("step_start")
        .agg(
            iteration=pl.col("dur").sum(),
            device_busy=ns(c | k | x | o),
            non_transfer_busy=ns(c | o),
            compute_busy=ns(c),
            exposed_comm=ns(k & ~c),
            exposed_copy=ns((x | o) & ~c & ~k),
            in_graph=ns(pl.col("graph") > 0),
        )
        .join(_classes_per_step(pieces, starts, hull), on="step_start", how="left")
        .with_columns(pl.col(CLASSES).fill_null(0))
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
