"""One rank's steady-state window, prepared once for every wall's measures: the event frames
clipped to the window and classified with the taxonomy, and the time each layer of GPU work
covers (:class:`Layers`: compute, communication, copies, profiler overhead and their unions),
from which every busy, idle and exposed time is read."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.intervals import Busy
from traceclf.model.taxonomy import Taxonomy, by_name, matches
from traceclf.model.trace import Trace
from traceclf.steps.steady import Steps
from traceclf.support.cpus import second_lane


@dataclass(frozen=True)
class Layers:
    """The window's GPU work as unions of intervals (clipped to the window's spans): compute
    (kernels other than communication, and graph-level traced replays, whose kernels the trace
    hides), communication kernels, copies and memsets, profiler overhead; and the unions that
    states are read from. A node-traced replay is its kernels: the gaps between them are
    idle, not compute."""

    compute: Busy
    comm: Busy
    copy: Busy
    profiler: Busy
    compute_comm: Busy  # compute or communication: any kernel
    work: Busy  # any GPU work: busy

    @classmethod
    def of(cls, compute: Busy, comm: Busy, copy: Busy, profiler: Busy) -> Layers:
        kernels = compute | comm
        return cls(compute, comm, copy, profiler, kernels, kernels | copy)

    def state_times(self) -> dict[str, int]:
        """ns of the window in each state (busy, compute, exposed comm, ...)."""
        return {
            "busy": self.work.total,
            "compute": self.compute.total,
            "compute_only": self.compute_comm.total - self.comm.total,
            "comm": self.comm.total,
            "exposed_comm": self.compute_comm.total - self.compute.total,
            "copy": self.copy.total,
            "exposed_copy": self.work.total - self.compute_comm.total,
        }


@dataclass(frozen=True)
class RankWindow:
    trace: Trace
    steps: Steps
    taxonomy: Taxonomy
    gpu: dict | None
    # kernels in the window, with family / is_comm / comm_kind / in_optimizer columns
    kern: pl.DataFrame
    graphs: pl.DataFrame  # graph-level traced graph executions
    graph_spans: pl.DataFrame  # one interval per graph replay, either tracing mode
    node_replays: Busy  # the spans of node-traced replays (the device-side gaps lie inside)
    copies: pl.DataFrame
    api: pl.DataFrame  # CUDA calls while the GPU runs the window, is_sync/wait/launch/alloc flags
    flagged: pl.DataFrame  # every CUDA call of the rank, row for row, flagged (classify_api)
    layers: Layers  # what each layer of GPU work covers
    state: dict[str, int]  # ns of the window in each state (Layers.state_times)

    @functools.cached_property
    def compute(self) -> pl.DataFrame:
        """Intervals of compute kernels and graph-level traced replays."""
        return pl.concat(
            [
                self.kern.select("start", "end", "is_comm")
                .filter(~pl.col("is_comm"))
                .drop("is_comm"),
                self.graphs.select("start", "end"),
            ]
        )

    @functools.cached_property
    def comm(self) -> pl.DataFrame:
        """Intervals of communication kernels."""
        return self.kern.select("start", "end", "is_comm").filter(pl.col("is_comm")).drop("is_comm")

    def step_calls(self) -> pl.DataFrame:
        """The sync, launch and allocation calls (start, end, is_sync, is_launch, is_alloc,
        is_free) of the analysed steps (:attr:`step_call_mask`); made when asked and not kept:
        millions of calls over ``--all-steps``. Without steps, every call overlapping the
        window, whole: clipped to it, a launch made before the first kernel looked 2 µs long
        where it took 38 µs."""
        mine = pl.Series(self.step_call_mask)
        if not self.steps.count:
            return self.flagged.filter(mine)
        flags = self.flagged.select("is_sync", "is_launch", "is_alloc", "is_free")
        counted = pl.any_horizontal(pl.all().fill_null(False))
        keep = flags.select(counted & mine).to_series()
        calls = self.trace.api.select("start", "end")
        return pl.concat([calls, flags], how="horizontal").filter(keep)

    @functools.cached_property
    def collective_ranges(self) -> pl.DataFrame:
        """The rank's NVTX ranges that name a collective (taxonomy ``nvtx_collectives``):
        start, end, global_tid, source and ``nvtx_kind``, once per source that names it;
        matched once for the communication kernels' kinds and the device copies issued
        inside collectives."""
        tax, nvtx = self.taxonomy, self.trace.nvtx
        parts = [
            nvtx.select("start", "end", "global_tid", nvtx_kind=tax.nvtx_collective(source))
            .filter(pl.col("nvtx_kind").is_not_null())
            .with_columns(source=pl.lit(source))
            for source in tax.collective_sources
        ]
        schema = {"start": pl.Int64, "end": pl.Int64, "global_tid": pl.Int64}
        empty = pl.DataFrame(schema=schema | {"nvtx_kind": pl.String, "source": pl.String})
        return pl.concat(parts) if parts and not nvtx.is_empty() else empty

    @functools.cached_property
    def step_call_mask(self) -> np.ndarray:
        """Whether each CUDA call of the trace (row for row) is one of the analysed steps'
        (:func:`step_call_mask`; without steps, one overlapping the window): found once for
        the measures that ask, a byte a call."""
        if not self.steps.count:
            lo, hi = self.steps.window
            api = self.trace.api
            return ((api["end"] > lo) & (api["start"] < hi)).to_numpy()
        return step_call_mask(self.trace, self.steps)

    def uncovered(self, rows: pl.DataFrame, cover: Busy) -> int:
        """ns of the window in which one of ``rows`` (start, end) is in flight and ``cover``
        (one of :attr:`layers`) covers nothing."""
        if rows.is_empty():
            return 0
        in_flight = Busy.of(intervals.clip(rows.select("start", "end"), self.spans))
        return in_flight.total - cover.overlap(in_flight)

    @property
    def window(self) -> tuple[int, int]:
        """The hull of the window (first to last analysed ns)."""
        return self.steps.window

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The window itself: one span, or the runs of analysed steps when a long capture is sampled."""
        return self.steps.spans

    @property
    def wall(self) -> int:
        """ns of the window (its spans only): the denominator of every ``*_frac``."""
        return self.steps.wall

    @property
    def n_steps(self) -> int:
        """Steady steps the window covers: the denominator of every ``*_per_step``."""
        return max(self.steps.analysed, 1)

    @property
    def host_traced(self) -> bool:
        """Whether CUDA API rows exist at all: without them host-side counts are unknown."""
        return not self.trace.api.is_empty()


