"""What one rank's steady step is made of, kernel by kernel, for ``traceclf compare``: each
kernel's time per step with its step-to-step spread, its launch shapes, and the step's account
(kernel time, overlap between kernels, copies, idle by cause) that a comparison reconciles.

Kernel time is the kernels' own durations clipped to the window, each counted in the step its
start falls in; a graph-level traced CUDA-graph replay counts as one kernel named after its
graph (its kernels are not rows of the export). Summed over kernels this is more than the
time any kernel runs when kernels overlap (streams), less when a graph replay's span has
gaps between its node kernels; ``overlap_ms`` is that difference, so that

    window per step = kernel_ms - overlap_ms + copy_ms + idle_ms

holds exactly on every rank. The block is bounded: the ``KERNEL_ROWS`` kernels with the most
time, and one ``other`` row for the rest; and the recurring NVTX ranges besides the step and
its phases (:mod:`traceclf.measures.nvtx_ranges`).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.intervals import Busy
from traceclf.measures.nvtx_ranges import recurring_ranges
from traceclf.measures.window import RankWindow

KERNEL_ROWS = 200  # kernels listed per rank; the rest are summed into `other`
SHAPES = 8  # launch shapes (grid, block) listed per kernel, most instances first


def step_kernels(w: RankWindow, gaps: pl.DataFrame, breakdown: list[dict]) -> dict:
    """The rank's step account and per-kernel rows over the analysed steady steps
    (``breakdown``: :func:`traceclf.measures.series.step_breakdown`; ``gaps``:
    :func:`traceclf.measures.host.idle_gaps`); ``{}`` without steps."""
    if not breakdown:
        return {}
    n = len(breakdown)
    starts = np.array([row["step_start"] for row in breakdown], np.int64)
    work = w.layers
    per_step = {
        "steps": n,
        "step_ms": _ms(w.wall, n),
        "copy_ms": _ms(work.work.total - work.compute_comm.total, n),
        "idle_ms": _ms(w.wall - work.work.total, n),
        "idle_sd_ms": _sd_ms(np.array([row["idle"] for row in breakdown], np.float64)),
        "idle_by_cause_ms": _idle_by_cause(gaps, n),
        "graph_ms": _ms(Busy.of(w.graph_spans).total, n),
    }
    launches = _launches(w, starts)
    kernels = (
        launches.group_by("name", "step")
        .agg(pl.col("short_name").first(), pl.col("ns", "instances").sum())
        .join(_family_of(launches), on="name", how="left")
    )
    kernel_ns = int(kernels["ns"].sum())
    per_step["kernel_ms"] = _ms(kernel_ns, n)
    per_step["overlap_ms"] = _ms(kernel_ns - work.compute_comm.total, n)
    rows, other = _rows(kernels, _shapes(launches, n), n)
    return per_step | {"kernels": rows, "other": other, "ranges": recurring_ranges(w, starts)}


def _launches(w: RankWindow, starts: np.ndarray) -> pl.DataFrame:
    """ns and instances of each kernel (and graph-level replay) per analysed step, launch
    shape and family: name, step, grid_blocks, block_threads, short_name, family, ns,
    instances. One
    pass over the kernels (millions with --all-steps), grouped on the names' Categorical
    codes; names as text after it (a few hundred of them)."""
    kernels = (
        w.kern.lazy()  # (lazy: the columns it reads, not a copy of each, -40% on 2 M kernels)
        .select(
            "name",
            "grid_blocks",
            "block_threads",
            "short_name",
            "family",
            step=_step_of(w.kern["start"], starts),
            dur=pl.col("end") - pl.col("start"),
        )
        # (by family too: a kernel inside the optimizer's runs and outside them is two rows,
        # each with its own time, which :func:`_family_of` weighs)
        .group_by("name", "step", "grid_blocks", "block_threads", "family")
        .agg(pl.col("short_name").first(), ns=pl.col("dur").sum(), instances=pl.len())
        .with_columns(pl.col("name", "short_name", "family").cast(pl.String))
        .collect()
    )
    replays = (
        w.graphs.select(
            name=pl.format("CUDA graph {}", pl.col("graph_id")),
            step=_step_of(w.graphs["start"], starts),
            dur=pl.col("end") - pl.col("start"),
        )
        .group_by("name", "step")
        .agg(ns=pl.col("dur").sum(), instances=pl.len())
        .with_columns(
            short_name=pl.col("name"),
            family=pl.lit("cuda_graph"),
            grid_blocks=pl.lit(None),
            block_threads=pl.lit(None),
        )
    )
    return pl.concat([kernels, replays.select(kernels.columns)], how="vertical_relaxed")


def _family_of(launches: pl.DataFrame) -> pl.DataFrame:
    """Each kernel's family: of a kernel launched in several (an elementwise kernel is the
    optimizer's inside its runs), the one with most time, then the first by name; decided
    once, so that no later grouping takes whichever row its groups happen to come in."""
    return (
        launches.group_by("name", "family")
        .agg(pl.col("ns").sum())
        .sort(["name", "ns", "family"], descending=[False, True, False], nulls_last=True)
        .unique("name", keep="first", maintain_order=True)
        .select("name", "family")
    )


def _step_of(start: pl.Series, starts: np.ndarray) -> pl.Series:
    """The analysed step each start falls in (by the steps' GPU starts)."""
    return pl.Series(np.searchsorted(starts, start.to_numpy(), side="right") - 1, dtype=pl.Int64)


def _rows(per: pl.DataFrame, shapes: pl.DataFrame, n: int) -> tuple[list[dict], dict]:
    """Per kernel: ms per step (mean over the ``n`` steps, steps without it counting 0), the
    sample standard deviation of its time per step, instances per step and launch shapes; the
    KERNEL_ROWS longest, and the rest summed step by step into one row."""
    totals = per.group_by("name").agg(total=pl.col("ns").sum())
    listed = totals.sort(["total", "name"], descending=[True, False]).head(KERNEL_ROWS)
    keyed = per.with_columns(
        key=pl.when(pl.col("name").is_in(listed["name"].implode())).then(pl.col("name"))
    )
    steps = keyed.group_by("key", "step").agg(
        pl.col("name", "short_name", "family").first(),
        pl.col("ns", "instances").sum(),
    )
    stats = (
        steps.group_by("key")
        .agg(
            pl.col("short_name", "family").first(),
            kernels=pl.col("name").n_unique(),
            total=pl.col("ns").sum(),
            square=(pl.col("ns").cast(pl.Float64) ** 2).sum(),
            instances=pl.col("instances").sum(),
        )
        .with_columns(
            ms=(pl.col("total") / 1e6 / n).round(6),
            sd_ms=_sd(pl.col("total").cast(pl.Float64), pl.col("square"), n).round(6),
            instances=(pl.col("instances") / n).round(4),
        )
        .join(shapes, left_on="key", right_on="name", how="left")
        .sort(["total", "key"], descending=[True, False], nulls_last=True)
    )
    rows = [
        {
            "name": r["key"],
            "short_name": r["short_name"],
            "family": r["family"],
            "ms": r["ms"],
            "sd_ms": r["sd_ms"],
            "instances": r["instances"],
            "shapes": [[s["grid"], s["block"], s["instances"]] for s in r["shapes"] or []],
        }
        for r in stats.filter(pl.col("key").is_not_null()).to_dicts()
    ]
    rest = stats.filter(pl.col("key").is_null())
    other = (
        {k: rest[k][0] for k in ("kernels", "ms", "sd_ms", "instances")}
        if rest.height
        else {"kernels": 0, "ms": 0.0, "sd_ms": 0.0 if n > 1 else None, "instances": 0.0}
    )
    return rows, other


def _sd(total: pl.Expr, square: pl.Expr, n: int) -> pl.Expr:
    """Sample standard deviation (ms) over ``n`` steps of a per-step time whose steps sum to
    ``total`` ns and whose squares sum to ``square``; steps without it count 0. Null for one
    step."""
    if n < 2:
        return pl.lit(None, pl.Float64)
    variance = (square - total**2 / n) / (n - 1)
    return variance.clip(lower_bound=0).sqrt() / 1e6


def _shapes(launches: pl.DataFrame, n: int) -> pl.DataFrame:
    """Per kernel name: its launch shapes (grid blocks, threads per block, instances per
    step), the SHAPES most launched; none for graph replays."""
    counted = (
        launches.filter(pl.col("grid_blocks").is_not_null() | pl.col("block_threads").is_not_null())
        .group_by("name", "grid_blocks", "block_threads")
        .agg(pl.col("instances").sum())
        .sort(["instances", "grid_blocks", "block_threads"], descending=[True, False, False])
    )
    return counted.group_by("name", maintain_order=True).agg(
        shapes=pl.struct(
            grid=pl.col("grid_blocks"),
            block=pl.col("block_threads"),
            instances=(pl.col("instances") / n).round(4),
        ).head(SHAPES)
    )


def _idle_by_cause(gaps: pl.DataFrame, n: int) -> dict[str, float]:
    """ms per step of idle gaps by cause (millions of gaps: one pass, no copy of them)."""
    ns = gaps.select(
        **{cause: pl.col("dur").filter(pl.col("cause") == cause).sum() for cause in IDLE_CAUSES}
    ).row(0, named=True)
    return {cause: _ms(int(ns[cause]), n) for cause in IDLE_CAUSES}


def _ms(ns: float, n: int) -> float:
    return round(ns / 1e6 / n, 6)


def _sd_ms(ns: np.ndarray) -> float | None:
    return round(float(np.std(ns, ddof=1)) / 1e6, 6) if len(ns) > 1 else None
