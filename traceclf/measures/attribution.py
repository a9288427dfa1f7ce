"""Compute-absent time split into the classes of the critical path (docs/measures.md,
"Critical path": launch-starved, blocking by producer, blocking host sync,
dependency-stalled, unresolved), per step.

:func:`attribute_gaps` follows each gap's critical path back from the compute operation that
ended it; :func:`class_ns` sums the pieces per step. A kernel-dense capture has millions of
gaps, so both work on numpy arrays, gathering operations by id (an operation's id is its row
in ``ops``), gaps in batches of :data:`BATCH`: memory follows the batch, not the capture.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.claims import claim
from traceclf.measures.dependencies import COMPUTE_KINDS, KIND
from traceclf.measures.host import SYNC_SLACK_NS

# Producer class of a blocking interval, from the kind of the operation that ran then.
PRODUCER_CLASS = {
    "collective": "comm",
    "copy": "copy",
    "compute": "compute",
    "graph": "compute",
    "nodes": "compute",
}
BLOCKING = ("blocking_comm", "blocking_copy", "blocking_compute", "blocking_host_sync")
# Classes of compute-absent time: they partition it.
CLASSES = ("launch_starved", *BLOCKING, "dependency_stalled", "unresolved")
MAX_HOPS = 64  # longest dependency chain followed inside one gap
BATCH = 1 << 18  # gaps attributed at once (each batch holds a few dozen arrays of this size)
LAUNCH_STARVED, HOST_SYNC = CLASSES.index("launch_starved"), CLASSES.index("blocking_host_sync")
STALLED, UNRESOLVED = CLASSES.index("dependency_stalled"), CLASSES.index("unresolved")
# A piece of a gap: start, end (ns), its class (index into CLASSES, one or one per piece) and
# the operation that ran then (its id, one per piece) where the piece is a producer's run, -1
# where no operation ran (launch-starved, stalled, unresolved, a sync's return latency or a
# blocking copy's staging).
Piece = tuple[np.ndarray, np.ndarray, np.ndarray | int, np.ndarray | int]
NO_OP = -1


def kind_is(ops: pl.DataFrame, kinds: tuple[str, ...]) -> np.ndarray:
    """Whether each operation's kind (:data:`~traceclf.measures.dependencies.KIND`) is one
    of ``kinds``."""
    table = np.isin(KIND.categories.to_numpy(), kinds)
    return table[ops["kind"].to_physical().to_numpy()]


def _valued(s: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """A nullable integer column as (values, valid): nulls read as 0."""
    return s.fill_null(0).to_numpy(), s.is_not_null().to_numpy()


@dataclass
class Ops:
    """The operations as arrays (ids are rows): what the walk gathers."""

    start: np.ndarray
    end: np.ndarray
    producer: np.ndarray  # the class (index into CLASSES) an operation blocks as
    compute: np.ndarray
    launch: tuple[np.ndarray, np.ndarray]  # its launch call's end, valid
    dep: tuple[np.ndarray, np.ndarray]  # when its dependencies finished, valid
    dep_op: np.ndarray  # the operation that finished then, or -1
    # it also waited for an event whose record the export lacks (nsys <= 2022 wrote no
    # eventSyncId): its wait after its known dependencies is unexplained, not "stalled"
    unresolved: np.ndarray
    _by_end: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, ops: pl.DataFrame) -> Ops:
        return cls.of_arrays(
            ops,
            launch=_valued(ops["launch_end"]),
            dep=_valued(ops["dep_end"]),
            dep_op=ops["dep_op"].fill_null(-1).to_numpy(),
            unresolved=(
                ops["unresolved_wait"].fill_null(False).to_numpy()
                if "unresolved_wait" in ops.columns
                else np.zeros(ops.height, bool)
            ),
        )

    @classmethod
    def of_arrays(
        cls,
        ops: pl.DataFrame,
        launch: tuple[np.ndarray, np.ndarray],
        dep: tuple[np.ndarray, np.ndarray],
        dep_op: np.ndarray,
        unresolved: np.ndarray,
    ) -> Ops:
        """``ops`` (kind, start, end) with the other columns given as arrays already."""
        codes = ops["kind"].to_physical().to_numpy()
        names = KIND.categories.to_list()
        producer = np.array(
            [CLASSES.index(f"blocking_{PRODUCER_CLASS[k]}") for k in names], np.int8
        )
        return cls(
            start=ops["start"].to_numpy(),
            end=ops["end"].to_numpy(),
            producer=producer[codes],
            compute=kind_is(ops, COMPUTE_KINDS),
            launch=launch,
            dep=dep,
            dep_op=dep_op,
            unresolved=unresolved,
        )

    @property
    def by_end(self) -> tuple[np.ndarray, np.ndarray]:
        """Operation ids in end order (ties in id order) and their ends, sorted once when
        first needed."""
        if self._by_end is None:
            order = _narrow(np.argsort(self.end, kind="stable"))
            self._by_end = order, self.end[order]
        return self._by_end

    def next_compute(self) -> tuple[np.ndarray, np.ndarray]:
        """Start times of compute operations (sorted, distinct) and, for each, the operation
        that ends a gap there: of several starting at once, the one whose launch returned
        first (unknown launches last)."""
        ids = _narrow(np.flatnonzero(self.compute))
        start = self.start[ids]
        dup = np.zeros(len(ids), bool)
        dup[1:] = start[1:] == start[:-1]
        if not dup.any():
            return start, ids
        keep = ~dup
        tied = np.flatnonzero(dup | np.append(dup[1:], False))
        end, valid = self.launch[0][ids[tied]], self.launch[1][ids[tied]]
        first = (
            pl.DataFrame({"i": tied, "start": start[tied], "launch": end})
            .with_columns(launch=pl.when(pl.Series(valid)).then("launch").otherwise(2**62))
            .sort("start", "launch", maintain_order=True)
            .unique("start", keep="first", maintain_order=True)
        )
        keep[tied] = False
        keep[first["i"].to_numpy()] = True
        return start[keep], ids[keep]


def _narrow(ids: np.ndarray) -> np.ndarray:
    """Operation ids as int32 when they fit: arrays of millions of ids held through the walk."""
    return ids.astype(np.int32) if len(ids) < 2**31 else ids


def _max_valid(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The larger of two nullable values, ignoring a null one (polars' max_horizontal)."""
    (x, vx), (y, vy) = a, b
    both = np.maximum(x, y)
    return np.where(vx & vy, both, np.where(vx, x, y)), vx | vy


