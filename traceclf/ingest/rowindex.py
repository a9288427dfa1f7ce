"""Where a time range of an event table lies in its rowids, without reading the table.

nsys writes the rows of each event table in ``start`` order, so a binary search over rowids —
a few dozen B-tree lookups per boundary — turns a time range into a rowid range that SQLite
reads directly. The order is not taken on trust: a few hundred rows sampled evenly must be in
time order (``ordered``), and the rows read by rowid range are checked again once read
(:mod:`traceclf.pipeline.twopass`). A table that is not in start order is scanned once, its
times a block at a time, for the runs of rows that are (:class:`Pieces`: nsys writes out of
order by whole buffers); a time range is then a rowid range in each piece it meets. A table
shuffled finer than :data:`MAX_PIECES` pieces is read by a filtered scan on time instead.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sqlite3
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traceclf.ingest.schema import connect_readonly
from traceclf.support.cpus import cpu_share
from traceclf.support.errors import TraceError

# Evenly spaced samples per table: the order check, row-count estimates, and the brackets that
# each binary search starts from.
SAMPLES = 256


@contextlib.contextmanager
def connect(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection for many small lookups. Not memory-mapped: mapped pages of the
    export would count in the process's resident memory."""
    try:
        con = connect_readonly(path, check_same_thread=False)
    except sqlite3.Error as e:
        raise TraceError(path, f"cannot open SQLite database: {e}") from None
    try:
        con.execute("PRAGMA cache_size=-16384")  # 16 MiB: the B-tree's inner pages stay cached
        yield con
    except sqlite3.DatabaseError as e:
        raise TraceError(path, f"corrupt or unreadable database ({e})") from None
    finally:
        con.close()


