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

from collections.abc import Iterable, Iterator

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
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.intervals import Busy
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
    "the GPU work it waited for had finished (the sync's return latency), or in a blocking "
    "copy's call before the copy began (staging pageable memory)",
    "dependency_stalled_frac": "compute-absent time the next compute kernel was issued and its "
    "resolved dependencies done, yet it did not run (queueing, another process on the GPU, a "
    "dependency the export does not show)",
    "attribution_residual_frac": "compute-absent time the split cannot attribute (no compute "
    "follows, CUDA API not traced, chain too long): compute_absent_frac minus the three classes "
    "and graph_internal_frac",
    **{
        f"launch_starved_{cause}_frac": f"launch-starved time in GPU-idle gaps of cause {cause} "
        "(host.py idle_gaps): what the host did while the next kernel was not yet issued"
        for cause in IDLE_CAUSES
    },
    "launch_starved_busy_frac": "launch-starved time while copies or communication kept the GPU "
    "busy (not idle): launch_starved_frac is the sum of this and launch_starved_<cause>_frac",
    "graph_internal_frac": "compute-absent time inside node-traced CUDA-graph replays, between "
    "their kernels: device-side scheduling and dependencies between graph nodes, which the "
    "trace does not show per node (0 without node-level graph tracing)",
    "graph_unresolved_frac": "time inside graph-level traced CUDA-graph replays: the trace hides "
    "their kernels, so what runs inside them is unknown, and they are counted as compute (an "
    "upper bound: compute_frac is at most this much too high; 0 with node-level tracing, which "
    "shows the kernels)",
    "launch_call_missing_frac": "share of the window's GPU operations (kernels, communication "
    "kernels, copies, graph replays) whose launch call the export lacks (a correlationId that "
    "matches no CUDA call; unified-memory migrations, which no call launches, count as found): the critical-path split cannot follow them (a gap one ends is "
    "attribution_residual_frac; a wait for one through an event cannot be resolved and may "
    "read as dependency-stalled), so its shares may be wrong (null without a CUDA API trace)",
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
    "graph_internal",
    "in_graph",
)