def attribute_gaps(
    gaps: pl.DataFrame,
    ops: pl.DataFrame | Ops,
    host_syncs: pl.DataFrame | None = None,
    max_hops: int = MAX_HOPS,
) -> Iterator[Piece]:
    """Split each compute-absent gap (start, end) into disjoint pieces of the classes in
    CLASSES. ``ops`` holds the operations (kind, start, end, launch_end, dep_end, dep_op,
    unresolved_wait; an operation's id is its row). K is the compute operation that ended the gap (the first to
    start at or after its end).

    - Until K's launch call returned, K was not issued: launch_starved, except while the host
      sat in a synchronising call (``host_syncs``: start, end): then it was waiting for the
      GPU, and the time is attributed to the work it waited for (the last GPU operation that
      finished before the call returned, walked back as below) and to the call's own return
      latency (blocking_host_sync); a copy the call issued itself (a blocking copy) ran until
      it ended or the call returned, and before it started the call staged it (host sync),
      after what it waited for.
    - After K was issued, the critical path is walked back from K through what each operation
      waited for (``resolve_arrays``): the time a producer ran is ``blocking_<class>``
      of that producer (collective, copy, compute); the time between a producer's (or K's)
      readiness and its start is dependency_stalled (issued, dependencies done, not running:
      queueing, another process on the GPU, a dependency the export does not show).
    - unresolved: no compute follows in the trace, K's launch call is not in the export (CUDA
      API not traced: launch-starved and stalled cannot be told apart), an operation's wait
      after its known dependencies when it also waited for an event the export cannot resolve
      (which may be what held it), or a chain longer than ``max_hops``.
    """
    arrays = ops if isinstance(ops, Ops) else Ops.of(ops)
    k_start, k_op = arrays.next_compute()
    syncs = None
    if host_syncs is not None and not host_syncs.is_empty():
        ordered = host_syncs.select("start", "end").sort("start", "end", maintain_order=True)
        syncs = intervals.union_sorted(ordered["start"].to_numpy(), ordered["end"].to_numpy())
    gs, ge = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    for lo, hi in _batches(gs, ge):
        yield from _attribute(gs[lo:hi], ge[lo:hi], arrays, k_start, k_op, syncs, max_hops)


def _batches(start: np.ndarray, end: np.ndarray) -> Iterator[tuple[int, int]]:
    """Row ranges of about BATCH gaps, never cut between two gaps that touch (a synchronising
    call over both is one stretch of waiting)."""
    lo = 0
    while lo < len(start):
        hi = min(lo + BATCH, len(start))
        while hi < len(start) and start[hi] <= end[hi - 1]:
            hi += 1
        yield lo, hi
        lo = hi


