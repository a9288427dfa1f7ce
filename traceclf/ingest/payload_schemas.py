"""NVTX extended-payload schemas: how the binary values of NVTX events are laid out, read from
the schema tables an export declares (``NVTX_PAYLOAD_SCHEMAS`` / ``_SCHEMA_ENTRIES``, enums in
``NVTX_PAYLOAD_ENUMS`` / ``_ENUM_ENTRIES``) into :class:`Layout`s that
:mod:`traceclf.ingest.payloads` decodes with. Type and flag values are NVIDIA/NVTX's
(``c/include/nvtx3/nvToolsExtPayload.h``, ``NVTX_PAYLOAD_ENTRY_TYPE_*`` and
``NVTX_PAYLOAD_ENTRY_FLAG_*``). The schema tables are untrusted too: nesting is bounded, a
schema declared twice differently is ambiguous, and a type of unknown size makes no layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from traceclf.ingest.reader import Reader

# --- NVTX_PAYLOAD_ENTRY_TYPE_* (nvToolsExtPayload.h): size in bytes (LP64, as nsys runs on
# Linux) and how the value is read; None where polars has no such number (long double,
# 128-bit, half and bfloat16 floats): those entries keep their place and read as null.
SCALAR_TYPES: dict[int, tuple[int, pl.DataType | None]] = {
    1: (1, pl.Int8()),  # CHAR
    2: (1, pl.UInt8()),  # UCHAR
    3: (2, pl.Int16()),  # SHORT
    4: (2, pl.UInt16()),  # USHORT
    5: (4, pl.Int32()),  # INT
    6: (4, pl.UInt32()),  # UINT
    7: (8, pl.Int64()),  # LONG
    8: (8, pl.UInt64()),  # ULONG
    9: (8, pl.Int64()),  # LONGLONG
    10: (8, pl.UInt64()),  # ULONGLONG
    11: (1, pl.Int8()),  # INT8
    12: (1, pl.UInt8()),  # UINT8
    13: (2, pl.Int16()),  # INT16
    14: (2, pl.UInt16()),  # UINT16
    15: (4, pl.Int32()),  # INT32
    16: (4, pl.UInt32()),  # UINT32
    17: (8, pl.Int64()),  # INT64
    18: (8, pl.UInt64()),  # UINT64
    19: (4, pl.Float32()),  # FLOAT
    20: (8, pl.Float64()),  # DOUBLE
    21: (16, None),  # LONGDOUBLE
    22: (8, pl.UInt64()),  # SIZE (size_t)
    23: (8, pl.UInt64()),  # ADDRESS
    24: (4, pl.Int32()),  # WCHAR (wchar_t)
    25: (1, pl.UInt8()),  # CHAR8
    26: (2, pl.UInt16()),  # CHAR16
    27: (4, pl.UInt32()),  # CHAR32
    32: (1, pl.UInt8()),  # BYTE
    33: (16, None),  # INT128
    34: (16, None),  # UINT128
    42: (2, None),  # FLOAT16
    43: (4, pl.Float32()),  # FLOAT32
    44: (8, pl.Float64()),  # FLOAT64
    45: (16, None),  # FLOAT128
    50: (2, None),  # BF16
    52: (4, pl.Float32()),  # TF32 (stored in 32 bits)
    68: (4, pl.UInt32()),  # CATEGORY
    69: (4, pl.UInt32()),  # COLOR_ARGB
    70: (8, pl.UInt64()),  # SCOPE_ID
    71: (4, pl.UInt32()),  # PID_UINT32
    72: (8, pl.UInt64()),  # PID_UINT64
    73: (4, pl.UInt32()),  # TID_UINT32
    74: (8, pl.UInt64()),  # TID_UINT64
}
STRING_HANDLE = (
    80  # NVTX_PAYLOAD_ENTRY_TYPE_NVTX_REGISTERED_STRING_HANDLE: nsys writes StringIds ids
)
SCHEMA_ID_STATIC_START = 1 << 24  # types from here on are schema (or enum) ids
FLAG_POINTER = 1 << 1  # NVTX_PAYLOAD_ENTRY_FLAG_POINTER: an address, meaningless in an export
# NVTX_PAYLOAD_ENTRY_FLAG_ARRAY_*: bits 4..6 of the entry's flags
ARRAY_FIXED_SIZE, ARRAY_ZERO_TERMINATED, ARRAY_LENGTH_INDEX = 1, 2, 3
SCHEMA_STATIC, SCHEMA_DYNAMIC = 1, 2  # NVTX_PAYLOAD_SCHEMA_TYPE_* (unions are not read)

# Nesting of structs in a schema (deeper, or a cycle of schemas: no layout), and values in
# one layout (nested structs flattened): a schema is untrusted input too.
MAX_DEPTH = 4
MAX_FIELDS = 1024
# No value of a payload lies further than this, nor is an element bigger (blobs are read up to
# 64 KiB): larger offsets and sizes in a schema are not a layout to trust.
MAX_OFFSET = 1 << 16


@dataclass(frozen=True)
class Field:
    """One value at a fixed place of a payload (or of an array element): a number, an enum
    (``labels``: value -> name) or a string handle. ``name`` joins nested struct names with
    ``.``; ``dtype`` None: a type with no polars number (read as null)."""

    name: str
    offset: int
    size: int
    dtype: pl.DataType | None
    labels: dict[int, str] | None = None
    string: bool = False

    @property
    def align(self) -> int:
        """Natural alignment: a value's own size (16 at most)."""
        return min(max(self.size, 1), 16)


