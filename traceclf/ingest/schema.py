"""Recognise an Nsight Systems SQLite export and describe what it holds.

Everything here is cheap (file header, ``sqlite_master``, metadata rows): it runs before any
event table is read, so bad input is rejected in milliseconds with a message naming the problem.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from traceclf.support.errors import NoGpuWork, TraceError
from traceclf.support.owned import read_head

SQLITE_MAGIC = b"SQLite format 3\x00"
SQLITE_HEADER_BYTES = 100
# Tables whose rows are GPU work; an export without any of them cannot be analysed.
GPU_ACTIVITY_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
)
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
# Exports up to this size are checked for damaged pages before the loader starts (~0.25 s).
PAGE_CHECK_MAX_BYTES = 64 << 20
# Names of the tables traceclf reads (nsys writes them as tables). A view under one of these
# names would run SQL stored in the file (a recursive one never ends): refused, not ignored.
READ_TABLE_PREFIXES = (
    "CUPTI_ACTIVITY_KIND_",
    "NVTX_EVENTS",
    "TARGET_INFO_",
    "GPU_METRICS",
    "META_DATA_",
    "EXPORT_META_DATA",
    "StringIds",
    "PROCESSES",
    "CUDA_GPU_MEMORY_USAGE_EVENTS",
    "PROFILER_OVERHEAD",
    "NVTX_PAYLOAD_",
    "OSRT_",
    "COMPOSITE_EVENTS",
    "SAMPLING_CALLCHAINS",
    "SCHED_EVENTS",
    "DIAGNOSTIC_EVENT",
    "ENUM_",
    "ThreadNames",
)
HOT_JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")
WAL_HEADER_BYTES = 32
# An export that changes while it is read is being written (nsys export, a copy in progress)
# or was replaced: its bytes are half old, half new, which is not damage.
BEING_WRITTEN = (
    "changed while traceclf read it: it is still being written (or was replaced); wait for "
    "the writer to finish, then retry"
)
# How long a file that failed to read is watched for a writer still growing it.
SETTLE_S = 0.25


@dataclass(frozen=True)
class ExportInfo:
    """What an export is: versions, tables and their columns."""

    path: Path
    nsys_version: str | None
    schema_version: str | None
    columns: dict[str, tuple[str, ...]] = field(repr=False)
    # (size, mtime ns) when inspected: a read that fails on a file that changed since then
    # reports a writer, not damage
    identity: tuple[int, int] | None = None

    def has(self, table: str) -> bool:
        return table in self.columns

    @property
    def tables(self) -> frozenset[str]:
        return frozenset(self.columns)


def text_as_utf8(raw: bytes) -> str:
    """sqlite3's text factory for exports: nsys stores bytes in TEXT columns unchecked (see
    :mod:`traceclf.ingest.utf8`), so a bad byte becomes U+FFFD instead of an error."""
    return raw.decode("utf-8", "replace")


def connect_readonly(path: Path, **kwargs) -> sqlite3.Connection:
    """A read-only, immutable sqlite3 connection to the export (raises sqlite3.Error)."""
    con = sqlite3.connect(readonly_uri(path), uri=True, **kwargs)
    con.text_factory = text_as_utf8
    return con


def readonly_uri(path: Path) -> str:
    """SQLite URI that can neither write the file nor create journal/lock files beside it.

    The path is quoted as bytes: a file name that is not UTF-8 (its bytes kept as surrogates
    by Python) reaches SQLite as the same bytes. ``immutable=1`` ignores journals and WAL
    files, so :func:`check_sqlite_file` first refuses an export that has live ones."""
    return f"file:{quote(os.fsencode(path.resolve()))}?mode=ro&immutable=1"


def is_sqlite_file(path: Path) -> bool:
    """Whether ``path`` is a regular file starting with SQLite's magic string, whatever its
    name."""
    return read_head(path, len(SQLITE_MAGIC)) == SQLITE_MAGIC


def file_identity(path: Path) -> tuple[int, int] | None:
    """(size, mtime ns) of ``path``; None when it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def changed_since(info: ExportInfo) -> bool:
    """Whether the export changed since it was inspected, or still changes (a writer growing
    it): then a failed read is a file being written, not a damaged one."""
    return _changing(info.path, info.identity)


def _changing(path: Path, before: tuple[int, int] | None) -> bool:
    if before is None:
        return False
    if file_identity(path) != before:
        return True
    time.sleep(SETTLE_S)
    return file_identity(path) != before


def check_sqlite_file(path: Path) -> None:
    """Reject missing, empty, non-SQLite and truncated files from the header alone."""
    if not path.exists():
        raise TraceError(path, "no such file")
    if not path.is_file():
        raise TraceError(path, "not a regular file")
    try:
        st = path.stat()
        size = st.st_size
        with path.open("rb") as f:
            header = f.read(SQLITE_HEADER_BYTES)
    except OSError as e:
        raise TraceError(path, f"cannot read file: {e.strerror or e}") from None
    try:
        _check_header(path, size, header)
    except TraceError:
        if _changing(path, (size, st.st_mtime_ns)):
            raise TraceError(path, BEING_WRITTEN) from None
        raise
    _check_not_being_written(path, wal_mode=2 in header[18:20])