def prepare(trace: Trace, steps: Steps, gpu: dict | None, taxonomy: Taxonomy) -> RankWindow:
    window = steps.spans
    with second_lane("traceclf-calls") as pool:
        # flagged once for both: the window's calls and the steps' calls (millions of rows
        # each), beside the kernels and the layers, which need none of them
        calls = trace.api.select("start", "end", "name", "correlation_id")
        flagging = pool.submit(classify_api, calls, taxonomy)
        kern, graphs, graph_spans, node_replays, copies, layers = _gpu_work(trace, window, taxonomy)
        flagged = flagging.result()
    api = intervals.clip(flagged, window)
    return RankWindow(
        trace,
        steps,
        taxonomy,
        gpu,
        kern,
        graphs,
        graph_spans,
        node_replays,
        copies,
        api,
        flagged,
        layers,
        layers.state_times(),
    )


def _gpu_work(trace: Trace, window: intervals.Spans, taxonomy: Taxonomy) -> tuple:
    """The window's kernels (classified), graph replays, their spans, node-traced replays,
    copies, and the layers of GPU work."""
    kern = optimizer_family(
        optimizer_runs(taxonomy.classify(intervals.clip(_flag_optimizer(trace, taxonomy), window)))
    )
    graphs = intervals.clip(trace.graphs, window)
    graph_spans = intervals.clip(trace.graph_executions, window)
    node_replays = Busy.of(intervals.clip(trace.node_replays, window))
    copies = intervals.clip(trace.copies, window)
    starts, ends = kern["start"].to_numpy(), kern["end"].to_numpy()
    is_comm = kern["is_comm"].fill_null(False).to_numpy()
    # Profiler overhead (CUPTI buffer flushes, ...) is a layer of its own: not GPU work, but
    # idle time it covers is the profiler's, not the training loop's.
    compute = ~is_comm
    layers = Layers.of(
        compute=(
            Busy.of_arrays(starts, ends)  # (no communication: no copy of every kernel)
            if compute.all()
            else Busy.of_arrays(starts[compute], ends[compute])
        )
        | Busy.of(graphs),  # (node-traced replays: their kernels are rows of ``kern``)
        comm=Busy.of_arrays(starts[is_comm], ends[is_comm]),
        copy=Busy.of(copies),
        profiler=Busy.of(intervals.clip(trace.overhead, window)),
    )
    return kern, graphs, graph_spans, node_replays, copies, layers


