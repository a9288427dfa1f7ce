"""NVTX ranges that recur in the steady step besides the step and the forward, backward and
optimizer phases (``moe_dispatch``, ``experts``, ``ncclAlltoAll``, ...), projected onto the GPU:
how long per step the GPU work they launched spans, and how much of that the GPU was busy.
``traceclf compare`` diffs the ranges two runs share, phase by phase.

A range is projected like a step or a phase (first start to last end of the work launched by
the CUDA calls inside it); ranges of one name are united, so a row counts no ns twice, while
ranges of different names may nest and overlap. PyTorch's per-call counters (``seq = 47595``)
are dropped from names. A range name recurs when its GPU spans start in at least half of the
analysed steps, at most MAX_PER_STEP times per step on average; the RANGE_ROWS longest are
kept.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.host_nvtx import NVTX_COUNTERS
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import matches, numbered
from traceclf.model.trace import outermost

RANGE_ROWS = 12
# A name opened more often than this per step marks operators (PyTorch's emit_nvtx, CUB's own
# ranges around each sort), not a phase of the step; leaving them out also keeps the
# projection cheap on captures of millions of kernels.
MAX_PER_STEP = 64
# Recurring ranges nested deeper than this among themselves are not projected (each level is
# one pass over the kernels' launches); a name with a range that deep is left out whole.
MAX_DEPTH = 8


def recurring_ranges(w: RankWindow, starts: np.ndarray) -> list[dict]:
    """Per recurring range name: ``ms`` (its GPU span per step), ``sd_ms`` (the sample standard
    deviation of that span per step, steps without it counting 0; null with one step),
    ``busy_ms``, ``idle_ms``, ``instances`` (ranges per step) and ``steps`` (analysed steps it
    starts in); ``starts``: the analysed steps' GPU starts, sorted."""
    trace = w.trace
    n = len(starts)
    if trace.nvtx.is_empty() or not w.host_traced or not n:
        return []
    candidates = _candidates(w, n)
    spans = _projected(trace, candidates.with_columns(pl.col("range_id").cast(pl.Int64)))
    runs = _united(intervals.clip(spans, w.spans)).sort("start")  # (queries in time order)
    if runs.is_empty():
        return []
    lo, hi = runs["start"].to_numpy(), runs["end"].to_numpy()
    table = (
        runs.with_columns(
            busy=pl.Series(w.layers.work.covered(lo, hi)),
            step=pl.Series(np.searchsorted(starts, lo, side="right") - 1),
        )
        .group_by("name", "step")
        .agg(
            ns=(pl.col("end") - pl.col("start")).sum(),
            busy=pl.col("busy").sum(),
            instances=pl.col("ranges").sum(),
        )
        .group_by("name")
        .agg(
            pl.col("ns", "busy", "instances").sum(),
            squares=(pl.col("ns").cast(pl.Float64) ** 2).sum(),
            steps=pl.col("step").n_unique(),
        )
        .filter((pl.col("steps") * 2 >= n) & (pl.col("instances") <= MAX_PER_STEP * n))
        .sort(["ns", "name"], descending=[True, False])
        .head(RANGE_ROWS)
    )
    return [
        {
            "name": r["name"],
            "ms": round(r["ns"] / 1e6 / n, 6),
            "sd_ms": sd_ms(r["ns"], r["squares"], n),
            "busy_ms": round(r["busy"] / 1e6 / n, 6),
            "idle_ms": round((r["ns"] - r["busy"]) / 1e6 / n, 6),
            "instances": round(r["instances"] / n, 4),
            "steps": r["steps"],
        }
        for r in table.to_dicts()
    ]


