"""Which NVTX rows step sampling reads (:mod:`traceclf.pipeline.twopass`): a capture may hold
a range for every layer of every step, so neither pass reads the whole table. Pass 1 reads the
rows that may be steps; pass 2 the ranges over the analysed steps."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import polars as pl

from traceclf.ingest.assemble import NVTX_DOMAIN_CREATE
from traceclf.ingest.reader import Reader, Span, rowid_in
from traceclf.ingest.session import MAX_PAYLOAD_ROWS, RANK_PAYLOAD_SQL
from traceclf.ingest.textfilter import text_condition
from traceclf.ingest.utf8 import decode_text
from traceclf.model.taxonomy import matches
from traceclf.support.cpus import cpu_share

# Rows whose own text matches the step pattern read by rowid at most (one per step and
# thread); more, and every row with text is read and matched after.
MAX_INLINE_STEPS = 100_000
# NVTX rows per query of pass 1's scan (:func:`_scan`): its memory is bounded on any
# export (a block's rowids and texts, ~50 MB where every row keeps its text).
SCAN_ROWS = 1 << 20


def step_rows(reader: Reader, pattern: str) -> tuple[pl.DataFrame, list[int] | None]:
    """The NVTX rows that may be step ranges (their text matches ``pattern``) and the domains'
    creations (their names): what pass 1 needs of a table that may hold a range for every
    layer of every step, or for every op (PyTorch's emit_nvtx: millions of texts, each
    numbered). Text kept in StringIds is matched there; text kept in the row (as nsys keeps
    strings that were not registered) is matched as the table is scanned once, a block at a
    time: then only the rows found are read. A pattern that matches no text at all would
    match rows without any: then every row is read.

    With them, the rowids of the first rows whose JSON payload may name an NCCL rank
    (:func:`traceclf.ingest.session.nccl_ranks`), found by the same scan; None where it did
    not look through the whole table."""
    table = reader.table_of("nvtx")
    columns = reader.info.columns.get(table or "", ())
    if table is None or matches(pl.Series([""]), pattern).any():
        return reader.read("nvtx"), None
    strings = reader.strings
    ids = strings.filter(matches(strings["value"], pattern))["id"].drop_nulls().to_list()
    wanted = [f'"eventType" = {NVTX_DOMAIN_CREATE}']
    if ids and "textId" in columns:
        wanted.append(f'"textId" IN ({", ".join(str(int(i)) for i in ids)})')
    if "text" not in columns:
        return reader.read("nvtx", where=" OR ".join(wanted)), None
    payload = RANK_PAYLOAD_SQL if "jsonText" in columns else None
    found = _scan(reader, table, " OR ".join(wanted), pattern, payload)
    if found.steps is None:  # (past the cap: every row with text, matched after)
        return reader.read("nvtx", where=" OR ".join([*wanted, '"text" IS NOT NULL'])), None
    if found.picked is None:  # (past the cap: what ``wanted`` picks, by a second scan)
        rows = reader.read("nvtx", where=" OR ".join([*wanted, rowid_in(found.steps)]))
    else:
        rows = reader.read("nvtx", listed=sorted(found.picked + found.steps))
    return rows, found.payloads


def window_rows(reader: Reader, spans: Sequence[Span], steps: pl.DataFrame) -> pl.DataFrame:
    """The NVTX rows of the analysed steps: every range overlapping the spans read (one
    filtered scan, in SQLite: :func:`traceclf.ingest.reader.overlap_clause`), and the
    domains' creations (their names) from ``steps``, pass 1's rows (:func:`step_rows`),
    which hold them all: not a second scan of the table."""
    ranges = reader.read("nvtx", list(spans)) if spans else reader.empty("nvtx")
    domains = steps.filter(pl.col("event_type") == NVTX_DOMAIN_CREATE)
    return pl.concat([domains, ranges], how="vertical_relaxed")


@dataclass(frozen=True)
class _Found:
    """What pass 1's scan of the NVTX table found, by rowid (None: past its cap)."""

    picked: list[int] | None  # by the SQL condition
    steps: list[int] | None  # by their own text
    payloads: list[int]  # rows whose payload may name a rank


def _scan(reader: Reader, table: str, wanted: str, pattern: str, payload: str | None) -> _Found:
    """One scan of ``table``, :data:`SCAN_ROWS` rows a query, as many at once as this analysis
    may keep cores busy (:func:`_blocks`): the rowids of the rows that ``wanted`` (SQL)
    picks, and of those whose own text matches ``pattern`` (each row with text read as its
    rowid and bytes, matched here by the regex engine polars runs, as for StringIds); either
    None past :data:`MAX_INLINE_STEPS` rows, and the scan stops once the steps are. Where
    every row keeps its own text, each numbered (``aten::mm, seq = 7``), the distinct texts
    are as many as the rows: comparing them in SQL took 7 s of a 1.4 GB export. Also the
    first :data:`MAX_PAYLOAD_ROWS` rows that ``payload`` (SQL) picks."""
    picked: list[int] | None = []
    steps: list[int] = []
    payloads: list[int] = []
    for raw in _blocks(reader, table, wanted, text_condition("text", pattern), payload):
        if raw["text"].dtype != pl.Binary:  # (not read as bytes: every row with text)
            return _Found(picked, None, payloads)
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
            return _Found(picked, None, payloads)
        room = MAX_PAYLOAD_ROWS - len(payloads)
        payloads += rowids.filter(raw["payload"] == 1).head(room).to_list()
    return _Found(picked, steps, payloads)


def _blocks(
    reader: Reader, table: str, wanted: str, texts: str | None, payload: str | None
) -> Iterator[pl.DataFrame]:
    """The rows of ``table`` that ``wanted`` or ``payload`` picks or that keep their own text
    (those ``texts`` picks, if given: :func:`~traceclf.ingest.textfilter.text_condition`),
    as (rowid ``r``, ``wanted`` and ``payload`` 1 or 0, ``text`` bytes, empty for none),
    :data:`SCAN_ROWS` rowids a query, in rowid order; the next queries run while a block is
    matched (no more blocks held than there are queries at once). Each block also returns its
    first row, whatever it holds (flagged like any other): connectorx types computed columns
    from a first row it reads beforehand, and a block that picks few rows would be scanned
    twice, once to find it."""
    carries = f"iif({payload}, 1, 0)" if payload else "0"
    texts = texts or '"text" IS NOT NULL'
    picks = f"{wanted} OR {texts}" + (f" OR {payload}" if payload else "")
    first, last = reader.sql(
        f"SELECT coalesce((SELECT min(rowid) FROM {table}), 0) AS a, "
        f"coalesce((SELECT max(rowid) FROM {table}), 0) AS b"
    ).row(0)

    def block(after: int) -> pl.DataFrame:
        # (no value read is null: connectorx types an expression's column by its first row)
        return reader.sql(
            f"SELECT rowid AS r, iif({wanted}, 1, 0) AS wanted, {carries} AS payload, "
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
