"""Read an nsys SQLite export into the typed trace model.

Tables are read column-wise through connectorx into Arrow (no Python row loop), selecting only
the columns the analysis needs and pushing the optional time window into the SQL. Column names
differ between nsys versions, so each logical column lists the physical names it may have;
optional ones that an export lacks become typed nulls.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import connectorx as cx
import polars as pl

from traceclf.errors import TraceError
from traceclf.ingest.devices import (
    decode_pid,
    nccl_payload,
    read_device_map,
    read_gpu_metrics,
    read_gpus,
    read_processes,
    read_session,
    read_threads,
)
from traceclf.ingest.schema import ExportInfo, inspect_export, readonly_uri
from traceclf.model import Trace

# copyKind values of CUpti_ActivityMemcpyKind
COPY_KINDS = {
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
    11: "UVM_HtoD",
    12: "UVM_DtoH",
    13: "UVM_DtoD",
}
MEMORY_KIND_PAGEABLE = 0
NVTX_RANGE_TYPES = (59, 60)  # push/pop and start/end ranges
NVTX_DOMAIN_CREATE = 75
# What load_trace passes to its ``progress`` callback, in order: one call as each stage starts.
LOAD_STAGES = (
    "strings",
    "kernels",
    "graphs",
    "copies",
    "CUDA API",
    "syncs",
    "NVTX",
    "memory",
    "GPU metrics",
)


@dataclass(frozen=True)
class Col:
    """One logical column: its physical names across nsys versions, dtype, and whether required."""

    name: str
    sources: tuple[str, ...]
    dtype: type[pl.DataType] | pl.DataType = pl.Int64
    required: bool = False


def _c(name: str, *sources: str, dtype=pl.Int64, required: bool = False) -> Col:
    return Col(name, sources or (name,), dtype, required)


GPU_ROW = (
    _c("start", required=True),
    _c("end", required=True),
    _c("device_id", "deviceId"),
    _c("stream_id", "streamId"),
    _c("correlation_id", "correlationId"),
    _c("global_pid", "globalPid", "globalTid"),
)

TABLES: dict[str, tuple[tuple[str, ...], tuple[Col, ...]]] = {
    "kernels": (
        ("CUPTI_ACTIVITY_KIND_KERNEL",),
        (
            *GPU_ROW,
            # Exports without demangled names still have a short or mangled one.
            _c("name_id", "demangledName", "name", "shortName", "mangledName", required=True),
            _c("short_id", "shortName"),
            _c("grid_x", "gridX"),
            _c("grid_y", "gridY"),
            _c("grid_z", "gridZ"),
            _c("block_x", "blockX"),
            _c("block_y", "blockY"),
            _c("block_z", "blockZ"),
            _c("registers", "registersPerThread"),
            _c("static_smem", "staticSharedMemory"),
            _c("dynamic_smem", "dynamicSharedMemory"),
            _c("graph_node_id", "graphNodeId"),
            _c("graph_id", "graphId"),
        ),
    ),
    "graphs": (
        ("CUPTI_ACTIVITY_KIND_GRAPH_TRACE",),
        (*GPU_ROW, _c("graph_id", "graphId"), _c("graph_exec_id", "graphExecId")),
    ),
    "memcpy": (
        ("CUPTI_ACTIVITY_KIND_MEMCPY",),
        (
            *GPU_ROW,
            _c("bytes", required=True),
            _c("copy_kind", "copyKind"),
            _c("src_kind", "srcKind"),
            _c("dst_kind", "dstKind"),
        ),
    ),
    "memset": (
        ("CUPTI_ACTIVITY_KIND_MEMSET",),
        (*GPU_ROW, _c("bytes", required=True), _c("mem_kind", "memKind")),
    ),
    "api": (
        ("CUPTI_ACTIVITY_KIND_RUNTIME",),
        (
            _c("start", required=True),
            _c("end", required=True),
            _c("global_tid", "globalTid", required=True),
            _c("correlation_id", "correlationId", required=True),
            _c("name_id", "nameId", required=True),
            _c("event_class", "eventClass"),
        ),
    ),
    "syncs": (
        ("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",),
        (
            *GPU_ROW,
            _c("sync_type", "syncType", "deprecatedSyncType"),
            _c("event_id", "eventId"),
            # Unique per record of an event (nsys >= 2023); eventId is a handle CUDA reuses.
            _c("event_sync_id", "eventSyncId"),
        ),
    ),
    # cudaEventRecord: on which stream, after which launch (no time of its own: completion is
    # read from the stream's work).
    "events": (
        ("CUPTI_ACTIVITY_KIND_CUDA_EVENT",),
        (
            _c("device_id", "deviceId"),
            _c("stream_id", "streamId"),
            _c("correlation_id", "correlationId", required=True),
            _c("global_pid", "globalPid"),
            _c("event_id", "eventId"),
            _c("event_sync_id", "eventSyncId"),
        ),
    ),
    "nvtx": (
        ("NVTX_EVENTS",),
        (
            _c("start", required=True),
            _c("end"),
            _c("event_type", "eventType", required=True),
            _c("text", dtype=pl.String),
            _c("text_id", "textId"),
            _c("global_tid", "globalTid"),
            _c("domain_id", "domainId"),
        ),
    ),
    "memory": (
        ("CUDA_GPU_MEMORY_USAGE_EVENTS",),
        (
            _c("start", required=True),
            _c("global_pid", "globalPid"),
            _c("device_id", "deviceId"),
            _c("bytes", required=True),
            _c("op", "memoryOperationType", required=True),
            _c("mem_kind", "memKind"),
        ),
    ),
    "overhead": (
        ("PROFILER_OVERHEAD",),
        (
            _c("start", required=True),
            _c("end", required=True),
            _c("global_tid", "globalTid"),
            _c("name_id", "nameId"),
        ),
    ),
}

# Tables with more rows than this are read in rowid ranges on several cores (2x on 2 cores).
PARTITION_MIN_ROWS = 500_000


def _read_parallelism() -> int:
    """Cores for one read: CPUs this process may use (worker processes share them), at most 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


