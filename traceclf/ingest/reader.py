"""How an export is read: :class:`Reader` runs SQL on it through connectorx into Arrow (no
Python row loop), translating each logical table's columns across nsys versions
(:mod:`traceclf.ingest.tables`), pushing time spans and rowid ranges into the SQL and
splitting big tables over several cores; the raw rows' buffers are handed back as soon as the
frames hold them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import connectorx as cx
import polars as pl

from traceclf.ingest.schema import BEING_WRITTEN, ExportInfo, changed_since, readonly_uri
from traceclf.ingest.tables import EVENT_TABLES, ROW_FILTERS, TABLES, TIMED, Col
from traceclf.ingest.utf8 import blob_sql, decode_text
from traceclf.support.cpus import cpu_share, in_worker
from traceclf.support.errors import TraceError
from traceclf.support.panics import panics_hidden

# Tables with more rows than this are read in rowid ranges on several cores (2x on 2 cores).
PARTITION_MIN_ROWS = 500_000


def _uri(path: Path) -> str:
    """connectorx URI that opens the export read-only and never creates a missing file.

    connectorx percent-decodes what follows ``sqlite://`` and opens it with SQLite's URI
    parsing on, so a (quoted) ``file:`` URI carries mode=ro&immutable=1 through. A plain path
    would be opened read-write, created empty if it vanished, and retried for 30 s on error.
    """
    return "sqlite://" + quote(readonly_uri(path), safe="")


Span = tuple[int, int]  # (start, end) ns on the session's timeline
# What a value of the wrong type reads as when a table is read ``checked``: INT64's minimum,
# never a time, id or size nsys writes; it becomes null after the read.
CHECKED_MISSING = -(1 << 63)


@dataclass
class _Columns:
    """How the columns of one read were selected: read as bytes (``{name: physical}``),
    type-checked, absent from the table, decoded after the read."""

    text: dict[str, str] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)
    missing: list[Col] = field(default_factory=list)
    decoded: list[Col] = field(default_factory=list)


class Reader:
    """Reads logical tables of one export, translating nsys-version differences."""

    def __init__(self, info: ExportInfo) -> None:
        self.info = info
        self.uri = _uri(info.path)
        # strings that were not UTF-8, by "TABLE.column": repaired with U+FFFD (ingest/utf8.py)
        self.repaired: dict[str, int] = {}
        # the process given to GPU rows of a table that names none (:meth:`_named_process`)
        self.pid_from_calls: int | None = None
        self._counting = threading.Lock()  # (host side and NCCL payloads: threads of their own)

    def sql(self, query: str | list[str]) -> pl.DataFrame:
        """Run a query (or several whose results are concatenated, read in parallel)."""
        try:
            with panics_hidden():  # (a failed read is the one-line error below, no panic)
                # (not connectorx's Arrow stream: it holds the GIL while it waits for each
                # batch, so a read on one thread stopped every other thread for its length)
                table = cx.read_sql(self.uri, query, return_type="arrow")
            if isinstance(query, list) and len(query) > 1:
                table = _in_start_order(table)
            return pl.from_arrow(table)  # type: ignore[return-value]
        except BaseException as e:  # connectorx surfaces SQLite corruption as Rust panics
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            if isinstance(e, MemoryError):
                raise TraceError(self.info.path, "out of memory while reading it") from None
            if changed_since(self.info):
                raise TraceError(self.info.path, BEING_WRITTEN) from None
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TraceError(self.info.path, f"corrupt or unreadable database ({detail})") from None

    def table_of(self, logical: str) -> str | None:
        """The physical table behind a logical one in this export, if any."""
        return next((t for t in TABLES[logical][0] if self.info.has(t)), None)

    @functools.cached_property
    def strings(self) -> pl.DataFrame:
        """StringIds: (id, value)."""
        if not self.info.has("StringIds"):
            return pl.DataFrame(schema={"id": pl.Int64, "value": pl.String})
        raw = self.sql(f"SELECT id, {blob_sql('value')} AS value FROM StringIds")
        return self.decoded(raw, "StringIds", {"value": "value"}).with_columns(
            pl.col("id").cast(pl.Int64)
        )

    def decoded(self, df: pl.DataFrame, table: str, columns: dict[str, str]) -> pl.DataFrame:
        """``df`` with each text column read as bytes (``{column: its physical name}``)
        decoded, the repaired strings counted under ``TABLE.column``."""
        out = []
        for name, source in columns.items():
            if name not in df.columns:
                continue
            text, repaired = decode_text(df[name])
            if repaired:
                key = f"{table}.{source}"
                with self._counting:
                    self.repaired[key] = self.repaired.get(key, 0) + repaired
            out.append(text)
        return df.with_columns(out) if out else df

    def read(
        self,
        logical: str,
        spans: Span | Sequence[Span] | None = None,
        where: str | None = None,
        *,
        rowids: Sequence[tuple[int, int]] | None = None,
        listed: Sequence[int] | None = None,
        rowid: bool = False,
        limit: int | None = None,
    ) -> pl.DataFrame:
        """The rows of ``logical`` overlapping ``spans`` (one time span or several), with
        ``where``; only those in the rowid ranges ``(after, upto]`` of ``rowids`` when given,
        or only the rows ``listed`` by rowid (sorted); with their rowid as ``_rowid`` when
        ``rowid``; at most ``limit`` rows from each of the queries the read is split in (a cap
        checked on what came back, with no count first)."""
        cols = TABLES[logical][1]
        if rowid:
            cols = (*cols, Col("_rowid", ("rowid",)))
        table = self.table_of(logical)
        if table is None:
            return empty_frame(cols)
        present = frozenset(self.info.columns[table])
        if logical in EVENT_TABLES and logical != "api":
            cols = self._named_process(cols, table, present)
        clauses = [where] if where else []
        if logical in ROW_FILTERS:
            column, condition, comes_with = ROW_FILTERS[logical]
            if column in present and self.info.has(comes_with):
                clauses.append(condition)
        if spans is not None and logical in TIMED:
            end = '"end"' if "end" in present else "start"
            # (first: SQLite tests the terms in the order given, and the spans of analysed
            # steps reject most rows of a long capture; the OS runtime calls' thread test
            # first took 2.7 s of a 4.3 GB capture's scan, the spans first 2.0 s)
            clauses.insert(0, overlap_clause(spans, end))
        try:
            df, columns = self._select(table, cols, present, clauses, rowids, limit, listed)
        except TraceError:
            # A value of another type than the column's (a TEXT or REAL time, as a damaged or
            # hand-edited export holds) fails the whole read: read again with every value
            # type-checked in SQL, the odd ones read as missing. Honest exports never pay
            # for the checks (~0.1 us a row).
            df, columns = self._select(
                table, cols, present, clauses, rowids, limit, listed, checked=True
            )
        if df.is_empty():
            return empty_frame(cols)
        df = (
            self.decoded(df, table, columns.text)
            .with_columns(
                *[
                    pl.when(pl.col(c) != CHECKED_MISSING).then(pl.col(c)).alias(c)
                    for c in columns.checked
                ],
                *[pl.lit(None, dtype=c.dtype).alias(c.name) for c in columns.missing],
                *[decode_pid(c.decode_from).alias(c.name) for c in columns.decoded],  # type: ignore[arg-type]
            )
            .select([_typed(c) for c in cols])
        )
        df = _contiguous(_nulls_unwritten(df))
        if df.height >= PARTITION_MIN_ROWS:  # the batches are no longer referenced: a big
            release_read_buffers()  # read's go back now (a trim walks the heap: not per read)
        return df

    def _select(
        self,
        table: str,
        cols: tuple[Col, ...],
        present: frozenset[str],
        clauses: list[str],
        rowids: Sequence[tuple[int, int]] | None,
        limit: int | None = None,
        listed: Sequence[int] | None = None,
        *,
        checked: bool = False,
    ) -> tuple[pl.DataFrame, _Columns]:
        """Read ``cols`` of ``table`` where ``clauses`` hold; with ``checked`` every integer
        column's value passes ``typeof()`` first (:data:`CHECKED_MISSING` where it fails)."""
        columns = _Columns()
        select = []
        for col in cols:
            if col.decode_from is not None:
                columns.decoded.append(col)
                continue
            expr = col.sql(present) if col.sql else None
            src = next((s for s in col.sources if s in present or s == "rowid"), None)
            if expr is not None:
                select.append(
                    f"CAST({expr} AS INTEGER) AS {col.name}" if checked else f"{expr} AS {col.name}"
                )
            elif src is not None and col.sql is None and col.dtype == pl.String:
                select.append(f"{blob_sql(src)} AS {col.name}")
                columns.text[col.name] = src
            elif src is not None and col.sql is None and checked and src != "rowid":
                # (a whole number stored as REAL, as a table written back by pandas holds
                # it, is that integer; below 2^53 a double holds every integer exactly)
                select.append(
                    f'iif(typeof("{src}") = \'integer\', "{src}", '
                    f'iif(typeof("{src}") = \'real\' AND abs("{src}") < 9007199254740992 '
                    f'AND "{src}" = CAST("{src}" AS INTEGER), CAST("{src}" AS INTEGER), '
                    f"{CHECKED_MISSING})) AS {col.name}"
                )
                columns.checked.append(col.name)
            elif src is not None and col.sql is None:
                select.append(f'"{src}" AS {col.name}')
            elif col.required:
                raise TraceError(
                    self.info.path,
                    f"table {table} lacks column {col.sources[0]!r} "
                    f"(schema {self.info.schema_version or 'unknown'})",
                )
            else:
                columns.missing.append(col)
        query = f"SELECT {', '.join(select)} FROM {table}"
        if listed is not None:
            queries = in_list(query, listed, clauses)
        elif rowids is not None:
            queries = in_ranges(query, rowids, clauses)
        else:
            queries = self.partitioned(query, table, clauses)
        if limit is not None:
            tail = f" LIMIT {int(limit)}"
            queries = queries + tail if isinstance(queries, str) else [q + tail for q in queries]
        return (self.sql(queries) if queries else pl.DataFrame()), columns

    def _named_process(
        self, cols: tuple[Col, ...], table: str, present: frozenset[str]
    ) -> tuple[Col, ...]:
        """``cols`` of a GPU table, its process column given the one process that the
        export's CUDA calls name where the table has no process column at all, or one whose
        first row is null (an export trimmed by hand or rewritten by another tool): CUDA calls
        launch every kernel and copy, so those of a process that is alone in making them are
        its. Else ``cols`` as they are (several processes, or no calls: the rows that name no
        process are left out)."""
        pid = next((c for c in cols if c.name == "pid"), None)
        if pid is None or pid.sql is None:
            return cols
        # (the calls' process last: finding that no second one exists scans every call)
        named = pid.sql(present)
        if named is not None and not self._first_pid_null(
            table, next(c for c in pid.sources if c in present)
        ):
            return cols
        if self._calls_process is None:
            return cols
        # a column a tool left null (every row, as its first): the rows that name a process
        # keep it; those that name none are the calls' process's
        sql = (
            str(self._calls_process)
            if named is None
            else f"coalesce(nullif({named}, -1), {self._calls_process})"
        )
        self.pid_from_calls = self._calls_process
        given = Col("pid", (), pl.Int32, sql=lambda _present: sql)
        return tuple(given if c is pid else c for c in cols)

    @functools.cache  # noqa: B019 (one reader per export, a handful of tables)
    def _first_pid_null(self, table: str, column: str) -> bool:
        """Whether the first row of ``table`` names no process (one row read, not a scan)."""
        first = self.sql(f'SELECT "{column}" IS NULL AS null_pid FROM {table} LIMIT 1')
        return bool(first.height and first["null_pid"][0])

    @functools.cached_property
    def _calls_process(self) -> int | None:
        """The process of the export's CUDA calls where they name one and only one."""
        api = self.table_of("api")
        pid = self.pid_sql("api")
        if api is None or pid is None:
            return None
        found = self.sql(
            f"SELECT pid FROM (SELECT DISTINCT {pid} AS pid FROM {api} WHERE {pid} >= 0 LIMIT 2)"
        )
        return int(found["pid"][0]) if found.height == 1 else None

    @functools.cache  # noqa: B019 (one reader per export, a handful of tables)
    def _rowids(self, table: str) -> tuple[int, int]:
        """``(first - 1, last)`` rowid of the table (``(0, 0)`` when empty): SQLite reads both
        off the B-tree's edges, one aggregate per subquery. No query returns more rows."""
        lo, hi = self.sql(
            f"SELECT coalesce((SELECT min(rowid) FROM {table}), 1) - 1 AS lo, "
            f"coalesce((SELECT max(rowid) FROM {table}), 0) AS hi"
        ).row(0)
        return int(lo), int(hi)

    def pid_sql(self, logical: str) -> str | None:
        """SQL expression of a row's process id in ``logical``'s table, if it has one."""
        table = self.table_of(logical)
        if table is None:
            return None
        cols, present = TABLES[logical][1], frozenset(self.info.columns[table])
        if logical in EVENT_TABLES and logical != "api":
            cols = self._named_process(cols, table, present)
        col = next((c for c in cols if c.name == "pid"), None)
        return None if col is None or col.sql is None else col.sql(present)

    def empty(self, logical: str) -> pl.DataFrame:
        """A frame with ``logical``'s columns and no rows."""
        return empty_frame(TABLES[logical][1])

    def partitioned(self, select: str, table: str, clauses: list[str]) -> str | list[str]:
        """``select`` with ``clauses``, split into rowid ranges that connectorx reads on
        several cores when the table is big (SQLite finds min and max rowid without a scan)."""
        parts = cpu_share()
        if parts > 1:
            first, last = self._rowids(table)
            parts = parts if last - first >= PARTITION_MIN_ROWS else 1
        if parts == 1:
            return select + "".join(
                f" {'WHERE' if i == 0 else 'AND'} ({c})" for i, c in enumerate(clauses)
            )
        # rowids start at min(rowid), which may be 0 or negative: those rows are events too
        cuts = [first + (last - first) * i // parts for i in range(parts + 1)]
        return in_ranges(select, list(itertools.pairwise(cuts)), clauses, split=False)

    def small_table(
        self, table: str, columns: Iterable[str], text: Iterable[str] = ()
    ) -> pl.DataFrame:
        """Those of ``columns`` that a small metadata table (GPU info, processes) has, or an
        empty frame. Only named columns: connectorx fails on an all-NULL column it cannot
        type, and newer exports may add such columns anywhere. The ``text`` ones are read as
        bytes and decoded (:mod:`traceclf.ingest.utf8`)."""
        present = [c for c in dict.fromkeys(columns) if c in self.info.columns.get(table, ())]
        if not present:
            return pl.DataFrame()
        text = {c: c for c in text if c in present}
        select = ", ".join(f'{blob_sql(c)} AS "{c}"' if c in text else f'"{c}"' for c in present)
        return self.decoded(self.sql(f"SELECT {select} FROM {table}"), table, text)


def _in_start_order(table):
    """The record batches of several queries read in parallel, in the order of their first
    ``start``: connectorx interleaves the batches of the queries, so a table that nsys wrote in
    start order would come back out of order and be sorted row by row (a copy of every
    column). Batches are moved, not rows: a table that is not in start order stays so."""
    if "start" not in table.column_names:
        return table
    import pyarrow as pa

    batches = [b for b in table.to_batches() if b.num_rows]
    first = [b.column("start")[0].as_py() for b in batches]
    if None in first:
        return table
    order = sorted(range(len(batches)), key=first.__getitem__)
    return pa.Table.from_batches([batches[i] for i in order], schema=table.schema)


def overlap_clause(spans: Span | Sequence[Span], end: str = '"end"') -> str:
    """SQL: the row overlaps one of ``spans`` (or the one span): ``start < hi AND end > lo``
    for one of them.

    A filtered scan tests every row of a table, so the test is a search, not a list: the spans
    sorted and those that overlap merged, the row's start finds by halving the first span
    that ends after it (nested CASEs, which SQLite evaluates lazily), and the row overlaps
    one iff it starts before the last span ends and ends after that span's start (the CASEs'
    value: one comparison of the end, not both ends tested at the leaf). Testing sixteen
    spans one by one cost SQLite four times a scan's reading; on the 4.3 GB benchmark
    capture's OS runtime table (9.3 M rows, sixteen spans) a scan testing the start alone
    takes 0.8 s, the search with both ends tested at its leaves 2.1 s, this one 1.9 s."""
    listed = [spans] if isinstance(spans[0], int) else list(spans)  # type: ignore[list-item]
    pairs = sorted((int(lo), int(hi)) for lo, hi in listed)  # type: ignore[misc]
    if any(hi < lo for lo, hi in pairs):  # (no search over spans that end before they start)
        return " OR ".join(f"(start < {hi} AND {end} > {lo})" for lo, hi in pairs)
    merged: list[list[int]] = []
    for lo, hi in pairs:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if not merged:
        return "0"

    def start_of_first_after(i: int, j: int) -> str:  # that span's start among merged[i:j]
        if j - i == 1:
            return str(merged[i][0])
        m = (i + j) // 2
        return (
            f"CASE WHEN start < {merged[m - 1][1]} THEN {start_of_first_after(i, m)} "
            f"ELSE {start_of_first_after(m, j)} END"
        )

    return f"start < {merged[-1][1]} AND {end} > {start_of_first_after(0, len(merged))}"


def in_ranges(
    select: str, ranges: Sequence[tuple[int, int]], clauses: list[str], split: bool = True
) -> list[str]:
    """One query per rowid range ``(after, upto]``; with ``split`` a range bigger than
    :data:`PARTITION_MIN_ROWS` is cut in parts so that the cores share it."""
    parts = cpu_share() if split else 1
    pieces: list[tuple[int, int]] = []
    for after, upto in ranges:
        n = 1 if upto - after < PARTITION_MIN_ROWS // 2 else parts
        pieces += [
            (after + (upto - after) * i // n, after + (upto - after) * (i + 1) // n)
            for i in range(n)
        ]
    return [
        select
        + " WHERE "
        + " AND ".join([f"rowid > {int(lo)} AND rowid <= {int(hi)}", *(f"({c})" for c in clauses)])
        for lo, hi in pieces
        if hi > lo
    ]


def in_list(select: str, rowids: Sequence[int], clauses: list[str]) -> list[str]:
    """Queries for the rows ``rowids`` (sorted), one B-tree seek each: in as many lists as
    there are cores where they are many. Never beside a rowid range, which SQLite prefers to
    a list of thousands and scans: pass 1 read 3.5 k NVTX rows of a 4.3 GB export in
    0.35-0.45 s that way, in 0.02 s by the list alone."""
    parts = cpu_share() if len(rowids) >= PARTITION_MIN_ROWS // 10 else 1
    cuts = [len(rowids) * i // parts for i in range(parts + 1)]
    return [
        select + " WHERE " + " AND ".join([rowid_in(rowids[a:b]), *(f"({c})" for c in clauses)])
        for a, b in itertools.pairwise(cuts)
        if b > a
    ]


def rowid_in(rowids: Sequence[int]) -> str:
    """SQL that holds for the rows ``rowids`` (for none: never)."""
    return f"rowid IN ({', '.join(str(int(r)) for r in rowids)})" if rowids else "0"


def _contiguous(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` in one chunk per column, so that its Arrow record batches can be freed.

    The frame over connectorx's batches is a zero-copy view of their chunks (64 k rows each);
    the first frame-wide operation (adding the name column) would copy it into one chunk
    anyway.
    Copying here, table by table, lets the batches go before the next table is read and before
    the names are looked up: at 1 GB of export, ~400 MB less at the peak of loading."""
    return df.rechunk() if max(df.n_chunks("all"), default=1) > 1 else df


def _nulls_unwritten(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with each column that holds no value (a kernel table's graph ids when nothing ran
    in a CUDA graph) made anew: a fresh null column's zeroed pages are never written, so never
    resident, where the read's are (~80 MB for two such columns at 1 GB of export)."""
    if df.height < PARTITION_MIN_ROWS:
        return df
    empty = [c for c in df.columns if df[c].null_count() == df.height]
    if not empty:
        return df
    return df.with_columns(
        pl.repeat(None, df.height, dtype=df.schema[c], eager=True).alias(c) for c in empty
    )


def _typed(col: Col) -> pl.Expr:
    expr = pl.col(col.name)
    if col.null_as is not None and col.decode_from is None:  # a decoded one has real nulls
        expr = pl.when(expr != col.null_as).then(expr)
    return expr.cast(col.dtype, strict=False).alias(col.name)


def empty_frame(cols: tuple[Col, ...]) -> pl.DataFrame:
    return pl.DataFrame(schema={c.name: c.dtype for c in cols})


def decode_pid(col: str) -> pl.Expr:
    """Process id from a serialized globalPid/globalTid: bits 24..47."""
    return ((pl.col(col) // (1 << 24)) % (1 << 24)).cast(pl.Int64)


def release_read_buffers() -> None:
    """Hand the pages of the raw rows back to the system. connectorx's Arrow buffers live on
    the C heap, and freeing them after their conversion leaves them resident beside polars'
    own memory until the heap is trimmed: at 1 GB of export, some 300 MB of peak memory for
    nothing (glibc only; elsewhere a no-op).

    A ``--jobs`` worker keeps them: its next export's reads reuse those pages, where trimmed
    ones are mapped and zeroed afresh (8 exports of 128 MB on 2 workers: a third fewer page
    faults, ~100 MB more at a worker's peak)."""
    if not sys.platform.startswith("linux") or in_worker():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