def measure(
    w: RankWindow,
    comm_blocking: list[CommBlocking] | None = None,
    starved: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[dict[str, float | int | None], list[dict]]:
    """The critical-path measures of one rank and its per-step budget (ms per step); with
    ``comm_blocking``, the blocking pieces whose producer is a communication kernel are
    appended to it (:func:`budget_ns`); ``starved`` (a list) receives the launch-starved
    pieces (:func:`starved_by_cause`)."""
    ops, per_step = budget_ns(w, comm_blocking, starved)
    total = per_step.drop("step_start").sum().row(0, named=True)
    wall = w.wall

    def frac(col: str) -> float:
        return total[col] / wall

    inside = intervals.inside("start", w.spans)  # (a sum, not a filtered copy of every column)
    unresolved, missing = ops.select(
        pl.col("unresolved_wait").filter(inside).sum(),
        (~pl.col("launch_found")).filter(inside).mean(),
    ).row(0)
    m: dict[str, float | int | None] = {
        "non_transfer_busy_frac": frac("non_transfer_busy"),
        "compute_absent_frac": frac("compute_absent"),
        "occupied_not_computing_frac": frac("occupied_not_computing"),
        "launch_starved_frac": frac("launch_starved"),
        "blocking_frac": frac("blocking"),
        **{f"{cls}_frac": frac(cls) for cls in BLOCKING},
        "dependency_stalled_frac": frac("dependency_stalled"),
        "attribution_residual_frac": frac("residual"),
        "graph_internal_frac": frac("graph_internal"),
        "graph_unresolved_frac": frac("in_graph"),
        "launch_call_missing_frac": missing,
        "event_waits_unresolved": int(unresolved),
    }
    api = w.trace.api
    if not w.host_traced or api["correlation_id"].null_count() == api.height:
        # without launch calls (not traced, or none with a correlationId to find its work by)
        # the split is unknown, not zero
        m |= dict.fromkeys(
            ("launch_starved_frac", "dependency_stalled_frac", "launch_call_missing_frac")
        )
    return m, _rounded_rows(per_step.with_columns(pl.col(c) / 1e6 for c in BUDGET_COLUMNS), 4)


def _rounded_rows(df: pl.DataFrame, digits: int) -> list[dict]:
    """The rows of ``df`` as dicts, floats rounded to ``digits`` as Python's ``round`` does
    (:func:`_rounded`): ``--all-steps`` has a row per step, tens of thousands of them, and
    ``round`` costs a microsecond a value."""
    columns = [
        _rounded(s, digits) if s.dtype.is_float() else s.to_list() for s in df.iter_columns()
    ]
    return [dict(zip(df.columns, row, strict=True)) for row in zip(*columns, strict=True)]


def _rounded(s: pl.Series, digits: int) -> list:
    """``[round(v, digits) for v in s]`` (nulls kept), the same floats: scaled, rounded to an
    integer and scaled back in numpy where the scaled value is not within its rounding error
    of a half (the integer is then the one ``round`` picks, and the division gives the float
    nearest to it, as ``round`` does); by ``round`` itself where it may be, or is too large."""
    if s.null_count():
        return [None if v is None else round(v, digits) for v in s.to_list()]
    x = s.to_numpy().astype(np.float64, copy=False)
    scale = 10.0**digits
    y = x * scale
    with np.errstate(invalid="ignore"):
        doubt = np.abs(np.abs(y - np.trunc(y)) - 0.5) <= np.abs(y) * 2.0**-52
        doubt |= ~(np.abs(y) < 2.0**52)  # (also not finite)
    out = (np.rint(y) / scale).tolist()
    for i in np.flatnonzero(doubt).tolist():
        out[i] = round(float(x[i]), digits)
    return out


def budget_ns(
    w: RankWindow,
    comm_blocking: list[CommBlocking] | None = None,
    starved: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rank's operations (kind, start, end, transfer, unresolved_wait), and the budget of
    every steady step in ns (:func:`step_budget`; one row for the whole window when there are
    no steps). With ``comm_blocking``, each batch of blocking pieces whose producer is a
    communication kernel is appended to it as (start, end, the kernel's correlationId): what
    each communicator blocked; the launch-starved pieces go to ``starved`` when given."""
    ops, arrays, collectives = _rank_ops(w)
    # (the window may be several spans: gaps end at a span's edge, nothing between spans counts)
    gaps = pl.concat([compute_gaps(ops, span) for span in intervals.spans_of(w.spans)])
    pieces = attribute_gaps(gaps, arrays, _host_holds(w))  # (consumed by step_budget)
    if comm_blocking is not None:
        pieces = _collect_comm(pieces, collectives, comm_blocking)
    if starved is not None:
        pieces = _keeping(pieces, CLASSES.index("launch_starved"), starved)
    steps = w.steps.steady["gpu_start"].to_list() if w.steps.count else []
    nodes = w.kern.filter(pl.col("graph_node_id").is_not_null())
    node_kernels = (  # (a node-traced replay's op is its span; compute is its kernels)
        Busy.of(nodes.filter(~pl.col("is_comm")).select("start", "end")),
        Busy.of(nodes.filter(pl.col("is_comm")).select("start", "end")),
    )
    return ops, step_budget(ops, pieces, w.spans, steps, node_kernels)


def _keeping(
    pieces: Iterable[Piece], cls: int, kept: list[tuple[np.ndarray, np.ndarray]]
) -> Iterator[Piece]:
    """``pieces``, passed on as they come, the (start, end) of those of class ``cls`` also
    added to ``kept``."""
    for piece in pieces:
        start, end, classes, _ = piece
        mine = np.broadcast_to(np.asarray(classes) == cls, start.shape)
        if mine.any():
            kept.append((start[mine], end[mine]))
        yield piece


def starved_by_cause(
    starved: list[tuple[np.ndarray, np.ndarray]], gaps: pl.DataFrame, w: RankWindow
) -> dict[str, float | None]:
    """Launch-starved time by what the GPU and the host did meanwhile: the idle cause of the
    idle gap it falls in (``launch_starved_<cause>_frac``: in sync idle, while the
    host launched, ...), or ``launch_starved_busy_frac`` while copies or communication kept
    the GPU busy. Two views of one time: the critical path says the next kernel was not yet
    issued, the idle cause what the host was doing instead. They sum to launch_starved_frac."""
    if not w.host_traced:  # (launch-starved itself is unknown then)
        return dict.fromkeys(
            [*(f"launch_starved_{c}_frac" for c in IDLE_CAUSES), "launch_starved_busy_frac"]
        )
    # (each gap's cause by its code in IDLE_CAUSES, the Enum's order; none: a bin of its own)
    code = gaps["cause"].to_physical().fill_null(len(IDLE_CAUSES)).to_numpy()
    gstart, gend = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    start = np.concatenate([p[0] for p in starved] or [np.empty(0, np.int64)])
    end = np.concatenate([p[1] for p in starved] or [np.empty(0, np.int64)])
    pieces = Busy.of_arrays(start, end)
    covered = pieces.covered(gstart, gend)  # each gap's launch-starved ns, summed per cause
    ns = np.bincount(code, weights=covered, minlength=len(IDLE_CAUSES) + 1)
    out = {f"launch_starved_{c}_frac": int(ns[i]) / w.wall for i, c in enumerate(IDLE_CAUSES)}
    busy = pieces.total - int(covered.sum())
    return out | {"launch_starved_busy_frac": busy / w.wall}


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
    # (a graph replay without one, as a damaged export holds: -1, no collective's; a null would
    # make every id a float, which no join with the kernels' ids takes)
    corr = raw["correlation_id"].fill_null(-1).to_numpy()
    ops = raw.select("kind", "start", "end", "transfer")
    del raw
    if rows is not None:
        ops = ops[pl.Series(rows)]
        launch = launch[0][rows], launch[1][rows]
    coll = np.flatnonzero(kind_is(ops, ("collective",)))
    collectives = coll, corr[rows[coll] if rows is not None else coll]
    # (an operation no call launched, as a unified-memory migration is, has correlationId 0)
    called = corr > 0 if rows is None else corr[rows] > 0
    ops = ops.with_columns(
        unresolved_wait=pl.Series(unresolved),
        launch_found=pl.Series(launch[1] | ~called),
    )
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
    ops: pl.DataFrame,
    pieces: Iterable[Piece],
    window: intervals.Spans,
    step_starts: list[int],
    node_kernels: tuple[Busy, Busy] | None = None,
) -> pl.DataFrame:
    """Per step (from each of ``step_starts``; one row for the window without steps), ns of
    the columns of BUDGET_COLUMNS: the iteration; device busy (kernels, graph replays, copies,
    memsets); non-transfer busy (without communication kernels and host<->device or peer
    copies); compute busy (compute kernels and graph-level traced replays); compute-absent
    (iteration - compute busy); occupied-not-computing (device busy - compute busy); exposed
    communication and copies (the upper bounds of blocking); compute-absent split into the
    classes of :func:`attribute_gaps`; the gaps inside node-traced replays (graph_internal);
    the residual (compute-absent minus launch-starved, blocking, dependency-stalled and
    graph_internal: measured, not absorbed); time inside graph-level traced replays.

    A node-traced replay ("nodes" op) is one operation for the walk, but busy only while its
    kernels run: ``node_kernels`` (compute, communication) stand in for its span.

    Each is the length of a union of kinds of work within the step's part of the window, read
    off the union's running length (:class:`traceclf.measures.intervals.Busy`)."""
    spans = intervals.spans_of(window)
    hull = (spans[0][0], spans[-1][1])
    starts = sorted({s for s in step_starts if hull[0] <= s < hull[1]} | {hull[0]})
    bounds = np.array([*starts, hull[1]], dtype=np.int64)
    start, end = ops["start"].to_numpy(), ops["end"].to_numpy()
    transfer = ops["transfer"].to_numpy()
    nodes = kind_is(ops, ("nodes",))
    compute = kind_is(ops, COMPUTE_KINDS) & ~nodes
    comm = kind_is(ops, ("collective",))
    local = kind_is(ops, ("copy",)) & ~transfer
    empty = Busy(np.empty(0, np.int64), np.empty(0, np.int64))
    node_compute, node_comm = node_kernels or (empty, empty)
    node_any = node_compute | node_comm
    unions = {  # (mask of ops, node kernels that join them)
        "compute": (compute, node_compute),
        "compute_comm": (compute | comm, node_any),
        "compute_local": (compute | local, node_compute),
        "device": (~nodes, node_any),
        "graph": (kind_is(ops, ("graph",)), empty),
        "compute_replays": (compute | nodes, node_compute),
    }
    length = {
        name: _union_lengths(start, end, mask, extra, bounds, spans)
        for name, (mask, extra) in unions.items()
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
            "graph_internal": length["compute_replays"] - length["compute"],
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
            - pl.col("graph_internal")
        )
        .select("step_start", *BUDGET_COLUMNS)
    )


def _union_lengths(
    start: np.ndarray,
    end: np.ndarray,
    mask: np.ndarray,
    extra: Busy,
    bounds: np.ndarray,
    spans: list[tuple[int, int]],
) -> np.ndarray:
    """ns per part of the union of the operations ``mask`` selects and ``extra``."""
    if not extra.total:
        return Busy.lengths(start, end, mask, bounds, spans)
    busy = extra
    for rs, re in intervals.runs(start, end, mask):
        busy = busy | Busy(rs, re)
    return busy.within(bounds, spans)
