"""What blocked compute, per step: the device budget of NVIDIA's method for Megatron-Bridge
traces (iteration, device busy, non-transfer busy, compute busy, compute-absent, occupied-not-
computing) and compute-absent time split into launch-starved, blocking (by the producer's
class) and dependency-stalled, with what cannot be resolved reported as a residual.

The split follows each compute-absent gap's critical path back from the compute operation
that ended it (:func:`attribute_gaps`), through the dependencies of
:mod:`traceclf.measures.dependencies`: binary searches and gathers by operation id (an
operation's row), one gather per hop, never a loop over events or a join of millions of rows.
The budget is read off the unions of each kind of work (:mod:`traceclf.measures.busy`).
docs/measures.md ("Critical path") defines every class.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.kernels import by_name
from traceclf.measures import busy, dependencies, timeline
from traceclf.measures.dependencies import COMPUTE_KINDS, KIND, CallIndex
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
CLASS = pl.Enum(CLASSES)
PIECE_SCHEMA = {"start": pl.Int64, "end": pl.Int64, "cls": CLASS, "producer_op": pl.Int64}
# The columns of an operation the walk reads (an operation's id is its row).
INFO = ("kind", "start", "end", "launch_end", "dep_end", "dep_op", "unresolved_wait")
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
    ops = _rank_ops(w)
    # (the window may be several spans: gaps end at a span's edge, nothing between spans counts)
    gaps = pl.concat([compute_gaps(ops, span) for span in timeline.spans_of(w.spans)])
    pieces = attribute_gaps(gaps, ops, _host_holds(w))
    steps = w.steps.steady["gpu_start"].to_list() if w.steps.count else []
    return ops, step_budget(ops, pieces, w.spans, steps)


def _rank_ops(w: RankWindow) -> pl.DataFrame:
    """The rank's GPU operations from the window's start on (a producer that matters ends
    inside the window; the compute that ends the last gap may start after it), each with its
    launch call's end (``launch_end``) and its dependencies resolved; only the columns the
    split reads (:data:`INFO`, ``transfer``, ``unresolved_wait``) are kept."""
    trace, lo = w.trace, w.window[0]
    kernels = trace.kernels
    names = (
        kernels.select("name").unique().with_columns(is_comm=w.taxonomy.family() == "communication")
    )
    is_comm = by_name(kernels.select("name"), names)["is_comm"]
    ops = dependencies.gpu_ops(kernels, is_comm, trace.graphs, trace.copies, since=lo)
    calls = CallIndex(trace.api)
    waits = dependencies.stream_waits(trace.syncs, calls)
    ops = ops.with_columns(launch_end=calls.column("end", ops["pid"], ops["correlation_id"]))
    resolved = dependencies.resolve_dependencies(ops, waits, trace.events)
    return resolved.select(*INFO, "transfer")


def _host_holds(w: RankWindow) -> pl.DataFrame:
    """CUDA calls during which the host waited for the GPU: synchronising calls, and the
    calls of pageable copies (the host stages a pageable copy before the call returns)."""
    pageable = w.copies.filter(pl.col("pageable")).select("correlation_id")
    held = w.api.filter(
        pl.col("is_sync").fill_null(False)
        | pl.col("correlation_id").is_in(pageable["correlation_id"].implode())
    )
    return held.select("start", "end")


def _codes(ops: pl.DataFrame, kinds: tuple[str, ...]) -> np.ndarray:
    """Whether each operation's kind is one of ``kinds``."""
    codes = ops["kind"].to_physical().to_numpy()
    return np.isin(codes, [KIND.categories.to_list().index(k) for k in kinds])


def compute_gaps(ops: pl.DataFrame, window: tuple[int, int]) -> pl.DataFrame:
    """Stretches of ``window`` with no compute (kernel or graph replay) on any stream."""
    lo, hi = window
    start, end = ops["start"].to_numpy(), ops["end"].to_numpy()
    keep = _codes(ops, COMPUTE_KINDS) & (start < hi) & (end > lo)
    starts, ends = busy.union(np.maximum(start[keep], lo), np.minimum(end[keep], hi))
    edge = np.concatenate([[lo], ends])
    nxt = np.concatenate([starts, [hi]])
    real = edge < nxt
    return pl.DataFrame(
        {"start": edge[real], "end": nxt[real]}, schema={"start": pl.Int64, "end": pl.Int64}
    )