def _check_header(path: Path, size: int, header: bytes) -> None:
    if size == 0:
        raise TraceError(path, "empty file")
    if not header.startswith(SQLITE_MAGIC):
        raise TraceError(
            path,
            "not an SQLite database (expected an Nsight Systems export: "
            "nsys export --type sqlite REPORT.nsys-rep)",
        )
    if len(header) < SQLITE_HEADER_BYTES:
        raise TraceError(path, f"truncated SQLite database ({size} bytes, header incomplete)")
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        raise TraceError(path, f"corrupt SQLite database (invalid page size {page_size} in header)")
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


def _check_not_being_written(path: Path, *, wal_mode: bool) -> None:
    """Refuse an export whose latest content is not in the file itself: read immutably (as
    traceclf does, to never write beside an input) it would look unchanged or corrupt.

    - WAL mode with a non-empty ``-wal`` file: committed changes not yet checkpointed (a
      writer is open, or did not close cleanly);
    - a hot ``-journal`` (it starts with the journal magic): a write is in progress or was
      interrupted, so pages in the file may be half-written.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        wal_bytes = wal.stat().st_size if wal_mode else 0
    except OSError:
        wal_bytes = 0
    if wal_bytes > WAL_HEADER_BYTES:
        raise TraceError(
            path,
            f"WAL-mode export whose latest changes are still in {wal.name} ({wal_bytes} bytes): "
            "a writer is open or did not close; close it, or checkpoint with "
            f"sqlite3 {path.name} 'PRAGMA wal_checkpoint(TRUNCATE)', then retry",
        )
    journal = path.with_name(path.name + "-journal")
    # (a FIFO there is no journal, and opening it normally would wait for a writer forever)
    if read_head(journal, len(HOT_JOURNAL_MAGIC)) == HOT_JOURNAL_MAGIC:
        raise TraceError(
            path,
            f"being written ({journal.name} is a hot journal: a write is in progress or was "
            "interrupted); wait for the writer, or open it once with sqlite3 to roll the "
            "interrupted write back, then retry",
        )


def inspect_export(path: Path, *, check_pages: bool = True) -> ExportInfo:
    """Validate ``path`` as an nsys export and return its versions and table columns.

    ``check_pages`` also looks for damaged pages (see :func:`_check_pages`); the loader skips
    it because reading the tables finds them anyway.
    """
    check_sqlite_file(path)
    identity = file_identity(path)
    try:
        con = connect_readonly(path)
    except sqlite3.Error as e:
        raise TraceError(path, f"cannot open SQLite database: {e}") from None
    try:
        _check_views(path, con)
        columns = _table_columns(con)
        meta = _export_meta(con, columns)
        # quick_check runs as one VDBE opcode, so no progress handler can cut it short: only
        # files it reads in well under a second (~4 ms/MB) are checked up front.
        if check_pages and path.stat().st_size <= PAGE_CHECK_MAX_BYTES:
            _check_pages(con)
        issued = _issued_gpu_work(con, columns)
    # Garbage where a table name or metadata text should be fails UTF-8 decoding, not SQLite.
    except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
        if _changing(path, identity):
            raise TraceError(path, BEING_WRITTEN) from None
        raise TraceError(path, f"corrupt SQLite database ({e})") from None
    finally:
        con.close()
    if not _written_by_nsys(columns):  # (among several inputs, left out: another tool's file)
        raise NoGpuWork(
            path,
            "SQLite database, but not an Nsight Systems export (none of the tables nsys "
            "writes: its metadata, CUPTI activity or string tables)",
        )
    if not any(t in columns for t in GPU_ACTIVITY_TABLES):
        raise NoGpuWork(path, _no_gpu_activity(columns, issued))
    return ExportInfo(
        path=path,
        nsys_version=meta.get("EXPORT_PRODUCT_VERSION"),
        schema_version=_schema_version(meta),
        columns=columns,
        identity=identity,
    )


# Tables every nsys export has, with or without metadata (an export of a capture that recorded
# nothing, or one written by a wrapper such as the nsys_cli package, may lack META_DATA_*).
NSYS_TABLES = ("StringIds", "ThreadNames", "TARGET_INFO_GPU", "ANALYSIS_DETAILS")


def _written_by_nsys(columns: dict[str, tuple[str, ...]]) -> bool:
    """Whether the tables are an nsys export's: its metadata, activity tables, or its string
    table beside another table nsys always writes."""
    return (
        any(t in columns for t in META_TABLES)
        or any(t.startswith("CUPTI_ACTIVITY_KIND_") for t in columns)
        or ("StringIds" in columns and any(t in columns for t in NSYS_TABLES[1:]))
    )


def _issued_gpu_work(con: sqlite3.Connection, columns: dict[str, tuple[str, ...]]) -> bool:
    """Whether an export without GPU activity tables traced a CUDA call that issues GPU work
    (a launch, graph launches included, a copy, a memset). Asked only of such exports: a scan
    of the CUDA calls that stops at the first such call."""
    if (
        any(t in columns for t in GPU_ACTIVITY_TABLES)
        or "CUPTI_ACTIVITY_KIND_RUNTIME" not in columns
    ):
        return False
    readable = {"id", "value"} <= set(columns.get("StringIds", ()))
    if not readable or "nameId" not in columns["CUPTI_ACTIVITY_KIND_RUNTIME"]:
        return True  # (cannot tell: the message for lost records names what to check)
    issuing = (
        "SELECT 1 FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE nameId IN (SELECT id FROM StringIds "
        "WHERE value LIKE '%Launch%' OR value LIKE '%Memcpy%' OR value LIKE '%Memset%') LIMIT 1"
    )
    return con.execute(issuing).fetchone() is not None


def _no_gpu_activity(columns: dict[str, tuple[str, ...]], issued: bool) -> str:
    """Why an export holds no GPU activity, and what to do: CUDA calls traced that issued GPU
    work without the records of that work means the records were lost, not that tracing was
    off; CUDA calls that issued none mean the process gave the GPU nothing while traced."""
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in columns and not issued:
        return (
            "export has no GPU activity: the CUDA calls traced issued no kernel, copy or "
            "memset (the process gave the GPU no work while nsys traced it)"
        )
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in columns:
        return (
            "export has no GPU activity: CUDA API calls were traced but no kernel, CUDA graph "
            "or memcpy record reached the export (lost when a process ends before nsys "
            "collects its GPU records: let every process exit normally and profile again)"
        )
    return (
        "export has no GPU activity (no kernel, CUDA graph or memcpy tables; "
        "profile with CUDA tracing on: nsys profile -t cuda,nvtx)"
    )


def _check_views(path: Path, con: sqlite3.Connection) -> None:
    """Refuse a view named like a table traceclf reads. SQLite matches names whatever their
    case, so the names are compared case-blind: ``target_info_system_env`` is read for
    ``TARGET_INFO_SYSTEM_ENV``."""
    views = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='view'")]
    prefixes = tuple(p.casefold() for p in READ_TABLE_PREFIXES)
    shadow = next((v for v in views if str(v).casefold().startswith(prefixes)), None)
    if shadow is not None:
        raise TraceError(
            path,
            f"{shadow} is a view, not a table: traceclf reads the tables nsys writes and does "
            "not run SQL stored in an export (materialise it: CREATE TABLE ... AS SELECT)",
        )


def _table_columns(con: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    return {
        t: tuple(r[0] for r in con.execute("SELECT name FROM pragma_table_info(?)", (t,)))
        for t in names
    }


# The rows of the export's metadata that are read: versions only (nsys may add anything).
META_NAMES = (
    "EXPORT_PRODUCT_VERSION",
    "EXPORT_SCHEMA_VERSION",
    "EXPORT_SCHEMA_VERSION_MAJOR",
    "EXPORT_SCHEMA_VERSION_MINOR",
    "EXPORT_SCHEMA_VERSION_MICRO",
)


def _export_meta(con: sqlite3.Connection, columns: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The version rows (:data:`META_NAMES`) of META_DATA_EXPORT (nsys >= 2023) or
    EXPORT_META_DATA (older)."""
    table = next((t for t in META_TABLES if t in columns), None)
    if table is None or not {"name", "value"} <= set(columns[table]):
        return {}
    marks = ", ".join("?" * len(META_NAMES))
    rows = con.execute(f'SELECT name, value FROM "{table}" WHERE name IN ({marks})', META_NAMES)
    return {str(k): str(v) for k, v in rows}


def _schema_version(meta: dict[str, str]) -> str | None:
    if "EXPORT_SCHEMA_VERSION" in meta:
        return meta["EXPORT_SCHEMA_VERSION"]
    if "EXPORT_SCHEMA_VERSION_MAJOR" in meta:
        return ".".join(
            meta.get(f"EXPORT_SCHEMA_VERSION_{p}", "0") for p in ("MAJOR", "MINOR", "MICRO")
        )
    return None


def _check_pages(con: sqlite3.Connection) -> None:
    """Raise sqlite3.DatabaseError if a b-tree page is damaged.

    A damaged data page otherwise surfaces only when the loader reaches it, after the other
    files of a run were loaded for nothing. Bigger exports skip this; the loader reports
    damage when it reads it.
    """
    result = con.execute("PRAGMA quick_check(1)").fetchone()
    if result and result[0] != "ok":
        # First problem only, without quick_check's "*** in database main ***" banner.
        raise sqlite3.DatabaseError(str(result[0]).split("***")[-1].strip().splitlines()[0])