@dataclass(frozen=True)
class Array:
    """An array entry: its elements (``fields``, offsets within an element of
    ``element_size`` bytes) and its length, ``length`` elements or the value of the field
    ``length_field``, or up to a zero element (``zero_terminated``). ``offset`` None: right
    after the previous entry, wherever the data puts that."""

    name: str
    offset: int | None
    element_size: int
    align: int
    fields: tuple[Field, ...]
    length: int | None = None
    length_field: str | None = None
    zero_terminated: bool = False


@dataclass(frozen=True)
class Layout:
    """How one schema's payload is laid out: its values and arrays in entry order."""

    domain_id: int
    schema_id: int
    name: str
    items: tuple[Field | Array, ...]
    pack: int = 0  # the schema's alignTo: fields packed to at most this alignment

    @property
    def fields(self) -> tuple[Field, ...]:
        return tuple(i for i in self.items if isinstance(i, Field))

    @property
    def arrays(self) -> tuple[Array, ...]:
        return tuple(i for i in self.items if isinstance(i, Array))

    @property
    def fixed(self) -> bool:
        """Whether every value sits at a place known before reading the data (then every
        event is read at once)."""
        return all(
            i.offset is not None and not (isinstance(i, Array) and i.zero_terminated)
            for i in self.items
        )

    @property
    def min_size(self) -> int:
        """Bytes a payload needs for its values at fixed places."""
        ends = [f.offset + f.size for f in self.fields if f.offset is not None]
        return max(ends, default=0)


# ------------------------------------------------------------------------------- schemas

SCHEMA_COLUMNS = {
    "NVTX_PAYLOAD_SCHEMAS": ("domainId", "schemaId", "name", "type", "payloadSize", "alignTo"),
    "NVTX_PAYLOAD_SCHEMA_ENTRIES": (
        "domainId",
        "schemaId",
        "idx",
        "flags",
        "type",
        "name",
        "arrayOrUnionDetail",
        "offset",
    ),
    "NVTX_PAYLOAD_ENUMS": ("domainId", "schemaId", "name", "size"),
    "NVTX_PAYLOAD_ENUM_ENTRIES": ("domainId", "schemaId", "idx", "name", "value"),
}


