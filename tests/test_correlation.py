"""traceclf/correlation.py: which CUDA call launched a GPU operation, on CONSTRUCTED frames
(no export: the cases real traces rarely show — several processes, calls out of
correlationId order, a correlationId used twice, nulls), checked against a plain join."""

from __future__ import annotations

import polars as pl
import pytest

from traceclf.model import correlation
from traceclf.model.correlation import CallIndex


def first_call(api: pl.DataFrame, pid: list, corr: list) -> list:
    """The reference: the first row (frame order) of each (pid, correlation_id)."""
    rows = api.with_row_index("row").group_by("pid", "correlation_id").agg(pl.col("row").min())
    query = pl.DataFrame(
        {"pid": pid, "correlation_id": corr}, schema=api.select(rows.columns[:2]).schema
    )
    found = query.join(rows, on=["pid", "correlation_id"], how="left", maintain_order="left")
    return [-1 if r is None else r for r in found["row"].to_list()]


@pytest.mark.parametrize(
    "api",
    [
        pl.DataFrame({"pid": [7] * 5, "correlation_id": [1, 2, 3, 5, 8]}),  # one process, in order
        pl.DataFrame({"pid": [7] * 5, "correlation_id": [3, 1, 2, 1, 9]}),  # out of order, a twin
        pl.DataFrame({"pid": [7, 8, 7, 8, 7], "correlation_id": [1, 1, 2, 2, 1]}),  # processes
        pl.DataFrame({"pid": [7, 7, 7], "correlation_id": [1, None, 2]}),  # a call without id
        pl.DataFrame({"pid": [7, 8], "correlation_id": [1 << 40, 3]}),  # beyond the packed key
        pl.DataFrame(schema={"pid": pl.Int64, "correlation_id": pl.Int64}),  # no calls
    ],
)
def test_first_call_of_each_key(api: pl.DataFrame):
    pid = [7, 7, 8, 7, 9, None, 7, 8]
    corr = [1, 2, 1, 9, 1, 1, None, 1 << 40]
    index = CallIndex(api.with_columns(pl.col("pid", "correlation_id").cast(pl.Int64)))
    got = index.find(pl.Series(pid, dtype=pl.Int64), pl.Series(corr, dtype=pl.Int64))
    assert got.tolist() == first_call(api.cast(pl.Int64), pid, corr)


def test_column_is_null_where_no_call_launched_it():
    api = pl.DataFrame({"pid": [7, 7], "correlation_id": [4, 6], "end": [40, 60]})
    index = CallIndex(api)
    ends = index.column("end", pl.Series([7, 7, 7]), pl.Series([6, 5, 4]))
    assert ends.to_list() == [60, None, 40]


@pytest.mark.parametrize("block", [1 << 20, 7])  # keys and queries ranked in one or many blocks
@pytest.mark.parametrize("spread", [1, 3, 80])  # ids per call: ranked in a bitmap, or searched
def test_ranked_and_searched_keys_agree_with_a_join(
    spread: int, block: int, monkeypatch: pytest.MonkeyPatch
):
    # Constructed: one process's calls with ids spread over a range (a few used twice, the
    # frame out of order), asked for ids in and around it.
    import numpy as np

    monkeypatch.setattr(correlation, "BLOCK", block)

    rng = np.random.default_rng(spread)
    ids = np.sort(rng.choice(600 * spread, 600, replace=False)) + 5
    ids = np.concatenate([ids, ids[::50]])
    rng.shuffle(ids)
    api = pl.DataFrame(
        {"pid": [3] * len(ids), "correlation_id": ids},
        schema={"pid": pl.Int64, "correlation_id": pl.Int64},
    )
    corr = [*rng.integers(0, 600 * spread + 10, 2000).tolist(), None]
    pid = [3] * (len(corr) - 2) + [4, 3]
    got = CallIndex(api).find(pl.Series(pid, dtype=pl.Int64), pl.Series(corr, dtype=pl.Int64))
    assert got.tolist() == first_call(api, pid, corr)


def test_narrower_queries_than_keys_find_nothing_false():
    # Constructed: Int32 ids asked of Int64 calls (an API user's frames; the loader reads both
    # as Int64): compared as Int64, not wrapped.
    for ids, query in (
        ([3_000_000_000, 3_000_000_010], [5]),
        ([2**31 - 5, 2**31 + 5], [-(2**31) + 5]),
    ):
        api = pl.DataFrame({"pid": [1] * len(ids), "correlation_id": ids})
        got = CallIndex(api).find(pl.Series([1]), pl.Series(query, dtype=pl.Int32))
        assert got.tolist() == [-1]