def _attribute(
    gs: np.ndarray,
    ge: np.ndarray,
    ops: Ops,
    k_start: np.ndarray,
    k_op: np.ndarray,
    syncs: tuple[np.ndarray, np.ndarray] | None,
    max_hops: int,
) -> Iterator[Piece]:
    pos = np.searchsorted(k_start, ge, side="left")
    found = pos < len(k_start)
    cur = np.where(found, k_op[np.minimum(pos, max(len(k_op) - 1, 0))], 0) if len(k_op) else pos
    yield gs[~found], ge[~found], UNRESOLVED, NO_OP
    gs, ge, cur = gs[found], ge[found], cur[found]
    launch = ops.launch[0][cur], ops.launch[1][cur]
    known = launch[1]
    issued = np.maximum(gs, np.minimum(launch[0], ge))
    lo = np.where(known, issued, gs)
    stalled = np.where(known, STALLED, UNRESOLVED)
    ready, has_ready = _max_valid((ops.dep[0][cur], ops.dep[1][cur]), launch)
    ready = np.where(has_ready, np.clip(ready, lo, ge), lo)
    yield ready, ge, np.where(ops.unresolved[cur], UNRESOLVED, stalled), NO_OP
    starved = gs[known], lo[known]
    seeds = [(lo, stalled, ready, ops.dep_op[cur])]
    yield from _split_host_syncs(*starved, syncs, ops, seeds)  # (adds the sync seeds)
    del gs, ge, cur, launch, issued
    yield from _walk(
        *(np.concatenate(c) for c in zip(*seeds, strict=True)), ops=ops, max_hops=max_hops
    )


def _split_host_syncs(
    start: np.ndarray,
    end: np.ndarray,
    syncs: tuple[np.ndarray, np.ndarray] | None,
    ops: Ops,
    seeds: list,
) -> Iterator[Piece]:
    """Launch-starved intervals minus the time the host sat in a synchronising call; for each
    such stretch [s0, s1], the GPU operation it waited for (the last to finish by s1) seeds a
    walk (appended to ``seeds``), and the time after that operation finished is the call's
    return latency; an operation the calls issued themselves (a blocking copy) is split by
    :func:`_issued_by_the_calls`. Only the (few) intervals a call overlaps are split; the
    others are launch-starved whole."""
    if syncs is None or not len(start):
        yield start, end, LAUNCH_STARVED, NO_OP
        return
    u_start, u_end = syncs
    j = np.searchsorted(u_end, start, side="right")  # the first call stretch ending after start
    touched = (j < len(u_end)) & (u_start[np.minimum(j, len(u_end) - 1)] < end)
    yield start[~touched], end[~touched], LAUNCH_STARVED, NO_OP
    touched &= end > start  # (an instant holds no time)
    if not touched.any():
        return
    # the time outside the calls stays launch-starved; the time in them, merged where it
    # touches, is held (the intervals are disjoint and sorted, the calls' stretches too)
    held, _, free = claim(
        (start[touched], end[touched], np.zeros(int(touched.sum()), np.int64)), u_start, u_end
    )
    yield free[0], free[1], LAUNCH_STARVED, NO_OP
    # The awaited work: the last operation to finish by the time the call returned, or the
    # last one started before it if that ends within SYNC_SLACK_NS after, or if the calls
    # themselves issued it: a pageable copy's call stages the copy and returns before its
    # last bytes land (0.15 ms before, for 100 ms copies of a public export, whose time had
    # read as the call's return latency).
    h_start, h_end = intervals.union_sorted(held[0], held[1])
    x_op = _last_finished(ops, h_end)
    y = np.searchsorted(ops.start, h_end - 1, side="right") - 1
    y0 = np.maximum(y, 0)
    y_end = ops.end[y0]
    late = (y >= 0) & (y_end > h_end)
    late &= (y_end <= h_end + SYNC_SLACK_NS) | _issued_in(ops, y0, h_start, h_end)
    x_op = np.where(late, y, x_op)
    at = np.maximum(x_op, 0)
    own = (x_op >= 0) & _issued_in(ops, at, h_start, h_end)
    yield from _issued_by_the_calls(h_start[own], h_end[own], at[own], ops, seeds)
    has = (x_op >= 0) & ~own
    x_end = np.clip(ops.end[at], h_start, h_end)
    yield np.where(has, x_end, h_start)[~own], h_end[~own], HOST_SYNC, NO_OP
    seeds.append((h_start[has], np.full(int(has.sum()), STALLED), x_end[has], x_op[has]))


def _last_finished(ops: Ops, t: np.ndarray) -> np.ndarray:
    """The operation that finished last by each time of ``t`` (-1: none)."""
    by_end, ends = ops.by_end
    x = np.searchsorted(ends, t, side="right") - 1
    return np.where(x >= 0, by_end[np.maximum(x, 0)], -1)


