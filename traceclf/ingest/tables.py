"""What is read of an nsys SQLite export: each logical table's physical tables and columns.

Column names differ between nsys versions, so each logical column lists the physical names it
may have (the first present is read); optional ones that an export lacks become typed nulls.
Some are computed in SQL (launch configuration, process ids, whether a payload is set) so that
fewer, narrower columns cross into Arrow. :mod:`traceclf.ingest.load` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polars as pl


@dataclass(frozen=True)
class Col:
    """One logical column: its physical names across nsys versions, dtype, and whether required.

    ``sql``, when given, computes the column in SQLite from the physical columns present (it
    gets their names and returns an expression, or None when it cannot be computed): fewer,
    narrower columns cross into Arrow than the raw ones it combines.
    """

    name: str
    sources: tuple[str, ...]
    dtype: type[pl.DataType] | pl.DataType = pl.Int64
    required: bool = False
    sql: Callable[[frozenset[str]], str | None] | None = None
    # what an ``sql`` column holds for NULL: connectorx types a computed column from its first
    # value and fails on a NULL there, so a computed column is never NULL in SQL
    null_as: int | None = None
    # a process id decoded after the read from this (already read) logical column rather than
    # in SQL: one column less through connectorx (~0.3 s on 11 M CUDA calls)
    decode_from: str | None = None


def _c(
    name: str,
    *sources: str,
    dtype: type[pl.DataType] | pl.DataType = pl.Int64,
    required: bool = False,
) -> Col:
    return Col(name, sources or (name,), dtype, required)


def _product(name: str, sources: tuple[str, ...], missing: int, dtype=pl.Int64) -> Col:
    """``name`` = the product (or sum, for missing=0) of those of ``sources`` present, each
    NULL read as ``missing``; the launch configuration as three numbers instead of eight."""
    op = " * " if missing else " + "

    def sql(present: frozenset[str]) -> str:
        terms = [f'coalesce("{c}", {missing})' for c in sources if c in present]
        return op.join(terms) if terms else str(missing)

    return Col(name, sources, dtype, sql=sql)


def _pid(*sources: str, decode_from: str | None = None) -> Col:
    """Process id decoded in SQL from a serialized globalPid/globalTid (bits 24..47), or with
    ``decode_from`` in polars from that logical column of the same read."""

    def sql(present: frozenset[str]) -> str | None:
        src = next((c for c in sources if c in present), None)
        return f'coalesce(("{src}" >> 24) & 16777215, -1)' if src else None

    return Col("pid", sources, pl.Int32, sql=sql, null_as=-1, decode_from=decode_from)


# No allocation is this large (256 TiB): a memory event beyond it would put the peak of
# allocated memory at millions of times the GPU's capacity.
MAX_ALLOCATION_BYTES = 1 << 48
# What an implausible (or missing) allocation size reads as in SQL: a null once read.
NO_BYTES = -(1 << 62)


def _signed_bytes() -> Col:
    """``delta``: a memory event's bytes, negative for a deallocation, computed in SQL (one
    column through connectorx where bytes and operation were two: memory events are read for
    the whole capture); null where the size is negative or over :data:`MAX_ALLOCATION_BYTES`."""

    def sql(present: frozenset[str]) -> str | None:
        if not {"bytes", "memoryOperationType"} <= present:
            return None
        return (
            f'CASE WHEN "bytes" BETWEEN 0 AND {MAX_ALLOCATION_BYTES} '
            f'THEN iif("memoryOperationType" = 0, "bytes", -"bytes") ELSE {NO_BYTES} END'
        )

    return Col("delta", ("bytes", "memoryOperationType"), required=True, sql=sql, null_as=NO_BYTES)


# NVTX payload columns (nsys >= 2022): NCCL's ranges carry message sizes and peers here
PAYLOAD_COLUMNS = (
    "uint64Value",
    "int64Value",
    "doubleValue",
    "uint32Value",
    "int32Value",
    "floatValue",
    "jsonTextId",
    "jsonText",
    "binaryData",
)


def _any_set(name: str, sources: tuple[str, ...]) -> Col:
    """``name`` = 1 where any of ``sources`` present holds a value, else 0: whether a row
    carries something, as one byte instead of the columns."""

    def sql(present: frozenset[str]) -> str:
        terms = [f'"{c}" IS NOT NULL' for c in sources if c in present]
        return f"({' OR '.join(terms)})" if terms else "0"

    return Col(name, sources, pl.Int8, sql=sql)


GPU_ROW = (
    _c("start", required=True),
    _c("end", required=True),
    _c("device_id", "deviceId", dtype=pl.Int32),
    _c("stream_id", "streamId", dtype=pl.Int32),
    _c("correlation_id", "correlationId"),
    _pid("globalPid", "globalTid"),
)

# Only the columns some measure or step finder uses; what the model keeps of each is listed in
# traceclf/model/trace.py.
TABLES: dict[str, tuple[tuple[str, ...], tuple[Col, ...]]] = {
    "kernels": (
        ("CUPTI_ACTIVITY_KIND_KERNEL",),
        (
            *GPU_ROW,
            # Exports without demangled names still have a short or mangled one.
            _c("name_id", "demangledName", "name", "shortName", "mangledName", required=True),
            _c("short_id", "shortName"),
            _c("registers", "registersPerThread", dtype=pl.Int32),
            _c("graph_node_id", "graphNodeId"),
            _c("graph_id", "graphId"),
            _product("grid_blocks", ("gridX", "gridY", "gridZ"), 1),
            _product("block_threads", ("blockX", "blockY", "blockZ"), 1, pl.Int32),
            _product("smem_per_block", ("staticSharedMemory", "dynamicSharedMemory"), 0, pl.Int32),
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
            _c("copy_kind", "copyKind", dtype=pl.Int32),
            _c("src_kind", "srcKind", dtype=pl.Int32),
            _c("dst_kind", "dstKind", dtype=pl.Int32),
        ),
    ),
    "memset": (
        ("CUPTI_ACTIVITY_KIND_MEMSET",),
        (*GPU_ROW, _c("bytes", required=True)),
    ),
    "api": (
        ("CUPTI_ACTIVITY_KIND_RUNTIME",),
        (
            _c("start", required=True),
            _c("end", required=True),
            _c("global_tid", "globalTid", required=True),
            _c("correlation_id", "correlationId", required=True),
            _c("name_id", "nameId", required=True),
            _pid("globalTid", decode_from="global_tid"),
        ),
    ),
    "syncs": (
        ("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",),
        (
            *GPU_ROW,
            _c("sync_type", "syncType", "deprecatedSyncType", dtype=pl.Int32),
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
            _c("device_id", "deviceId", dtype=pl.Int32),
            _c("stream_id", "streamId", dtype=pl.Int32),
            _c("correlation_id", "correlationId", required=True),
            _pid("globalPid"),
            _c("event_id", "eventId"),
            _c("event_sync_id", "eventSyncId"),
        ),
    ),
    "nvtx": (
        ("NVTX_EVENTS",),
        (
            _c("start", required=True),
            _c("end"),
            _c("event_type", "eventType", required=True, dtype=pl.Int32),
            _c("text", dtype=pl.String),
            _c("text_id", "textId"),
            _c("global_tid", "globalTid"),
            _c("domain_id", "domainId"),
            _any_set("payload", PAYLOAD_COLUMNS),
        ),
    ),
    "memory": (
        ("CUDA_GPU_MEMORY_USAGE_EVENTS",),
        (
            _c("start", required=True),
            _pid("globalPid"),
            _c("device_id", "deviceId", dtype=pl.Int32),
            _signed_bytes(),
            _c("mem_kind", "memKind", dtype=pl.Int32),
        ),
    ),
    "overhead": (
        ("PROFILER_OVERHEAD",),
        (
            _c("start", required=True),
            _c("end", required=True),
            _c("global_tid", "globalTid"),
            _c("name_id", "nameId"),
            _pid("globalTid"),
        ),
    ),
    # The host side beyond CUDA calls (ingest/hosttables.py): read only on the threads that made
    # CUDA calls, in the spans the trace covers.
    "osrt": (
        ("OSRT_API",),
        (
            _c("start", required=True),
            _c("end", required=True),
            _c("global_tid", "globalTid", required=True),
            _c("name_id", "nameId", required=True),
            _c("callchain_id", "callchainId"),
            _pid("globalTid", decode_from="global_tid"),
        ),
    ),
    "samples": (
        ("COMPOSITE_EVENTS",),
        (
            _c("start", required=True),
            _c("sample_id", "id", required=True),
            _c("global_tid", "globalTid", required=True),
            _pid("globalTid", decode_from="global_tid"),
        ),
    ),
    "sched": (
        ("SCHED_EVENTS",),
        (
            _c("start", required=True),
            _c("global_tid", "globalTid", required=True),
            _c("is_in", "isSchedIn", required=True, dtype=pl.Int8),
            _c("block", "threadBlock", dtype=pl.Int32),
            _pid("globalTid", decode_from="global_tid"),
        ),
    ),
}
# The event tables of the GPU and the CUDA API whose rows are checked for usability (a time, an
# end not before the start, a process) and that step sampling reads by rowid range.
EVENT_TABLES = ("kernels", "graphs", "memcpy", "memset", "api", "syncs")

# Rows of a table that are not its events, left out of every read where the column exists and
# the export holds the table that such rows come with (column, SQL condition, table):
# exports taken with --cudabacktrace (nsys 2021-2022) hold a second row for each call that has
# a backtrace, of eventClass TRACE_PROCESS_EVENT_CUDABACKTRACE (67; 68, 69: its start and
# finish) and the same correlationId, its callchain in CUDA_CALLCHAINS: read as calls, each
# launch and sync counted twice. (Only there: the test costs 0.6 s a core on 11 M calls.)
ROW_FILTERS: dict[str, tuple[str, str, str]] = {
    "api": ("eventClass", 'coalesce("eventClass", 0) NOT IN (67, 68, 69)', "CUDA_CALLCHAINS"),
}


# Tables with a [start, end) extent; the others (memory events) are instants.
TIMED = {
    "kernels",
    "graphs",
    "memcpy",
    "memset",
    "api",
    "syncs",
    "nvtx",
    "overhead",
    "osrt",
    "samples",  # (instants: a window holds those that start inside it)
    "sched",
}
