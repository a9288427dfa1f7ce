"""The GPU start of single NVTX steps, without projecting every step.

An NVTX step range is CPU time; its GPU start is the first GPU work launched by the CUDA calls
inside it. For one step that is two SQL aggregates: the correlation ids of the rank's calls
inside the range (one rowid range of the call table; CUPTI numbers a process's calls in call
order, so they form one interval of ids, whose ends the first and the last few calls of the
range hold: the cost does not grow with the calls a step makes), then the first GPU row in
start order with one of them, looked for from the range's start onward. Step sampling's first pass
(:mod:`traceclf.pipeline.twopass`) uses it to decide warm-up and a cut-off last step on GPU
durations, as ``--all-steps`` does, and to know each analysed run's GPU span before reading it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable

import numpy as np
import polars as pl

from traceclf.ingest import rowindex
from traceclf.ingest.reader import Reader
from traceclf.ingest.rowindex import RowIndex
from traceclf.support.cpus import second_lane


class Projector:
    """The GPU start of single NVTX steps of one rank, each from a few SQL aggregates: the
    correlation ids of the rank's CUDA calls inside the step's range (one rowid range of the
    call table), then the first GPU row, in start order, with one of them. CUPTI numbers a
    process's calls in call order, so a step's calls hold one interval of ids.

    Enough to decide warm-up and a cut-off last step on GPU durations, as ``--all-steps``
    does, without projecting every step."""

    BLOCK = 4096  # GPU rows per look, doubled each time; at most MAX_ROWS past the call
    MAX_ROWS = 1 << 19
    SAMPLE = 9  # steps whose durations give the reference (median) step
    # Calls read at each end of a step for its first and last correlation ids. Ids follow
    # call order; only calls made at once on two threads can swap (by tens of ns in the
    # shared traces), never 256 calls apart.
    EDGE_CALLS = 256

    def __init__(
        self,
        con: sqlite3.Connection,
        reader: Reader,
        indexes: dict[str, RowIndex],
        pid: int,
        table: pl.DataFrame,
    ) -> None:
        self.con, self.reader, self.pid = con, reader, pid
        self.starts = table["start"].to_list()
        self.ends = table["end"].to_list()
        api = indexes.get("api")
        self.api = api if api is not None and api.ordered else None
        # each ordered run of rows of each GPU table (one, the table, when it is in order),
        # kernels first (where a step's first work is found, the other tables' search stops)
        self.gpu = [
            (piece, reader.pid_sql(t))
            for t in ("kernels", "graphs", "memcpy", "memset")
            if t in indexes and indexes[t].ordered
            for piece in indexes[t].pieces
        ]
        self.usable = self.api is not None and bool(self.gpu)
        self._starts: dict[int, int | None] = {}
        self._reference: float | None = None

    def reference(self) -> float:
        """Median duration of steps sampled evenly after the first (found once: the last
        step's duration reads its GPU rows through, and the analysed runs' spans ask again)."""
        if self._reference is None:
            self.find_starts(j for i in self._picks() for j in (i, i + 1))
            self._reference = self.sampled_median(self.duration)
        return self._reference

    def sampled_median(self, value: Callable[[int], float | None]) -> float:
        """Median of ``value(i)`` over steps sampled evenly after the first (unknown values
        left out; 0 when none is known)."""
        known = [v for v in (value(i) for i in self._picks()) if v is not None]
        return float(np.median(known)) if known else 0.0

    def _picks(self) -> list[int]:
        """The steps :meth:`sampled_median` samples: evenly spread after the first."""
        n = len(self.starts)
        picks = {round(1 + i * (n - 2) / max(self.SAMPLE - 1, 1)) for i in range(self.SAMPLE)}
        return [i for i in sorted(picks) if 0 < i < n]

    def duration(self, i: int) -> float | None:
        """GPU start to the next step's GPU start (the last step: its own GPU span)."""
        start = self.gpu_start(i)
        end = self.gpu_start(i + 1) if i + 1 < len(self.starts) else self._gpu_end(i)
        return None if start is None or end is None else float(end - start)

    def _calls(self, i: int, con: sqlite3.Connection | None = None) -> tuple[int, int] | None:
        assert self.api is not None
        lo, hi = self.starts[i], self.ends[i]
        ranges = self.api.ranges(lo, hi)
        if not ranges:
            return None
        rowids = " OR ".join(f"(rowid > {a} AND rowid <= {b})" for a, b in ranges)
        calls = (
            f"SELECT correlationId AS c FROM {self.api.table} "
            f"WHERE ({rowids}) AND start BETWEEN {lo} AND {hi} "
            f"AND {self.reader.pid_sql('api')} = {self.pid} AND typeof(correlationId) = 'integer'"
        )
        # The smallest id is among the step's first calls and the largest among its last:
        # ids follow call order (the rows are in start order here), so a few rows at each
        # end stand for the step, however many calls it holds.
        row = (
            (con or self.con)
            .execute(
                f"SELECT (SELECT min(c) FROM ({calls} ORDER BY rowid LIMIT {self.EDGE_CALLS})), "
                f"(SELECT max(c) FROM ({calls} ORDER BY rowid DESC LIMIT {self.EDGE_CALLS}))"
            )
            .fetchone()
        )
        return None if row[0] is None else (int(row[0]), int(row[1]))

    def allocates(self, i: int, name_ids: list[int]) -> bool | None:
        """Whether the rank calls, inside step ``i``'s range, one of ``name_ids`` (the
        allocator's: warm-up while they still grow it); None without usable calls. The first
        such call answers: a step's calls are looked through to the end only when it makes
        none (a count cost a scan of every call of each step asked about: 0.4 s a step of
        1.4 M calls)."""
        if self.api is None:
            return None
        if not name_ids:
            return False
        lo, hi = self.starts[i], self.ends[i]
        ranges = self.api.ranges(lo, hi)  # (one per ordered piece of the table it meets)
        if not ranges:
            return False
        rowids = " OR ".join(f"(rowid > {a} AND rowid <= {b})" for a, b in ranges)
        ids = ",".join(str(int(n)) for n in name_ids)
        (found,) = self.con.execute(
            f"SELECT EXISTS (SELECT 1 FROM {self.api.table} WHERE ({rowids}) "
            f"AND start BETWEEN {lo} AND {hi} AND {self.reader.pid_sql('api')} = {self.pid} "
            f"AND nameId IN ({ids}))"
        ).fetchone()
        return bool(found)

    def gpu_start(self, i: int) -> int | None:
        if i not in self._starts:
            self._starts[i] = self._first_start(i)
        return self._starts[i]

    def find_starts(self, steps: Iterable[int]) -> None:
        """The GPU start of each of ``steps`` not known yet (:meth:`gpu_start` then answers
        from memory), every other one found on a second lane with a connection of its own:
        each is SQLite's work, without the GIL, and takes tens of ms where a GPU table is
        in many ordered pieces (1.2 s on one core for the out-of-order benchmark input)."""
        todo = sorted({i for i in steps if 0 <= i < len(self.starts)} - self._starts.keys())
        if len(todo) < 2:
            return
        path = self.reader.info.path

        def theirs() -> dict[int, int | None]:
            with rowindex.connect(path) as con:
                return {i: self._first_start(i, con) for i in todo[1::2]}

        found = second_lane("traceclf-projector").submit(theirs)
        for i in todo[0::2]:
            self.gpu_start(i)
        self._starts.update(found.result())

    def _first_start(self, i: int, con: sqlite3.Connection | None = None) -> int | None:
        con = con or self.con
        calls = self._calls(i, con)
        if calls is None:
            return None
        best = None
        for index, pid in self.gpu:
            if best is not None and int(index.times[0]) > best:
                continue  # a piece that starts later than the work found
            rowid = index.first_from(self.starts[i]) - 1  # no work starts before its call
            stop = index.first_from(best + 1) - 1 if best is not None else None
            block, scanned = self.BLOCK, 0
            while rowid < index.last and scanned < self.MAX_ROWS:
                upto = rowid + block if stop is None else stop
                (found,) = con.execute(
                    f"SELECT min(start) FROM {index.table} WHERE rowid > {rowid} "
                    "AND typeof(start) = 'integer' "
                    f"AND rowid <= {upto} AND {pid} = {self.pid} "
                    f"AND correlationId BETWEEN {calls[0]} AND {calls[1]}"
                ).fetchone()
                if found is not None:
                    best = found if best is None else min(best, found)
                    break
                if stop is not None:
                    break
                rowid, scanned, block = upto, scanned + block, block * 2
        return best

    def _gpu_end(self, i: int) -> int | None:
        calls = self._calls(i)
        if calls is None:
            return None
        ends = []
        for index, pid in self.gpu:
            (found,) = self.con.execute(
                f'SELECT max("end") FROM {index.table} WHERE rowid > '
                f"{index.first_from(self.starts[i]) - 1} AND rowid <= {index.last} "
                f"AND {pid} = {self.pid} "
                "AND typeof(\"end\") = 'integer' "
                f"AND correlationId BETWEEN {calls[0]} AND {calls[1]}"
            ).fetchone()
            if found is not None:
                ends.append(int(found))
        return max(ends) if ends else None
