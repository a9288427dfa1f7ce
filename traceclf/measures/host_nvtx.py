"""What NVTX says the host was doing while the GPU idled: the ranges over the long idle gaps
(the report's ``idle_nvtx``; the NVTX source of host attribution, :mod:`.hostsources`)."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import Taxonomy, matches
from traceclf.model.trace import outermost

TOP_NVTX = 5
JOIN_ROWS = 1 << 22  # gap × range pairs joined at once by nvtx_cover (bounded memory)
NVTX_COUNTERS = r",?\s*\b(seq|op_id|id|step)\s*=\s*\d+"


def long_gaps(gaps: pl.DataFrame) -> pl.DataFrame:
    """The idle gaps the host spent on something else than CUDA calls (causes input, host):
    those NVTX can name."""
    return gaps.filter(pl.col("cause").is_in(["input", "host"]))


def idle_by_nvtx(gaps: pl.DataFrame, w: RankWindow, activities: list[dict]) -> list[dict]:
    """The NVTX ranges the host was in during long idle gaps, most idle time first: what the
    report names instead of guessing "input" (``name``, ``detail``, ``activity``, ``frac`` of
    the window, ``ms_per_step``, ``gaps``).

    For each host activity (compile, checkpoint, ...): the idle time under any of its ranges
    at any depth (a compiler's passes nest and do not each cover half of a gap), named by its
    outermost range with the most of it, its innermost (``detail``) the one that covers each
    gap most often. Ranges of no known activity: the innermost range covering at least half of
    a gap, by name. ``activities``: :func:`activity_cover` of the :func:`long_gaps`."""
    long = long_gaps(gaps)
    if long.is_empty():
        return []
    rows = activities + _by_name(long.filter(pl.col("activity").is_null()))
    top = sorted(rows, key=lambda r: (-r["ns"], r["name"]))[:TOP_NVTX]
    return [
        {
            "name": row["name"],
            "detail": row["detail"],
            "activity": row["activity"],
            "frac": round(row["ns"] / w.wall, 6),
            "ms_per_step": round(row["ns"] / 1e6 / w.n_steps, 4),
            "gaps": row["gaps"],
        }
        for row in top
    ]


def activity_cover(long: pl.DataFrame, w: RankWindow) -> list[dict]:
    """Per host activity, the long gaps' time under the union of its NVTX ranges: ``ns``, the
    ``gaps`` it reaches, its ``name`` (the outermost range with the most of it) and ``detail``
    (the innermost range covering the most gaps), and the covered stretches themselves
    (``lo``, ``hi``: what host attribution claims for it)."""
    if long.is_empty():
        return []
    gstart, gend = long["start"].to_numpy(), long["end"].to_numpy()
    idle = Busy.of_arrays(gstart, gend)
    ranges = host_ranges(w)
    # (only ranges over a long gap can cover one, or enclose one that does: the others are not
    # matched against the activities, millions of op ranges on a PyTorch capture)
    over = idle.covered(ranges["start"].to_numpy(), ranges["end"].to_numpy()) > 0
    ranges = ranges.filter(pl.Series(over))
    ranges = ranges.with_columns(activity=w.taxonomy.host_activity_of(ranges["text"]))
    ranges = ranges.drop_nulls("activity")
    rows = []
    for (activity,), group in ranges.group_by("activity"):
        under = Busy.of(group.select("start", "end"))
        lo, hi = _inside(under, gstart, gend)
        if not len(lo):
            continue
        outer = outermost(group.select("start", "end", "text"))
        named = outer.with_columns(
            ns=pl.Series(idle.covered(outer["start"].to_numpy(), outer["end"].to_numpy())),
            name=_plain("text"),
        )
        by_name = named.group_by("name").agg(pl.col("ns").sum()).sort(["ns", "name"])
        name = by_name["name"][-1]
        inner = long.filter(pl.col("activity") == activity).with_columns(name=_plain("nvtx"))
        innermost = inner.group_by("name").agg(pl.len(), pl.col("nvtx_ns").sum())
        detail = innermost.sort(["len", "nvtx_ns", "name"])["name"][-1] if len(innermost) else None
        rows.append(
            {
                "name": name,
                "detail": detail if detail != name else None,
                "activity": activity,
                "ranges": _shares(by_name),
                "ns": int((hi - lo).sum()),
                "gaps": int((under.covered(gstart, gend) > 0).sum()),
                "lo": lo,
                "hi": hi,
            }
        )
    # (most time first: of activities whose ranges overlap, host attribution credits the first)
    return sorted(rows, key=lambda r: (-r["ns"], r["name"]))


RANGES_NAMED = 3  # an activity's outermost ranges named with their shares, at most


def _shares(by_name: pl.DataFrame) -> str | None:
    """'MPI_Send 51%, MPI_Recv 49%': an activity's outermost ranges by their share of its
    time, where it has several (its row is named after the first: "MPI_Send" read for 174 ms
    half of which was MPI_Recv); None where one range holds it all."""
    if by_name.height < 2:
        return None
    total = max(int(by_name["ns"].sum()), 1)
    top = by_name.sort(["ns", "name"], descending=[True, False]).head(RANGES_NAMED)
    shown = ", ".join(f"{n} {100 * ns / total:.0f}%" for n, ns in top.iter_rows())
    rest = by_name.height - top.height
    return shown + (f" and {rest} more" if rest else "")


def _inside(runs: Busy, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The parts of ``runs`` inside the disjoint sorted intervals [lo, hi), in order."""
    first = np.searchsorted(runs.end, lo, side="right")  # first run ending after each lo
    n = np.maximum(np.searchsorted(runs.start, hi, side="left") - first, 0)
    gap = np.repeat(np.arange(len(lo)), n)
    run = np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    start, end = np.maximum(runs.start[run], lo[gap]), np.minimum(runs.end[run], hi[gap])
    keep = end > start
    return start[keep], end[keep]


def _by_name(named: pl.DataFrame) -> list[dict]:
    """Per NVTX name (of no known activity), the long gaps' time its range covers when it is
    the innermost covering at least half of the gap."""
    named = named.filter(pl.col("nvtx").is_not_null()).with_columns(name=_plain("nvtx"))
    if named.is_empty():
        return []
    per = named.group_by("name").agg(ns=pl.col("nvtx_ns").sum(), gaps=pl.len())
    return [
        {"name": r["name"], "detail": None, "activity": None, "ns": r["ns"], "gaps": r["gaps"]}
        for r in per.iter_rows(named=True)
    ]


def _plain(col: str) -> pl.Expr:
    # PyTorch's ranges carry per-call counters ("aten::addmm, seq = 47595, op_id = 999269"):
    # one name per operator, not per call
    return pl.col(col).str.replace_all(NVTX_COUNTERS, "").str.strip_chars(" ,")


def nvtx_cover(long: pl.DataFrame, w: RankWindow) -> pl.DataFrame:
    """Per gap of ``long`` (start, end, dur) that one covers: the innermost NVTX range of the
    process that covers at least half of it (``nvtx``, ``nvtx_ns`` it covers, ``activity``
    from the taxonomy or the nearest enclosing range's, and its ``r_start``, ``r_end``).

    Step ranges and forward/backward/optimizer phases are skipped: that the host is "in step
    7" says nothing about what it is doing."""
    tax = w.taxonomy
    # (a range covers half of a gap only if it is half as long: of the shortest gap, at least)
    shortest = int(long["dur"].min() or 0)  # type: ignore[arg-type]
    ranges = host_ranges(w, covering=shortest).select("text", r_start="start", r_end="end")
    schema = {
        "start": pl.Int64,
        "nvtx": pl.String,
        "nvtx_ns": pl.Int64,
        "activity": pl.String,
        "r_start": pl.Int64,
        "r_end": pl.Int64,
    }
    if long.is_empty() or ranges.is_empty():
        return pl.DataFrame(schema=schema)
    # gaps a block at a time: each gap meets every range over it, and deeply nested ranges
    # over many gaps would make a join of gaps × depth rows
    per_block = max(JOIN_ROWS // ranges.height, 1)
    blocks = [
        _innermost_cover(long.slice(at, per_block), ranges, tax)
        for at in range(0, long.height, per_block)
    ]
    return pl.concat(blocks).select(pl.col(c).cast(t) for c, t in schema.items())


def _innermost_cover(long: pl.DataFrame, ranges: pl.DataFrame, tax: Taxonomy) -> pl.DataFrame:
    """:func:`nvtx_cover` of the gaps ``long`` among ``ranges`` (text, r_start, r_end)."""
    cover = (
        long.join_where(
            ranges, pl.col("r_start") < pl.col("end"), pl.col("r_end") > pl.col("start")
        )
        .with_columns(
            nvtx_ns=pl.min_horizontal("end", "r_end") - pl.max_horizontal("start", "r_start")
        )
        .filter(pl.col("nvtx_ns") * 2 >= pl.col("dur"))
        .with_columns(activity=tax.host_activity())
    )
    # innermost = latest start (of ranges starting together, the first to end, then by text:
    # the same range whatever order the join gave them); its activity, or the nearest
    # enclosing range's that has one
    return (
        cover.sort(["r_start", "r_end", "text"], descending=[True, False, False])
        .group_by("start", maintain_order=True)
        .agg(
            nvtx=pl.col("text").first(),
            nvtx_ns=pl.col("nvtx_ns").first(),
            activity=pl.col("activity").drop_nulls().first(),
            r_start=pl.col("r_start").first(),
            r_end=pl.col("r_end").first(),
        )
    )


def host_ranges(w: RankWindow, covering: int = 0) -> pl.DataFrame:
    """The process's NVTX ranges (text, start, end) that can say what the host was doing:
    step ranges and forward/backward/optimizer phases say nothing ("in step 7"). With
    ``covering``, only those long enough to cover half of that many ns (tested first: an op's
    range of a few us, one per kernel launch, covers no long gap)."""
    generic = w.taxonomy.step_or_phase()
    step_names = w.steps.table["name"].unique().implode()
    ranges = w.trace.nvtx
    if covering > 0:
        ranges = ranges.filter((pl.col("end") - pl.col("start")) * 2 >= covering)
    return ranges.filter(
        ~pl.col("text").is_in(step_names) & ~matches(ranges["text"], generic)
    ).select("text", "start", "end")