def optimizer_ranges(trace: Trace, taxonomy: Taxonomy) -> pl.DataFrame:
    """The NVTX ranges of the optimizer step (the taxonomy's ``nvtx.optimizer`` pattern)."""
    return trace.nvtx.filter(matches(trace.nvtx["text"], taxonomy.nvtx["optimizer"]))


def _flag_optimizer(trace: Trace, taxonomy: Taxonomy) -> pl.DataFrame:
    """The rank's kernels with ``in_optimizer``: launched inside an optimizer NVTX range. A
    per-tensor optimizer runs as plain elementwise kernels, which only the range (or where
    they run: :func:`optimizer_runs`) tells apart from the model's own; without such a range
    the column is a constant false."""
    ranges = optimizer_ranges(trace, taxonomy)
    if ranges.is_empty() or trace.kernels.is_empty():
        return trace.kernels.with_columns(in_optimizer=pl.lit(False))
    return trace.kernels.with_columns(
        in_optimizer=pl.Series(trace.launched_within(trace.kernels, ranges))
    )


# Kernels that end an optimizer's run: the model's own work (GEMMs, attention, convolutions) and
# communication never run inside the optimizer step's sequence of elementwise kernels.
RUN_BREAKS = ("gemm", "attention", "convolution", "communication")


def optimizer_runs(kern: pl.DataFrame) -> pl.DataFrame:
    """``kern`` (classified, in start order) with ``in_optimizer`` also set on every kernel of
    an optimizer's run: between the first and the last optimizer-named kernel of a stretch
    that no GEMM, attention, convolution or communication kernel breaks, in one CUDA-graph replay
    (node-level tracing: its kernels share the launch's correlationId) or on one stream; and
    ``optimizer_by_position`` on those that only where they run makes the optimizer's (not
    their name, nor an optimizer NVTX range), a premise the report states.

    A foreach Adam step interleaves its multi_tensor_apply kernels with per-tensor kernels
    named like any elementwise kernel (``div_`` between the foreach kernels of a captured
    step): without an optimizer NVTX range, only where they run says whose they are."""
    if kern.is_empty():
        return kern.with_columns(in_optimizer=pl.lit(False), optimizer_by_position=pl.lit(False))
    if not (kern["family"] == "optimizer").any():  # no run to find: no window functions
        # over millions of kernels (~1 s at 5 M; an optimizer NVTX range flags its own)
        flagged = kern if "in_optimizer" in kern.columns else kern.with_columns(in_optimizer=False)
        return flagged.with_columns(optimizer_by_position=pl.lit(False))
    family = pl.col("family")  # (a Categorical: compared by its few names, not per kernel)
    node = pl.col("graph_node_id").is_not_null()
    group = [  # a replay's kernels, or a stream's (a replay may run on several streams)
        pl.when(node).then(pl.col("correlation_id")).alias("_replay"),
        pl.when(~node).then(pl.col("stream_id")).alias("_stream"),
    ]
    flags = (
        kern.select(*group, _break=family.is_in(RUN_BREAKS), _named=family == "optimizer")
        .with_row_index("_row")
        .with_columns(_run=pl.col("_break").cum_sum().over("_replay", "_stream"))
        .with_columns(
            _first=pl.col("_row").filter("_named").min().over("_replay", "_stream", "_run"),
            _last=pl.col("_row").filter("_named").max().over("_replay", "_stream", "_run"),
        )
        .select(~pl.col("_break") & pl.col("_row").is_between("_first", "_last").fill_null(False))
        .to_series()
    )
    ranged = pl.col("in_optimizer") if "in_optimizer" in kern.columns else pl.lit(False)
    return kern.with_columns(
        in_optimizer=ranged | flags,
        optimizer_by_position=flags & (family != "optimizer") & ~ranged,
    )


