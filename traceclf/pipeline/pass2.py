"""Pass 2 of step sampling (:mod:`traceclf.pipeline.twopass`): the rows of the event tables
that overlap the analysed steps' time spans, each row once, by rowid ranges where a table is in
start order (:mod:`traceclf.ingest.rowindex`) and by a filtered scan where it is not."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from traceclf.ingest import rowindex
from traceclf.ingest.reader import Reader, Span
from traceclf.ingest.rowindex import RowIndex
from traceclf.ingest.tables import EVENT_TABLES


@dataclass
class _Table:
    """The rows of one event table read so far."""

    index: RowIndex | None
    done: list[tuple[int, int]]
    frames: list[pl.DataFrame]
    spans: list[Span]

    def frame(self) -> pl.DataFrame:
        """One frame of the rows read, each once, in rowid order (connectorx returns the
        ranges of one read in any order; rowid ranges never overlap, filtered scans may)."""
        if len(self.frames) > 1 or (self.frames and not self.frames[0]["_rowid"].is_sorted()):
            rows = pl.concat(self.frames, how="vertical_relaxed")
            if not self.by_rowid:
                rows = rows.unique("_rowid", keep="first")
            self.frames = [rows.sort("_rowid")]
        return self.frames[0] if self.frames else pl.DataFrame()

    @property
    def by_rowid(self) -> bool:
        """Whether rows are read by rowid range (the table is in start order)."""
        return self.index is not None and self.index.ordered


class Pass2:
    """Reads rows of the event tables by time span, each row once."""

    def __init__(self, reader: Reader, indexes: dict[str, RowIndex]) -> None:
        self.reader = reader
        self.tables = {
            logical: _Table(indexes.get(logical), [], [], [])
            for logical in EVENT_TABLES
            if reader.table_of(logical) is not None
        }

    def read(self, logicals: tuple[str, ...], spans: list[Span]) -> None:
        """Add the rows of each of ``logicals`` overlapping ``spans`` (by rowid range when
        the table is in start order, else by a filtered scan)."""
        for logical in logicals:
            table = self.tables.get(logical)
            if table is None or not spans:
                continue
            table.spans += spans
            if table.index is not None and table.index.ordered:
                wanted = rowindex.merge([r for lo, hi in spans for r in table.index.ranges(lo, hi)])
                todo = rowindex.subtract(wanted, table.done)
                if todo:
                    table.frames.append(self.reader.read(logical, rowids=todo, rowid=True))
                    table.done = rowindex.merge(table.done + todo)
            else:
                table.frames.append(self.reader.read(logical, spans, rowid=True))

    def finish(self, logical: str) -> pl.DataFrame:
        """Everything read of ``logical`` that overlaps the spans asked for, in start order.

        Rows read by rowid range that are not in start order break the order assumption where
        the samples did not show it: the table is then read again with a filtered scan."""
        table = self.tables.get(logical)
        if table is None or not table.spans:
            return self.reader.empty(logical)
        df = table.frame()
        if df.is_empty():
            return self.reader.empty(logical)
        spans = merge_spans(table.spans)
        pieces = table.index is not None and len(table.index.pieces) > 1
        if table.by_rowid and not pieces and not df["start"].is_sorted():
            df = self.reader.read(logical, spans, rowid=True)
        elif not table.by_rowid or pieces:
            df = df.sort("start")
        keep = pl.lit(False)
        for lo, hi in spans:  # ends included: the row starting at ``hi`` ends the window
            keep = keep | ((pl.col("start") <= hi) & (pl.col("end") >= lo))
        # in start order: flagged so (set_sorted), later sorts and searches are free
        return df.filter(keep).drop("_rowid").sort("start")


def merge_spans(spans: list[Span]) -> list[Span]:
    """Time spans merged where they overlap or touch, in order (empty ones kept)."""
    out: list[Span] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