# Tables with a [start, end) extent; the others (memory events) are instants.
TIMED = {"kernels", "graphs", "memcpy", "memset", "api", "syncs", "nvtx", "overhead"}


def _uri(path: Path) -> str:
    """connectorx URI that opens the export read-only and never creates a missing file.

    connectorx percent-decodes what follows ``sqlite://`` and opens it with SQLite's URI
    parsing on, so a (quoted) ``file:`` URI carries mode=ro&immutable=1 through. A plain path
    would be opened read-write, created empty if it vanished, and retried for 30 s on error.
    """
    return "sqlite://" + quote(readonly_uri(path), safe="")


class Reader:
    """Reads logical tables of one export, translating nsys-version differences."""

    def __init__(self, info: ExportInfo) -> None:
        self.info = info
        self.uri = _uri(info.path)

    def sql(self, query: str | list[str]) -> pl.DataFrame:
        """Run a query (or several whose results are concatenated, read in parallel)."""
        try:
            return pl.from_arrow(cx.read_sql(self.uri, query, return_type="arrow"))  # type: ignore[return-value]
        except BaseException as e:  # connectorx surfaces SQLite corruption as Rust panics
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TraceError(self.info.path, f"corrupt or unreadable database ({detail})") from None

    def read(
        self, logical: str, window: tuple[int, int] | None = None, where: str | None = None
    ) -> pl.DataFrame:
        tables, cols = TABLES[logical]
        table = next((t for t in tables if self.info.has(t)), None)
        if table is None:
            return empty_frame(cols)
        present = self.info.columns[table]
        select, missing = [], []
        for col in cols:
            src = next((s for s in col.sources if s in present), None)
            if src is None:
                if col.required:
                    raise TraceError(
                        self.info.path,
                        f"table {table} lacks column {col.sources[0]!r} "
                        f"(schema {self.info.schema_version or 'unknown'})",
                    )
                missing.append(col)
            else:
                select.append(f'"{src}" AS {col.name}')
        clauses = [where] if where else []
        if window is not None and logical in TIMED:
            lo, hi = window
            end = '"end"' if "end" in present else "start"
            clauses.append(f"start < {int(hi)} AND {end} > {int(lo)}")
        df = self.sql(self.partitioned(f"SELECT {', '.join(select)} FROM {table}", table, clauses))
        return df.with_columns([pl.lit(None, dtype=c.dtype).alias(c.name) for c in missing]).select(
            [pl.col(c.name).cast(c.dtype, strict=False) for c in cols]
        )

    def partitioned(self, select: str, table: str, clauses: list[str]) -> str | list[str]:
        """``select`` with ``clauses``, split into rowid ranges that connectorx reads on
        several cores when the table is big (SQLite finds max(rowid) without a scan)."""
        parts = _read_parallelism()
        if parts > 1:
            last = self.sql(f"SELECT coalesce(max(rowid), 0) AS n FROM {table}")["n"][0]
            parts = parts if last >= PARTITION_MIN_ROWS else 1
        if parts == 1:
            return select + "".join(
                f" {'WHERE' if i == 0 else 'AND'} ({c})" for i, c in enumerate(clauses)
            )
        bounds = [last * i // parts for i in range(parts + 1)]
        return [
            select
            + " WHERE "
            + " AND ".join([f"rowid > {lo} AND rowid <= {hi}", *(f"({c})" for c in clauses)])
            for lo, hi in itertools.pairwise(bounds)
        ]

    def small_table(self, table: str, columns: Iterable[str]) -> pl.DataFrame:
        """Those of ``columns`` that a small metadata table (GPU info, processes) has, or an
        empty frame. Only named columns: connectorx fails on an all-NULL column it cannot
        type, and newer exports may add such columns anywhere."""
        present = [c for c in dict.fromkeys(columns) if c in self.info.columns.get(table, ())]
        if not present:
            return pl.DataFrame()
        select = ", ".join(f'"{c}"' for c in present)
        return self.sql(f"SELECT {select} FROM {table}")


def empty_frame(cols: tuple[Col, ...]) -> pl.DataFrame:
    return pl.DataFrame(schema={c.name: c.dtype for c in cols})


def decode_tid(col: str) -> pl.Expr:
    return (pl.col(col) % (1 << 24)).cast(pl.Int64)


def _names(strings: pl.DataFrame, id_col: str, out: str) -> Callable[[pl.DataFrame], pl.DataFrame]:
    def attach(df: pl.DataFrame) -> pl.DataFrame:
        return df.join(strings.rename({"id": id_col, "value": out}), on=id_col, how="left").drop(
            id_col
        )

    return attach


def load_trace(
    path: str | Path,
    window: tuple[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Open one SQLite export and return its :class:`~traceclf.model.Trace`.

    ``window`` (ns, session timeline) restricts every timed table to events overlapping it;
    it is pushed into the SQL so that memory follows the window, not the file. ``progress`` is
    called with each of :data:`LOAD_STAGES` (e.g. a :class:`traceclf.progress.LoadProgress`).
    """
    path = Path(path)
    info = inspect_export(path, check_pages=False)
    reader = Reader(info)
    step = progress or (lambda _msg: None)

    step("strings")
    strings = (
        reader.sql("SELECT id, value FROM StringIds")
        if info.has("StringIds")
        else pl.DataFrame(schema={"id": pl.Int64, "value": pl.String})
    ).with_columns(pl.col("id").cast(pl.Int64), pl.col("value").cast(pl.String))

    step("kernels")
    kernels = reader.read("kernels", window)
    kernels = _names(strings, "name_id", "name")(kernels)
    kernels = _names(strings, "short_id", "short_name")(kernels)
    # Categorical: a few hundred distinct names over millions of rows (~4x less memory).
    kernels = kernels.with_columns(
        name=pl.coalesce("name", "short_name", pl.lit("<unknown kernel>")).cast(pl.Categorical),
        short_name=pl.coalesce("short_name", "name", pl.lit("<unknown kernel>")).cast(
            pl.Categorical
        ),
        grid_blocks=(
            pl.col("grid_x").fill_null(1)
            * pl.col("grid_y").fill_null(1)
            * pl.col("grid_z").fill_null(1)
        ),
        block_threads=(
            pl.col("block_x").fill_null(1)
            * pl.col("block_y").fill_null(1)
            * pl.col("block_z").fill_null(1)
        ),
        smem_per_block=pl.col("static_smem").fill_null(0) + pl.col("dynamic_smem").fill_null(0),
    ).drop(
        "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "static_smem", "dynamic_smem"
    )

    step("graphs")
    graphs = reader.read("graphs", window)

    step("copies")
    memcpy = (
        reader.read("memcpy", window)
        .with_columns(
            op=pl.lit("memcpy"),
            direction=pl.col("copy_kind").replace_strict(
                COPY_KINDS, default="other", return_dtype=pl.String
            ),
            pageable=(pl.col("src_kind") == MEMORY_KIND_PAGEABLE)
            | (pl.col("dst_kind") == MEMORY_KIND_PAGEABLE),
        )
        .drop("src_kind", "dst_kind")
    )
    memset = (
        reader.read("memset", window)
        .with_columns(
            op=pl.lit("memset"),
            copy_kind=pl.lit(None, pl.Int64),
            direction=pl.lit("memset"),
            pageable=pl.lit(False),
        )
        .drop("mem_kind")
    )
    copies = pl.concat([memcpy, memset.select(memcpy.columns)], how="vertical")

    step("CUDA API")
    api = reader.read("api", window)
    api = _names(strings, "name_id", "name")(api).with_columns(
        name=pl.col("name").fill_null("<unknown api>").cast(pl.Categorical),
        pid=decode_pid("global_tid"),
        tid=decode_tid("global_tid"),
    )

    step("syncs")
    syncs = reader.read("syncs", window)
    events = reader.read("events")

    step("NVTX")
    nvtx = _read_nvtx(reader, strings, window)

    step("memory")
    memory = reader.read("memory")  # instants; the whole capture is needed for the peak
    overhead = _names(strings, "name_id", "name")(reader.read("overhead", window))

    step("GPU metrics")
    gpu_metrics = read_gpu_metrics(reader, window)

    gpus = read_gpus(reader)
    processes = read_processes(reader)
    threads = read_threads(reader, strings)

    kernels, graphs, copies, syncs, events, memory = (
        df.with_columns(pid=decode_pid("global_pid"))
        for df in (kernels, graphs, copies, syncs, events, memory)
    )
    overhead = overhead.with_columns(pid=decode_pid("global_tid"))
    return Trace(
        path=path,
        nsys_version=info.nsys_version,
        schema_version=info.schema_version,
        tables=info.tables,
        kernels=kernels,
        graphs=graphs,
        copies=copies,
        api=api,
        syncs=syncs,
        events=events,
        nvtx=nvtx,
        gpu_metrics=gpu_metrics,
        memory=memory,
        overhead=overhead,
        gpus=gpus,
        processes=processes,
        device_map=read_device_map(reader),
        threads=threads,
        nccl_payload=nccl_payload(reader),
        session=read_session(reader),
    )


def _read_nvtx(
    reader: Reader, strings: pl.DataFrame, window: tuple[int, int] | None
) -> pl.DataFrame:
    raw = reader.read("nvtx")
    domains = (
        raw.filter(pl.col("event_type") == NVTX_DOMAIN_CREATE)
        .select("domain_id", domain=pl.col("text"))
        .unique("domain_id", maintain_order=True)
    )
    ranges = raw.filter(pl.col("event_type").is_in(NVTX_RANGE_TYPES) & pl.col("end").is_not_null())
    if window is not None:
        ranges = ranges.filter((pl.col("start") < window[1]) & (pl.col("end") > window[0]))
    ranges = ranges.join(strings.rename({"id": "text_id", "value": "_t"}), on="text_id", how="left")
    return (
        ranges.join(domains, on="domain_id", how="left")
        .select(
            "start",
            "end",
            text=pl.coalesce("text", "_t", pl.lit("")),
            domain=pl.col("domain").fill_null(""),
            pid=decode_pid("global_tid"),
            tid=decode_tid("global_tid"),
            global_tid="global_tid",
        )
        .sort("start")
    )