def optimizer_family(kern: pl.DataFrame) -> pl.DataFrame:
    """Kernels the optimizer step launched are of the optimizer family whatever their names
    (communication stays communication: a distributed optimizer's all-gather is exchanged,
    not computed), so that the optimizer's time and the other families' never overlap."""
    if not kern["in_optimizer"].any():
        return kern
    optimizer = pl.col("in_optimizer") & ~pl.col("is_comm").fill_null(False)
    # (Categorical on both sides: no string per kernel, millions of them with --all-steps)
    return kern.with_columns(
        family=pl.when(optimizer)
        .then(pl.lit("optimizer", dtype=pl.Categorical))
        .otherwise(pl.col("family"))
    )


def classify_api(api: pl.DataFrame, taxonomy: Taxonomy) -> pl.DataFrame:
    """Flag sync (and of those, wait-only), launch and allocation calls (and of those, frees;
    regexes once per distinct API name)."""
    names = (
        api.select("name")
        .unique()
        .with_columns(
            is_sync=taxonomy.is_api("sync"),
            is_wait=taxonomy.is_api("wait"),
            is_launch=taxonomy.is_api("launch"),
            is_alloc=taxonomy.is_api("alloc"),
            is_free=taxonomy.is_api("alloc") & taxonomy.is_api("free"),
        )
    )
    return by_name(api, names)


def step_call_mask(trace: Trace, steps: Steps) -> np.ndarray:
    """Whether each of ``trace.api``'s calls belongs to the analysed steps.

    The host runs ahead of the GPU (with CUDA graphs by whole steps), so the calls made while
    the GPU runs a step are not that step's. A step found on the host (NVTX) owns the calls
    made inside its range, on any thread of the process; for steps found on the GPU (graph
    launches, a recurring kernel) each run of analysed steps owns the calls from the one that
    launched its first GPU work (by correlationId) to the one that launched the first work
    after it — or to the process's last call, when nothing follows."""
    starts = trace.api["start"].to_numpy()
    steady = steps.steady.filter(pl.col("cpu_start").is_not_null())
    if steps.source == "nvtx" and not steady.is_empty():  # a call at a range's end is in it
        lo = np.searchsorted(starts, steady["cpu_start"].to_numpy(), side="left")
        hi = np.searchsorted(starts, steady["cpu_end"].to_numpy(), side="right")
    else:
        lo, hi = _launched_runs(trace, steps, starts)
    # +1 from each range's first row to its end; counts of ranges fit 32 bits, and the sum
    # is taken in place (no second array of every call)
    inside = np.zeros(len(starts) + 1, np.int32)
    np.add.at(inside, lo, 1)
    np.add.at(inside, hi, -1)
    np.cumsum(inside, out=inside)
    return inside[:-1] > 0


def _launched_runs(trace: Trace, steps: Steps, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row ranges [lo, hi) of the (start-sorted) calls from the launch of each span's first GPU
    work to the launch of the first work after the span."""
    # (the launches of the trace's own GPU work are found once, for every measure that asks)
    frames = [f for f in (trace.kernels, trace.graphs, trace.copies) if not f.is_empty()]
    calls = [trace.launch_starts(f) for f in frames]
    gpu_start = np.concatenate(
        [f["start"].filter(c.is_not_null()).to_numpy() for f, c in zip(frames, calls, strict=True)]
        or [np.empty(0, np.int64)]
    )
    call_start = np.concatenate(
        [c.drop_nulls().to_numpy() for c in calls] or [np.empty(0, np.int64)]
    )
    lo, hi = [], []
    for a, b in intervals.spans_of(steps.spans):
        mine = (gpu_start >= a) & (gpu_start < b)
        if not mine.any():
            continue
        later = gpu_start >= b
        lo.append(np.searchsorted(starts, call_start[mine].min(), side="left"))
        hi.append(
            np.searchsorted(starts, call_start[later].min(), side="left")
            if later.any()
            else len(starts)
        )
    return np.array(lo, np.int64), np.array(hi, np.int64)