class PayloadSchemas:
    """The payload schemas and enums an export declares, as :class:`Layout`s.

    nsys writes a schema's rows once per process that registered it (same ids): identical rows
    are one. Two processes may number their domains alike and register different schemas
    under one (domain, schema) id: such a schema is ambiguous and has no layout.
    """

    def __init__(
        self,
        schemas: pl.DataFrame,
        entries: pl.DataFrame,
        enums: pl.DataFrame | None = None,
        enum_entries: pl.DataFrame | None = None,
    ) -> None:
        self._schemas = _rows(schemas, ("domainId", "schemaId"))
        self._entries: dict[tuple[int, int], list[dict] | None] = {}
        for key, rows in _grouped(entries, ("domainId", "schemaId"), "idx").items():
            self._entries[key] = rows
        self._enums: dict[tuple[int, int], tuple[int, dict[int, str]] | None] = {}
        sizes = _rows(enums if enums is not None else pl.DataFrame(), ("domainId", "schemaId"))
        labels = _grouped(
            enum_entries if enum_entries is not None else pl.DataFrame(),
            ("domainId", "schemaId"),
            "idx",
        )
        for key, row in sizes.items():
            rows = labels.get(key, [])
            if row is None or rows is None:
                self._enums[key] = None
                continue
            # an enum entry's value NULL is 0 (NCCL's "Sum")
            self._enums[key] = (
                int(row.get("size") or 4),
                {int(r.get("value") or 0): str(r.get("name") or "") for r in rows},
            )
        self._layouts: dict[tuple[tuple[int, int], int], Layout | None] = {}

    @classmethod
    def read(cls, reader: Reader) -> PayloadSchemas:
        """The schemas of ``reader``'s export (none when it declares none)."""
        frames = [
            reader.small_table(t, cols, text=("name", "description"))
            for t, cols in SCHEMA_COLUMNS.items()
        ]
        return cls(*frames)

    def layout(self, domain_id: int, schema_id: int) -> Layout | None:
        """The layout of one schema, or None (unknown, ambiguous, a union, nested deeper than
        :data:`MAX_DEPTH` or in a cycle, more than :data:`MAX_FIELDS` values)."""
        return self._layout((int(domain_id), int(schema_id)), depth=0)

    def _layout(self, key: tuple[int, int], depth: int) -> Layout | None:
        """Each schema is built once per nesting depth (a schema nested many times costs one
        build; a cycle ends at :data:`MAX_DEPTH`)."""
        if (key, depth) not in self._layouts:
            self._layouts[key, depth] = self._build(key, depth)
        return self._layouts[key, depth]

    def find(self, name: str | None = None, *, entry: str | None = None) -> list[Layout]:
        """Layouts of the schemas named ``name`` and/or holding an entry named ``entry``."""
        found = []
        for key in sorted(k for k, v in self._entries.items() if v is not None):
            schema = self._schemas.get(key)
            if name is not None and (schema is None or schema.get("name") != name):
                continue
            rows = self._entries[key] or []
            if entry is not None and not any(r.get("name") == entry for r in rows):
                continue
            layout = self.layout(*key)
            if layout is not None:
                found.append(layout)
        return found

    def _build(self, key: tuple[int, int], depth: int) -> Layout | None:
        rows = self._entries.get(key)
        schema = self._schemas.get(key, {})
        if rows is None or schema is None or depth > MAX_DEPTH:
            return None
        if int(schema.get("type") or SCHEMA_STATIC) not in (SCHEMA_STATIC, SCHEMA_DYNAMIC):
            return None  # unions: which member holds the value is not read
        pack = int(schema.get("alignTo") or 0)
        items: list[Field | Array] = []
        cursor: int | None = 0  # where the next entry starts, when the schema alone says
        by_index = {int(r["idx"]): r for r in rows}
        values = 0
        for row in rows:
            entry = self._entry(key[0], row, by_index, depth)
            values += len(entry.fields) if isinstance(entry, Array | _Struct) else 1
            if entry is None or values > MAX_FIELDS:
                return None
            align = min(entry.align, pack) if pack else entry.align
            offset = row.get("offset")
            if offset is not None:
                offset = int(offset)
                if not 0 <= offset <= MAX_OFFSET:
                    return None
            elif cursor is not None:
                offset = round_up(cursor, align)
            if isinstance(entry, _Struct):  # a nested struct: its values, flattened
                if offset is None:
                    return None  # (after a variable-length array: not read)
                items += [replace(f, offset=offset + f.offset) for f in entry.fields]
                cursor = offset + entry.size
                continue
            items.append(replace(entry, offset=offset))
            known = offset is not None and not (isinstance(entry, Array) and entry.length is None)
            cursor = offset + _size_of(entry) if known else None  # type: ignore[operator]
        return Layout(key[0], key[1], str(schema.get("name") or ""), tuple(items), pack)

    def _entry(
        self, domain: int, row: dict, by_index: dict, depth: int
    ) -> Field | Array | _Struct | None:
        """One entry (offset still unset), or None when it cannot be read."""
        name = str(row.get("name") or f"entry {row['idx']}")
        flags, kind = int(row.get("flags") or 0), int(row.get("type") or 0)
        array = (flags >> 4) & 7
        fields = self._fields(domain, kind, flags, depth)
        if fields is None:
            return None
        if not array:
            if len(fields) == 1 and not fields[0].name:
                return replace(fields[0], name=name)
            return _Struct(
                tuple(replace(f, name=f"{name}.{f.name}") for f in fields),
                self._struct_size(domain, kind, fields),
                max(f.align for f in fields),
            )
        # an array's elements: a scalar is named for the array, a struct's fields for theirs
        fields = [replace(f, name=f.name or name) for f in fields]
        size = self._struct_size(domain, kind, fields)
        align = max(f.align for f in fields)
        detail = row.get("arrayOrUnionDetail")
        if array == ARRAY_FIXED_SIZE and detail is not None:
            return Array(name, None, size, align, tuple(fields), length=int(detail))
        if array == ARRAY_LENGTH_INDEX and detail is not None:
            source = by_index.get(int(detail))
            if source is None or int(source.get("type") or 0) not in SCALAR_TYPES:
                return None
            length_field = str(source.get("name") or f"entry {source['idx']}")
            return Array(name, None, size, align, tuple(fields), length_field=length_field)
        if array == ARRAY_ZERO_TERMINATED:
            return Array(name, None, size, align, tuple(fields), zero_terminated=True)
        return None  # a length in another payload of the event: not read

    def _fields(self, domain: int, kind: int, flags: int, depth: int) -> list[Field] | None:
        """The values of one entry of type ``kind``, offsets from the entry's start: one
        (unnamed) for a scalar, enum or string handle, a nested struct's fields flattened."""
        if flags & FLAG_POINTER:  # an address in the profiled process
            return [Field("", 0, 8, pl.UInt64())]
        if kind in SCALAR_TYPES:
            size, dtype = SCALAR_TYPES[kind]
            return [Field("", 0, size, dtype)]
        if kind == STRING_HANDLE:
            return [Field("", 0, 8, pl.UInt64(), string=True)]
        if kind < SCHEMA_ID_STATIC_START:
            return None  # C strings, union selectors, types of a later NVTX: size unknown
        enum = self._enums.get((domain, kind), False)
        if enum is None:
            return None  # declared twice, differently
        if enum is not False:
            size, labels = enum
            dtype = {1: pl.UInt8(), 2: pl.UInt16(), 4: pl.UInt32(), 8: pl.UInt64()}.get(size)
            return [Field("", 0, size, dtype, labels=labels)] if dtype is not None else None
        nested = self._layout((domain, kind), depth + 1)
        if nested is None or not nested.fixed or nested.arrays:
            return None  # (arrays inside a struct or an element are not read)
        return list(nested.fields)

    def _struct_size(self, domain: int, kind: int, fields: list[Field]) -> int:
        """Bytes of one element: the schema's static size when declared, else its fields'
        extent rounded up to their alignment."""
        schema = self._schemas.get((domain, kind))
        declared = schema.get("payloadSize") if schema else None
        end = max(f.offset + f.size for f in fields)
        computed = round_up(end, max(f.align for f in fields))
        size = max(int(declared), end) if declared is not None else computed
        return min(size, MAX_OFFSET + 1)  # (an element that big fits no payload read)


