"""Interval arithmetic, the one place for it: every busy / idle / overlap measure is the length
of a union of intervals (``start``/``end``, ns), or a difference of two: time with compute and
no communication is |compute ∪ comm| − |comm|.

- On polars frames: :func:`clip` to the window, :func:`union`, :func:`total`, :func:`covered`,
  and :func:`sweep`, the state timeline of several layers (how many intervals of each are
  active in each segment) when the counts matter, not just whether any is active.
- On numpy arrays in start order (millions of kernels in a kernel-dense capture): one linear
  pass per union instead of sorting every start and end event: :func:`union_sorted`,
  :func:`runs` (block by block), :class:`Busy` (the time a union covers before any instant).

The window is one ``(lo, hi)`` span or several disjoint ones in time order (the analysed
steps when a long capture is sampled: :attr:`traceclf.steps.steady.Steps.spans`); time
between the spans is not part of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import polars as pl

Span = tuple[int, int]  # (start, end) ns on the session's timeline
Spans = Span | Sequence[Span]  # one span, or several disjoint ones in time order


def spans_of(window: Spans) -> list[Span]:
    """The spans of a window given as one span or several."""
    if len(window) == 2 and not isinstance(window[0], tuple | list):
        return [(int(window[0]), int(window[1]))]  # type: ignore[arg-type]
    return [(int(lo), int(hi)) for lo, hi in window]  # type: ignore[misc]


def complement(window: Spans) -> list[Span]:
    """The spans of time outside the window's spans, to either side of it included."""
    bounds = [t for span in spans_of(window) for t in span]
    edges = [-_FAR, *bounds, _FAR]
    return [(lo, hi) for lo, hi in zip(edges[::2], edges[1::2], strict=True) if hi > lo]


_FAR = 1 << 62  # (times are ns since the session start: far beyond any)


def length(window: Spans) -> int:
    """Total length of the window's spans (ns)."""
    return sum(hi - lo for lo, hi in spans_of(window))


def clip(df: pl.DataFrame, window: Spans) -> pl.DataFrame:
    """Rows overlapping ``window``, with start/end clipped to it (a row overlapping several
    spans once per span)."""
    spans = spans_of(window)
    if len(spans) == 1:
        return _clip_one(df, *spans[0])
    if df.is_empty():
        return df
    if df.height >= CLIP_SLICED_ROWS * len(spans) and _start_ordered(df):
        sliced = _clip_sorted(df, spans)
        if sliced is not None:
            return sliced
    # One pass: each row's first and last overlapping span (spans are sorted and disjoint).
    los = pl.Series([lo for lo, _ in spans], dtype=pl.Int64)
    his = pl.Series([hi for _, hi in spans], dtype=pl.Int64)
    rows = df.with_columns(
        _first=pl.lit(his).search_sorted(pl.col("start"), side="right").cast(pl.Int64),
        _last=pl.lit(los).search_sorted(pl.col("end"), side="left").cast(pl.Int64) - 1,
    ).filter(pl.col("_first") <= pl.col("_last"))
    if (rows["_last"] > rows["_first"]).any():  # a row across a gap: once per span
        rows = rows.with_columns(_first=pl.int_ranges("_first", pl.col("_last") + 1)).explode(
            "_first"
        )
    return rows.with_columns(
        start=pl.max_horizontal("start", pl.lit(los).gather(pl.col("_first"))),
        end=pl.min_horizontal("end", pl.lit(his).gather(pl.col("_first"))),
    ).drop("_first", "_last")


# :func:`clip` cuts rows in start order span by span from this many rows per span on (a few
# polars calls per span: fewer rows are cheaper searched among the spans)
CLIP_SLICED_ROWS = 8192


def _start_ordered(df: pl.DataFrame) -> bool:
    """Rows flagged in start order, with every start and end known."""
    return bool(df["start"].flags["SORTED_ASC"]) and not (
        df["start"].null_count() or df["end"].null_count()
    )


