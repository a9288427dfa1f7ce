"""Idle time claimed piece by piece: disjoint sorted pieces of time (each with an owner, e.g.
the idle gap it is part of) split by intervals in any order, what they cover and what is left
(:func:`claim`), or only what is left (:func:`subtract`, for a claim whose parts are summed);
host attribution (:mod:`traceclf.measures.hostsources`) claims every idle ns once this way,
source by source. A claim by a few intervals works on the pieces they touch and splices what
is left of them back in; the pairs of pieces and runs of intervals that overlap are visited in
blocks, so memory follows a block, not a capture's millions of CUDA calls."""

from __future__ import annotations

import itertools

import numpy as np

from traceclf.measures.intervals import is_sorted, rank_sorted, union_sorted

Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]  # disjoint sorted [start, end), owner


def claim(
    pieces: Pieces, lo: np.ndarray, hi: np.ndarray, label: np.ndarray | None = None
) -> tuple[Pieces, np.ndarray, Pieces]:
    """Split ``pieces`` (disjoint, sorted; each with an owner, e.g. the idle gap it is part of)
    by the intervals [lo, hi) (any order, may overlap): the parts they cover, the ``label`` of
    the interval covering each part (of several, the one reaching furthest; None: no labels),
    and the parts they do not cover, as pieces with their owners, in order.

    Only the (piece, run) pairs that overlap are visited: millions of CUDA calls, most of them
    made while the GPU is busy, cost the idle pieces they touch, not an array of every call's
    bounds."""
    start = pieces[0]
    order = _start_order(lo)
    if order is not None:
        lo, hi = lo[order], hi[order]
    cover = union_sorted(lo, hi)
    if not len(start) or not len(cover[0]):
        return _none(pieces), np.empty(0, np.int64), pieces
    labels = None
    if label is not None:
        # cut at every interval's bounds too: each part is then covered by the same intervals
        # all along, and the one reaching furthest among those started by its start covers it
        bounds = np.sort(np.concatenate([lo, hi]))
        bounds = bounds[np.concatenate([[True], bounds[1:] != bounds[:-1]])]
        reach = np.maximum.accumulate(hi)
        furthest = np.maximum.accumulate(np.where(hi == reach, np.arange(len(hi)), 0))
        labels = (bounds, lo, (label if order is None else label[order])[furthest])
    hit = touched(pieces, *cover)
    if hit is None:
        return _claim_all(pieces, cover, labels)
    cut, at, left = _claim_all(_take(pieces, hit), cover, labels)
    return cut, at, _splice(pieces, hit, left)


def subtract(
    pieces: Pieces, lo: np.ndarray, hi: np.ndarray
) -> tuple[Pieces, np.ndarray, np.ndarray]:
    """What is left of ``pieces`` (disjoint, sorted, with owners) outside the intervals
    [lo, hi) (any order, may overlap), as :func:`claim` leaves it, and what they take, without
    the covered parts themselves: ``(rest, owner, ns)``, every piece left, and the ns taken
    from the owner of each piece the intervals may touch (owners repeat). Pieces of no
    length hold no time and are dropped (``claim`` keeps those no interval touches).

    Read from the bounds alone, not from (piece, run) pairs: a piece's start not covered and
    a run's end inside a piece start a stretch left; a piece's end not covered and a run's
    start inside a piece end one."""
    order = _start_order(lo)
    cover = union_sorted(lo, hi) if order is None else union_sorted(lo[order], hi[order])
    if not bool(np.all(pieces[1] > pieces[0])):  # (read from bounds, a piece needs a length)
        real = pieces[1] > pieces[0]
        pieces = (pieces[0][real], pieces[1][real], pieces[2][real])
    if not len(pieces[0]) or not len(cover[0]):
        return pieces, pieces[2][:0], np.empty(0, np.int64)
    hit = touched(pieces, *cover)
    mine = pieces if hit is None else _take(pieces, hit)
    left, taken = _left_in_blocks(mine, *cover)
    return (left if hit is None else _splice(pieces, hit, left)), mine[2], taken