def _next_compute(info: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Start times of compute operations (sorted, distinct) and, for each, the operation that
    ends a gap there: of several starting at once, the one whose launch returned first."""
    ids = np.flatnonzero(_codes(info, COMPUTE_KINDS))
    start = info["start"].to_numpy()[ids]
    dup = np.zeros(len(ids), bool)
    dup[1:] = start[1:] == start[:-1]
    keep = ~dup
    if dup.any():
        tied = np.flatnonzero(dup | np.append(dup[1:], False))
        launch = info["launch_end"].gather(pl.Series(ids[tied])).fill_null(2**62)
        first = (
            pl.DataFrame({"i": tied, "start": start[tied], "launch": launch})
            .sort("start", "launch", maintain_order=True)
            .unique("start", keep="first", maintain_order=True)
        )
        keep[tied] = False
        keep[first["i"].to_numpy()] = True
    return start[keep], ids[keep]


def _at(info: pl.DataFrame, col: str, ids: pl.Series) -> pl.Series:
    """``col`` of the operations ``ids`` (null where the id is)."""
    return info[col].gather(ids)


def attribute_gaps(
    gaps: pl.DataFrame,
    info: pl.DataFrame,
    host_syncs: pl.DataFrame | None = None,
    max_hops: int = MAX_HOPS,
) -> pl.DataFrame:
    """Split each compute-absent gap into disjoint pieces (start, end, cls, producer_op) of
    the classes in CLASSES. ``info`` holds the operations (:data:`INFO`; an operation's id is
    its row). K is the compute operation that ended the gap (the first to start at or after
    its end).

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
    k_start, k_op = _next_compute(info)
    pos = np.searchsorted(k_start, gaps["end"].to_numpy(), side="left")
    found = pos < len(k_start)
    cur = (
        pl.select(
            pl.when(pl.Series(found)).then(pl.Series(k_op[np.minimum(pos, max(len(k_op) - 1, 0))]))
        ).to_series()
        if len(k_op)
        else pl.Series([None] * gaps.height, dtype=pl.Int64)
    )
    g = gaps.with_columns(
        cur=cur,
        k_launch=_at(info, "launch_end", cur),
        k_dep=_at(info, "dep_end", cur),
        nxt_op=_at(info, "dep_op", cur),
        # it also waits for an event whose record the export lacks (nsys <= 2022 wrote no
        # eventSyncId): its wait after its known dependencies is not "stalled" but unexplained
        k_unres=_at(info, "unresolved_wait", cur),
    )
    known = pl.col("k_launch").is_not_null()
    issued = pl.max_horizontal("start", pl.col("k_launch").clip(upper_bound=pl.col("end")))
    g = g.with_columns(
        lo=pl.when(known).then(issued).otherwise(pl.col("start")),
        stalled=pl.when(known)
        .then(pl.lit("dependency_stalled", CLASS))
        .otherwise(pl.lit("unresolved", CLASS)),
    ).with_columns(
        ready=pl.max_horizontal("k_dep", "k_launch")
        .clip(pl.col("lo"), pl.col("end"))
        .fill_null(pl.col("lo"))
    )
    followed = g.filter(pl.col("cur").is_not_null())
    pieces = [
        g.filter(pl.col("cur").is_null()).select("start", "end", cls=pl.lit("unresolved", CLASS)),
        followed.select(start="ready", end="end", cls=_stalled_or_unresolved("k_unres")),
    ]
    starved = followed.filter(known).select("start", end="lo")
    host_pieces, sync_seeds = _split_host_syncs(starved, host_syncs, info)
    pieces += host_pieces
    seeds = [followed.select("lo", "stalled", t="ready", nxt_op="nxt_op"), sync_seeds]
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
    walk, and the time after that operation finished is the call's return latency. Only the
    (few) intervals a call overlaps are split; the others are launch-starved whole."""
    seeds_schema = {"lo": pl.Int64, "stalled": CLASS, "t": pl.Int64, "nxt_op": pl.Int64}
    no_seeds = pl.DataFrame(schema=seeds_schema)
    starving = pl.lit("launch_starved", CLASS)
    if host_syncs is None or host_syncs.is_empty() or starved.is_empty():
        return [starved.with_columns(cls=starving)], no_seeds
    u_start, u_end = busy.union(*_sorted_intervals(host_syncs))
    s, e = starved["start"].to_numpy(), starved["end"].to_numpy()
    j = np.searchsorted(u_end, s, side="right")  # the first call stretch ending after s
    touched = (j < len(u_end)) & (u_start[np.minimum(j, len(u_end) - 1)] < e)
    whole = starved.filter(pl.Series(~touched)).with_columns(cls=starving)
    starved = starved.filter(pl.Series(touched))
    if starved.is_empty():
        return [whole], no_seeds
    lo, hi = int(starved["start"].min()), int(starved["end"].max())  # type: ignore[arg-type]
    tl = timeline.timeline({"ls": starved, "sync": host_syncs.select("start", "end")}, (lo, hi))
    in_ls = tl.filter(pl.col("ls") > 0)
    free = in_ls.filter(pl.col("sync") == 0).select("start", "end", cls=starving)
    held = timeline.union(in_ls.filter(pl.col("sync") > 0).select("start", "end"))
    # The awaited work: the last operation to finish by the time the call returned, or the
    # last one started before it if that ends within SYNC_SLACK_NS after (a pageable copy's
    # last bytes land just after its call returns).
    h_start, h_end = held["start"].to_numpy(), held["end"].to_numpy()
    op_start, op_end = info["start"].to_numpy(), info["end"].to_numpy()
    by_end = np.argsort(op_end, kind="stable")
    x = np.searchsorted(op_end[by_end], h_end, side="right") - 1
    y = np.searchsorted(op_start, h_end - 1, side="right") - 1
    x_op = np.where(x >= 0, by_end[np.maximum(x, 0)], -1)
    y_end = np.where(y >= 0, op_end[np.maximum(y, 0)], 0)
    late = (y >= 0) & (y_end > h_end) & (y_end <= h_end + SYNC_SLACK_NS)
    x_op = np.where(late, np.maximum(y, 0), x_op)
    x_end = np.clip(op_end[np.maximum(x_op, 0)], h_start, h_end)
    has = x_op >= 0
    latency = pl.DataFrame({"start": np.where(has, x_end, h_start), "end": h_end}).with_columns(
        cls=pl.lit("blocking_host_sync", CLASS)
    )
    seeds = pl.DataFrame({"lo": h_start[has], "t": x_end[has], "nxt_op": x_op[has]}).with_columns(
        stalled=pl.lit("dependency_stalled", CLASS)
    )
    return [whole, free, latency], seeds.select(list(seeds_schema)).cast(seeds_schema)  # type: ignore[arg-type]


def _sorted_intervals(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    ordered = df.select("start", "end").sort("start", "end", maintain_order=True)
    return ordered["start"].to_numpy(), ordered["end"].to_numpy()


def _stalled_or_unresolved(unres: str) -> pl.Expr:
    """The class of the wait between an operation's known readiness and its start: "stalled"
    (the walk's class for it), or "unresolved" when it also waited for an event the export
    cannot resolve, which may be what held it."""
    return (
        pl.when(pl.col(unres).fill_null(False))
        .then(pl.lit("unresolved", CLASS))
        .otherwise("stalled")
    )


def _walk(seeds: pl.DataFrame, info: pl.DataFrame, max_hops: int) -> list[pl.DataFrame]:
    """Walk critical paths back from ``seeds`` (lo, stalled, t, nxt_op: time [lo, t] is left
    to explain and nxt_op is the operation that finished at t), one hop per iteration for all
    of them at once: the producer's run is blocking by its class, the wait between its
    readiness and its start is ``stalled``, then on to what it waited for."""
    producer = pl.col("kind").replace_strict(
        {kind: f"blocking_{cls}" for kind, cls in PRODUCER_CLASS.items()},
        default="blocking_compute",
        return_dtype=CLASS,
    )
    pieces: list[pl.DataFrame] = []
    walk = seeds.filter((pl.col("t") > pl.col("lo")) & pl.col("nxt_op").is_not_null())
    for _ in range(max_hops):
        if walk.is_empty():
            break
        cur = walk["nxt_op"]
        walk = (
            walk.select("lo", "stalled", "t", cur="nxt_op")
            .with_columns(_at(info, c, cur) for c in INFO)
            .with_columns(run_from=pl.col("start").clip(pl.col("lo"), pl.col("t")))
            .with_columns(
                ready=pl.max_horizontal("dep_end", "launch_end")
                .clip(pl.col("lo"), pl.col("run_from"))
                .fill_null(pl.col("lo")),
                cls=producer,
            )
        )
        pieces += [
            walk.select(start="run_from", end="t", cls="cls", producer_op="cur"),
            walk.select(
                start="ready", end="run_from", cls=_stalled_or_unresolved("unresolved_wait")
            ),
        ]
        walk = walk.select("lo", "stalled", t="ready", nxt_op="dep_op").filter(
            (pl.col("t") > pl.col("lo")) & pl.col("nxt_op").is_not_null()
        )
    if not walk.is_empty():  # a chain longer than max_hops: say so rather than guess
        pieces.append(walk.select(start="lo", end="t", cls=pl.lit("unresolved", CLASS)))
    return pieces


def _classes_per_step(pieces: pl.DataFrame, bounds: np.ndarray) -> np.ndarray:
    """ns of each class (columns, in CLASSES order) per step (rows; step i runs from
    ``bounds[i]`` to ``bounds[i + 1]``): the pieces are disjoint, so each is cut at the step
    boundaries it spans (rare) and summed, without sweeping a timeline per class."""
    out = np.zeros((len(bounds) - 1, len(CLASSES)), np.int64)
    lo, hi = int(bounds[0]), int(bounds[-1])
    start = np.maximum(pieces["start"].to_numpy(), lo)
    end = np.minimum(pieces["end"].to_numpy(), hi)
    cls = pieces["cls"].to_physical().to_numpy().astype(np.int64)
    keep = end > start
    start, end, cls = start[keep], end[keep], cls[keep]
    first = np.searchsorted(bounds, start, side="right") - 1
    last = np.searchsorted(bounds, end, side="left") - 1
    count = last - first + 1
    row = np.repeat(np.arange(len(start)), count)
    step = first[row] + np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)
    dur = np.minimum(end[row], bounds[step + 1]) - np.maximum(start[row], bounds[step])
    # float sums of integer ns below 2**53 are exact
    flat = np.bincount(step * len(CLASSES) + cls[row], weights=dur, minlength=out.size)
    return np.rint(flat).astype(np.int64).reshape(out.shape)


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
    dependency-stalled: measured, not absorbed); time inside graph replays.

    Each is the length of a union of kinds of work within the step's part of the window, read
    off the union's running length (:class:`traceclf.measures.busy.Busy`)."""
    spans = timeline.spans_of(window)
    hull = (spans[0][0], spans[-1][1])
    starts = sorted({s for s in step_starts if hull[0] <= s < hull[1]} | {hull[0]})
    bounds = np.array([*starts, hull[1]], dtype=np.int64)
    start, end = ops["start"].to_numpy(), ops["end"].to_numpy()
    transfer = ops["transfer"].to_numpy()
    compute = _codes(ops, COMPUTE_KINDS)
    comm = _codes(ops, ("collective",))
    local = _codes(ops, ("copy",)) & ~transfer
    unions = {
        "compute": compute,
        "compute_comm": compute | comm,
        "compute_local": compute | local,
        "device": np.ones(len(start), bool),
        "graph": _codes(ops, ("graph",)),
    }
    length = {
        name: busy.Busy(*busy.union(start[mask], end[mask])).within(bounds, spans)
        for name, mask in unions.items()
    }
    iteration = busy.within_spans(bounds, spans)
    per = pl.DataFrame(
        {
            "step_start": bounds[:-1],
            "iteration": iteration,
            "device_busy": length["device"],
            "non_transfer_busy": length["compute_local"],
            "compute_busy": length["compute"],
            "exposed_comm": length["compute_comm"] - length["compute"],
            "exposed_copy": length["device"] - length["compute_comm"],
            "in_graph": length["graph"],
        }
        | dict(zip(CLASSES, _classes_per_step(pieces, bounds).T, strict=True))
    ).filter(pl.col("iteration") > 0)
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
