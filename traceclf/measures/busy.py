"""Unions of intervals and the time they cover, on numpy arrays in start order: one linear pass
per union instead of sorting every interval's start and end events (millions of kernels in a
kernel-dense capture). Every busy / idle / overlap measure is a length of such a union, or a
difference of two: time with compute and no communication is |compute ∪ comm| − |comm|.
:func:`traceclf.measures.timeline.timeline` is the general sweep when the counts per layer
matter, not just whether any is active."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import polars as pl


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the same time as ``start``/``end`` (sorted by start;
    intervals that touch merge, as in :func:`traceclf.measures.timeline.union`)."""
    if not len(start):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    # already disjoint and in order (kernels of one stream): as they are, nothing allocated
    if bool(np.all(start[1:] > end[:-1])) and bool(np.all(end >= start)):
        return start, end
    reach = np.maximum.accumulate(end)
    new = np.ones(len(start), bool)
    new[1:] = start[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(start) - 1)
    return start[first], reach[last]


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
        rs, re = union(s, e)
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
        start = np.concatenate([f["start"].to_numpy() for f in frames] or [np.empty(0, np.int64)])
        end = np.concatenate([f["end"].to_numpy() for f in frames] or [np.empty(0, np.int64)])
        return cls.of_arrays(start, end)

    @classmethod
    def of_arrays(cls, start: np.ndarray, end: np.ndarray) -> Busy:
        if len(start) > 1 and not bool(np.all(start[1:] >= start[:-1])):
            order = np.argsort(start, kind="stable")  # a merge of a few sorted runs
            start, end = start[order], end[order]
        return cls(*union(start.astype(np.int64, copy=False), end.astype(np.int64, copy=False)))

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
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = np.clip(t - self.start[j], 0, self.end[j] - self.start[j])
        return np.where(i >= 0, self.before[j] + inside, 0)

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
        return union(start, end) if len(spans) > 1 else (start, end)


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
    return Busy(*union(start, end))
