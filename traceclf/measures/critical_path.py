"""What blocked compute, per step: the device budget of NVIDIA's method for Megatron-Bridge
traces (iteration, device busy, non-transfer busy, compute busy, compute-absent, occupied-not-
computing) and compute-absent time split into launch-starved, blocking (by the producer's
class) and dependency-stalled, with what cannot be resolved reported as a residual.

The split follows each compute-absent gap's critical path back from the compute operation
that ended it (:func:`traceclf.measures.attribution.attribute_gaps`), through the
dependencies of :mod:`traceclf.measures.dependencies`: binary searches and gathers by
operation id (an operation's row), never a loop over events or a join of millions of rows.
The budget is read off the unions of each kind of work (:mod:`traceclf.measures.intervals`).
docs/measures.md ("Critical path") defines every class.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from traceclf.measures import dependencies, intervals
from traceclf.measures.attribution import (
    BLOCKING,
    CLASSES,
    Ops,
    Piece,
    attribute_gaps,
    class_ns,
    kind_is,
)
from traceclf.measures.dependencies import COMPUTE_KINDS
from traceclf.measures.window import RankWindow
from traceclf.model.correlation import CallIndex
from traceclf.model.taxonomy import by_name

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


def measure(
    w: RankWindow, comm_blocking: list[CommBlocking] | None = None
) -> tuple[dict[str, float | int | None], list[dict]]:
    """The critical-path measures of one rank and its per-step budget (ms per step); with
    ``comm_blocking``, the blocking pieces whose producer is a communication kernel are
    appended to it (:func:`budget_ns`)."""
    ops, per_step = budget_ns(w, comm_blocking)
    total = per_step.drop("step_start").sum().row(0, named=True)
    wall = w.wall

    def frac(col: str) -> float:
        return total[col] / wall

    inside = intervals.inside("start", w.spans)  # (a sum, not a filtered copy of every column)
    unresolved = int(ops.select(pl.col("unresolved_wait").filter(inside).sum()).item())
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


def budget_ns(
    w: RankWindow, comm_blocking: list[CommBlocking] | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rank's operations (kind, start, end, transfer, unresolved_wait), and the budget of
    every steady step in ns (:func:`step_budget`; one row for the whole window when there are
    no steps). With ``comm_blocking``, each batch of blocking pieces whose producer is a
    communication kernel is appended to it as (start, end, the kernel's correlationId): what
    each communicator blocked."""
    ops, arrays, collectives = _rank_ops(w)
    # (the window may be several spans: gaps end at a span's edge, nothing between spans counts)
    gaps = pl.concat([compute_gaps(ops, span) for span in intervals.spans_of(w.spans)])
    pieces = attribute_gaps(gaps, arrays, _host_holds(w))  # (consumed by step_budget)
    if comm_blocking is not None:
        pieces = _collect_comm(pieces, collectives, comm_blocking)
    steps = w.steps.steady["gpu_start"].to_list() if w.steps.count else []
    return ops, step_budget(ops, pieces, w.spans, steps)


# Blocking pieces of communication producers: start, end (ns), the kernel's correlationId.
CommBlocking = tuple[np.ndarray, np.ndarray, np.ndarray]
BLOCKING_COMM = CLASSES.index("blocking_comm")


def _collect_comm(
    pieces: Iterable[Piece],
    collectives: tuple[np.ndarray, np.ndarray],
    into: list[CommBlocking],
) -> Iterable[Piece]:
    """``pieces`` as they are, appending to ``into`` those whose producer is a communication
    kernel (``collectives``: their operation ids, sorted, and correlationIds)."""
    ids, corr = collectives
    for piece in pieces:
        start, end, cls, op = piece
        if not isinstance(op, int) and len(ids):
            mine = (np.asarray(cls) == BLOCKING_COMM) & (end > start)
            if mine.any():
                at = np.searchsorted(ids, op[mine])
                into.append((start[mine], end[mine], corr[np.minimum(at, len(ids) - 1)]))
        yield piece


