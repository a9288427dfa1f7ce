"""Recognise an Nsight Systems SQLite export and describe what it holds.

Everything here is cheap (file header, ``sqlite_master``, metadata rows): it runs before any
event table is read, so bad input is rejected in milliseconds with a message naming the problem.
"""

from __future__ import annotations

import sqlite3
import struct
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from traceclf.errors import TraceError

SQLITE_MAGIC = b"SQLite format 3\x00"
# Tables whose rows are GPU work; an export without any of them cannot be analysed.
GPU_ACTIVITY_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
)
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")


@dataclass(frozen=True)
class ExportInfo:
    """What an export is: versions, tables and their columns."""

    path: Path
    nsys_version: str | None
    schema_version: str | None
    columns: dict[str, tuple[str, ...]] = field(repr=False)

    def has(self, table: str) -> bool:
        return table in self.columns

    @property
    def tables(self) -> frozenset[str]:
        return frozenset(self.columns)

    @property
    def schema_tuple(self) -> tuple[int, ...]:
        try:
            return tuple(int(p) for p in (self.schema_version or "").split("."))
        except ValueError:
            return ()


def readonly_uri(path: Path) -> str:
    """SQLite URI that can neither write the file nor create journal/lock files beside it."""
    return f"file:{quote(str(path.resolve()))}?mode=ro&immutable=1"


def check_sqlite_file(path: Path) -> None:
    """Reject missing, empty, non-SQLite and truncated files from the header alone."""
    if not path.exists():
        raise TraceError(path, "no such file")
    if not path.is_file():
        raise TraceError(path, "not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise TraceError(path, "empty file")
    with path.open("rb") as f:
        header = f.read(100)
    if not header.startswith(SQLITE_MAGIC):
        raise TraceError(
            path,
            "not an SQLite database (expected an Nsight Systems export: "
            "nsys export --type sqlite REPORT.nsys-rep)",
        )
    if len(header) < 100:
        raise TraceError(path, f"truncated SQLite database ({size} bytes, header incomplete)")
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    page_count, change_counter, valid_for = (
        struct.unpack(">I", header[28:32])[0],
        struct.unpack(">I", header[24:28])[0],
        struct.unpack(">I", header[92:96])[0],
    )
    # The in-header page count is only trustworthy when written by the same change (SQLite doc §1.3.7).
    if page_count and change_counter == valid_for and size < page_count * page_size:
        raise TraceError(
            path, f"truncated SQLite database ({size} of {page_count * page_size} bytes)"
        )


def inspect_export(path: Path) -> ExportInfo:
    """Validate ``path`` as an nsys export and return its versions and table columns."""
    check_sqlite_file(path)
    try:
        con = sqlite3.connect(readonly_uri(path), uri=True)
    except sqlite3.Error as e:
        raise TraceError(path, f"cannot open SQLite database: {e}") from None
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        columns = {
            t: tuple(r[1] for r in con.execute(f"PRAGMA table_info('{t}')")) for t in names
        }
        meta_table = next((t for t in META_TABLES if t in columns), None)
        meta: dict[str, str] = {}
        if meta_table:
            meta = dict(con.execute(f"SELECT name, value FROM {meta_table}").fetchall())
    except sqlite3.DatabaseError as e:
        raise TraceError(path, f"corrupt SQLite database ({e})") from None
    finally:
        con.close()
    if meta_table is None and not any(t.startswith("CUPTI_ACTIVITY_KIND_") for t in columns):
        raise TraceError(
            path, "SQLite database, but not an Nsight Systems export (no META_DATA_EXPORT table)"
        )
    if not any(t in columns for t in GPU_ACTIVITY_TABLES):
        raise TraceError(
            path,
            "export has no GPU activity (no kernel, CUDA graph or memcpy tables; "
            "profile with CUDA tracing on: nsys profile -t cuda,nvtx)",
        )
    schema = meta.get("EXPORT_SCHEMA_VERSION")
    if schema is None and "EXPORT_SCHEMA_VERSION_MAJOR" in meta:
        schema = ".".join(
            meta.get(f"EXPORT_SCHEMA_VERSION_{p}", "0") for p in ("MAJOR", "MINOR", "MICRO")
        )
    return ExportInfo(
        path=path,
        nsys_version=meta.get("EXPORT_PRODUCT_VERSION"),
        schema_version=schema,
        columns=columns,
    )
