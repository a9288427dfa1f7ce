"""NVTX extended payloads: the binary values some NVTX events carry (NCCL's communicator, message
size and reduction; nsys's own Python backtraces), decoded by the schemas the export declares.

An export holds them only when made with ``nsys export --include-blobs=true``: then
``NVTX_EVENTS.binaryData`` (declared TEXT, holding a BLOB: read as bytes) is, little-endian::

    u64 count                                   payloads in this event
    count x {u64 schemaId, u64 size, u64 offset} offset: from the blob's start to the payload
    payload data ...

and each payload is laid out by its schema (``NVTX_PAYLOAD_SCHEMAS`` / ``_SCHEMA_ENTRIES``,
enums in ``NVTX_PAYLOAD_ENUMS`` / ``_ENUM_ENTRIES``; type and flag values from NVIDIA/NVTX
``c/include/nvtx3/nvToolsExtPayload.h``). Use::

    schemas = PayloadSchemas.read(reader)               # every schema the export declares
    layout = schemas.find(entry="Message size [bytes]")[0]
    events, too_big = read_payload_events(reader, "domainId = 1")
    decoded = decode(events, layout)
    decoded.values   # one row per event: its columns + one per value ("Message size [bytes]")
    decoded.arrays   # per array entry ("Frames"): one row per element, keyed by ``event``
    decoded.skipped  # events of this schema whose payload does not fit it (malformed, cut)

Values at fixed places (numbers, enum labels, string handles: nsys writes the ``StringIds``
id) are read for every event at once (``bin.slice`` + ``bin.reinterpret``), arrays of fixed-size
elements by exploding their indices; only a layout whose offsets depend on the data (entries
after a variable-length array, zero-terminated arrays) is read event by event, for at most
:data:`MAX_LOOP_EVENTS` events. Everything read is untrusted: counts, sizes, offsets and
nesting are checked, a blob that does not fit is skipped and counted, never an exception.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import polars as pl

from traceclf.ingest.payload_schemas import Array, Field, Layout, PayloadSchemas, round_up
from traceclf.ingest.reader import overlap_clause

if TYPE_CHECKING:
    from traceclf.ingest.reader import Reader, Span

__all__ = ["Decoded", "Layout", "PayloadSchemas", "decode", "read_payload_events"]

HEADER_BYTES = 8  # u64 count
RECORD_BYTES = 24  # u64 schemaId, u64 size, u64 offset
# Bounds on untrusted input: payloads per event looked at, bytes of one event's blob (larger
# ones are not read at all), elements of one array read (more are counted as ``clipped``),
# and events read one by one on the slow path.
MAX_PAYLOADS = 8
MAX_BLOB_BYTES = 1 << 16
MAX_ELEMENTS = 256
MAX_LOOP_EVENTS = 50_000


@dataclass
class Decoded:
    """What :func:`decode` read: ``values`` (one row per decoded event: the event's columns,
    ``event`` = its row in the input, one column per :class:`Field`), ``arrays`` (per
    :class:`Array` name: ``event``, ``index``, one column per element field), ``skipped``
    (events of this schema whose payload does not fit the layout: cut short, sizes or
    offsets out of bounds), ``unreadable`` (events of the layout's domain whose blob header
    names no payload at all) and ``clipped`` (array elements past :data:`MAX_ELEMENTS`, not
    read)."""

    values: pl.DataFrame
    arrays: dict[str, pl.DataFrame] = field(default_factory=dict)
    skipped: int = 0
    unreadable: int = 0
    clipped: int = 0


# --------------------------------------------------------------------------------- events

PAYLOAD_EVENT_COLUMNS = {
    "start": pl.Int64,
    "end": pl.Int64,
    "event_type": pl.Int32,
    "global_tid": pl.Int64,
    "domain_id": pl.Int64,
    "text_id": pl.Int64,
    "data": pl.Binary,
}


def read_payload_events(
    reader: Reader,
    where: str | None = None,
    spans: Span | Iterable[Span] | None = None,
) -> tuple[pl.DataFrame, int]:
    """NVTX events that carry a binary payload (``data``: the blob as bytes), with ``where``
    (SQL on NVTX_EVENTS), overlapping the time ``spans`` when given; and how many such events
    were not read for a blob over :data:`MAX_BLOB_BYTES`."""
    columns = reader.info.columns.get("NVTX_EVENTS", ())
    empty = pl.DataFrame(schema=PAYLOAD_EVENT_COLUMNS)
    if "binaryData" not in columns or "start" not in columns:
        return empty, 0
    clauses = ["binaryData IS NOT NULL", *([f"({where})"] if where else [])]
    if spans is not None:
        clauses.append(f"({overlap_clause(spans, _end(columns))})")
    cond = " AND ".join(clauses)
    (over,) = reader.sql(
        f"SELECT count(*) AS n FROM NVTX_EVENTS WHERE {cond} AND length(binaryData) > "
        f"{MAX_BLOB_BYTES}"
    ).row(0)
    select = ", ".join(
        f"{_col(columns, src)} AS {name}"
        for name, src in (
            ("start", "start"),
            ("end", "end"),
            ("event_type", "eventType"),
            ("global_tid", "globalTid"),
            ("domain_id", "domainId"),
            ("text_id", "textId"),
        )
    )
    frame = reader.sql(
        f"SELECT {select}, CAST(binaryData AS BLOB) AS data FROM NVTX_EVENTS WHERE {cond} "
        f"AND length(binaryData) <= {MAX_BLOB_BYTES} ORDER BY start"
    )
    if frame.is_empty():
        return empty, int(over)
    return frame.select(pl.col(c).cast(t) for c, t in PAYLOAD_EVENT_COLUMNS.items()), int(over)


def _col(columns: tuple[str, ...], name: str) -> str:
    return f'"{name}"' if name in columns else "NULL"


def _end(columns: tuple[str, ...]) -> str:
    return 'coalesce("end", start)' if "end" in columns else "start"


# -------------------------------------------------------------------------------- decoding


def decode(events: pl.DataFrame, layout: Layout, data: str = "data") -> Decoded:
    """The payload of ``layout``'s schema in each of ``events`` that carries one (a Binary
    column ``data``; with a ``domain_id`` column, only the layout's domain: domain ids are the
    registering process's own)."""
    events = events.with_row_index("event")
    if "domain_id" in events.columns:
        events = events.filter(pl.col("domain_id") == layout.domain_id)
    blob = pl.col(data)
    n = blob.bin.size().cast(pl.UInt64)
    count = _read(blob, pl.lit(0, pl.UInt64), 8, pl.UInt64())
    record = pl.lit(None, pl.UInt64)
    for k in reversed(range(MAX_PAYLOADS)):  # the first record of this schema
        at = pl.lit(HEADER_BYTES + RECORD_BYTES * k, pl.UInt64)
        hit = (count > k) & (_read(blob, at, 8, pl.UInt64()) == layout.schema_id)
        record = pl.when(hit).then(at).otherwise(record)
    located = events.with_columns(
        # the header fits in the blob (compared by division: a count near 2**64 must not wrap)
        _header=((count >= 1) & (count <= n.clip(HEADER_BYTES) // RECORD_BYTES)).fill_null(False),
        _n=n,
        _count=count,
        _record=record,
        _base=_read(blob, record + 16, 8, pl.UInt64()),
        _size=_read(blob, record + 8, 8, pl.UInt64()),
    )
    unreadable = located.filter(~pl.col("_header")).height
    mine = located.filter(pl.col("_header") & pl.col("_record").is_not_null())
    ok = (
        (pl.col("_base") >= pl.col("_count") * RECORD_BYTES + HEADER_BYTES)
        & (pl.col("_base") <= pl.col("_n"))
        & (pl.col("_size") <= pl.col("_n") - pl.col("_base"))
        & (pl.col("_size") >= layout.min_size)
    ).fill_null(False)
    fits = mine.filter(ok).drop("_header", "_n", "_count", "_record")
    decode_all = _decode_fixed if layout.fixed else _decode_loop
    out = decode_all(fits, layout, data)
    out.skipped += mine.height - fits.height
    out.unreadable = unreadable
    return out


def _decode_fixed(fits: pl.DataFrame, layout: Layout, data: str) -> Decoded:
    """Every event at once: values at fixed offsets, arrays by exploding their indices."""
    blob, base = pl.col(data), pl.col("_base")
    values = fits.with_columns(_value(blob, base, f.offset, f) for f in layout.fields)  # type: ignore[arg-type]
    # arrays must lie inside the payload: an event with one that does not is skipped whole
    lengths = {a.name: _length(a, values) for a in layout.arrays}
    inside = pl.lit(True)
    for a in layout.arrays:
        n = pl.col(f"_len {a.name}")
        # (at most one element per byte first: the product below then cannot overflow)
        fits_n = (n >= 0) & (n <= pl.col("_size").cast(pl.Int64))
        end = n.clip(0).cast(pl.UInt64) * a.element_size + a.offset  # type: ignore[operator]
        inside = inside & fits_n & (end <= pl.col("_size"))
    values = values.with_columns(**{f"_len {k}": v for k, v in lengths.items()})
    good = values.filter(inside.fill_null(False))
    out = Decoded(pl.DataFrame(), skipped=values.height - good.height)
    for a in layout.arrays:
        n = pl.col(f"_len {a.name}")
        out.clipped += int(good.select((n - MAX_ELEMENTS).clip(0).sum()).item() or 0)
        rows = (
            good.select("event", data, "_base", _n=n.clip(0, MAX_ELEMENTS))
            .with_columns(index=pl.int_ranges(0, "_n", dtype=pl.UInt32))
            .explode("index")
            .drop_nulls("index")
        )
        at = pl.col("index").cast(pl.UInt64) * a.element_size + a.offset  # type: ignore[operator]
        out.arrays[a.name] = rows.select(
            "event",
            "index",
            *[_value(blob, base + at, f.offset, f) for f in a.fields],
        )
    out.values = good.drop(data, "_base", "_size", *[f"_len {a.name}" for a in layout.arrays])
    return out


def _length(a: Array, values: pl.DataFrame) -> pl.Expr:
    if a.length is not None:
        return pl.lit(a.length, pl.Int64)
    if a.length_field is None or a.length_field not in values.columns:
        return pl.lit(-1, pl.Int64)  # (zero-terminated arrays are not read here)
    return pl.col(a.length_field).cast(pl.Int64, strict=False).fill_null(-1)


def _value(blob: pl.Expr, base: pl.Expr, offset: int, f: Field) -> pl.Expr:
    """The field's value at ``base + offset`` of each blob (an enum as its label, or its
    number where the enum names none)."""
    if f.dtype is None:
        return pl.lit(None, pl.Int64).alias(f.name)
    raw = _read(blob, base + offset, f.size, f.dtype)
    if f.labels is not None:
        labels = pl.DataFrame(
            {"v": list(f.labels), "l": list(f.labels.values())},
            schema={"v": f.dtype, "l": pl.String},
        )
        raw = raw.replace_strict(
            labels["v"], labels["l"], default=raw.cast(pl.String), return_dtype=pl.String
        )
    elif f.string:
        raw = raw.cast(pl.Int64, strict=False)  # (a StringIds id)
    return raw.alias(f.name)


def _read(blob: pl.Expr, at: pl.Expr, size: int, dtype: pl.DataType) -> pl.Expr:
    """``size`` bytes at ``at`` as ``dtype`` (null where the blob is shorter)."""
    return blob.bin.slice(at, size).bin.reinterpret(dtype=dtype, endianness="little")


# --------------------------------------------------------------- the slow path (per event)

_STRUCT = {
    pl.Int8(): "b",
    pl.UInt8(): "B",
    pl.Int16(): "h",
    pl.UInt16(): "H",
    pl.Int32(): "i",
    pl.UInt32(): "I",
    pl.Int64(): "q",
    pl.UInt64(): "Q",
    pl.Float32(): "f",
    pl.Float64(): "d",
}


def _decode_loop(fits: pl.DataFrame, layout: Layout, data: str) -> Decoded:
    """Event by event, for layouts whose offsets depend on the data; at most
    :data:`MAX_LOOP_EVENTS` events (the rest are skipped)."""
    head = fits.head(MAX_LOOP_EVENTS)
    values: dict[str, list] = {f.name: [] for f in layout.fields}
    arrays: dict[str, dict[str, list]] = {
        a.name: {"event": [], "index": [], **{f.name: [] for f in a.fields}} for a in layout.arrays
    }
    kept, skipped, clipped = [], fits.height - head.height, 0
    for event, blob, base, size in head.select("event", data, "_base", "_size").iter_rows():
        payload = memoryview(blob)[base : base + size]
        parsed = _parse(payload, layout)
        if parsed is None:
            skipped += 1
            continue
        kept.append(event)
        scalars, elements, cut = parsed
        clipped += cut
        for name, value in scalars.items():
            values[name].append(value)
        for name, rows in elements.items():
            for index, row in enumerate(rows):
                arrays[name]["event"].append(event)
                arrays[name]["index"].append(index)
                for key, value in row.items():
                    arrays[name][key].append(value)
    frame = head.filter(pl.col("event").is_in(kept)).drop(data, "_base", "_size")
    out = Decoded(
        frame.with_columns(_series(f, values[f.name]) for f in layout.fields),
        skipped=skipped,
        clipped=clipped,
    )
    for a in layout.arrays:
        cols = arrays[a.name]
        out.arrays[a.name] = pl.DataFrame(
            [
                pl.Series("event", cols["event"], dtype=pl.UInt32),
                pl.Series("index", cols["index"], dtype=pl.UInt32),
                *[_series(f, cols[f.name]) for f in a.fields],
            ]
        )
    return out


def _parse(payload: memoryview, layout: Layout) -> tuple[dict, dict, int] | None:
    """One payload's values and array elements, or None when it does not fit."""
    scalars: dict = {}
    elements: dict[str, list[dict]] = {}
    cursor, clipped = 0, 0
    for item in layout.items:
        align = min(item.align, layout.pack) if layout.pack else item.align
        offset = item.offset if item.offset is not None else round_up(cursor, align)
        if isinstance(item, Field):
            if offset + item.size > len(payload):
                return None
            scalars[item.name] = _unpack(payload, offset, item)
            cursor = offset + item.size
            continue
        n = item.length
        if n is None and item.length_field is not None:
            n = scalars.get(item.length_field)
        if item.zero_terminated:
            n = _zero_terminated(payload, offset, item)
        if not isinstance(n, int) or n < 0 or offset + n * item.element_size > len(payload):
            return None
        rows = []
        for i in range(min(n, MAX_ELEMENTS)):
            at = offset + i * item.element_size
            rows.append({f.name: _unpack(payload, at + f.offset, f) for f in item.fields})
        elements[item.name] = rows
        clipped += max(n - MAX_ELEMENTS, 0)
        cursor = offset + (n + item.zero_terminated) * item.element_size
    return scalars, elements, clipped


def _zero_terminated(payload: memoryview, offset: int, a: Array) -> int | None:
    """Elements before the first all-zero one, or None when no element is all zero."""
    size = a.element_size
    if size <= 0:
        return None
    zero = bytes(size)
    n = 0
    while offset + (n + 1) * size <= len(payload):
        if payload[offset + n * size : offset + (n + 1) * size] == zero:
            return n
        n += 1
    return None


def _unpack(payload: memoryview, at: int, f: Field):
    code = _STRUCT.get(f.dtype) if f.dtype is not None else None
    if code is None or at + f.size > len(payload):
        return None
    value = struct.unpack_from("<" + code, payload, at)[0]
    if f.labels is not None:
        return f.labels.get(value, str(value))
    return value


def _series(f: Field, values: list) -> pl.Series:
    if f.dtype is None:
        return pl.Series(f.name, values, dtype=pl.Int64)
    if f.labels is not None:
        return pl.Series(f.name, values, dtype=pl.String)
    if f.string:
        return pl.Series(f.name, values, dtype=pl.UInt64).cast(pl.Int64, strict=False)
    return pl.Series(f.name, values, dtype=f.dtype)
