"""Pass 2 of step sampling (:mod:`traceclf.pipeline.twopass`): the rows of the event tables
that overlap the analysed steps' time spans, each row once, by rowid ranges where a table is in
start order (:mod:`traceclf.ingest.rowindex`) and by a filtered scan where it is not.

The order is checked on a few hundred sampled rows, which a short block of rows written out of
place (nsys writes a thread's CUDA calls a buffer at a time) can slip between. What a rowid-range
read brings back is checked again: rows out of start order, or GPU work whose CUDA call must be
among the calls read and is not (:func:`unread_calls`), and the table is then read again by a
filtered scan (``rescanned``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl

from traceclf.ingest import rowindex
from traceclf.ingest.assemble import sorted_by_start
from traceclf.ingest.reader import Reader, Span
from traceclf.ingest.rowindex import RowIndex
from traceclf.ingest.tables import EVENT_TABLES
from traceclf.model.correlation import CallIndex, call_key


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
        # tables read by rowid ranges that what came back showed were not wholly read: read
        # again by a filtered scan
        self.rescanned: set[str] = set()

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
        pieces = table.index is not None and len(table.index.pieces) > 1
        if table.by_rowid and not pieces and not df["start"].is_sorted():
            return self.rescan(logical)
        if not table.by_rowid or pieces:
            df = df.sort("start")
        return _within(df, merge_spans(table.spans))

    def rescan(self, logical: str) -> pl.DataFrame:
        """The rows a rowid-range read of ``logical`` stands for, those that start inside a
        span asked for, read again by a filtered scan. (The scan also finds rows that began
        before a span and overlap it, which rowid ranges never bring: a re-read keeps to what
        the read it repairs would have held, so the path does not change which long calls at a
        span's edge are counted.)"""
        self.rescanned.add(logical)
        spans = merge_spans(self.tables[logical].spans)
        rows = self.reader.read(logical, spans, rowid=True)
        inside = _span_of(rows["start"].to_numpy(), spans) >= 0
        return _within(rows.filter(pl.Series(inside)), spans)

    def calls_complete(self, frames: dict[str, pl.DataFrame]) -> pl.DataFrame:
        """The CUDA calls of ``frames`` (finished), or read again by a filtered scan where the
        GPU work read names calls that a rowid-range read should have brought and did not."""
        table = self.tables.get("api")
        calls = frames["api"]
        if table is None or not table.by_rowid or "api" in self.rescanned:
            return calls
        work = [frames[logical] for logical in EVENT_TABLES if logical != "api"]
        if unread_calls(calls, work, table.spans).is_empty():
            return calls
        return self.rescan("api")


def _within(df: pl.DataFrame, spans: list[Span]) -> pl.DataFrame:
    """The rows of ``df`` overlapping one of ``spans`` (merged), in start order."""
    keep = pl.lit(False)
    for lo, hi in spans:  # ends included: the row starting at ``hi`` ends the window
        keep = keep | ((pl.col("start") <= hi) & (pl.col("end") >= lo))
    # in start order, flagged so (set_sorted): later sorts and searches are free, and rows
    # read in that order are checked, not sorted (a sort gathers every column)
    return sorted_by_start(df.filter(keep).drop("_rowid", strict=False))


def unread_calls(
    calls: pl.DataFrame, work: Iterable[pl.DataFrame], spans: list[Span]
) -> pl.DataFrame:
    """``pid`` and ``correlation_id`` of the GPU rows in ``work`` whose CUDA call started
    inside one of ``spans`` but is not among ``calls``.

    CUPTI numbers a process's calls, runtime and driver API alike, in call order, and GPU work
    carries the number of the call that made it. A call numbered between the first and the
    last call of its process that started inside a span started inside that span too, so a
    read of the span's calls that lacks it has left calls out. (Calls and work keyed by
    process and id as :mod:`traceclf.model.correlation` keys them: binary searches, ~0.1 s for
    0.8 M calls.)"""
    merged = merge_spans(list(spans))
    none = pl.DataFrame(schema={"pid": pl.Int32, "correlation_id": pl.Int64})
    if calls.is_empty() or not merged:
        return none
    keys, valid = call_key(calls["pid"], calls["correlation_id"])
    span = _span_of(calls["start"].to_numpy(), merged)
    inside = valid & (span >= 0)
    # each process's calls inside each span: one interval of keys (disjoint from the others
    # while ids follow call order; one nested in another would hide the outer's gaps)
    bounds = (
        pl.DataFrame(
            {"key": keys[inside], "pid": calls["pid"].filter(inside), "span": span[inside]}
        )
        .group_by("pid", "span")
        .agg(first=pl.col("key").min(), last=pl.col("key").max())
        .sort("first")
    )
    if bounds.is_empty():  # no call started inside a span: none to bracket GPU work
        return none
    firsts, lasts = bounds["first"].to_numpy(), bounds["last"].to_numpy()
    gpu = pl.concat([w.select(none.columns).cast(none.schema) for w in work] or [none])
    gpu_keys, gpu_valid = call_key(gpu["pid"], gpu["correlation_id"])
    at = np.searchsorted(firsts, gpu_keys, side="right") - 1
    named = gpu.filter(gpu_valid & (at >= 0) & (gpu_keys <= lasts[np.maximum(at, 0)]))
    unread = CallIndex(calls).find(named["pid"], named["correlation_id"]) < 0
    return named.filter(unread)


def _span_of(starts: np.ndarray, spans: list[Span]) -> np.ndarray:
    """The index of the span (``spans`` merged) each instant of ``starts`` falls in, both
    ends included; -1 for an instant outside every span."""
    if not spans:
        return np.full(len(starts), -1, np.int64)
    los = np.array([lo for lo, _hi in spans], dtype=np.int64)
    his = np.array([hi for _lo, hi in spans], dtype=np.int64)
    span = np.searchsorted(los, starts, side="right") - 1
    outside = (span < 0) | (starts > his[np.maximum(span, 0)])
    return np.where(outside, -1, span)


def merge_spans(spans: list[Span]) -> list[Span]:
    """Time spans merged where they overlap or touch, in order (empty ones kept)."""
    out: list[Span] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
