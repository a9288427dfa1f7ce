"""The typed trace model: one object holding every event frame of one export.

All times are integer nanoseconds on the capture's session timeline. Kernel and API names are
polars Categoricals (millions of rows, a few hundred names: ``NAME_COLUMNS``), which polars'
``.str`` operations refuse; :meth:`Trace.with_text` (what ``traceclf.open`` returns) holds them
as text instead, and :meth:`Trace.with_categories` turns them back. Every GPU-side frame has
``pid`` (decoded from ``globalPid``: 24 bits, an Int32 in the event frames), so ranks that share
one GPU stay apart.

Frames and their columns
- ``kernels``: start, end, device_id, stream_id, correlation_id, pid, name, short_name,
  registers, graph_node_id, graph_id, grid_blocks, block_threads, smem_per_block
- ``graphs``: CUDA-graph executions (graph-level tracing): start, end, device_id, stream_id,
  correlation_id, pid, graph_id, graph_exec_id
- ``copies``: memcpy and memset rows: start, end, device_id, stream_id, correlation_id, pid,
  bytes, op ("memcpy"/"memset"), copy_kind, direction ("HtoD", "DtoH", "DtoD", ...), pageable
- ``api``: CUDA runtime/driver calls: start, end, global_tid, correlation_id, pid, name
- ``syncs``: CUPTI synchronization records: start, end, pid, device_id, stream_id,
  correlation_id, sync_type, event_id, event_sync_id (cudaStreamWaitEvent rows name the
  waiting stream and the event record they wait for)
- ``events``: cudaEventRecord records (CUPTI_ACTIVITY_KIND_CUDA_EVENT): pid, device_id,
  stream_id, correlation_id, event_id, event_sync_id
- ``nvtx``: ranges only: start, end, text, domain, pid, tid, global_tid
- ``gpu_metrics``: timestamp, source, metric ("sm_active", "sm_issue", "tensor_active": the
  nsys metric under whatever name this GPU gives it), value (%)
- ``memory``: allocation events: start, pid, device_id, delta (bytes; negative: a free), mem_kind
  (nsys's ENUM_CUDA_MEM_KIND: 0 pageable, 1 pinned host memory, 2 device, ...; null in exports
  without it)
- ``gpus``: one row per GPU of TARGET_INFO_GPU; ``processes``: pid, process_name
- ``threads``: global_tid, pid, tid, thread_name (ThreadNames)
- the host side beyond CUDA calls (ingest/hosttables.py), on the threads that made CUDA calls:
  ``osrt`` (OS runtime calls, outermost only: start, end, global_tid, pid, name, callchain_id),
  ``samples`` (CPU samples: start, global_tid, pid, sample_id), ``callchains`` (their frames,
  innermost first: source "osrt"/"sampling", id, depth, symbol, module, unresolved),
  ``py_frames`` (nsys's Python samples, one row per frame, innermost first: start,
  global_tid, pid, sample, state, depth, function, file, line), ``sched`` (thread
  scheduling: start, global_tid, pid, running, block) and ``diagnostics`` (nsys's messages:
  timestamp, pid, severity, source, text); ``host_sources`` names the host sources the export
  holds (nvtx, cuda_api, osrt, sampling, python_sampling, sched), ``host_notes`` why one of
  them was not read
- ``nccl``: NCCL's NVTX ranges that carry a payload, decoded (ingest/nccl_calls.py): start,
  end, pid, global_tid, call (ncclAllReduce, ncclSend, ncclCommInitRankConfig, ...), comm_id,
  nranks, rank, bytes (NCCL's message size), peer, root, reduce_op; empty without payload
  values (an export made without ``--include-blobs=true``)

Event frames come in ``start`` order (flagged sorted when they are) as nsys writes them; rows
no measure can use (no time, an end before the start, no process) are left out and counted in
``unusable_rows``. A trace read for the default step sampling holds only the rows of the steps
chosen for analysis, plus whole-capture NVTX ranges and memory events: ``read_spans`` lists the
time spans its event frames cover (None: the whole capture).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:  # (a cached result's re-analysis imports this module, not numpy)
    import numpy as np

LAUNCH_BLOCK = 1 << 20  # rows of GPU work per block when their launches are placed in ranges
# Memory kinds of host memory (ENUM_CUDA_MEM_KIND: pageable, pinned): cudaHostAlloc'd buffers
# that CUDA_GPU_MEMORY_USAGE_EVENTS records beside the device's own. Every other kind (device,
# array, managed, device static, managed static, unknown) counts as the GPU's memory.
HOST_MEMORY_KINDS = (0, 1)
PINNED_MEMORY_KIND = 1
# Copy directions over the host link (ingest/assemble.py COPY_KINDS): to a device buffer, a
# CUDA array or unified memory, and back (a public kNN code copies its input to arrays).
HOST_TO_DEVICE = ("HtoD", "HtoA", "UVM_HtoD")
DEVICE_TO_HOST = ("DtoH", "AtoH", "UVM_DtoH")
# ... and copies that cross no host link: on one GPU, between GPUs (PtoP), CUDA arrays
DEVICE_TO_DEVICE = ("DtoD", "PtoP", "AtoA", "AtoD", "DtoA", "UVM_DtoD")

# The Categorical columns of the model, by frame (ingest/assemble.py, ingest/devices.py)
NAME_COLUMNS = {"kernels": ("name", "short_name"), "api": ("name",), "gpu_metrics": ("metric",)}


@dataclass(frozen=True)
class Trace:
    path: Path
    nsys_version: str | None
    schema_version: str | None
    tables: frozenset[str]
    kernels: pl.DataFrame
    graphs: pl.DataFrame
    copies: pl.DataFrame
    api: pl.DataFrame
    syncs: pl.DataFrame
    nvtx: pl.DataFrame
    gpu_metrics: pl.DataFrame
    memory: pl.DataFrame
    overhead: pl.DataFrame
    gpus: pl.DataFrame
    processes: pl.DataFrame
    device_map: pl.DataFrame = field(default_factory=pl.DataFrame)
    threads: pl.DataFrame = field(default_factory=pl.DataFrame)
    # "values" | "declared_empty" | "absent": NCCL's NVTX payload (ingest/devices.nccl_payload)
    nccl_payload: str = "absent"
    events: pl.DataFrame = field(default_factory=pl.DataFrame)
    nccl: pl.DataFrame = field(default_factory=pl.DataFrame)
    # utc_offset_ns (session timestamp + offset = UTC ns) and host: to align several exports
    session: dict = field(default_factory=dict)
    # rows left out as unusable, by "<frame>.<reason>" (no_time, end_before_start, no_process)
    unusable_rows: dict[str, int] = field(default_factory=dict)
    # strings that were not UTF-8, repaired with U+FFFD, by "<TABLE>.<column>" (ingest/utf8.py)
    repaired_strings: dict[str, int] = field(default_factory=dict)
    # the process given to GPU rows whose table names none: the one process the CUDA calls
    # name (Reader.pid_from_calls); None where the rows name theirs
    pid_from_calls: int | None = None
    # time spans (ns) the event frames cover; None: the whole capture
    read_spans: tuple[tuple[int, int], ...] | None = None
    # with ``read_spans``: first start and last end of GPU work in the whole capture, and the rows
    # of each event table (what the frames cannot say, holding only the analysed steps)
    capture_span: tuple[int, int] | None = None
    capture_rows: dict[str, int] = field(default_factory=dict)
    # how the event frames were read: "whole" (the whole capture), or the analysed steps by
    # "rowid_ranges", "ordered_pieces", "filtered_scan" or "rescanned"
    # (:mod:`traceclf.pipeline.twopass`, :mod:`traceclf.pipeline.pass2`)
    read_path: str = "whole"
    osrt: pl.DataFrame = field(default_factory=pl.DataFrame)
    samples: pl.DataFrame = field(default_factory=pl.DataFrame)
    callchains: pl.DataFrame = field(default_factory=pl.DataFrame)
    py_frames: pl.DataFrame = field(default_factory=pl.DataFrame)
    sched: pl.DataFrame = field(default_factory=pl.DataFrame)
    diagnostics: pl.DataFrame = field(default_factory=pl.DataFrame)
    host_sources: tuple[str, ...] = ()
    host_notes: dict[str, str] = field(default_factory=dict)

    FRAMES = (
        "kernels",
        "graphs",
        "copies",
        "api",
        "syncs",
        "nvtx",
        "gpu_metrics",
        "memory",
        "overhead",
        "gpus",
        "processes",
        "device_map",
        "threads",
        "events",
        "osrt",
        "samples",
        "callchains",
        "py_frames",
        "sched",
        "diagnostics",
        "nccl",
    )
    # Frames of events that belong to one process (for_pid keeps only that process's rows);
    # the others describe the machine (GPUs, metrics, processes, threads) or the capture
    # (diagnostics; callchains, found by the id of a call or sample).
    PER_PROCESS = (
        "kernels",
        "graphs",
        "copies",
        "api",
        "syncs",
        "nvtx",
        "memory",
        "overhead",
        "osrt",
        "samples",
        "py_frames",
        "sched",
        "nccl",
    )

    @property
    def graph_executions(self) -> pl.DataFrame:
        """One interval per CUDA-graph replay, whichever way the graph was traced: the
        GRAPH_TRACE rows (graph-level tracing), or :attr:`node_replays`. Both modes show the
        device occupied by a replay; only node-level tracing shows when its kernels run (the
        gaps between them are idle, docs/measures.md)."""
        cols = ["start", "end", "pid", "correlation_id"]
        return pl.concat([self.graphs.select(cols), self.node_replays.select(cols)])

    @property
    def node_replays(self) -> pl.DataFrame:
        """One interval per replay traced with ``--cuda-graph-trace=node``: the span of the node
        kernels that share one launch's correlationId (start, end, pid, correlation_id)."""
        return (
            self.kernels.filter(pl.col("graph_node_id").is_not_null())
            .group_by("pid", "correlation_id")
            .agg(pl.col("start").min(), pl.col("end").max())
            .select("start", "end", "pid", "correlation_id")
            .sort("start")
        )

    @property
    def rank_pids(self) -> list[int]:
        """Processes that ran GPU work, in pid order: one rank each."""
        pids = (
            pl.concat(
                [self.kernels.select("pid"), self.graphs.select("pid"), self.copies.select("pid")]
            )["pid"]
            .drop_nulls()
            .unique()
            .sort()
        )
        return pids.to_list()

    def with_text(self) -> Trace:
        """The same trace with its names (``NAME_COLUMNS``) as plain text, so that polars'
        ``.str`` operations work on them: the notebook's frames. Each row is a view of its
        name's one copy, about 20 bytes a row (a cast would copy every row's name: ~1 GB and
        16 s for 10 M kernels)."""
        return replace(
            self,
            **{
                frame: getattr(self, frame).with_columns(
                    _as_text(getattr(self, frame)[c]) for c in cols
                )
                for frame, cols in NAME_COLUMNS.items()
                if getattr(self, frame).schema.get(cols[0]) == pl.Categorical
            },
        )

    def with_categories(self) -> Trace:
        """The trace with its names as Categoricals again, as the measures read them."""
        return replace(
            self,
            **{
                frame: getattr(self, frame).with_columns(pl.col(cols).cast(pl.Categorical))
                for frame, cols in NAME_COLUMNS.items()
                if getattr(self, frame).schema.get(cols[0]) == pl.String
            },
        )

    def for_pid(self, pid: int) -> Trace:
        """The same trace restricted to one process (one rank)."""
        if self._only_pid(pid):  # the usual one-rank-per-file case: no copy of every frame
            return self

        def keep(df: pl.DataFrame) -> pl.DataFrame:
            return df.filter(pl.col("pid") == pid) if "pid" in df.columns else df

        return replace(self, **{n: keep(getattr(self, n)) for n in self.PER_PROCESS})

    def metrics_of_gpu(self, gpu_id: int | None) -> pl.DataFrame:
        """GPU-metric samples of one GPU. nsys gives each sampled GPU its own source id, in
        the GPUs' order; when sources and GPUs don't pair up one to one, all samples are kept."""
        sources = self.gpu_metrics["source"].unique().sort().to_list()
        gpu_ids = self.gpus["gpu_id"].drop_nulls().unique().sort().to_list()
        if len(sources) <= 1 or len(sources) != len(gpu_ids) or gpu_id not in gpu_ids:
            return self.gpu_metrics
        source = sources[gpu_ids.index(gpu_id)]
        return self.gpu_metrics.filter(pl.col("source") == source)

    def _only_pid(self, pid: int) -> bool:
        frames = (getattr(self, n) for n in self.PER_PROCESS)
        return all(
            df.is_empty() or bool((df["pid"] == pid).all()) for df in frames if "pid" in df.columns
        )

    def device_of(self, pid: int) -> tuple[int | None, bool]:
        """The CUDA device ordinal a process ran its kernels on, and whether the export maps it
        to a physical GPU (TARGET_INFO_CUDA_DEVICE): without that map, two ranks that each see
        "device 0" may or may not be on one GPU."""
        devices = self.kernels.filter(pl.col("pid") == pid)["device_id"].drop_nulls()
        device = int(devices.mode()[0]) if len(devices) else None
        if device is None:  # (a rank of copies alone: no device to look up)
            return None, False
        mapped = not self.device_map.filter(
            (pl.col("pid") == pid) & (pl.col("device_id") == device)
        ).is_empty()
        return device, mapped

    def gpu_of(self, pid: int) -> dict | None:
        """The TARGET_INFO_GPU row of the GPU a process ran on (first GPU if unknown)."""
        if self.gpus.is_empty():
            return None
        devices = self.kernels.filter(pl.col("pid") == pid)["device_id"].drop_nulls()
        device = int(devices.mode()[0]) if len(devices) else 0
        gpu_id = device
        if not self.device_map.is_empty():
            hit = self.device_map.filter((pl.col("pid") == pid) & (pl.col("device_id") == device))
            if len(hit):
                gpu_id = int(hit["gpu_id"][0])
        row = self.gpus.filter(pl.col("gpu_id") == gpu_id)
        return (row if len(row) else self.gpus).row(0, named=True)

    def calls_in(self, ranges: pl.DataFrame, key: str) -> pl.DataFrame:
        """(correlation_id, ``key``) of the CUDA calls made inside each CPU range of ``ranges``
        (start, end, key) — how a CPU-side NVTX range is projected onto the GPU work it
        launched. Any thread of the process counts: PyTorch launches backward kernels from its
        autograd thread, not the thread that pushed the range. A range nested in another one
        is dropped: the outer range already owns its calls."""
        return (
            self.calls_by_start.join_asof(
                outermost(ranges).select("start", key, range_end="end"),
                on="start",
                strategy="backward",
            )
            .filter(pl.col("start") <= pl.col("range_end"))
            .select("correlation_id", key)
        )

    @functools.cached_property
    def call_index(self):
        """The CUDA calls by (pid, correlationId) (:class:`traceclf.model.correlation.CallIndex`):
        which call launched a GPU operation, by rank or binary search rather than a join."""
        from traceclf.model.correlation import CallIndex

        return CallIndex(self.api)

    def launched_in(self, work: pl.DataFrame, ranges: pl.DataFrame, key: str) -> pl.Series:
        """For each row of ``work`` (pid, correlation_id: kernels, graph replays, copies), the
        ``key`` of the range of ``ranges`` (start, end, key) in which the CUDA call that
        launched it was made; null where none was. The GPU side of :meth:`calls_in`, with the
        same ranges (outermost ones) and ends included: the launch is found by correlationId
        (:attr:`call_index`), its range by binary search, so nothing joins millions of rows."""
        outer = outermost(ranges.select("start", "end", key))
        if not len(outer):
            return pl.Series(key, [None] * len(work), dtype=ranges.schema[key])
        inside, j = self._range_of_launch(work, outer)
        keys = outer[key].gather(pl.Series(j))
        return pl.select(pl.when(pl.Series(inside)).then(keys)).to_series().alias(key)

    def launched_within(self, work: pl.DataFrame, ranges: pl.DataFrame) -> np.ndarray:
        """Whether the CUDA call that launched each row of ``work`` was made in one of
        ``ranges`` (start, end): :meth:`launched_in` as flags, without a column of keys."""
        import numpy as np

        outer = outermost(ranges.select("start", "end"))
        return self._range_of_launch(work, outer)[0] if len(outer) else np.zeros(len(work), bool)

    def _range_of_launch(self, work: pl.DataFrame, outer: pl.DataFrame) -> tuple:
        """For each row of ``work``: whether its launch call lies in one of the ``outer``
        ranges (disjoint, sorted; at least one), and the row of that range (0 where none)."""
        import numpy as np

        starts = self.launch_starts(work)
        lo, hi = outer["start"].to_numpy(), outer["end"].to_numpy()
        inside, j = np.zeros(len(starts), bool), np.zeros(len(starts), np.uint32)
        # by blocks of rows: the temporaries of millions of kernels at once were a peak
        for a in range(0, len(starts), LAUNCH_BLOCK):
            part = starts.slice(a, LAUNCH_BLOCK)
            at = part.fill_null(-1).to_numpy()
            i = np.searchsorted(lo, at, side="right") - 1  # the last range starting by then
            k = np.maximum(i, 0)
            ok = part.is_not_null().to_numpy() & (i >= 0)
            ok &= at <= hi[k]
            inside[a : a + len(at)], j[a : a + len(at)] = ok, k
        return inside, j

    @functools.cached_property
    def calls_by_start(self) -> pl.DataFrame:
        """(start, correlation_id) of every CUDA call, sorted by start: the one projection
        that every NVTX range → GPU work mapping shares (sorted once, or not at all when the
        loader flagged the calls already in order)."""
        return self.api.select("start", "correlation_id").sort("start")

    def launch_starts(self, work: pl.DataFrame) -> pl.Series:
        """Start of the call that launched each row of ``work``; found once for the trace's
        own kernels, graph replays and copies (every NVTX projection asks for them)."""
        name = self._own(work)
        cache = self._launches
        if name is not None and name in cache:
            return cache[name]
        starts = self.launch_column("start", work)
        if name is not None:
            cache[name] = starts
        return starts

    def launch_column(self, column: str, work: pl.DataFrame) -> pl.Series:
        """``column`` of the CUDA call that launched each row of ``work`` (null where none
        did): :meth:`CallIndex.column`, with the calls of the trace's own kernels, graph
        replays and copies searched once however many columns are asked for."""
        name = self._own(work)
        if name is None:
            return self.call_index.column(column, work["pid"], work["correlation_id"])
        if name not in self._launch_rows:  # (rows of the calls fit 32 bits: half the memory)
            rows = self.call_index.find(work["pid"], work["correlation_id"])
            self._launch_rows[name] = rows.astype("int32") if len(self.api) < 1 << 31 else rows
        return self.call_index.gather(column, self._launch_rows[name])

    def _own(self, work: pl.DataFrame) -> str | None:
        return next((n for n in ("kernels", "graphs", "copies") if getattr(self, n) is work), None)

    @functools.cached_property
    def _launches(self) -> dict[str, pl.Series]:
        return {}

    @functools.cached_property
    def _launch_rows(self) -> dict[str, np.ndarray]:
        return {}

    def gpu_spans(self, ranges: pl.DataFrame, key: str) -> pl.DataFrame:
        """(``key``, gpu_start, gpu_end): first start and last end of the GPU work (kernels,
        graph replays, copies) launched inside each range of ``ranges`` (start, end, key) —
        how a CPU-side NVTX range is projected onto the GPU."""
        outer = outermost(ranges.select("start", "end", key))
        parts = [pl.DataFrame(schema={"_range": pl.UInt32, "start": pl.Int64, "end": pl.Int64})]
        for f in (self.kernels, self.graphs, self.copies) if len(outer) else ():
            # each frame's spans per range first: a few thousand rows, not one of every kernel
            inside, j = self._range_of_launch(f, outer)
            mine = pl.Series(inside)
            parts.append(
                pl.DataFrame(
                    {
                        "_range": pl.Series(j[inside]),
                        "start": f["start"].filter(mine).cast(pl.Int64),
                        "end": f["end"].filter(mine).cast(pl.Int64),
                    }
                )
                .group_by("_range")
                .agg(pl.col("start").min(), pl.col("end").max())
            )
        spans = pl.concat(parts)
        keys = (
            outer[key].gather(spans["_range"])
            if len(outer)
            else pl.Series(key, [], dtype=ranges.schema[key])
        )
        return (
            spans.with_columns(keys.alias(key))
            .drop_nulls(key)
            .group_by(key)
            .agg(gpu_start=pl.col("start").min(), gpu_end=pl.col("end").max())
        )

    @property
    def span(self) -> tuple[int, int]:
        """First start and last end of any GPU work."""
        frames = [f for f in (self.kernels, self.graphs, self.copies) if not f.is_empty()]
        if not frames:
            return (0, 0)
        return (
            min(int(f["start"].min()) for f in frames),  # type: ignore[arg-type]
            max(int(f["end"].max()) for f in frames),  # type: ignore[arg-type]
        )

    def __repr__(self) -> str:
        """One line: what was read, not every frame (a notebook shows this)."""
        lo, hi = self.span
        ranks = len(self.rank_pids)
        return (
            f"<Trace {self.path.name}: nsys {self.nsys_version or '?'}, {ranks} rank"
            f"{'s' * (ranks != 1)}, {len(self.kernels):,} kernels, {len(self.graphs):,} graph "
            f"replays, {len(self.copies):,} copies/memsets, {len(self.api):,} CUDA calls, "
            f"{len(self.nvtx):,} NVTX ranges; GPU work {lo / 1e9:.3f}–{hi / 1e9:.3f} s>"
        )

    def to_pandas(self, frame: str = "kernels"):
        """One frame of the trace (``FRAMES``) as a pandas DataFrame. Needs pandas:
        ``pip install 'traceclf[pandas]'``."""
        from traceclf.support.pandas_frames import to_pandas

        return to_pandas({name: getattr(self, name) for name in self.FRAMES}, frame)

    def sql(self, query: str):
        """Run a DuckDB SQL query over the frames (tables named like the attributes).

        Needs the optional ``duckdb`` extra; DuckDB reads the polars frames zero-copy.
        """
        import duckdb

        con = duckdb.connect()
        for name in self.FRAMES:
            con.register(name, getattr(self, name).to_arrow())
        return con.sql(query).pl()


def outermost(ranges: pl.DataFrame) -> pl.DataFrame:
    """Ranges (start, end) that no earlier range contains or overlaps, sorted by start."""
    return (
        ranges.sort("start")
        .with_columns(_reach=pl.col("end").cum_max().shift(1).fill_null(-1))
        .filter(pl.col("start") >= pl.col("_reach"))
        .drop("_reach")
    )


def _as_text(names: pl.Series) -> pl.Series:
    """A Categorical column as text: each distinct name made a string once, and every row a
    view of it (a lookup by the Categorical's codes)."""
    codes = names.to_physical()
    if codes.null_count() == len(codes):
        return pl.Series(names.name, [None] * len(codes), dtype=pl.String)
    distinct = pl.DataFrame({"name": names, "code": codes}).drop_nulls("code").unique("code")
    table = pl.repeat(None, int(codes.max()) + 1, dtype=pl.String, eager=True)
    table = table.scatter(distinct["code"], distinct["name"].cast(pl.String))
    return table.gather(codes).alias(names.name)