@dataclass(frozen=True)
class _Struct:
    """A nested struct entry that is not an array: its fields, offsets from its start."""

    fields: tuple[Field, ...]
    size: int
    align: int


def _rows(frame: pl.DataFrame, key: tuple[str, ...]) -> dict[tuple[int, int], dict | None]:
    """Distinct rows by key; a key with two different rows maps to None (ambiguous)."""
    if frame.is_empty() or not set(key) <= set(frame.columns):
        return {}
    out: dict[tuple[int, int], dict | None] = {}
    for row in frame.unique(maintain_order=True).iter_rows(named=True):
        if any(row[k] is None for k in key):
            continue
        k = (int(row[key[0]]), int(row[key[1]]))
        out[k] = row if k not in out else None
    return out


def _grouped(frame: pl.DataFrame, key: tuple[str, ...], idx: str) -> dict:
    """Rows by key, sorted by ``idx``; None where one index has two different rows."""
    if frame.is_empty() or not {*key, idx} <= set(frame.columns):
        return {}
    out: dict = {}
    for row in frame.unique(maintain_order=True).sort(idx).iter_rows(named=True):
        if any(row[k] is None for k in (*key, idx)):
            continue
        k = (int(row[key[0]]), int(row[key[1]]))
        rows = out.setdefault(k, [])
        if rows is None:
            continue
        if rows and int(rows[-1][idx]) == int(row[idx]):
            out[k] = None
        else:
            rows.append(row)
    return out


def _size_of(item: Field | Array) -> int:
    if isinstance(item, Field):
        return item.size
    return item.element_size * (item.length or 0)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align if align > 1 else n