CLAIM_PAIRS = 1 << 21  # (piece, run) pairs that :func:`claim` visits at once
SPARSE_CLAIM = 16  # intervals touching under 1/16 of the pieces: those alone, then spliced
SPLICE_SLICES = 1 << 12  # touched pieces up to which a splice joins slices (a Python loop:
# 3x faster than masks at 400 of 10 M pieces, as fast at 22 k)
# pieces that :func:`subtract` reads at once: every array of a block stays a few MB, which the
# allocator hands back to the next block rather than asking the system for fresh pages (on a
# VM the cost of a capture's millions of pieces was mostly page faults)
SUBTRACT_PIECES = 1 << 19


def _start_order(lo: np.ndarray) -> np.ndarray | None:
    """The order that sorts ``lo``, stably; None when it is sorted already (a source's calls
    usually are, and millions of them need no index and no copies)."""
    return None if is_sorted(lo) else np.argsort(lo, kind="stable")


def touched(pieces: Pieces, cover_lo: np.ndarray, cover_hi: np.ndarray) -> np.ndarray | None:
    """The pieces that the runs [cover_lo, cover_hi) overlap, found from the runs (a source's
    few calls meet few of a window's millions of pieces), when under 1/:data:`SPARSE_CLAIM`
    of them; None when the runs or the pieces they touch are more."""
    start, end = pieces[0], pieces[1]
    if len(cover_lo) * SPARSE_CLAIM >= len(start):
        return None
    # each run overlaps the pieces from the first ending after it starts to the last starting
    # before it ends; consecutive runs share at most one piece, so the list stays in order
    first = np.searchsorted(end, cover_lo, side="right")
    n = np.maximum(np.searchsorted(start, cover_hi, side="left") - first, 0)
    at = np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    at = at[np.concatenate([[True], at[1:] != at[:-1]])] if len(at) else at
    return at if len(at) * SPARSE_CLAIM < len(start) else None


def _take(pieces: Pieces, at: np.ndarray) -> Pieces:
    return pieces[0][at], pieces[1][at], pieces[2][at]


def _none(pieces: Pieces) -> Pieces:
    return pieces[0][:0], pieces[1][:0], pieces[2][:0]


def _splice(pieces: Pieces, touched: np.ndarray, left: Pieces) -> Pieces:
    """``pieces`` with the ``touched`` ones replaced by what is left of them (``left``, in
    order): each stretch goes where the piece it lies in was."""
    if not len(touched):
        return pieces
    firsts = pieces[0][touched]
    n = np.bincount(np.searchsorted(firsts, left[0], side="right") - 1, minlength=len(touched))
    if len(touched) <= SPLICE_SLICES:
        # few touched pieces: the stretches between them and what is left of each, joined
        # as slices (one copy of each array, not a masked delete and a masked insert)
        bounds = np.concatenate([[0], np.cumsum(n)]).tolist()
        cuts = [-1, *touched.tolist(), len(pieces[0])]
        return tuple(  # type: ignore[return-value]
            np.concatenate(
                [
                    part
                    for k in range(len(cuts) - 1)
                    for part in (
                        x[cuts[k] + 1 : cuts[k + 1]],
                        y[bounds[k] : bounds[k + 1]] if k < len(touched) else y[:0],
                    )
                ]
            )
            for x, y in zip(pieces, left, strict=True)
        )
    at = np.repeat(touched - np.arange(len(touched)), n)  # its place once it is deleted
    return tuple(  # type: ignore[return-value]
        np.insert(np.delete(x, touched), at, y) for x, y in zip(pieces, left, strict=True)
    )


