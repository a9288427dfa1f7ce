"""Which NVTX rows step sampling reads (:mod:`traceclf.pipeline.twopass`): a capture may hold
a range for every layer of every step, so neither pass reads the whole table. Pass 1 reads the
rows that may be steps; pass 2 the ranges over the analysed steps."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import polars as pl

from traceclf.ingest import rowindex
from traceclf.ingest.assemble import NVTX_DOMAIN_CREATE
from traceclf.ingest.reader import Reader, Span, in_ranges, rowid_in
from traceclf.ingest.rowindex import RowIndex
from traceclf.ingest.session import MAX_PAYLOAD_ROWS, RANK_PAYLOAD_SQL
from traceclf.ingest.textfilter import text_condition
from traceclf.ingest.utf8 import decode_text
from traceclf.model.taxonomy import matches
from traceclf.support.cpus import cpu_share
from traceclf.support.errors import TraceError

# Rows whose own text matches the step pattern read by rowid at most (one per step and
# thread); more, and every row with text is read and matched after.
MAX_INLINE_STEPS = 100_000
# NVTX rows per query of pass 1's scan (:func:`_scan`): its memory is bounded on any
# export (a block's rowids and texts, ~50 MB where every row keeps its text).
SCAN_ROWS = 1 << 20
# Pass 1's scan also notes the ranges longer than this (steps, epochs, a whole run: few);
# pass 2 then reads the window's ranges as those that start near it, by rowid range, and
# the long ones that overlap it (:func:`window_rows`), not by a scan of the whole table.
LONG_RANGE_NS = 50_000_000
MAX_LONG_ROWS = 100_000  # more long ranges than this: pass 2 scans the table
INT64_MAX = (1 << 63) - 1
NEAR_MIN_ROWS = SCAN_ROWS  # NVTX rows from which pass 2 reads near the window, not by a scan
NEAR_CHECK_ROWS = 1024  # rows on either side of a near read checked for one out of place


class StepRows(NamedTuple):
    """What pass 1 read of the NVTX table (:func:`step_rows`)."""

    rows: pl.DataFrame  # the rows that may be steps, and the domains' creations
    payloads: list[int] | None  # rows whose payload may name an NCCL rank (None: not looked)
    long: list[int] | None  # ranges longer than LONG_RANGE_NS (None: not all of them found)


def step_rows(reader: Reader, pattern: str, long_ranges: bool = False) -> StepRows:
    """The NVTX rows that may be step ranges (their text matches ``pattern``) and the domains'
    creations (their names): what pass 1 needs of a table that may hold a range for every
    layer of every step, or for every op (PyTorch's emit_nvtx: millions of texts, each
    numbered). Text kept in StringIds is matched there; text kept in the row (as nsys keeps
    strings that were not registered) is matched as the table is scanned once, a block at a
    time: then only the rows found are read. A pattern that matches no text at all would
    match rows without any: then every row is read.

    With them, the rowids of the first rows whose JSON payload may name an NCCL rank
    (:func:`traceclf.ingest.session.nccl_ranks`), and with ``long_ranges`` of the ranges
    longer than :data:`LONG_RANGE_NS` (:func:`reads_near`), found by the same scan; None
    where it did not look through the whole table."""
    table = reader.table_of("nvtx")
    columns = reader.info.columns.get(table or "", ())
    if table is None or matches(pl.Series([""]), pattern).any():
        return StepRows(reader.read("nvtx"), None, None)
    strings = reader.strings
    ids = strings.filter(matches(strings["value"], pattern))["id"].drop_nulls().to_list()
    wanted = [f'"eventType" = {NVTX_DOMAIN_CREATE}']
    if ids and "textId" in columns:
        wanted.append(f'"textId" IN ({", ".join(str(int(i)) for i in ids)})')
    if "text" not in columns:
        return StepRows(reader.read("nvtx", where=" OR ".join(wanted)), None, None)
    payload = RANK_PAYLOAD_SQL if "jsonText" in columns else None
    # (an end that is not a number, as a damaged export holds, passes ``"end" > X`` for any X,
    # as in the filtered scan: such a row is long too, so either read finds it)
    long = (
        f'"end" - start > {LONG_RANGE_NS} OR "end" > {INT64_MAX}'
        if long_ranges and "end" in columns
        else None
    )
    found = _scan(reader, table, " OR ".join(wanted), pattern, payload, long)
    if found.steps is None:  # (past the cap: every row with text, matched after)
        every = reader.read("nvtx", where=" OR ".join([*wanted, '"text" IS NOT NULL']))
        return StepRows(every, None, None)
    if found.picked is None:  # (past the cap: what ``wanted`` picks, by a second scan)
        rows = reader.read("nvtx", where=" OR ".join([*wanted, rowid_in(found.steps)]))
    else:
        rows = reader.read("nvtx", listed=sorted(found.picked + found.steps))
    return StepRows(rows, found.payloads, found.long)


def reads_near(index: RowIndex | None) -> bool:
    """Whether pass 2 may read the window's NVTX ranges near it (:func:`window_rows`): the
    table (``index``) is in start order, as nsys writes it, and big enough that a scan of it
    costs more than noting its long ranges in pass 1 (each row's end tested: 0.1 s of SQLite's
    time on a table of 4.8 M rows)."""
    return index is not None and index.ordered and index.rows >= NEAR_MIN_ROWS


def near_ranges(index: RowIndex | None, spans: Sequence[Span]) -> list[tuple[int, int]] | None:
    """The rowid ranges ``(after, upto]`` of the NVTX rows that start near ``spans`` (from
    twice :data:`LONG_RANGE_NS` before each to once after: a range out of place by less than
    that is still found), where ``index`` (the table's) shows it in start order; else None.
    None too where one of the :data:`NEAR_CHECK_ROWS` rows on either side of a range starts
    inside its stretch of time: the binary search met a row out of place, and the rows beyond
    it would be lost without a word. Searched on the caller's thread, through the index's
    connection."""
    if index is None or not index.ordered or not spans:
        return None
    ranges = []
    for lo, hi in spans:
        first, last = lo - 2 * LONG_RANGE_NS, hi + LONG_RANGE_NS
        after, upto = index.bounds(first, last)
        if _starts_within(index, after - NEAR_CHECK_ROWS, after, first, last) or _starts_within(
            index, upto, upto + NEAR_CHECK_ROWS, first, last
        ):
            return None
        ranges.append((after, upto))
    return rowindex.merge(ranges)


def _starts_within(index: RowIndex, after: int, upto: int, first: int, last: int) -> bool:
    """Whether a row of ``index``'s table in rowids ``(after, upto]`` starts in [first, last]."""
    query = (
        f"SELECT 1 FROM {index.table} WHERE rowid > ? AND rowid <= ? "
        f'AND "{index.column}" BETWEEN ? AND ? LIMIT 1'
    )
    return index.con.execute(query, (after, upto, first, last)).fetchone() is not None


def window_rows(
    reader: Reader,
    spans: Sequence[Span],
    steps: StepRows,
    near: list[tuple[int, int]] | None = None,
) -> pl.DataFrame:
    """The NVTX rows of the analysed steps: every range overlapping the spans read, and the
    domains' creations (their names) from pass 1's rows (:func:`step_rows`), which hold them
    all. A range overlapping a span either starts at most :data:`LONG_RANGE_NS` before it or
    is longer than that: where the table is in start order (``near``: :func:`near_ranges`)
    and pass 1 found every long range, the ranges are those of the rowid ranges ``near`` and
    the long ones, each tested against the spans in SQLite; else one filtered scan of the
    table (:func:`traceclf.ingest.reader.overlap_clause`). Either way in rowid order where the
    table is in start order (the scan's batches come in order of their first start;
    :func:`traceclf.ingest.assemble.nvtx_ranges` sorts the ranges by start)."""
    ranges = (
        _near(reader, spans, steps.long, near)
        if spans and near and steps.long is not None
        else None
    )
    if ranges is None:
        ranges = reader.read("nvtx", list(spans)) if spans else reader.empty("nvtx")
    domains = steps.rows.filter(pl.col("event_type") == NVTX_DOMAIN_CREATE)
    return pl.concat([domains, ranges], how="vertical_relaxed")


def _near(
    reader: Reader, spans: Sequence[Span], long: list[int], near: list[tuple[int, int]]
) -> pl.DataFrame | None:
    """The ranges overlapping ``spans`` among the rows of the rowid ranges ``near`` and the
    ``long`` ones outside them (each row read once: its text decoded, and any repair counted,
    once), in rowid order; None where the rows of ``near`` are not in start order (one out of
    place may have misled the search that found them), found from their starts alone before
    any text is read (the scan then decodes each text once)."""
    table = reader.table_of("nvtx")
    try:
        starts = reader.sql(in_ranges(f"SELECT rowid AS r, start FROM {table}", near, [], False))
    except TraceError:  # (a start that is not an integer: the scan counts its row as damaged)
        return None
    if not starts.sort("r")["start"].is_sorted():
        return None
    rows = reader.read("nvtx", list(spans), rowids=near, rowid=True).sort("_rowid")
    ids = np.asarray(long, dtype=np.int64)
    afters = np.array([after for after, _upto in near], dtype=np.int64)
    uptos = np.array([upto for _after, upto in near], dtype=np.int64)
    at = np.searchsorted(afters, ids, side="left") - 1  # the last range beginning below each
    inside = (at >= 0) & (ids <= uptos[np.maximum(at, 0)])
    if not inside.all():
        outside = ids[~inside].tolist()
        rows = pl.concat(
            [rows, reader.read("nvtx", list(spans), listed=outside, rowid=True)],
            how="vertical_relaxed",
        ).sort("_rowid")
    return rows.drop("_rowid")


@dataclass(frozen=True)
class _Found:
    """What pass 1's scan of the NVTX table found, by rowid (None: past its cap)."""

    picked: list[int] | None  # by the SQL condition
    steps: list[int] | None  # by their own text
    payloads: list[int]  # rows whose payload may name a rank
    long: list[int] | None  # ranges longer than LONG_RANGE_NS (None: not looked, or too many)


def _scan(
    reader: Reader, table: str, wanted: str, pattern: str, payload: str | None, long: str | None
) -> _Found:
    """One scan of ``table``, :data:`SCAN_ROWS` rows a query, as many at once as this analysis
    may keep cores busy (:func:`_blocks`): the rowids of the rows that ``wanted`` (SQL)
    picks, and of those whose own text matches ``pattern`` (each row with text read as its
    rowid and bytes, matched here by the regex engine polars runs, as for StringIds); either
    None past :data:`MAX_INLINE_STEPS` rows, and the scan stops once the steps are. Where
    every row keeps its own text, each numbered (``aten::mm, seq = 7``), the distinct texts
    are as many as the rows: comparing them in SQL took 7 s of a 1.4 GB export. Also the
    first :data:`MAX_PAYLOAD_ROWS` rows that ``payload`` (SQL) picks, and the rows that
    ``long`` (SQL) picks (None past :data:`MAX_LONG_ROWS`)."""
    picked: list[int] | None = []
    steps: list[int] = []
    payloads: list[int] = []
    longs: list[int] | None = [] if long else None
    for raw in _blocks(reader, table, wanted, text_condition("text", pattern), payload, long):
        if raw["text"].dtype != pl.Binary:  # (not read as bytes: every row with text)
            return _Found(picked, None, payloads, None)
        text, _repaired = decode_text(raw["text"])  # (repairs are counted on the rows read)
        # (row by row, not by matches(): a block may open with repeated texts and go on with
        # numbered ones, and its distinct texts then cost more than the regex over its rows)
        step = text.str.contains(pattern).fill_null(False)
        rowids = raw["r"].cast(pl.Int64)
        if picked is not None:
            picked += rowids.filter(raw["wanted"] == 1).to_list()
            picked = picked if len(picked) <= MAX_INLINE_STEPS else None
        steps += rowids.filter(step & (raw["wanted"] == 0)).to_list()
        if len(steps) > MAX_INLINE_STEPS:  # (what ``wanted`` picks is then read by its SQL)
            return _Found(picked, None, payloads, None)
        room = MAX_PAYLOAD_ROWS - len(payloads)
        payloads += rowids.filter(raw["payload"] == 1).head(room).to_list()
        if longs is not None:
            longs += rowids.filter(raw["long"] == 1).to_list()
            longs = longs if len(longs) <= MAX_LONG_ROWS else None
    return _Found(picked, steps, payloads, longs)


def _blocks(
    reader: Reader,
    table: str,
    wanted: str,
    texts: str | None,
    payload: str | None,
    long: str | None = None,
) -> Iterator[pl.DataFrame]:
    """The rows of ``table`` that ``wanted``, ``payload`` or ``long`` picks or that keep their
    own text (those ``texts`` picks, if given:
    :func:`~traceclf.ingest.textfilter.text_condition`), as (rowid ``r``, ``wanted``,
    ``payload`` and ``long`` 1 or 0, ``text`` bytes, empty for none),
    :data:`SCAN_ROWS` rowids a query, in rowid order; the next queries run while a block is
    matched (no more blocks held than there are queries at once). Each block also returns its
    first row, whatever it holds (flagged like any other): connectorx types computed columns
    from a first row it reads beforehand, and a block that picks few rows would be scanned
    twice, once to find it."""
    carries = f"iif({payload}, 1, 0)" if payload else "0"
    lasts = f"iif({long}, 1, 0)" if long else "0"
    texts = texts or '"text" IS NOT NULL'
    picks = f"{wanted} OR {texts}" + "".join(f" OR {c}" for c in (payload, long) if c)
    first, last = reader.sql(
        f"SELECT coalesce((SELECT min(rowid) FROM {table}), 0) AS a, "
        f"coalesce((SELECT max(rowid) FROM {table}), 0) AS b"
    ).row(0)

    def block(after: int) -> pl.DataFrame:
        # (no value read is null: connectorx types an expression's column by its first row)
        return reader.sql(
            f"SELECT rowid AS r, iif({wanted}, 1, 0) AS wanted, {carries} AS payload, "
            f"{lasts} AS long, "
            f"coalesce(CAST(\"text\" AS BLOB), X'') AS text FROM {table} "
            f"WHERE rowid > {after} AND rowid <= {after + SCAN_ROWS} AND ({picks} "
            f"OR rowid = (SELECT min(rowid) FROM {table} WHERE rowid > {after}))"
        )

    starts = iter(range(first - 1, last, SCAN_ROWS))
    with ThreadPoolExecutor(cpu_share(), thread_name_prefix="traceclf-nvtx-scan") as pool:
        pending = deque(pool.submit(block, a) for a in itertools.islice(starts, cpu_share()))
        while pending:
            raw = pending.popleft().result()
            pending.extend(pool.submit(block, a) for a in itertools.islice(starts, 1))
            if not raw.is_empty():
                yield raw