def _candidates(w: RankWindow, n: int) -> pl.DataFrame:
    """The ranges (range_id, start, end, name) of the names that may recur in ``n`` analysed
    steps: named, the step's and the phase table's left out, counted per name."""
    nvtx = w.trace.nvtx
    name = pl.col("text").cast(pl.String).str.replace_all(NVTX_COUNTERS, "").str.strip_chars(" ,")
    if numbered(nvtx["text"]):
        # texts that number their ranges (PyTorch's emit_nvtx: "aten::mm, seq = 7") each
        # differ: each range is named (4.8 M: 1.4 s), not each distinct text (3.6 s)
        named = nvtx.select("start", "end", name=name)
        counts = _names(named.group_by("name").len(), w)
        frequent = _frequent(counts, w, n)
        return named.join(frequent, on="name", how="semi").with_row_index("range_id")
    # names per distinct text, counted (a regex per text, not per range: hundreds of
    # thousands of ranges over a long capture, a few dozen texts)
    texts = _names(nvtx.group_by("text").len().with_columns(name=name), w)
    frequent = _frequent(texts.group_by("name").agg(pl.col("len").sum()), w, n)
    chosen = texts.join(frequent, on="name", how="semi").select("text", "name")
    return (
        nvtx.select("start", "end", "text")
        .join(chosen, on="text", how="inner")
        .drop("text")
        .with_row_index("range_id")
    )


def _names(named: pl.DataFrame, w: RankWindow) -> pl.DataFrame:
    """``named``'s rows whose name is one (not the step's or a phase table's range)."""
    named = named.filter(pl.col("name").is_not_null() & (pl.col("name") != ""))
    return named.filter(~matches(named["name"], w.taxonomy.step_or_phase()).fill_null(False))


def _frequent(counts: pl.DataFrame, w: RankWindow, n: int) -> pl.DataFrame:
    """The names of ``counts`` (name, len) with enough ranges to recur in ``n`` analysed steps:
    as many as half of them to recur in half of them (the capture's NVTX ranges span all its
    steps, analysed or not: step sampling), and at most MAX_PER_STEP a step."""
    return counts.filter(
        (pl.col("len") * 2 >= n) & (pl.col("len") <= MAX_PER_STEP * max(w.steps.count, n))
    ).select("name")


def _projected(trace, ranges: pl.DataFrame) -> pl.DataFrame:
    """GPU spans (name, start, end) of the ranges (range_id, name, start, end), one nesting
    level at a time (a projection counts each kernel for the outermost range around its
    launch only); names with a range nested deeper than MAX_DEPTH are left out."""
    parts = [
        pl.DataFrame(schema={"range_id": pl.Int64, "gpu_start": pl.Int64, "gpu_end": pl.Int64})
    ]
    remaining = ranges.select("start", "end", "range_id")
    for _ in range(MAX_DEPTH):
        if remaining.is_empty():
            break
        level = outermost(remaining)
        parts.append(trace.gpu_spans(level, "range_id"))
        remaining = remaining.join(level.select("range_id"), on="range_id", how="anti")
    deep = ranges.join(remaining, on="range_id", how="semi")["name"].unique()
    return (
        pl.concat(parts)
        .join(ranges.select("range_id", "name"), on="range_id")
        .filter(~pl.col("name").is_in(deep.implode()))
        .select("name", start="gpu_start", end="gpu_end")
    )


def _united(spans: pl.DataFrame) -> pl.DataFrame:
    """Each name's spans united into disjoint runs (name, start, end, ranges)."""
    return (
        spans.sort("name", "start")
        .with_columns(reach=pl.col("end").cum_max().shift(1).over("name"))
        .with_columns(
            run=(pl.col("reach").is_null() | (pl.col("start") > pl.col("reach"))).cum_sum()
        )
        .group_by("name", "run")
        .agg(pl.col("start").min(), pl.col("end").max(), ranges=pl.len())
        .drop("run")
    )


def sd_ms(total: int, squares: float, n: int) -> float | None:
    """The sample standard deviation (ms) of a time per step over ``n`` steps, from its sum
    and its sum of squares (steps without it count 0); None for one step."""
    if n < 2:
        return None
    variance = max(squares - total * total / n, 0.0) / (n - 1)
    return round(variance**0.5 / 1e6, 6)