def _rank_ops(w: RankWindow) -> tuple[pl.DataFrame, Ops, tuple[np.ndarray, np.ndarray]]:
    """The rank's GPU operations from the window's start on (a producer that matters ends
    inside the window; the compute that ends the last gap may start after it): the columns
    the budget reads (kind, start, end, transfer, unresolved_wait), and the arrays the split
    walks (:class:`~traceclf.measures.attribution.Ops`: launch call's end, dependencies).
    Dependencies come as arrays, not columns: millions of rows are not converted twice. Also
    the ids of the communication kernels among them and their correlationIds."""
    trace, lo = w.trace, w.window[0]
    kernels = trace.kernels
    names = (
        kernels.select("name").unique().with_columns(is_comm=w.taxonomy.family() == "communication")
    )
    is_comm = by_name(kernels.select("name"), names)["is_comm"]
    raw = dependencies.gpu_ops(kernels, is_comm, trace.graphs, trace.copies, lo, ordered=False)
    # Operation ids are rows in (start, end) order; of the unordered rows only the columns
    # kept are gathered into that order (the others are read through ``rows``).
    rows = dependencies.start_end_order(raw["start"].to_numpy(), raw["end"].to_numpy())
    calls = trace.call_index
    waits = dependencies.stream_waits(trace.syncs, calls)
    dep_end, dep_op, unresolved = dependencies.resolve_arrays(raw, waits, trace.events, rows)
    launch = _launch_ends(calls, raw)
    corr = raw["correlation_id"].to_numpy()
    ops = raw.select("kind", "start", "end", "transfer")
    del raw
    if rows is not None:
        ops = ops[pl.Series(rows)]
        launch = launch[0][rows], launch[1][rows]
    coll = np.flatnonzero(kind_is(ops, ("collective",)))
    collectives = coll, corr[rows[coll] if rows is not None else coll]
    ops = ops.with_columns(unresolved_wait=pl.Series(unresolved))
    has_dep = dep_end != dependencies.NULL
    dep_end[~has_dep] = 0  # (in place: Ops reads a null as 0 and not valid)
    return ops, Ops.of_arrays(ops, launch, (dep_end, has_dep), dep_op, unresolved), collectives


def _launch_ends(calls: CallIndex, ops: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The end of each operation's launch call (0 where it is not in the export) and whether
    it is: a gather by row from the calls' end column, not a nullable column per operation."""
    row = calls.find(ops["pid"], ops["correlation_id"])
    ends = calls.api["end"]
    if ends.null_count() or not len(ends):
        end = calls.column("end", ops["pid"], ops["correlation_id"])
        return end.fill_null(0).to_numpy(), end.is_not_null().to_numpy()
    valid = row >= 0
    return np.where(valid, ends.to_numpy()[np.maximum(row, 0)], 0), valid


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
    start, end = ops["start"].to_numpy(), ops["end"].to_numpy()
    keep = kind_is(ops, COMPUTE_KINDS) & (start < hi) & (end > lo)
    # At most one gap per interval and one more: written in place (pages never written are
    # never resident), not gathered in lists and copied once more.
    room = int(keep.sum()) + 1
    edges, nexts = np.empty(room, np.int64), np.empty(room, np.int64)
    count, last = 0, lo  # (gaps so far; the end of the compute before the next run)
    # Runs block by block (intervals.runs), clipped to the window: the union of the clipped
    # intervals is the union clipped. A run touching the one before leaves no gap.
    for run_start, run_end in intervals.runs(start, end, keep):
        edge = np.concatenate([[last], np.minimum(run_end[:-1], hi)])
        nxt = np.maximum(run_start, lo)
        real = edge < nxt
        found = int(real.sum())
        edges[count : count + found] = edge[real]
        nexts[count : count + found] = nxt[real]
        count += found
        last = min(int(run_end[-1]), hi)
    if last < hi:
        edges[count], nexts[count] = last, hi
        count += 1
    return pl.DataFrame(
        {"start": edges[:count], "end": nexts[:count]}, schema={"start": pl.Int64, "end": pl.Int64}
    )


def step_budget(
    ops: pl.DataFrame, pieces: Iterable[Piece], window: intervals.Spans, step_starts: list[int]
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
    off the union's running length (:class:`traceclf.measures.intervals.Busy`)."""
    spans = intervals.spans_of(window)
    hull = (spans[0][0], spans[-1][1])
    starts = sorted({s for s in step_starts if hull[0] <= s < hull[1]} | {hull[0]})
    bounds = np.array([*starts, hull[1]], dtype=np.int64)
    start, end = ops["start"].to_numpy(), ops["end"].to_numpy()
    transfer = ops["transfer"].to_numpy()
    compute = kind_is(ops, COMPUTE_KINDS)
    comm = kind_is(ops, ("collective",))
    local = kind_is(ops, ("copy",)) & ~transfer
    unions = {
        "compute": compute,
        "compute_comm": compute | comm,
        "compute_local": compute | local,
        "device": np.ones(len(start), bool),
        "graph": kind_is(ops, ("graph",)),
    }
    length = {
        name: intervals.Busy.lengths(start, end, mask, bounds, spans)
        for name, mask in unions.items()
    }
    iteration = intervals.within_spans(bounds, spans)
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
        | dict(zip(CLASSES, class_ns(pieces, bounds).T, strict=True))
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
