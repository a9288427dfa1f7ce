"""The default step sampling: read a long capture in two passes, so that time and memory follow
the steps analysed, not the capture's length.

Pass 1 finds the steps of every rank cheaply — the NVTX step ranges (CPU times), else the
CUDA-graph executions, else the kernel that recurs most regularly in a slice of the kernel
table — and chooses the steady steps to analyse: all of them when the row budget allows,
else as many as it allows (at most ``STEP_BUDGET`` per rank) in runs of consecutive steps
spread evenly over the steady state (:func:`traceclf.steps.plan.plan_steps`). Pass 2 reads only
those steps' rows, by rowid ranges found by binary search on ``start``
(:mod:`traceclf.ingest.rowindex`). A table whose rows are not in ``start`` order is scanned
once for its ordered pieces and read by rowid ranges within them; one shuffled finer is read
with a filtered scan on time (and NVTX steps' warm-up is then decided on their CPU durations);
one whose rows read by rowid range show rows missing is read again by a filtered scan:
``Trace.read_path`` says which (:mod:`traceclf.pipeline.pass2`). Memory
events are read whole, as the peak of allocated memory needs, on another thread while pass 1
plans; of NVTX, the rows that may be steps (pass 1) and the ranges over the analysed spans
(pass 2: :mod:`traceclf.ingest.nvtx_rows`).

An export whose event tables fit in the budget is read whole, as ``--all-steps`` does; of its
steady steps no more than ``STEP_BUDGET`` are analysed either way, in the runs a plan would
choose (:func:`traceclf.steps.plan.at_most_alike`).
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import polars as pl

from traceclf.ingest import rowindex
from traceclf.ingest.assemble import begin_host_read, build_trace, nvtx_ranges
from traceclf.ingest.devices import read_gpu_metrics
from traceclf.ingest.load import load_trace
from traceclf.ingest.nvtx_rows import near_ranges, reads_near, step_rows, window_rows
from traceclf.ingest.project import Projector
from traceclf.ingest.reader import Reader, Span
from traceclf.ingest.rowindex import RowIndex
from traceclf.ingest.schema import inspect_export
from traceclf.ingest.tables import EVENT_TABLES
from traceclf.model.taxonomy import Taxonomy, matches
from traceclf.model.trace import Trace
from traceclf.pipeline.pass2 import Pass2, merge_spans
from traceclf.steps.find import graph_launch_steps, range_label, recurring_kernel, step_ranges
from traceclf.steps.plan import StepPlan, plan_steps, shared_steady
from traceclf.steps.settings import StepSettings, bundled_settings
from traceclf.steps.steady import Allocations, steady_bounds
from traceclf.support.cpus import second_lane

# Event rows (kernels, CUDA calls, copies, syncs, graph executions) analysed per export by
# default: about 0.5 GB of memory and a second of reading on two cores.
ROW_BUDGET = 1_000_000
# Steps analysed per rank at most, however few rows a step has (CUDA-graph replays, short
# steps): 16 runs of 16 consecutive steps already pin a median step and its spread, and more
# would only make the measures' time follow the step count.
STEP_BUDGET = 256
# Kernel rows of the slice probed for a recurring kernel when there is neither NVTX steps nor
# CUDA graphs (doubled until a period shows, up to PROBE_MAX_ROWS).
PROBE_ROWS = 200_000
PROBE_MAX_ROWS = 3_200_000
# A table this small costs less to read whole than to reason about.
SMALL_ROWS = 100_000
GPU_SIDE = ("kernels", "graphs", "memcpy", "memset", "syncs")
# Steps of GPU rows read past an NVTX run's CPU end when its GPU start cannot be projected
# before reading (calls or GPU rows shuffled): how far the GPU may lag the host.
CPU_LAG = 4
# Values read back from SQL are used as numbers: rows whose end is not an integer are skipped.
INTEGER_END = "typeof(\"end\") = 'integer'"


@dataclass(frozen=True)
class SampledRead:
    """What step sampling read: the trace (only the analysed steps' rows, unless the
    capture fitted the budget) and, per rank pid, the plan of its steps (empty: whole capture)."""

    trace: Trace
    plans: dict[int, StepPlan]
    # rowids of the NVTX rows whose payload may name an NCCL rank, as pass 1's scan of the
    # table found them (ingest/session.py: nccl_ranks); None: not looked for
    payloads: list[int] | None = None


def load_for_analysis(
    path: Path,
    taxonomy: Taxonomy,
    step_regex: str | None = None,
    *,
    settings: StepSettings | None = None,
    all_steps: bool = False,
    budget: int | None = None,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> SampledRead:
    """The trace an analysis measures: step sampling's (:func:`load_sampled`), or with
    ``all_steps`` the whole capture through the model cache. An entry is written then only
    when the export was analysed before under other options: re-analysis with the same ones
    is served by the result cache, so a cold run never pays for writing a model it will not
    read again. Step sampling reads only the analysed steps' rows: no model cache."""
    if not all_steps:
        return load_sampled(
            path, taxonomy, step_regex, budget or ROW_BUDGET, progress, settings=settings
        )
    from traceclf.ingest import cache, results

    key = results.identity(path) if use_cache else None
    write = key is not None and results.analysed_before(path, key, cache_dir)
    trace = cache.load_trace_cached(
        path, use_cache=use_cache, cache_dir=cache_dir, progress=progress, write=write
    )
    return SampledRead(trace, {})