def _claim_all(
    pieces: Pieces,
    cover: tuple[np.ndarray, np.ndarray],
    labels: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> tuple[Pieces, np.ndarray, Pieces]:
    """:func:`claim` of every one of ``pieces`` by the disjoint sorted runs ``cover``, in
    blocks of about CLAIM_PAIRS (piece, run) pairs: memory bounded by a block's arrays, not by
    every pair of a capture's millions of calls at once."""
    start, end, owner = pieces
    cover_lo, cover_hi = cover
    if not len(start):
        return pieces, np.empty(0, np.int64), pieces
    # the runs each piece overlaps: from the first ending after it starts to the last
    # starting before it ends (runs and pieces are both disjoint and sorted)
    first = np.searchsorted(cover_hi, start, side="right")
    n = np.maximum(np.searchsorted(cover_lo, end, side="left") - first, 0)
    total = np.cumsum(n)
    cuts = np.searchsorted(total, np.arange(CLAIM_PAIRS, int(total[-1]), CLAIM_PAIRS))
    edges = np.unique(np.concatenate([[0], cuts + 1, [len(start)]]).clip(0, len(start)))
    blocks = [
        _claim_block(
            (start[i:j], end[i:j], owner[i:j]), first[i:j], n[i:j], cover_lo, cover_hi, labels
        )
        for i, j in itertools.pairwise(edges.tolist())
        if j > i
    ]
    if len(blocks) == 1:
        return blocks[0]
    cut, rest = (tuple(np.concatenate([b[i][k] for b in blocks]) for k in range(3)) for i in (0, 2))
    return cut, np.concatenate([b[1] for b in blocks]), rest  # type: ignore[return-value]


def _claim_block(
    pieces: Pieces,
    first: np.ndarray,
    n: np.ndarray,
    cover_lo: np.ndarray,
    cover_hi: np.ndarray,
    labels: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> tuple[Pieces, np.ndarray, Pieces]:
    """:func:`claim` of a block of pieces: ``first``, ``n`` the runs each overlaps; ``labels``:
    the intervals' distinct bounds, sorted starts, label of the one reaching furthest from each."""
    start, end, owner = pieces
    piece = np.repeat(np.arange(len(start)), n)
    run = np.arange(len(piece)) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
    a = np.maximum(start[piece], cover_lo[run])
    b = np.minimum(end[piece], cover_hi[run])
    cut = (a, b, owner[piece])
    rest = _slots(pieces, n, a, b)
    if labels is None:
        return cut, np.empty(0, np.int64), rest
    bounds, lo, furthest_label = labels
    cut = _split_at(cut, bounds)
    at = np.searchsorted(lo, cut[0], side="right") - 1
    return cut, furthest_label[at], rest


def _slots(pieces: Pieces, n: np.ndarray, a: np.ndarray, b: np.ndarray) -> Pieces:
    """What is left of each piece once its ``n`` covered parts [a, b) (in order, piece by
    piece) are cut out, slot by slot: piece p's n + 1 slots start at its first part's index
    plus p; part i of piece p fills the end of slot i + p and the start of the next."""
    start, end, owner = pieces
    first = np.cumsum(n) - n
    slot = first + np.arange(len(start))  # each piece's first slot
    at = np.arange(len(a)) + np.repeat(np.arange(len(start)), n)
    lo = np.empty(len(a) + len(start), start.dtype)
    hi = np.empty_like(lo)
    lo[slot] = start
    lo[at + 1] = b
    hi[at] = a
    hi[slot + n] = end
    keep = hi > lo
    return lo[keep], hi[keep], np.repeat(owner, n + 1)[keep]


def _left_in_blocks(
    pieces: Pieces, cover_lo: np.ndarray, cover_hi: np.ndarray
) -> tuple[Pieces, np.ndarray]:
    """:func:`_left` of :data:`SUBTRACT_PIECES` pieces at a time, each with the runs that can
    meet them (from the first ending after the block's first piece starts to the last
    starting before its last piece ends), written in place: a stretch left starts at a piece's
    start or at a run's end, so there are at most as many as pieces and runs together."""
    start, end = pieces[0], pieces[1]
    if len(start) <= SUBTRACT_PIECES:
        return _left(pieces, cover_lo, cover_hi)
    bound = len(start) + len(cover_lo)
    left = tuple(np.empty(bound, x.dtype) for x in pieces)
    taken = np.empty(len(start), np.int64)
    n = 0
    for i in range(0, len(start), SUBTRACT_PIECES):
        j = min(i + SUBTRACT_PIECES, len(start))
        a = int(np.searchsorted(cover_hi, start[i], side="right"))
        b = int(np.searchsorted(cover_lo, end[j - 1], side="left"))
        block, taken[i:j] = _left(tuple(x[i:j] for x in pieces), cover_lo[a:b], cover_hi[a:b])  # type: ignore[arg-type]
        for out, x in zip(left, block, strict=True):
            out[n : n + len(x)] = x
        n += len(block[0])
    return tuple(x[:n] for x in left), taken  # type: ignore[return-value]


def _left(pieces: Pieces, cover_lo: np.ndarray, cover_hi: np.ndarray) -> tuple[Pieces, np.ndarray]:
    """What is left of every one of ``pieces`` outside the disjoint sorted runs (touching runs
    merged), and the ns they take from each piece, from the bounds: 4 binary searches and one
    merge of two sorted lists each for the starts and the ends of the stretches left, which
    pair up in order."""
    start, end, owner = pieces
    if not len(start) or not len(cover_lo):
        return pieces, np.zeros(len(start), np.int64)
    last = len(cover_lo) - 1
    # a piece's start is left unless a run covers it, its end unless a run covers the ns before
    # (every list here is sorted: searched by rank_sorted, the way round that costs least)
    j = rank_sorted(cover_hi, start, side="right")
    start_left = (j > last) | (cover_lo[np.minimum(j, last, out=j)] > start)
    k = rank_sorted(cover_hi, end, side="left")
    end_left = (k > last) | (cover_lo[np.minimum(k, last, out=k)] >= end)
    # a run's end strictly inside a piece starts a stretch of it, a run's start ends one
    p = rank_sorted(start, cover_hi, side="right")
    p = np.maximum(p - 1, 0, out=p)
    ends_in = (cover_hi > start[p]) & (cover_hi < end[p])
    q = rank_sorted(start, cover_lo, side="right")
    q = np.maximum(q - 1, 0, out=q)
    starts_in = (cover_lo > start[q]) & (cover_lo < end[q])
    lo = np.concatenate([start[start_left], cover_hi[ends_in]])
    piece = np.concatenate([np.flatnonzero(start_left), p[ends_in]])
    order = np.argsort(lo, kind="stable")  # (two sorted lists: one merge)
    lo, piece = lo[order], piece[order]
    hi = np.sort(np.concatenate([end[end_left], cover_lo[starts_in]]), kind="stable")
    kept = np.bincount(piece, weights=hi - lo, minlength=len(start))
    return (lo, hi, owner[piece]), end - start - kept.astype(np.int64)


def _split_at(parts: Pieces, bounds: np.ndarray) -> Pieces:
    """``parts`` cut at each of the sorted ``bounds`` that falls strictly inside one."""
    a, b, owner = parts
    first = np.searchsorted(bounds, a, side="right")
    n = np.maximum(np.searchsorted(bounds, b, side="left") - first, 0)
    if not n.any():
        return parts
    part = np.repeat(np.arange(len(a)), n + 1)
    k = np.arange(len(part)) - np.repeat(np.cumsum(n + 1) - (n + 1), n + 1)  # 0..n per part
    at = np.repeat(first, n + 1) + k
    lo = np.where(k == 0, a[part], bounds[np.minimum(at - 1, len(bounds) - 1)])
    hi = np.where(k == n[part], b[part], bounds[np.minimum(at, len(bounds) - 1)])
    return lo, hi, owner[part]


def merged(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Two sets of disjoint sorted pieces, disjoint from each other, as one in order (with
    any arrays after start, end and owner that go with each piece)."""
    if not len(a[0]) or not len(b[0]):  # (one thread's gaps are often all of them)
        return b if not len(a[0]) else a
    # merged by position (each of ``b``'s placed among ``a``'s by a binary search), not sorted
    # again: 3x faster on millions of pieces; ties keep ``a``'s first, as a stable sort would
    at = np.searchsorted(a[0], b[0], side="right") + np.arange(len(b[0]))
    mine = np.ones(len(a[0]) + len(b[0]), bool)
    mine[at] = False
    out = []
    for x, y in zip(a, b, strict=True):
        both = np.empty(len(mine), np.result_type(x, y))
        both[mine], both[at] = x, y
        out.append(both)
    return tuple(out)