def _clip_sorted(df: pl.DataFrame, spans: list[Span]) -> pl.DataFrame | None:
    """:func:`clip` of rows in start order to several spans, span by span: the rows that
    start in a span, and those before it (after the previous span's) still running at its
    start, are slices of the frame, and only rows crossing an edge get new times (not a search
    among the spans and a new start and end for each of millions of rows). None when a row
    overlaps two spans (then it comes once per span, where :func:`clip` puts it)."""
    start = df["start"].to_numpy()
    end = df["end"].to_numpy()
    los = np.array([lo for lo, _ in spans], np.int64)
    his = np.array([hi for _, hi in spans], np.int64)
    firsts = np.searchsorted(start, los, side="left")
    uptos = np.searchsorted(start, his, side="left")
    # a row that starts before a span's part of the rows and ends after the span starts, other
    # than those that start after the previous span's part (the latest end of the rows before
    # each part against the span's start)
    reach = np.maximum.accumulate(end) if len(end) else end
    before = np.r_[0, uptos[:-1]]  # each span's rows from here: those of earlier spans end
    if len(end) and bool(np.any((before > 0) & (reach[np.maximum(before - 1, 0)] > los))):
        return None
    parts = [
        part
        for lo, hi, a, first, upto in zip(
            los.tolist(),
            his.tolist(),
            before.tolist(),
            firsts.tolist(),
            uptos.tolist(),
            strict=True,
        )
        for part in _cut_sorted(df, a, first, upto, lo, hi)
    ]
    return _in_start_order(pl.concat(parts, rechunk=False))


def _clip_one(df: pl.DataFrame, lo: int, hi: int) -> pl.DataFrame:
    start_sorted = df.height > 0 and df["start"].flags["SORTED_ASC"]
    if not start_sorted:
        return df.filter((pl.col("start") < hi) & (pl.col("end") > lo)).with_columns(
            start=pl.col("start").clip(lower_bound=lo), end=pl.col("end").clip(upper_bound=hi)
        )
    first = int(df["start"].search_sorted(lo, side="left"))
    upto = int(df["start"].search_sorted(hi, side="left"))
    return _in_start_order(pl.concat(_cut_sorted(df, 0, first, upto, lo, hi), rechunk=False))


def _cut_sorted(
    df: pl.DataFrame, a: int, first: int, upto: int, lo: int, hi: int
) -> list[pl.DataFrame]:
    """Rows in start order clipped to [lo, hi): those of rows ``a`` to ``first`` (starting
    before ``lo``) still running at ``lo``, then rows ``first`` to ``upto`` (starting in it).
    Slices, not copies: only rows that cross an edge get new times (a copy of a column of
    millions of rows for a few clipped values would cost more than the rest of the clip)."""
    running = df.slice(a, max(first - a, 0)).filter(pl.col("end") > lo)
    inside = df.slice(first, max(upto - first, 0))
    if not (inside["end"] > lo).all():  # (only an empty row at ``lo`` can fail it)
        inside = inside.filter(pl.col("end") > lo)
    # rows from the first one that ends after ``hi`` on: clipped; those before: as they are
    late = (inside["end"] > hi).arg_true()
    cut = int(late[0]) if len(late) else inside.height
    return [
        running.with_columns(
            start=pl.col("start").clip(lower_bound=lo), end=pl.col("end").clip(upper_bound=hi)
        ),
        inside.slice(0, cut),
        inside.slice(cut).with_columns(end=pl.col("end").clip(upper_bound=hi)),
    ]


def _in_start_order(out: pl.DataFrame) -> pl.DataFrame:
    """``out`` with its start flagged sorted (it is: cut from rows in start order)."""
    return out.with_columns(out["start"].set_sorted()) if out.height else out


def inside(col: str, window: Spans) -> pl.Expr:
    """``col`` (an instant) lies in one of the window's spans, ends included."""
    spans = spans_of(window)
    expr = pl.lit(False)
    for lo, hi in spans:
        expr = expr | pl.col(col).is_between(lo, hi)
    return expr


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