def load_sampled(
    path: str | Path,
    taxonomy: Taxonomy,
    step_regex: str | None = None,
    budget: int = ROW_BUDGET,
    progress: Callable[[str], None] | None = None,
    settings: StepSettings | None = None,
) -> SampledRead:
    """Read ``path`` for step sampling (see the module's description); ``settings`` (default:
    the bundled thresholds) decide warm-up and regularity as :func:`find_steps` does."""
    path = Path(path)
    reader = Reader(inspect_export(path, check_pages=False))
    step = progress or (lambda _msg: None)
    with rowindex.connect(path) as con:  # open while the indexes are searched
        indexes = event_indexes(reader, con)
        if sum(i.rows for i in indexes.values()) <= budget:
            return SampledRead(load_trace(path, progress=progress), {})
        step("steps")
        # Memory events are read whole (the capture's peak) on another thread while pass 1
        # plans, mostly in Python on one core: connectorx reads without holding the GIL.
        with ThreadPoolExecutor(1, thread_name_prefix="traceclf-memory") as pool:
            memory = pool.submit(reader.read, "memory")
            indexes = rowindex.in_pieces(con, indexes, reader.sql)
            planner = _Planner(
                reader, con, indexes, taxonomy, step_regex, budget, settings or bundled_settings()
            )
            plans = planner.plans()
            if plans is None:  # some rank's steps cannot be found cheaply: read it all
                return SampledRead(load_trace(path, progress=progress), {})
            trace = _read_plans(reader, con, indexes, planner, budget, progress, memory)
    return SampledRead(trace, plans, planner.nvtx.payloads)


def event_indexes(reader: Reader, con: sqlite3.Connection) -> dict[str, RowIndex]:
    """The row index of each event table the export has rows in (through ``con``, open while
    they are searched): their rows are what the row budget is compared with."""
    indexes = {
        logical: RowIndex.build(con, table)
        for logical in EVENT_TABLES
        if (table := reader.table_of(logical)) is not None
    }
    return {k: v for k, v in indexes.items() if v is not None}


def event_rows(path: str | Path) -> int:
    """The event rows of an export that the row budget is compared with (checks and tests
    choose their budgets from it)."""
    path = Path(path)
    reader = Reader(inspect_export(path, check_pages=False))
    with rowindex.connect(path) as con:
        return sum(i.rows for i in event_indexes(reader, con).values())