def _issued_in(ops: Ops, op: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each operation's launch call returned within [lo, hi]."""
    when, known = ops.launch
    return known[op] & (when[op] >= lo) & (when[op] <= hi)


def _issued_by_the_calls(
    h_start: np.ndarray, h_end: np.ndarray, op: np.ndarray, ops: Ops, seeds: list
) -> Iterator[Piece]:
    """Stretches [h_start, h_end] of synchronising calls that waited for an operation they
    issued themselves (a blocking copy of pageable memory stages it, then waits for it): it
    ran from its start until it ended or they returned, and after it ended they returned
    (their latency). Before it started, what it waited for ran (its dependency, or the
    operation that finished last by then where that ended later: an implicit order nsys does
    not record, as the legacy default stream's), walked back from there, and after that they
    were staging it, their own time (unresolved where it also waited for an event the export
    cannot resolve). Its launch ends after it starts: a walk from it would take that for its
    readiness and blame whatever ran before, even work that ended before the calls began."""
    ended = np.clip(ops.end[op], h_start, h_end)
    began = np.clip(ops.start[op], h_start, ended)
    yield began, ended, ops.producer[op], op
    yield ended, h_end, HOST_SYNC, NO_OP
    known = ops.dep[1][op] & (ops.dep_op[op] >= 0)
    prior = _last_finished(ops, began)
    prior_end = np.where(prior >= 0, ops.end[np.maximum(prior, 0)], 0)
    later = ~known | (prior_end > ops.dep[0][op])  # (an order the export does not show)
    before = np.where(later, prior, ops.dep_op[op])
    ready = np.clip(np.where(later, prior_end, ops.dep[0][op]), h_start, began)
    yield ready, began, np.where(ops.unresolved[op], UNRESOLVED, HOST_SYNC), NO_OP
    seeds.append((h_start, np.full(len(op), STALLED), ready, before))


def _walk(
    lo: np.ndarray, stalled: np.ndarray, t: np.ndarray, nxt: np.ndarray, ops: Ops, max_hops: int
) -> Iterator[Piece]:
    """Walk critical paths back from the seeds (time [lo, t] is left to explain, and ``nxt``
    is the operation that finished at t; -1: none), one hop per iteration for all of them at
    once: the producer's run is blocking by its class, the wait between its readiness and its
    start is ``stalled``, then on to what it waited for."""
    go = (t > lo) & (nxt >= 0)
    lo, stalled, t, cur = lo[go], stalled[go], t[go], nxt[go]
    for _ in range(max_hops):
        if not len(cur):
            return
        run_from = np.clip(ops.start[cur], lo, t)
        ready, has = _max_valid(
            (ops.dep[0][cur], ops.dep[1][cur]), (ops.launch[0][cur], ops.launch[1][cur])
        )
        ready = np.where(has, np.clip(ready, lo, run_from), lo)
        yield run_from, t, ops.producer[cur], cur
        yield ready, run_from, np.where(ops.unresolved[cur], UNRESOLVED, stalled), NO_OP
        nxt = ops.dep_op[cur]
        go = (ready > lo) & (nxt >= 0)
        lo, stalled, t, cur = lo[go], stalled[go], ready[go], nxt[go]
    if len(cur):  # a chain longer than max_hops: say so rather than guess
        yield lo, t, UNRESOLVED, NO_OP


def class_ns(pieces: Iterable[Piece], bounds: np.ndarray) -> np.ndarray:
    """ns of each class (columns, in CLASSES order) per step (rows; step i runs from
    ``bounds[i]`` to ``bounds[i + 1]``): the pieces are clipped to the steps and summed, a
    piece that spans step boundaries (rare) cut at each."""
    out = np.zeros((len(bounds) - 1, len(CLASSES)), np.int64)
    lo, hi = int(bounds[0]), int(bounds[-1])
    for start, end, cls, _ in pieces:
        start, end = np.maximum(start, lo), np.minimum(end, hi)
        keep = end > start
        start, end = start[keep], end[keep]
        cls = np.broadcast_to(np.asarray(cls, np.int64), keep.shape)[keep]
        first = np.searchsorted(bounds, start, side="right") - 1
        one = end <= bounds[first + 1]  # (almost every piece: no second search for its end)
        _add(out, first[one], cls[one], end[one] - start[one])
        if not one.all():
            s, e, c, f = start[~one], end[~one], cls[~one], first[~one]
            count = np.searchsorted(bounds, e, side="left") - f
            row = np.repeat(np.arange(len(s)), count)
            step = f[row] + np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)
            dur = np.minimum(e[row], bounds[step + 1]) - np.maximum(s[row], bounds[step])
            _add(out, step, c[row], dur)
    return out


def _add(out: np.ndarray, step: np.ndarray, cls: np.ndarray, dur: np.ndarray) -> None:
    # float sums of integer ns below 2**53 are exact
    flat = np.bincount(step * out.shape[1] + cls, weights=dur, minlength=out.size)
    out += np.rint(flat).astype(np.int64).reshape(out.shape)