def covered(df: pl.DataFrame, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """ns of each [start, end) that the union of ``df``'s intervals covers: P(end) - P(start),
    with P(t) the length of the union before t (vectorised, no loop over intervals)."""
    merged = union(df)
    if merged.is_empty():
        return np.zeros(len(starts), dtype=np.int64)
    return covered_by_runs(merged["start"].to_numpy(), merged["end"].to_numpy(), starts, ends)


def covered_by_runs(
    lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """ns of each [start, end) that the disjoint sorted runs [lo, hi) cover."""
    if not len(lo):
        return np.zeros(len(starts), dtype=np.int64)
    if len(starts) > len(lo) and _disjoint(starts, ends):
        return _covered_blocks(lo, hi, starts, ends)
    before = np.concatenate([[0], np.cumsum(hi - lo)])

    def prefix(t: np.ndarray) -> np.ndarray:
        n = rank_sorted(lo, t, side="right")  # runs starting at or before t
        over = np.where(n > 0, np.maximum(hi[np.maximum(n - 1, 0)] - t, 0), 0)
        return before[n] - over

    return prefix(ends) - prefix(starts)


def _disjoint(starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether the intervals are in order and none overlaps the next (idle gaps)."""
    return bool(np.all(ends >= starts)) and bool(np.all(starts[1:] >= ends[:-1]))


def _covered_blocks(
    lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """:func:`covered_by_runs` for disjoint sorted intervals and fewer runs: each run
    overlaps a block of consecutive intervals, so only the (run, interval) pairs that overlap
    are visited, not millions of intervals several times over (each pass a fresh array)."""
    first = np.searchsorted(ends, lo, side="right")  # first interval ending after the run starts
    n = np.maximum(np.searchsorted(starts, hi, side="left") - first, 0)  # ... starting before
    run = np.repeat(np.arange(len(lo)), n)
    idx = np.arange(len(run)) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
    part = np.minimum(ends[idx], hi[run]) - np.maximum(starts[idx], lo[run])
    out = np.zeros(len(starts), np.int64)
    np.add.at(out, idx, part)
    return out


def rank_sorted(hay: np.ndarray, needles: np.ndarray, side: str = "left") -> np.ndarray:
    """``np.searchsorted(hay, needles, side)`` (``hay`` sorted), faster when ``needles`` are
    sorted and many more: millions of idle gaps against a few thousand runs. Each element of
    ``hay`` is placed among the needles instead, and the counts summed up: one binary search
    per element of ``hay`` and a linear pass, rather than one search per needle."""
    if len(needles) < RANK_MIN_RATIO * max(len(hay), 1) or not is_sorted(needles):
        return np.searchsorted(hay, needles, side=side)  # type: ignore[call-overload]
    # needle x counts hay element h when h <= x (side "right") or h < x ("left")
    first = np.searchsorted(needles, hay, side="left" if side == "right" else "right")
    counts = np.bincount(first, minlength=len(needles) + 1)[:-1]
    return np.cumsum(counts, out=counts)  # (in place: one array of every needle, not two)


# rank_sorted searches the other way round from this many needles per element of ``hay`` on
# (measured on a kernel-dense capture: 1.8x faster with 2 needles per element, 5x with 500)
RANK_MIN_RATIO = 1


def reach_before(rows: pl.DataFrame, at: np.ndarray) -> np.ndarray:
    """Per instant of ``at``: the latest end of the ``rows`` (start, end) begun before it (``at``
    itself where none was): past ``at``, one still runs then (an idle gap's host in a CUDA
    call begun before it, such as a launch loading its module lazily)."""
    starts, ends = rows["start"].to_numpy(), rows["end"].to_numpy()
    if not len(starts):
        return at.copy()
    if not is_sorted(starts):
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the latest end of the rows begun so far
    before = rank_sorted(starts, at, side="left") - 1
    return np.where(before >= 0, np.maximum(reach[np.maximum(before, 0)], at), at)


def is_sorted(a: np.ndarray) -> bool:
    return len(a) < 2 or bool(np.all(a[1:] >= a[:-1]))


def sweep(
    layers: dict[str, pl.DataFrame], window: Spans, cuts: list[int] | None = None
) -> pl.DataFrame:
    """Sweep the window once and return disjoint segments with how many intervals of each
    layer are active in each (columns start, end, dur, and one count column per layer).

    ``cuts`` are extra boundaries (e.g. step starts) so that no segment crosses one. Segments
    between the spans of a window of several are left out.
    """
    spans = spans_of(window)
    window = (spans[0][0], spans[-1][1])
    events = [
        pl.concat(
            [
                clip(df, spans).select(t="start", **{name: pl.lit(1, pl.Int32)}),
                clip(df, spans).select(t="end", **{name: pl.lit(-1, pl.Int32)}),
            ]
        )
        for name, df in layers.items()
    ]
    bounds = [t for span in spans for t in span] + list(cuts or [])
    events.append(pl.DataFrame({"t": bounds}, schema={"t": pl.Int64}))
    counts = (
        pl.concat(events, how="diagonal")
        .with_columns(pl.col(n).fill_null(0) for n in layers)
        .sort("t")
        .with_columns(pl.col(n).cum_sum() for n in layers)
        # several events at one instant: the count after the last of them holds from there on
        .filter(pl.col("t") != pl.col("t").shift(-1).fill_null(-1))
    )
    segments = (
        counts.with_columns(end=pl.col("t").shift(-1))
        .rename({"t": "start"})
        .filter(
            pl.col("end").is_not_null()
            & (pl.col("start") >= window[0])
            & (pl.col("end") <= window[1])
        )
        .with_columns(dur=pl.col("end") - pl.col("start"))
    )
    if len(spans) > 1:  # span bounds are cuts: a segment is inside a span or between two
        in_span = pl.lit(False)
        for lo, hi in spans:
            in_span = in_span | ((pl.col("start") >= lo) & (pl.col("start") < hi))
        segments = segments.filter(in_span)
    return segments


# Unions on numpy arrays in start order ----------------------------------------------------------


def union_sorted(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the same time as ``start``/``end`` (sorted by start;
    intervals that touch merge, as in :func:`union`)."""
    if not len(start):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    # already disjoint and in order (kernels of one stream): as they are, nothing allocated
    if bool(np.all(start[1:] > end[:-1])) and bool(np.all(end >= start)):
        return start, end
    reach = np.maximum.accumulate(end)
    # a run begins where an interval starts after the reach of those before it, and ends at
    # the reach of the interval before the next run begins (masks of a byte per interval:
    # not index arrays of eight bytes per run, over millions of calls)
    new = np.empty(len(start) + 1, bool)
    new[0] = new[-1] = True
    np.greater(start[1:], reach[:-1], out=new[1:-1])
    return start[new[:-1]], reach[new[1:]]


BLOCK = 1 << 20  # intervals per block of :func:`runs`


def runs(
    start: np.ndarray, end: np.ndarray, mask: np.ndarray, block: int = BLOCK
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The union of the intervals ``mask`` selects (in start order), block by block: each
    block's runs (as :func:`union`), cut where the earlier blocks' reach ended, so disjoint
    from theirs (the first may touch the last before it). Over millions of intervals the
    temporaries stay block sized: every later interval starts after the one that set the
    reach began, so what an interval covers before the reach the earlier blocks covered."""
    reach = None
    for lo in range(0, len(start), block):
        hi = min(lo + block, len(start))
        m = mask[lo:hi]
        s, e = (start[lo:hi], end[lo:hi]) if m.all() else (start[lo:hi][m], end[lo:hi][m])
        if reach is not None:
            later = e > reach
            s, e = np.maximum(s[later], reach), e[later]
        if not len(s):
            continue
        rs, re = union_sorted(s, e)
        reach = int(re[-1])
        yield rs, re


class Busy:
    """Disjoint sorted intervals (runs) and the time they cover before any instant."""

    def __init__(self, start: np.ndarray, end: np.ndarray) -> None:
        keep = end > start  # an empty run covers nothing, and would split a gap in two
        self.start, self.end = (start, end) if keep.all() else (start[keep], end[keep])
        # ns covered before run i (written in place: millions of runs, one array)
        self.before = np.empty(len(self.start) + 1, np.result_type(self.end, self.start, np.int64))
        self.before[0] = 0
        np.subtract(self.end, self.start, out=self.before[1:])
        np.cumsum(self.before[1:], out=self.before[1:])

    @classmethod
    def of(cls, *frames: pl.DataFrame) -> Busy:
        """The union of the intervals (start, end) of ``frames``, in any order."""
        return cls.of_arrays(
            *(_joined([f[col].to_numpy() for f in frames]) for col in ("start", "end"))
        )

    @classmethod
    def of_arrays(cls, start: np.ndarray, end: np.ndarray) -> Busy:
        if len(start) > 1 and not bool(np.all(start[1:] >= start[:-1])):
            order = np.argsort(start, kind="stable")  # a merge of a few sorted runs
            start, end = start[order], end[order]
        return cls(
            *union_sorted(start.astype(np.int64, copy=False), end.astype(np.int64, copy=False))
        )

    def __or__(self, other: Busy) -> Busy:
        """The union, merged in start order by position (a binary search of the fewer runs
        among the more) rather than sorted again: millions of kernel runs and a few copies.
        The order is a stable sort's of ``self``'s runs then ``other``'s."""
        if not len(other.start):
            return self
        if not len(self.start):
            return other
        a, b = self, other
        if len(b.start) > len(a.start):  # (ties: ``a``'s runs first, whichever is searched)
            at_b = np.searchsorted(b.start, a.start, side="left") + np.arange(len(a.start))
            mine = np.zeros(len(a.start) + len(b.start), bool)
            mine[at_b] = True
            return _merge(b, a, ~mine)
        at_b = np.searchsorted(a.start, b.start, side="right") + np.arange(len(b.start))
        mine = np.ones(len(a.start) + len(b.start), bool)
        mine[at_b] = False
        return _merge(a, b, mine)

    @property
    def total(self) -> int:
        return int(self.before[-1])

    def upto(self, t: np.ndarray) -> np.ndarray:
        """ns covered before each instant of ``t``."""
        t = np.asarray(t, np.int64)
        if not len(self.start):
            return np.zeros(t.shape, np.int64)
        # run j is the last to start at or before t (sorted instants: the cheaper way round);
        # it covers min(t, its end) - its start of what is before t. Written in place: one
        # array of t's size and a gather at a time, not six (millions of pieces, both lanes)
        j = rank_sorted(self.start, t, side="right")
        before_any = j == 0
        j -= 1
        np.maximum(j, 0, out=j)
        out = self.end[j]
        np.minimum(out, t, out=out)
        out -= self.start[j]
        out += self.before[j]
        out[before_any] = 0
        return out

    @classmethod
    def lengths(
        cls,
        start: np.ndarray,
        end: np.ndarray,
        mask: np.ndarray,
        bounds: np.ndarray,
        spans: Sequence[tuple[int, int]],
    ) -> np.ndarray:
        """:meth:`within` of the union of the intervals ``mask`` selects (in start order),
        summed over the disjoint runs of each block (:func:`runs`)."""
        out = np.zeros(len(bounds) - 1, np.int64)
        for rs, re in runs(start, end, mask):
            out += cls(rs, re).within(bounds, spans)
        return out

    def covered(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """ns covered inside each [start[i], end[i])."""
        return self.upto(end) - self.upto(start)

    def overlap(self, other: Busy) -> int:
        """ns covered by both."""
        return int(self.covered(other.start, other.end).sum())

    def within(self, bounds: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """ns covered in each part i = [bounds[i], bounds[i + 1]) of the window's spans."""
        out = np.zeros(len(bounds) - 1, np.int64)
        for lo, hi in spans:
            out += self.covered(np.clip(bounds[:-1], lo, hi), np.clip(bounds[1:], lo, hi))
        return out

    def gaps(self, spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The stretches of the spans not covered, as disjoint sorted intervals (touching
        ones merged)."""
        starts, ends = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for lo, hi in spans:
            a = int(np.searchsorted(self.end, lo, side="right"))  # first run ending after lo
            b = max(int(np.searchsorted(self.start, hi, side="left")), a)  # ... before hi
            # (written in place: millions of runs, each temporary the size of all of them)
            edge, nxt = np.empty(b - a + 1, np.int64), np.empty(b - a + 1, np.int64)
            edge[0], nxt[-1] = lo, hi
            np.minimum(self.end[a:b], hi, out=edge[1:])
            np.maximum(self.start[a:b], lo, out=nxt[:-1])
            real = nxt > edge
            starts.append(edge[real])
            ends.append(nxt[real])
            del edge, nxt, real
        start = starts[1] if len(starts) == 2 else np.concatenate(starts)
        end = ends[1] if len(ends) == 2 else np.concatenate(ends)
        # (gaps of one span never touch: only the last of a span and the first of the next)
        return union_sorted(start, end) if len(spans) > 1 else (start, end)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays one after another; one array as it is (a frame's column, read-only: never
    copied for a union that only reads it, millions of calls)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.empty(0, np.int64)


def within_spans(bounds: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """ns of the window's spans in each part i = [bounds[i], bounds[i + 1])."""
    out = np.zeros(len(bounds) - 1, np.int64)
    for lo, hi in spans:
        out += np.clip(bounds[1:], lo, hi) - np.clip(bounds[:-1], lo, hi)
    return out


def _merge(a: Busy, b: Busy, from_a: np.ndarray) -> Busy:
    """The union of the runs of ``a`` (where ``from_a``) and ``b`` (elsewhere), in that order."""
    start = np.empty(len(from_a), np.int64)
    end = np.empty(len(from_a), np.int64)
    start[from_a], end[from_a] = a.start, a.end
    start[~from_a], end[~from_a] = b.start, b.end
    return Busy(*union_sorted(start, end))
