"""Interval arithmetic on polars frames of ``start``/``end`` (ns): clipping, unions, and the
state timeline that every busy/idle/overlap measure is read from."""

from __future__ import annotations

import polars as pl

Window = tuple[int, int]


def clip(df: pl.DataFrame, window: Window) -> pl.DataFrame:
    """Rows overlapping ``window``, with start/end clipped to it."""
    lo, hi = window
    return df.filter((pl.col("start") < hi) & (pl.col("end") > lo)).with_columns(
        start=pl.col("start").clip(lower_bound=lo), end=pl.col("end").clip(upper_bound=hi)
    )


def union(df: pl.DataFrame) -> pl.DataFrame:
    """Merge overlapping intervals into disjoint ones (columns start, end), sorted."""
    if df.is_empty():
        return pl.DataFrame(schema={"start": pl.Int64, "end": pl.Int64})
    return (
        df.select("start", "end")
        .sort("start")
        .with_columns(reach=pl.col("end").cum_max())
        .with_columns(new=(pl.col("start") > pl.col("reach").shift(1)).fill_null(True))
        .with_columns(first=pl.when("new").then("start").forward_fill())
        # the last row of each merged run carries the run's end (its running max)
        .filter(pl.col("new").shift(-1).fill_null(True))
        .select(start="first", end="reach")
    )


def total(df: pl.DataFrame) -> int:
    """Total length of the union of the intervals."""
    merged = union(df)
    return int((merged["end"] - merged["start"]).sum()) if len(merged) else 0


def timeline(
    layers: dict[str, pl.DataFrame], window: Window, cuts: list[int] | None = None
) -> pl.DataFrame:
    """Sweep the window once and return disjoint segments with how many intervals of each
    layer are active in each (columns start, end, dur, and one count column per layer).

    ``cuts`` are extra boundaries (e.g. step starts) so that no segment crosses one.
    """
    events = [
        pl.concat(
            [
                clip(df, window).select(t="start", **{name: pl.lit(1, pl.Int32)}),
                clip(df, window).select(t="end", **{name: pl.lit(-1, pl.Int32)}),
            ]
        )
        for name, df in layers.items()
    ]
    bounds = [window[0], window[1], *(cuts or [])]
    events.append(pl.DataFrame({"t": bounds}, schema={"t": pl.Int64}))
    counts = (
        pl.concat(events, how="diagonal")
        .with_columns(pl.col(n).fill_null(0) for n in layers)
        .sort("t")
        .with_columns(pl.col(n).cum_sum() for n in layers)
        # several events at one instant: the count after the last of them holds from there on
        .filter(pl.col("t") != pl.col("t").shift(-1).fill_null(-1))
    )
    return (
        counts.with_columns(end=pl.col("t").shift(-1))
        .rename({"t": "start"})
        .filter(
            pl.col("end").is_not_null()
            & (pl.col("start") >= window[0])
            & (pl.col("end") <= window[1])
        )
        .with_columns(dur=pl.col("end") - pl.col("start"))
    )
