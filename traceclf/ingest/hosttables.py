"""The host side of an export beyond CUDA calls and NVTX ranges: OS runtime calls (``OSRT_API``,
``-t osrt``), CPU samples (``COMPOSITE_EVENTS`` with ``SAMPLING_CALLCHAINS``, ``--sample``),
thread scheduling (``SCHED_EVENTS``, ``--cpuctxsw``), nsys's own Python samples (NVTX payloads,
``--python-sampling`` exported with ``--include-blobs=true``), and the capture's diagnostics
(``DIAGNOSTIC_EVENT``).

Each is read only when the export has it, only on the threads that made CUDA calls (the ones
whose time can leave the GPU idle) and only in the time spans the trace covers; a table with
more than :data:`HOST_ROW_CAP` such rows is not read at all (the capture block says so), and
callchains and Python stacks are cut to their innermost frames. What the analysis makes of
them is :mod:`traceclf.measures.hostsources`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import polars as pl

from traceclf.ingest.payloads import PayloadSchemas, decode, read_payload_events
from traceclf.ingest.reader import decode_pid
from traceclf.ingest.tables import TABLES

if TYPE_CHECKING:
    from traceclf.ingest.reader import Reader, Span

# The host sources a report names (capture.host_sources), in the order of the contract.
SOURCES = ("nvtx", "cuda_api", "osrt", "sampling", "python_sampling", "sched")
# Rows of one host table read at most (on the CUDA threads, in the spans read): more is
# not read at all rather than read in part (a part would attribute the wrong steps).
HOST_ROW_CAP = 1_000_000
CALLCHAIN_DEPTH = 32  # callchain frames kept from the innermost (the top user frame is near it)
PYTHON_FRAMES = 64  # Python frames kept per sample, innermost first
DIAGNOSTIC_ROWS = 1000
DIAGNOSTIC_CHARS = 400
PYTHON_SCHEMA = "Python Periodic Sampling"  # nsys's schema of --python-sampling
# nsys's enum of DIAGNOSTIC_EVENT.severity and .source, when the export lacks the enum tables
SEVERITY = {0: "unknown", 1: "info", 2: "warning", 3: "error", 4: "verbose"}

OSRT_SCHEMA = {
    "start": pl.Int64,
    "end": pl.Int64,
    "global_tid": pl.Int64,
    "pid": pl.Int32,
    "name": pl.Categorical,
    "callchain_id": pl.Int64,
}
SAMPLE_SCHEMA = {"start": pl.Int64, "global_tid": pl.Int64, "pid": pl.Int32, "sample_id": pl.Int64}
CALLCHAIN_SCHEMA = {
    "source": pl.String,
    "id": pl.Int64,
    "depth": pl.Int32,
    "symbol": pl.Categorical,
    "module": pl.Categorical,
    "unresolved": pl.Boolean,
}
PY_SCHEMA = {
    "start": pl.Int64,
    "global_tid": pl.Int64,
    "pid": pl.Int32,
    "sample": pl.UInt32,
    "state": pl.Categorical,
    "depth": pl.UInt32,
    "function": pl.Categorical,
    "file": pl.Categorical,
    "line": pl.Int32,
}
SCHED_SCHEMA = {
    "start": pl.Int64,
    "global_tid": pl.Int64,
    "pid": pl.Int32,
    "running": pl.Boolean,
    "block": pl.Categorical,
}
DIAGNOSTIC_SCHEMA = {
    "timestamp": pl.Int64,
    "pid": pl.Int64,
    "severity": pl.String,
    "source": pl.String,
    "text": pl.String,
}


@dataclass(frozen=True)
class HostSide:
    """The host-side frames of one export (see the module's description)."""

    osrt: pl.DataFrame
    samples: pl.DataFrame
    callchains: pl.DataFrame
    py_frames: pl.DataFrame
    sched: pl.DataFrame
    diagnostics: pl.DataFrame
    # which of SOURCES the export holds, and why one it holds was not read (or is empty)
    sources: tuple[str, ...] = ()
    notes: dict[str, str] = field(default_factory=dict)


def empty_host_side() -> HostSide:
    return HostSide(
        *(
            pl.DataFrame(schema=s)
            for s in (
                OSRT_SCHEMA,
                SAMPLE_SCHEMA,
                CALLCHAIN_SCHEMA,
                PY_SCHEMA,
                SCHED_SCHEMA,
                DIAGNOSTIC_SCHEMA,
            )
        )
    )


def read_host_side(
    reader: Reader,
    threads: Sequence[int],
    spans: Span | Sequence[Span] | None,
) -> HostSide:
    """What the export holds of the host side, for the CUDA-calling ``threads`` (global thread
    ids) in the time ``spans`` (None: the whole capture), each table by one filtered scan (its
    ``sources``: those of :data:`SOURCES` but NVTX ranges, which the caller reads).

    Not by rowid ranges, as the event tables of the analysed steps are: nsys writes these
    tables a thread's buffer at a time (no shared trace has them in start order but one), and
    a block of a sparse thread's rows between two of the rows an order check samples goes
    unseen: on a 4.3 GB capture the samples were in order and a rowid-range read left out 17
    of 96 waits of the autograd thread in the analysed steps."""
    info = reader.info
    present = {
        "cuda_api": info.has("CUPTI_ACTIVITY_KIND_RUNTIME"),
        "osrt": info.has("OSRT_API"),
        "sampling": info.has("COMPOSITE_EVENTS"),
        "python_sampling": False,
        "sched": info.has("SCHED_EVENTS"),
    }
    notes: dict[str, str] = {}
    schemas = PayloadSchemas.read(reader)
    python = schemas.find(PYTHON_SCHEMA)
    if python:
        present["python_sampling"] = _carries_blobs(reader, {lay.domain_id for lay in python})
        if not present["python_sampling"]:
            notes["python_sampling"] = "declared, no values (export with --include-blobs=true)"
    tids = sorted({int(t) for t in threads})
    where = f"globalTid IN ({', '.join(map(str, tids))})" if tids else "0"
    strings = reader.strings
    empty = empty_host_side()
    osrt = (
        _read_capped(reader, "osrt", where, spans, notes, strings)
        if present["osrt"]
        else empty.osrt
    )
    samples = (
        _read_capped(reader, "samples", where, spans, notes, strings)
        if present["sampling"]
        else empty.samples
    )
    sched = (
        _read_capped(reader, "sched", where, spans, notes, strings)
        if present["sched"]
        else empty.sched
    )
    py_frames = (
        _python_frames(reader, python, where, spans, notes, strings)
        if present["python_sampling"]
        else empty.py_frames
    )
    return HostSide(
        osrt=osrt,
        samples=samples,
        callchains=_callchains(reader, osrt, samples, notes, strings),
        py_frames=py_frames,
        sched=sched,
        diagnostics=read_diagnostics(reader),
        sources=tuple(s for s in SOURCES if present.get(s)),
        notes=notes,
    )


def _carries_blobs(reader: Reader, domains: set[int]) -> bool:
    if "binaryData" not in reader.info.columns.get("NVTX_EVENTS", ()):
        return False
    ids = ", ".join(str(int(d)) for d in sorted(domains))
    hit = reader.sql(
        "SELECT count(*) AS n FROM (SELECT 1 FROM NVTX_EVENTS WHERE binaryData IS NOT NULL "
        f"AND domainId IN ({ids}) LIMIT 1)"
    )
    return bool(int(hit["n"][0]))


def _read_capped(
    reader: Reader,
    logical: str,
    where: str,
    spans: Span | Sequence[Span] | None,
    notes: dict[str, str],
    strings: pl.DataFrame,
) -> pl.DataFrame:
    """One host table's rows on the CUDA threads in ``spans``, typed; empty (with a note)
    when there are more than :data:`HOST_ROW_CAP` of them."""
    table = reader.table_of(logical)
    source = {"samples": "sampling"}.get(logical, logical)
    columns = reader.info.columns.get(table or "", ())
    schema = {"osrt": OSRT_SCHEMA, "samples": SAMPLE_SCHEMA, "sched": SCHED_SCHEMA}[logical]
    # (an export of another nsys version may lack a column this reads: that source is then
    # left out, not the analysis failed)
    lacking = next(
        (
            c.sources[0]
            for c in TABLES[logical][1]
            if c.required and not any(name in columns for name in c.sources)
        ),
        None,
    )
    if lacking is not None:
        notes[source] = f"not read: {table} has no column {lacking!r}"
        return pl.DataFrame(schema=schema)
    if logical == "osrt" and "nestingLevel" in columns:  # calls inside calls: the outer one
        where = f"{where} AND coalesce(nestingLevel, 0) = 0"
    # One read, each of its queries capped one row past the limit: a table over the cap costs
    # at most that many rows, and one under it (every honest one) is scanned once, not counted
    # first and then read.
    raw = reader.read(logical, spans, where, limit=HOST_ROW_CAP + 1)
    if raw.height > HOST_ROW_CAP:
        notes[source] = f"not read: over {HOST_ROW_CAP:,} rows on the CUDA threads"
        return pl.DataFrame(schema=schema)
    if raw.is_empty():
        return pl.DataFrame(schema=schema)
    if logical == "osrt":
        return raw.with_columns(name=_named(strings, "name_id")).select(list(schema)).sort("start")
    if logical == "sched":
        blocks = _enum_labels(reader, "ENUM_SCHEDULING_THREAD_BLOCK")
        return raw.select(
            "start",
            "global_tid",
            "pid",
            running=pl.col("is_in") != 0,
            block=pl.col("block")
            .replace_strict(blocks, default=None, return_dtype=pl.String)
            .cast(pl.Categorical),
        ).sort("start")
    return raw.select(list(schema)).sort("start")


def _named(strings: pl.DataFrame, col: str) -> pl.Expr:
    """The StringIds value of each id in ``col`` (null where none), as a Categorical: a few
    hundred names over up to a million rows, replaced in place (no join copies the rows)."""
    names = strings.filter(pl.col("id").is_not_null())
    return (
        pl.col(col)
        .cast(pl.Int64)
        .replace_strict(names["id"], names["value"], default=None, return_dtype=pl.String)
        .cast(pl.Categorical)
    )


def _enum_labels(reader: Reader, table: str) -> dict[int, str]:
    raw = reader.small_table(table, ("id", "label"), text=("label",))
    if raw.is_empty() or not {"id", "label"} <= set(raw.columns):
        return {}
    return {int(i): str(label) for i, label in raw.iter_rows() if i is not None and label}


def _callchains(
    reader: Reader,
    osrt: pl.DataFrame,
    samples: pl.DataFrame,
    notes: dict[str, str],
    strings: pl.DataFrame,
) -> pl.DataFrame:
    """The innermost :data:`CALLCHAIN_DEPTH` frames of the callchains of the calls and samples
    read (by id range, then to the ids read: the ids of a time span are contiguous)."""
    parts = []
    for source, table, ids in (
        ("osrt", "OSRT_CALLCHAINS", osrt["callchain_id"]),
        ("sampling", "SAMPLING_CALLCHAINS", samples["sample_id"]),
    ):
        ids = ids.drop_nulls()
        columns = reader.info.columns.get(table, ())
        if ids.is_empty() or not {"id", "symbol", "module", "stackDepth"} <= set(columns):
            continue
        unresolved = '"unresolved"' if "unresolved" in columns else "0"
        query = (
            f"SELECT id, stackDepth AS depth, symbol, module, coalesce({unresolved}, 0) AS u "
            f"FROM {table} WHERE id BETWEEN {int(ids.min())} AND {int(ids.max())} "  # type: ignore[arg-type]
            f"AND stackDepth < {CALLCHAIN_DEPTH} LIMIT {HOST_ROW_CAP + 1}"
        )
        raw = reader.sql(query)
        if raw.height > HOST_ROW_CAP:
            notes[f"{source} callchains"] = f"not read: over {HOST_ROW_CAP:,} frames"
            continue
        if raw.is_empty():
            continue
        raw = raw.filter(pl.col("id").is_in(ids.unique().implode()))
        parts.append(
            raw.select(
                source=pl.lit(source),
                id=pl.col("id").cast(pl.Int64),
                depth=pl.col("depth").cast(pl.Int32),
                symbol=_named(strings, "symbol"),
                module=_named(strings, "module"),
                unresolved=pl.col("u").cast(pl.Int64) != 0,
            )
        )
    if not parts:
        return pl.DataFrame(schema=CALLCHAIN_SCHEMA)
    return pl.concat(parts).select(pl.col(c).cast(t) for c, t in CALLCHAIN_SCHEMA.items())


def _python_frames(
    reader: Reader,
    layouts: list,
    where: str,
    spans: Span | Sequence[Span] | None,
    notes: dict[str, str],
    strings: pl.DataFrame,
) -> pl.DataFrame:
    """nsys's Python samples on the CUDA threads: one row per frame, innermost (depth 0)
    first, at most :data:`PYTHON_FRAMES` per sample."""
    if not {"globalTid", "domainId"} <= set(reader.info.columns.get("NVTX_EVENTS", ())):
        notes["python_sampling"] = "not read: NVTX_EVENTS has no globalTid or domainId"
        return pl.DataFrame(schema=PY_SCHEMA)
    domains = ", ".join(str(int(d)) for d in sorted({lay.domain_id for lay in layouts}))
    events, too_big = read_payload_events(reader, f"{where} AND domainId IN ({domains})", spans)
    if events.height > HOST_ROW_CAP:
        notes["python_sampling"] = f"not read: {events.height:,} samples (over {HOST_ROW_CAP:,})"
        return pl.DataFrame(schema=PY_SCHEMA)
    parts, skipped = [], too_big
    for layout in layouts:
        decoded = decode(events, layout)
        skipped += decoded.skipped + decoded.unreadable
        frames = decoded.arrays.get("Frames")
        names = {f.name for f in layout.fields}
        if frames is None or not {"Function", "File", "Line"} <= set(frames.columns):
            continue
        state = "Thread state" if "Thread state" in names else None
        samples = decoded.values.select(
            "event",
            "start",
            "global_tid",
            state=pl.col(state).cast(pl.String) if state else pl.lit(None, pl.String),
        )
        parts.append(
            frames.filter(pl.col("index") < PYTHON_FRAMES)
            .join(samples, on="event")
            .select(
                "start",
                "global_tid",
                "state",
                sample="event",
                depth="index",
                function="Function",
                file="File",
                line="Line",
            )
        )
    if skipped:
        notes["python_sampling"] = f"{skipped} samples not decoded (damaged or over 64 KiB)"
    if not parts:
        return pl.DataFrame(schema=PY_SCHEMA)
    frames = pl.concat(parts)
    return (
        frames.with_columns(
            function=_named(strings, "function"),
            file=_named(strings, "file"),
            pid=decode_pid("global_tid"),
        )
        .select(pl.col(c).cast(t) for c, t in PY_SCHEMA.items())
        .sort("start", "sample", "depth")
    )


def read_diagnostics(reader: Reader) -> pl.DataFrame:
    """nsys's diagnostic messages (DIAGNOSTIC_EVENT): severity and source as words, the text
    cut to :data:`DIAGNOSTIC_CHARS` characters, at most :data:`DIAGNOSTIC_ROWS` messages."""
    columns = reader.info.columns.get("DIAGNOSTIC_EVENT", ())
    if not {"timestamp", "severity", "text"} <= set(columns):
        return pl.DataFrame(schema=DIAGNOSTIC_SCHEMA)
    pid = '"globalPid"' if "globalPid" in columns else "NULL"
    source = '"source"' if "source" in columns else "NULL"
    # (the text as the bytes nsys stored, decoded with U+FFFD where it is not UTF-8)
    raw = reader.sql(
        f"SELECT timestamp, {pid} AS gpid, severity, {source} AS src, "
        f"coalesce(substr(CAST(text AS BLOB), 1, {DIAGNOSTIC_CHARS}), X'00') AS text "
        f"FROM DIAGNOSTIC_EVENT ORDER BY timestamp LIMIT {DIAGNOSTIC_ROWS}"
    )
    raw = reader.decoded(raw, "DIAGNOSTIC_EVENT", {"text": "text"})
    if raw.is_empty():
        return pl.DataFrame(schema=DIAGNOSTIC_SCHEMA)
    severity = _enum_labels(reader, "ENUM_DIAGNOSTIC_SEVERITY_LEVEL") or SEVERITY
    sources = _enum_labels(reader, "ENUM_DIAGNOSTIC_SOURCE_TYPE")
    return raw.select(
        pl.col("timestamp").cast(pl.Int64),
        pid=decode_pid("gpid"),
        severity=pl.col("severity")
        .replace_strict(severity, default=None, return_dtype=pl.String)
        .str.to_lowercase(),
        source=pl.col("src").replace_strict(sources, default=None, return_dtype=pl.String),
        text=pl.col("text").cast(pl.String),
    )
