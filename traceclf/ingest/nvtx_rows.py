"""Which NVTX rows step sampling reads (:mod:`traceclf.pipeline.twopass`): a capture may hold
a range for every layer of every step, so neither pass reads the whole table. Pass 1 reads the
rows that may be steps; pass 2 the ranges over the analysed steps."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from traceclf.ingest.assemble import NVTX_DOMAIN_CREATE
from traceclf.ingest.reader import Reader, Span
from traceclf.ingest.utf8 import decode_text
from traceclf.model.taxonomy import matches

# Distinct texts matching the step pattern compared in SQL at most (step names numbered one
# by one: one per step); more, and every row with text is read and matched after.
MAX_INLINE_TEXTS = 20_000


def step_rows(reader: Reader, pattern: str) -> pl.DataFrame:
    """The NVTX rows that may be step ranges (their text matches ``pattern``) and the domains'
    creations (their names): what pass 1 needs of a table that may hold a range for every
    layer of every step. Text kept in StringIds is matched there, and only the rows of the
    matching ids are read; text kept in the row (as older nsys versions write it) is matched
    once per distinct text, and only the rows of the matching texts are read. A pattern that
    matches no text at all would match rows without any: then every row is read."""
    table = reader.table_of("nvtx")
    columns = reader.info.columns.get(table or "", ())
    if table is None or matches(pl.Series([""]), pattern).any():
        return reader.read("nvtx")
    strings = reader.strings
    ids = strings.filter(matches(strings["value"], pattern))["id"].drop_nulls().to_list()
    wanted = [f'"eventType" = {NVTX_DOMAIN_CREATE}']
    if "text" in columns:
        wanted.append(_inline_matching(reader, table, pattern))
    if ids and "textId" in columns:
        wanted.append(f'"textId" IN ({", ".join(str(int(i)) for i in ids)})')
    return reader.read("nvtx", where=" OR ".join(wanted))


def window_rows(reader: Reader, spans: Sequence[Span], steps: pl.DataFrame) -> pl.DataFrame:
    """The NVTX rows of the analysed steps: every range overlapping the spans read (one
    filtered scan, in SQLite: :func:`traceclf.ingest.reader.overlap_clause`), and the
    domains' creations (their names) from ``steps``, pass 1's rows (:func:`step_rows`),
    which hold them all: not a second scan of the table."""
    ranges = reader.read("nvtx", list(spans)) if spans else reader.empty("nvtx")
    domains = steps.filter(pl.col("event_type") == NVTX_DOMAIN_CREATE)
    return pl.concat([domains, ranges], how="vertical_relaxed")


def _inline_matching(reader: Reader, table: str, pattern: str) -> str:
    """SQL: the row's own text is one of the distinct texts of the table's rows that match
    ``pattern``, compared as bytes (hex literals: nothing read from the trace enters the SQL
    as text). One scan brings each text once, where reading every row with text brought the
    ranges of every layer (NCCL's, MoE's: 0.17 M rows of 16 texts on the EP input, 0.6 s).
    Past :data:`MAX_INLINE_TEXTS` matching texts, every row with text (matched after)."""
    raw = reader.sql(
        f'SELECT DISTINCT CAST("text" AS BLOB) AS text FROM {table} WHERE "text" IS NOT NULL'
    )
    if raw.is_empty():
        return "0"
    if raw["text"].dtype != pl.Binary:  # (not read as bytes: every row with text, as before)
        return '"text" IS NOT NULL'
    text, _repaired = decode_text(raw["text"])  # (repairs are counted on the rows read)
    hits = raw["text"].filter(matches(text, pattern).fill_null(False))
    if hits.len() > MAX_INLINE_TEXTS:
        return '"text" IS NOT NULL'
    if hits.is_empty():
        return "0"
    literals = ", ".join(f"X'{h}'" for h in hits.bin.encode("hex"))
    return f'CAST("text" AS BLOB) IN ({literals})'