class _Planner:
    """Pass 1: the steps of every rank, and which of them to analyse."""

    def __init__(self, reader, con, indexes, taxonomy, step_regex, budget, settings) -> None:
        self.reader, self.con, self.indexes = reader, con, indexes
        self.taxonomy, self.budget = taxonomy, budget
        self.settings: StepSettings = settings
        self.pattern = step_regex or taxonomy.nvtx["step"]
        table = reader.table_of("nvtx")
        self.nvtx_index = RowIndex.build(con, table) if table else None
        self.nvtx = step_rows(reader, self.pattern, long_ranges=reads_near(self.nvtx_index))
        self.spans: list[tuple[Span, Span]] = []  # (GPU rows, CUDA calls) to read per run

    def plans(self) -> dict[int, StepPlan] | None:
        nvtx, pattern = nvtx_ranges(self.reader, self.nvtx.rows), self.pattern
        found_steps, projectors = {}, {}
        for pid in self._rank_pids():
            found = self._nvtx(nvtx, pid, pattern) or self._graphs(pid) or self._pattern(pid)
            if found is None:
                return None
            table, source, label, exact = found
            steady, projector = None, None
            if not exact:  # CPU ranges: decide warm-up and cut-off on GPU durations
                projector = Projector(self.con, self.reader, self.indexes, pid, table)
                if not projector.usable:
                    if not self._traced():  # no CUDA calls or no GPU rows: read it all
                        return None
                    # calls or GPU rows shuffled (read by a filtered scan): warm-up and
                    # cut-off are decided on the CPU durations of the steps
                    projector = None
                else:
                    steady = steady_bounds(
                        len(table),
                        projector.duration,
                        projector.reference(),
                        self.settings,
                        self._allocations(projector),
                    )
            found_steps[pid] = (table, source, label, exact, steady, self._analysable(table))
            projectors[pid] = projector
        plans = {
            pid: plan_steps(t, src, lab, ex, n, self.settings, st)
            for pid, (t, src, lab, ex, st, n) in found_steps.items()
        }
        within = shared_steady(list(plans.values()))
        if within is not None:  # the ranks of this export analyse the same steps
            fewest = min(n for *_, n in found_steps.values())
            plans = {
                pid: plan_steps(t, src, lab, ex, fewest, self.settings, st, within)
                for pid, (t, src, lab, ex, st, _n) in found_steps.items()
            }
        for pid, plan in plans.items():
            self.spans += _read_spans(plan, projectors[pid])
        return plans or None

    def _allocations(self, projector: Projector) -> Allocations:
        """Whether each NVTX step calls the allocator, each step looked at on its own when
        asked, and whether the median of steps sampled evenly does, once and only when asked
        (warm-up while the caching allocator still grows: :func:`steady_bounds`)."""
        strings = self.reader.strings
        ids = strings.filter(matches(strings["value"], self.taxonomy.cuda_api["alloc"]))["id"]
        names = ids.to_list()

        def calls(i: int) -> bool | None:
            return projector.allocates(i, names)

        def some(i: int) -> float | None:
            called = calls(i)
            return None if called is None else float(called)

        # (the median of 0s and 1s is 0 exactly where that of the counts is)
        return Allocations(calls, functools.cache(lambda: projector.sampled_median(some) > 0))

    def _traced(self) -> bool:
        """Whether the export has CUDA calls and GPU rows (to project NVTX steps with)."""
        gpu = ("kernels", "graphs", "memcpy", "memset")
        return "api" in self.indexes and any(t in self.indexes for t in gpu)

    def _rank_pids(self) -> list[int]:
        """Processes with GPU work, from the rows at the sampled rowids of the GPU tables
        (a process with fewer rows than one sample interval may be missed)."""
        pids: set[int] = set()
        for logical in ("kernels", "graphs", "memcpy", "memset"):
            index = self.indexes.get(logical)
            table = self.reader.table_of(logical)
            pid = self.reader.pid_sql(logical)
            if index is None or table is None or pid is None:
                continue
            ids = ",".join(str(int(i)) for i in index.rowids)
            pids |= {
                int(p)
                for (p,) in self.con.execute(
                    f"SELECT DISTINCT {pid} FROM {table} WHERE rowid IN ({ids})"
                )
                if p is not None
            }
        return sorted(pids)

    def _nvtx(self, nvtx: pl.DataFrame, pid: int, pattern: str):
        ranges = step_ranges(nvtx.filter(pl.col("pid") == pid), pattern)
        if ranges is None or len(ranges) < 2:
            return None
        table = ranges.select("index", name="text", start="start", end="end")
        return table, "nvtx", range_label(ranges["text"]), False

    def _graphs(self, pid: int):
        """Graph-level traced replays of the most replayed graph (exact GPU times)."""
        if "graphs" not in self.indexes:
            return None
        graphs = self.reader.read("graphs", where=f"{self.reader.pid_sql('graphs')} = {pid}")
        if len(graphs) < 2:
            return None
        per_launch = graphs.group_by("correlation_id").agg(
            start=pl.col("start").min(),
            end=pl.col("end").max(),
            key=pl.col("graph_exec_id").first(),
        )
        return graph_launch_steps(per_launch, "start", "end"), "graph", "cudaGraphLaunch", True

    def _pattern(self, pid: int):
        """The most regular kernel of a slice from the middle of the kernel table, then every
        occurrence of it (one filtered scan of one column)."""
        index = self.indexes.get("kernels")
        if index is None:
            return None
        where = f"{self.reader.pid_sql('kernels')} = {pid}"
        rows, best = PROBE_ROWS, None
        while best is None:
            middle = index.first + index.rows // 2
            lo, hi = max(index.first - 1, middle - rows // 2), min(index.last, middle + rows // 2)
            probe = self.reader.read("kernels", where=where, rowids=[(lo, hi)])
            best = recurring_kernel(
                probe.select(name="name_id", start="start", end="end").sort("start"),
                self.settings,
            )
            if best is None and (rows >= PROBE_MAX_ROWS or rows >= index.rows):
                return None
            rows *= 2
        hits = self.reader.read("kernels", where=f"{where} AND ({self._name_match(best)})")
        if len(hits) < 2:
            return None
        # the last step ends with the rank's last kernel (as --all-steps has it), which sits
        # among the table's last rows
        table = self.reader.table_of("kernels")
        where += f" AND {INTEGER_END}"  # (a value of another type is no time)
        tail = f"{where} AND rowid > {index.last - Projector.BLOCK}"
        (last_end,) = self.con.execute(f'SELECT max("end") FROM {table} WHERE {tail}').fetchone()
        if last_end is None:
            (last_end,) = self.con.execute(
                f'SELECT max("end") FROM {table} WHERE {where}'
            ).fetchone()
        last_end = max(int(last_end or 0), int(hits["end"].max()))  # type: ignore[arg-type]
        table = hits.sort("start").select(
            index=pl.int_range(pl.len()).cast(pl.Int64),
            name=pl.lit(self._string(best)),
            start="start",
            end=pl.col("start").shift(-1).fill_null(last_end),
        )
        return table, "pattern", self._string(best), True

    def _name_match(self, name_id: int) -> str:
        table = self.reader.table_of("kernels")
        present = self.reader.info.columns[table]  # type: ignore[index]
        column = next(
            c for c in ("demangledName", "name", "shortName", "mangledName") if c in present
        )
        return f'"{column}" = {int(name_id)}'

    def _string(self, string_id: int) -> str:
        hit = self.reader.strings.filter(pl.col("id") == string_id)["value"]
        return str(hit[0]) if len(hit) else str(string_id)

    def _analysable(self, table: pl.DataFrame) -> int:
        """How many steps the row budget allows, from the rows per step over the steps' span
        (at most :data:`STEP_BUDGET`)."""
        lo, hi = int(table["start"].min()), int(table["end"].max())  # type: ignore[arg-type]
        rows = sum(index.count(lo, hi) for index in self.indexes.values())
        per_step = max(rows / max(len(table), 1), 1)
        return max(1, min(STEP_BUDGET, int(self.budget // per_step)))


# --------------------------------------------------------------------------------- pass 2


_END = 1 << 62  # a span to the end of the capture


def _read_spans(plan: StepPlan, projector: Projector | None) -> list[tuple[Span, Span]]:
    """(GPU rows, CUDA calls) time spans to read for each run of ``plan``.

    GPU rows from a little before the run's first GPU work (kernels still running then) to the
    first GPU work of the step after the run (which ends the run's last step), or to the end
    of the capture after the last step. CUDA calls: those made inside the runs' steps (their
    correlation ids project the steps onto the GPU) and until the GPU rows read end (launch,
    sync and idle-cause measures; the following step's first work, which ends the run, was
    launched before it ran); with exact (GPU-timed) steps, from a step before the run (the
    calls that launched its first work)."""
    table = plan.table
    starts = dict(zip(table["index"].to_list(), table["start"].to_list(), strict=True))
    ends = dict(zip(table["index"].to_list(), table["end"].to_list(), strict=True))
    if projector is not None:
        step_ns = int(projector.reference()) or 1
    else:
        step_ns = max(int(table["duration"].median() or 0), 1)  # type: ignore[arg-type]
    out = []
    last = max(starts)
    # the step after each run; the last step (never steady: it has no step time) is read
    # whole, to the end, like the rest of the capture after it: the compute that ends the
    # window's last idle gap may lie anywhere past it
    runs = [(a, b, b + 1 if b + 1 in starts and b + 1 != last else None) for a, b in plan.runs]
    if projector is not None:  # (the GPU starts asked for below, two at a time)
        projector.find_starts(
            i for a, _b, following in runs for i in (a, following) if i is not None
        )
    for a, b, following in runs:
        margin = step_ns // 4  # kernels still running at the start; the work that ends the
        # window's last idle gap (the critical path looks for it past the end)
        if projector is None and not plan.exact:
            # CPU times not projected (calls or GPU rows read by a filtered scan): the GPU
            # runs the steps' work later than their ranges, by up to a few steps
            hi = ends[following if following is not None else b]
            out.append(((starts[a] - margin, hi + CPU_LAG * step_ns), (starts[a], hi)))
            continue
        if projector is None:
            hi = (starts[following] if following is not None else ends[last]) + margin
            out.append(((starts[a] - margin, hi), (starts[a] - step_ns, hi)))
            continue
        first = projector.gpu_start(a) or starts[a]
        nxt = projector.gpu_start(following) if following is not None else None
        gpu_hi = nxt + margin if nxt is not None else _END
        # (not the following step's later calls: they launch work past the GPU rows read; in
        # runs of three host-bound steps they were a sixth of the calls read)
        calls_hi = max(ends[b], nxt + margin) if nxt is not None else _END
        out.append(
            (
                (min(first, starts[a]) - margin, gpu_hi),
                (min(first, starts[a]), calls_hi),
            )
        )
    return out


def _read_plans(
    reader: Reader,
    con,
    indexes: dict[str, RowIndex],
    planner: _Planner,
    budget: int,
    progress: Callable[[str], None] | None,
    memory: Future[pl.DataFrame],
) -> Trace:
    """Pass 2: the rows of the planned steps, then the trace model from them (with the
    memory events that ``memory`` reads meanwhile)."""
    p2 = Pass2(reader, indexes)
    read_spans = tuple(merge_spans([span for pair in planner.spans for span in pair]))
    # Graph-level tracing hides the replays' kernels; the measures then take kernel shapes
    # from the eager kernels outside the window (and the calls that captured the graph),
    # which are few: read them all.
    whole = {
        logical
        for logical in ("kernels", "api")
        if "graphs" in indexes
        and (index := indexes.get(logical)) is not None
        and index.rows <= max(budget // 2, SMALL_ROWS)
    }
    frames: dict[str, pl.DataFrame] = {}
    if "api" in whole:
        frames["api"] = reader.read("api")
    else:
        p2.read(("api",), [calls for _gpu, calls in planner.spans])
        frames["api"] = p2.finish("api")
    # The host side read on the threads of the calls read, beside the GPU's rows (built
    # anew where the calls are read again below and other threads made them)
    host = begin_host_read(reader, frames["api"], read_spans)
    # (the NVTX ranges over the analysed steps: SQLite's work, beside too; the rows near the
    # steps found here, through ``con``, which no other thread searches meanwhile)
    near = near_ranges(planner.nvtx_index, read_spans) if planner.nvtx.long is not None else None
    nvtx = second_lane("traceclf-nvtx").submit(window_rows, reader, read_spans, planner.nvtx, near)
    p2.read(
        tuple(logical for logical in GPU_SIDE if logical not in whole),
        [gpu for gpu, _calls in planner.spans],
    )
    for logical in EVENT_TABLES:
        if logical not in frames:
            frames[logical] = reader.read(logical) if logical in whole else p2.finish(logical)
    if "api" not in whole:
        frames["api"] = p2.calls_complete(frames)
    gpu_spans = merge_spans([gpu for gpu, _calls in planner.spans])

    def read_metrics() -> pl.DataFrame:
        index = (
            RowIndex.build(con, "GPU_METRICS", "timestamp")
            if reader.info.has("GPU_METRICS")
            else None
        )
        if index is not None and index.ordered:
            ranges = rowindex.merge([index.bounds(lo, hi) for lo, hi in gpu_spans])
            return read_gpu_metrics(reader, gpu_spans, rowids=ranges)
        return read_gpu_metrics(reader, gpu_spans)

    def read(logical: str) -> pl.DataFrame:
        if logical in frames:
            return frames[logical]
        if logical == "nvtx":
            return nvtx.result()
        if logical == "memory":
            return memory.result()
        return reader.read(logical)  # profiler overhead: small, whole

    trace = build_trace(
        reader,
        read,
        read_metrics,
        read_spans=read_spans,
        capture=_capture(reader, indexes),
        progress=progress,
        host_begun=host,
    )
    return replace(trace, read_path=rowindex.read_path(indexes, rescanned=bool(p2.rescanned)))


def _capture(
    reader: Reader, indexes: dict[str, RowIndex]
) -> tuple[tuple[int, int] | None, dict[str, int]]:
    """The whole capture's GPU span (first start; last end, among each table's last rows) and
    the rows of every event table, from the indexes and a few lookups."""
    lo, hi = None, None
    for logical in ("kernels", "graphs", "memcpy", "memset"):
        index = indexes.get(logical)
        if index is None:
            continue
        first = int(index.times.min())
        for piece in index.pieces:  # the last rows of each ordered run hold its last end
            (last,) = index.con.execute(
                f'SELECT max("end") FROM {index.table} WHERE rowid > '
                f"{piece.last - Projector.BLOCK} AND rowid <= {piece.last} AND {INTEGER_END}"
            ).fetchone()
            hi = int(last or 0) if hi is None else max(hi, int(last or 0))
        lo = first if lo is None else min(lo, first)
    span = (lo, hi) if lo is not None and hi is not None else None
    return span, {logical: index.rows for logical, index in indexes.items()}
