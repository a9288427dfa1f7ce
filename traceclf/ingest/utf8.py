"""Text columns of an export, read as the bytes nsys stored and decoded here.

nsys writes names (StringIds, NVTX text, GPU and process names, metadata) into TEXT columns
without checking that they are UTF-8: nsys 2022.2/2022.3 store raw GpuInfo bytes in
TARGET_INFO_SYSTEM_ENV, and an application's NVTX label or a kernel name may hold any bytes.
connectorx decodes TEXT strictly and fails the whole read on one bad byte, so text is selected
as a BLOB (:func:`blob_sql`) and decoded with :func:`decode_text`: valid UTF-8 at polars'
speed, anything else with U+FFFD in place of the bad bytes, and counted, so that the report
can say how many strings were repaired instead of refusing a valid export.
"""

from __future__ import annotations

import polars as pl

# Text longer than this many characters is cut, with a mark saying how long it was: a name
# comes from whoever made the trace, and its length would be paid in every row and every
# output that repeats it (four names of 1 MB made a 411 MB JSON report of a 14 MB export).
# Real names stay far below (a C++ kernel's template arguments: 9,840 in the shared traces).
MAX_TEXT = 16_384
# What a NULL text becomes in SQL: connectorx types a computed column from its first value and
# fails on a NULL there. One NUL byte is no name anyone writes; it reads back as null.
NULL_BYTES = b"\x00"
_NULL_SQL = "X'00'"


def blob_sql(column: str) -> str:
    """SQL for the bytes of the TEXT column ``column`` (quoted here), never NULL."""
    return f'coalesce(CAST("{column}" AS BLOB), {_NULL_SQL})'


def decode_text(values: pl.Series) -> tuple[pl.Series, int]:
    """``values`` (bytes read through :func:`blob_sql`) as text, and how many of them were not
    valid UTF-8 (decoded with U+FFFD for each bad sequence). A column already read as text
    (an empty result, which connectorx types from the declared column) is returned as it is."""
    if values.dtype != pl.Binary:
        return values.cast(pl.String), 0
    name = values.name
    values = pl.select(pl.when(pl.lit(values) != NULL_BYTES).then(pl.lit(values))).to_series()
    try:
        return bounded(values.cast(pl.String).alias(name)), 0
    except pl.exceptions.ComputeError:  # invalid UTF-8 somewhere: the slow path, rarely taken
        pass
    raw = values.to_list()
    repaired = sum(1 for b in raw if b is not None and not _valid(b))
    text = [None if b is None else b.decode("utf-8", "replace") for b in raw]
    return bounded(pl.Series(name, text, dtype=pl.String)), repaired


def bounded(text: pl.Series) -> pl.Series:
    """``text`` with every value longer than :data:`MAX_TEXT` characters cut there and marked
    (``… (1000000 characters)``)."""
    length = text.str.len_chars()
    if not bool((length > MAX_TEXT).any()):
        return text
    mark = pl.format("… ({} characters)", pl.lit(length))
    return pl.select(
        pl.when(pl.lit(length) > MAX_TEXT)
        .then(pl.concat_str(pl.lit(text).str.head(MAX_TEXT), mark))
        .otherwise(pl.lit(text))
        .alias(text.name)
    ).to_series()


def _valid(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
