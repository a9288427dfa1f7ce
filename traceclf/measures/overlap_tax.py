"""What overlap costs compute: kernels that run both with no communication in flight and beside
a communication kernel run slower beside it (NCCL's kernels take SMs and memory bandwidth), so
overlapped communication is not free.

A kernel shape is its (full, demangled) name and launch shape (grid and block); a launch runs *alone* when no
communication kernel of the rank is in flight at any time of it, *beside* one when
communication covers at least half of it. For every shape with at least
:data:`MIN_LAUNCHES` launches each way in the window, the tax is (median duration beside -
median duration alone) x launches beside. On a GPU that ranks share, "alone" and "beside"
speak of this rank's kernels only: the other process's kernels may run in both, so a slowdown
also holds its time slices (the report says so).
"""

from __future__ import annotations

import polars as pl

from traceclf.measures import intervals
from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "overlap_tax_frac": "compute kernels slower beside communication: for each kernel name and "
    "launch shape (grid, block) run both with no communication kernel of the rank in flight and "
    "beside one (over half its duration), (median beside - median alone) x launches beside, "
    "summed over shapes, as a share of the window (0 when none runs slower; null: no shape runs "
    "both ways at least 3 times)",
}
BESIDE_COVER = 0.5  # communication covers at least this share of a launch: it ran beside it
MIN_LAUNCHES = 3  # launches each way for a median that says something
MAX_SHAPES = 5  # shapes reported (the largest taxes)


def overlap_tax(w: RankWindow) -> tuple[dict[str, float | None], list[dict]]:
    """``overlap_tax_frac`` and the shapes behind it (largest tax first: kernel, grid, block,
    medians alone and beside in µs, slowdown, launches beside per step, ms per step)."""
    kern = w.kern.filter(~pl.col("is_comm").fill_null(False) & pl.col("graph_node_id").is_null())
    # whole launches only: a kernel cut at the window's edge has no duration of its own here
    edges = [t for span in intervals.spans_of(w.spans) for t in span]
    kern = kern.filter(~pl.col("start").is_in(edges) & ~pl.col("end").is_in(edges))
    if kern.is_empty() or w.layers.comm.total == 0:
        return {"overlap_tax_frac": None}, []
    start, end = kern["start"].to_numpy(), kern["end"].to_numpy()
    cover = w.layers.comm.covered(start, end)
    dur = end - start
    runs = kern.select(
        "name", "short_name", "grid_blocks", "block_threads", dur=pl.Series(dur)
    ).with_columns(
        way=pl.when(pl.Series(cover) == 0)
        .then(pl.lit("alone"))
        .when(pl.Series(cover) >= BESIDE_COVER * pl.col("dur"))
        .then(pl.lit("beside"))
    )
    shape = ["name", "grid_blocks", "block_threads"]
    per = (
        runs.drop_nulls("way")
        .group_by(*shape)
        .agg(
            pl.col("short_name").first(),
            n_alone=(pl.col("way") == "alone").sum(),
            n_beside=(pl.col("way") == "beside").sum(),
            alone=pl.col("dur").filter(pl.col("way") == "alone").median(),
            beside=pl.col("dur").filter(pl.col("way") == "beside").median(),
        )
        .filter((pl.col("n_alone") >= MIN_LAUNCHES) & (pl.col("n_beside") >= MIN_LAUNCHES))
        .with_columns(tax=(pl.col("beside") - pl.col("alone")) * pl.col("n_beside"))
    )
    if per.is_empty():
        return {"overlap_tax_frac": None}, []
    total = float(per["tax"].sum())
    n = w.n_steps
    shapes = [
        {
            "kernel": str(r["short_name"]),
            "grid": r["grid_blocks"],
            "block": r["block_threads"],
            "alone_us": round(r["alone"] / 1e3, 3),
            "beside_us": round(r["beside"] / 1e3, 3),
            "slowdown_frac": round(r["beside"] / r["alone"] - 1, 4) if r["alone"] else None,
            "beside_per_step": round(r["n_beside"] / n, 2),
            "ms_per_step": round(r["tax"] / 1e6 / n, 4),
        }
        for r in per.sort("tax", descending=True).head(MAX_SHAPES).iter_rows(named=True)
    ]
    return {"overlap_tax_frac": max(total, 0.0) / w.wall}, shapes