@dataclass(frozen=True)
class RowIndex:
    """Samples of (rowid, time) of one table, from its first row to its last, and binary
    search between them through ``con`` (open for as long as the index is used)."""

    con: sqlite3.Connection = field(repr=False)
    table: str
    column: str
    rowids: np.ndarray  # int64, increasing; the first and the last rowid of the table included
    times: np.ndarray  # int64, the ``column`` value of each sampled row
    ordered: bool  # samples never go back in time: rowid ranges may stand for time ranges
    found: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, con: sqlite3.Connection, table: str, column: str = "start", samples: int = SAMPLES
    ) -> RowIndex | None:
        """Sample ``table``; None when it has no rows."""
        # Two subqueries: SQLite reads min() or max() of the rowid off the B-tree's edge only
        # when it is the query's sole aggregate; both at once would scan the table.
        first, last = con.execute(
            f"SELECT (SELECT min(rowid) FROM {table}), (SELECT max(rowid) FROM {table})"
        ).fetchone()
        if first is None:
            return None
        wanted = np.unique(np.linspace(first, last, num=min(samples, last - first + 1)).round())
        ids = ",".join(str(int(i)) for i in wanted)
        # rowid IN (...) is one B-tree seek per id; a rowid that does not exist is skipped.
        rows = con.execute(
            f'SELECT rowid, "{column}" FROM {table} WHERE rowid IN ({ids}) ORDER BY rowid'
        ).fetchall()
        rows = [(r, t) for r, t in rows if type(t) is int]  # (an odd value is no time)
        if not rows:
            return None
        rowids = np.array([r for r, _ in rows], dtype=np.int64)
        times = np.array([t for _, t in rows], dtype=np.int64)
        ordered = bool(np.all(np.diff(times) >= 0))
        return cls(con, table, column, rowids, times, ordered)

    @property
    def first(self) -> int:
        return int(self.rowids[0])

    @property
    def last(self) -> int:
        return int(self.rowids[-1])

    @property
    def rows(self) -> int:
        """Rows of the table (rowids are dense in nsys exports)."""
        return self.last - self.first + 1

    def first_from(self, t: int) -> int:
        """The first rowid whose time is ``t`` or later (``last + 1`` if none), by binary
        search between the samples that bracket ``t`` (remembered: steps ask again)."""
        if t not in self.found:
            self.found[t] = self._search(t)
        return self.found[t]

    def _search(self, t: int) -> int:
        i = int(np.searchsorted(self.times, t, side="left"))
        if i == 0:
            return self.first
        if i == len(self.times):
            return self.last + 1
        # the answer is in [lo, hi]; rows before lo are earlier than t, row hi is not
        lo, hi = int(self.rowids[i - 1]) + 1, int(self.rowids[i])
        t_lo, t_hi = int(self.times[i - 1]), int(self.times[i])
        query = (
            f'SELECT rowid, "{self.column}" FROM {self.table} '
            f"WHERE rowid >= ? AND typeof(\"{self.column}\") = 'integer' ORDER BY rowid LIMIT 1"
        )
        # Times grow about evenly with rowids, so guessing by interpolation takes a few lookups
        # where halving takes ~17 (each a random read of a multi-GB file); halving every other
        # lookup keeps the worst case at twice the binary search's.
        guess = True
        while lo < hi:
            mid = (lo + hi) // 2
            if guess and t_hi > t_lo:
                mid = min(max(lo + (t - t_lo) * (hi - lo) // (t_hi - t_lo), lo), hi - 1)
            guess = not guess
            row = self.con.execute(query, (mid,)).fetchone()
            if row is None or row[0] >= hi:  # no row in [mid, hi): the answer is mid at most
                hi = mid
            elif row[1] >= t:
                hi, t_hi = row[0], row[1]
            else:
                lo, t_lo = row[0] + 1, row[1]
        return lo

    def bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """Rowid range ``(after, upto]`` holding the rows whose time is in ``[lo, hi]``."""
        return self.first_from(lo) - 1, self.first_from(hi + 1) - 1

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """:meth:`bounds` as a list (what :class:`Pieces` answers)."""
        return [self.bounds(lo, hi)]

    @property
    def pieces(self) -> tuple[RowIndex, ...]:
        """The table's ordered runs of rows: the whole table."""
        return (self,)

    def count(self, lo: int, hi: int) -> int:
        """Rows with time in ``[lo, hi]``, estimated from the samples alone."""
        if hi < lo:
            return 0
        r = np.interp([lo, hi], self.times, self.rowids)
        return max(int(r[1] - r[0]), 0)


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Rowid ranges ``(after, upto]`` merged where they overlap or touch, in order."""
    out: list[tuple[int, int]] = []
    for after, upto in sorted(ranges):
        if upto <= after:
            continue
        if out and after <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], upto))
        else:
            out.append((after, upto))
    return out


def subtract(ranges: list[tuple[int, int]], done: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` not already in ``done`` (both merged)."""
    out = []
    for after, upto in ranges:
        cursor = after
        for d_after, d_upto in done:
            if d_upto <= cursor or d_after >= upto:
                continue
            if d_after > cursor:
                out.append((cursor, d_after))
            cursor = max(cursor, d_upto)
        if cursor < upto:
            out.append((cursor, upto))
    return out


# Rows read per query of the order scan (:func:`scan_pieces`): bounded memory on any export.
SCAN_ROWS = 1 << 21
# More ordered pieces than MAX_PIECES, or than one per MIN_PIECE_ROWS rows (and over
# FEW_PIECES), and rowid ranges stop paying (a query per piece a span meets): the table is
# read by a filtered scan on time instead.
MAX_PIECES = 4096
MIN_PIECE_ROWS = 4096
FEW_PIECES = 64
# Rows of an ordered piece kept while scanning (for its samples): one in this many.
SCAN_STRIDE = 1024


@dataclass(frozen=True)
class Pieces:
    """A table whose rows are not in start order, as the runs of rows that are (``pieces``,
    each a :class:`RowIndex` over its own rowids, in order of their first time), from one scan
    of its ``start`` column (:func:`scan_pieces`). Answers what a :class:`RowIndex` answers,
    a time range as several rowid ranges: one per piece it meets."""

    con: sqlite3.Connection = field(repr=False)
    table: str
    pieces: tuple[RowIndex, ...]
    ordered: bool = True  # rowid ranges may stand for time ranges (piece by piece)

    @property
    def first(self) -> int:
        return min(p.first for p in self.pieces)

    @property
    def last(self) -> int:
        return max(p.last for p in self.pieces)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    @property
    def rowids(self) -> np.ndarray:
        return np.concatenate([p.rowids for p in self.pieces])

    @property
    def times(self) -> np.ndarray:
        return np.concatenate([p.times for p in self.pieces])

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Rowid ranges ``(after, upto]`` holding the rows whose time is in ``[lo, hi]``."""
        return merge(
            [
                p.bounds(lo, hi)
                for p in self.pieces
                if int(p.times[0]) <= hi and int(p.times[-1]) >= lo
            ]
        )

    def count(self, lo: int, hi: int) -> int:
        return sum(p.count(lo, hi) for p in self.pieces)


def scan_pieces(
    con: sqlite3.Connection, index: RowIndex, read, samples: int = SAMPLES
) -> Pieces | None:
    """The ordered pieces of ``index``'s table (not in start order), from its start times read
    ``SCAN_ROWS`` at a time, in as many rowid ranges as there are cores, each on its own thread
    through ``read`` (a query → one polars frame:
    :meth:`traceclf.ingest.reader.Reader.sql`; :func:`_scan_part`), or None when there are
    too many (:data:`MAX_PIECES`: the rows are shuffled, not written in out-of-order blocks).
    Memory: two blocks' times (and rowids, where they have holes: the next block is read while
    one is scanned), and one row in :data:`SCAN_STRIDE` of each piece."""
    table, column = index.table, index.column
    pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (rowids, times) of each piece
    run_ids: list[np.ndarray] = []
    run_times: list[np.ndarray] = []
    last_time = None
    parts = cpu_share()  # each block read on the cores in as many rowid ranges
    read_part = functools.partial(_scan_part, read, table, column)
    blocks = list(range(index.first - 1, index.last, SCAN_ROWS))
    with ThreadPoolExecutor(parts, thread_name_prefix="traceclf-scan") as pool:

        def begin(k: int) -> list[Future]:
            """Block ``k``'s reads, its rows cut evenly among the cores (none past the last)."""
            if k >= len(blocks):
                return []
            after, upto = blocks[k], min(blocks[k] + SCAN_ROWS, index.last)
            cuts = [after + (upto - after) * i // parts for i in range(parts + 1)]
            return [pool.submit(read_part, r) for r in itertools.pairwise(cuts) if r[0] < r[1]]

        following = begin(0)
        for k in range(len(blocks)):
            # the next block is read while this one's pieces are found (one core's numpy)
            reads, following = following, begin(k + 1)
            got = [p for p in (f.result() for f in reads) if len(p[0])]
            if not got:
                continue
            ids = np.concatenate([p[0] for p in got])
            times = np.concatenate([p[1] for p in got])
            breaks = np.flatnonzero(np.diff(times) < 0) + 1
            if last_time is not None and times[0] < last_time:
                breaks = np.concatenate([[0], breaks])
            if len(pieces) + len(breaks) > MAX_PIECES:
                for future in following:  # (not begun: not read)
                    future.cancel()
                return None
            bounds = [0, *breaks.tolist(), len(ids)]
            continues = not (len(breaks) and breaks[0] == 0)
            for a, b in itertools.pairwise(bounds):
                # a run's rows kept: one in SCAN_STRIDE, its first and its last
                at = np.unique(np.r_[np.arange(a, b, SCAN_STRIDE), b - 1])
                if not (a == 0 and continues) and run_ids:  # a new run: the one before ends
                    pieces.append(
                        _sampled(np.concatenate(run_ids), np.concatenate(run_times), samples)
                    )
                    run_ids, run_times = [], []
                run_ids.append(ids[at])
                run_times.append(times[at])
            last_time = int(times[-1])
    if run_ids:
        pieces.append(_sampled(np.concatenate(run_ids), np.concatenate(run_times), samples))
    if not pieces or len(pieces) > max(FEW_PIECES, index.rows // MIN_PIECE_ROWS):
        return None
    made = [RowIndex(con, table, column, r, t, True) for r, t in pieces]
    made.sort(key=lambda p: int(p.times[0]))
    return Pieces(con, table, tuple(made))


def _scan_part(read, table: str, column: str, part: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Rowids and times of the rows in rowid range ``part`` ``(after, upto]``, in rowid order,
    rows without an integer time left out. One query on one thread, so its rows come back in
    rowid order (connectorx interleaves the batches of parallel queries) and only the times
    are read: where the range is dense (nsys never deletes a row), rowids follow from the
    positions. A range with holes, nulls or odd values is read again with its rowids."""
    a, b = part
    where = f"rowid > {a} AND rowid <= {b}"
    try:
        times = read(f'SELECT "{column}" AS t FROM {table} WHERE {where}')["t"]
        if times.len() == b - a and not times.null_count():
            return np.arange(a + 1, b + 1, dtype=np.int64), times.to_numpy().astype(np.int64)
        block = read(f'SELECT rowid AS r, "{column}" AS t FROM {table} WHERE {where}')
    except TraceError:  # a value of another type (no time): those rows are left out
        block = read(
            f'SELECT rowid AS r, "{column}" AS t FROM {table} WHERE {where} '
            f"AND typeof(\"{column}\") = 'integer'"
        )
    block = block.drop_nulls().sort("r")
    return block["r"].to_numpy().astype(np.int64), block["t"].to_numpy().astype(np.int64)


def _sampled(ids: np.ndarray, times: np.ndarray, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``samples`` evenly spaced rows of a piece, its first and last included."""
    if len(ids) <= samples:
        return ids.copy(), times.copy()
    at = np.unique(np.linspace(0, len(ids) - 1, num=samples).round().astype(np.int64))
    return ids[at].copy(), times[at].copy()


def in_pieces(
    con: sqlite3.Connection, indexes: dict[str, RowIndex], read
) -> dict[str, RowIndex | Pieces]:
    """``indexes`` with each table that is not in start order scanned for its ordered pieces
    (:func:`scan_pieces`, through ``read``); a table shuffled finer stays unordered (read by a
    filtered scan on time)."""
    out: dict[str, RowIndex | Pieces] = {}
    for logical, index in indexes.items():
        pieces = None if index.ordered else scan_pieces(con, index, read)
        out[logical] = pieces if pieces is not None else index
    return out


def read_path(indexes: dict, rescanned: bool = False) -> str:
    """How the analysed steps were read (the report's ``capture.read_path``): by rowid ranges
    (every event table in start order), by rowid ranges within the ordered pieces of tables
    that are not, or by a filtered scan on time (a table shuffled finer than that); by rowid
    ranges, then a table read again by a filtered scan where what came back showed rows
    missing (``rescanned``: :mod:`traceclf.pipeline.pass2`)."""
    if any(not index.ordered for index in indexes.values()):
        return "filtered_scan"
    if rescanned:
        return "rescanned"
    if any(len(index.pieces) > 1 for index in indexes.values()):
        return "ordered_pieces"
    return "rowid_ranges"
