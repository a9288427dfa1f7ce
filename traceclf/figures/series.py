"""The small series the report's figures are drawn from, computed per rank while its trace is
loaded (the report keeps them in ``series``): the per-step breakdown, the idle-gap histogram
and the GPU metrics over the window."""

from __future__ import annotations

import polars as pl

from traceclf.measures import timeline
from traceclf.measures.compute import METRICS_OF_INTEREST
from traceclf.measures.host import IDLE_CAUSES
from traceclf.measures.window import RankWindow

GAP_BINS_NS = [1_000 * 10 ** (i / 2) for i in range(15)]  # 1 µs .. 10 s, half-decade steps


def step_breakdown(w: RankWindow) -> list[dict]:
    """Per steady step: ns of compute, exposed communication, exposed copies and idle."""
    steady = w.steps.steady
    if steady.is_empty():
        return []
    c, k, p = pl.col("compute") > 0, pl.col("comm") > 0, pl.col("copy") > 0
    seg = (
        w.timeline.with_columns(
            state=pl.when(c)
            .then(pl.lit("compute"))
            .when(k)
            .then(pl.lit("exposed_comm"))
            .when(p)
            .then(pl.lit("copy"))
            .otherwise(pl.lit("idle")),
            comm_ns=pl.when(k).then(pl.col("dur")).otherwise(0),
        )
        .sort("start")
        .join_asof(
            steady.select("index", step_start="gpu_start").sort("step_start"),
            left_on="start",
            right_on="step_start",
            strategy="backward",
        )
        .filter(pl.col("index").is_not_null())
    )
    per = (
        seg.group_by("index", "step_start")
        .agg(
            *(
                pl.col("dur").filter(pl.col("state") == s).sum().alias(s)
                for s in ("compute", "exposed_comm", "copy", "idle")
            ),
            comm_total=pl.col("comm_ns").sum(),
        )
        .sort("index")
    )
    return per.to_dicts()


def gap_histogram(gaps: pl.DataFrame) -> dict[str, list]:
    """Count and total time of idle gaps per cause in log-spaced length bins
    (bin i holds gaps in [edges[i-1], edges[i]); bin 0 is below 1 µs)."""
    n_bins = len(GAP_BINS_NS) + 1
    binned = (
        gaps.with_columns(
            bin=pl.lit(pl.Series(GAP_BINS_NS)).search_sorted(pl.col("dur"), side="right")
        )
        .group_by("cause", "bin")
        .agg(count=pl.len(), time=pl.col("dur").sum())
    )
    out: dict[str, list] = {"edges_ns": GAP_BINS_NS}
    for cause in IDLE_CAUSES:
        rows = binned.filter(pl.col("cause") == cause)
        counts, time = [0] * n_bins, [0] * n_bins
        for b, c, t in rows.select("bin", "count", "time").iter_rows():  # <= 16 rows
            counts[b], time[b] = int(c), int(t)
        out[cause] = counts
        out[f"{cause}_ns"] = time
    return out


def metric_series(
    metrics: pl.DataFrame, window: timeline.Spans, points: int = 400
) -> dict[str, list]:
    """GPU metrics averaged into ``points`` bins over the window (from its first to its last
    ns: a window of several spans shows no samples between them), per metric."""
    inside = metrics.filter(
        timeline.inside("timestamp", window)
        & pl.col("metric").is_in(list(METRICS_OF_INTEREST.values()))
    )
    if inside.is_empty():
        return {}
    spans = timeline.spans_of(window)
    window = (spans[0][0], spans[-1][1])
    width = max((window[1] - window[0]) // points, 1)
    binned = (
        inside.with_columns(bin=((pl.col("timestamp") - window[0]) // width))
        .group_by("metric", "bin")
        .agg(pl.col("value").mean())
        .sort("bin")
    )
    out: dict[str, list] = {}
    # sorted, so the report's JSON is the same from run to run
    for (metric,), rows in sorted(binned.group_by(["metric"]), key=lambda g: str(g[0][0])):
        out[str(metric)] = [
            [int(b * width), round(float(v), 2)]
            for b, v in zip(rows["bin"], rows["value"], strict=True)
        ]
    return out
