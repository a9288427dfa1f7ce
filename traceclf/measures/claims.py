"""Idle time claimed piece by piece: disjoint sorted pieces of time (each with an owner, e.g.
the idle gap it is part of) split by intervals in any order, what they cover and what is left
(:func:`claim`); host attribution (:mod:`traceclf.measures.hostsources`) claims every idle ns
once this way, source by source. The pairs of pieces and runs of intervals that overlap are
visited in blocks, so memory follows a block, not a capture's millions of CUDA calls."""

from __future__ import annotations

import itertools

import numpy as np

from traceclf.measures.intervals import union_sorted

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
    start, end, owner = pieces
    empty = (start[:0], end[:0], owner[:0])
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    cover_lo, cover_hi = union_sorted(lo, hi)
    if not len(start) or not len(cover_lo):
        return empty, np.empty(0, np.int64), pieces
    # the runs each piece overlaps: from the first ending after it starts to the last
    # starting before it ends (runs and pieces are both disjoint and sorted)
    first = np.searchsorted(cover_hi, start, side="right")
    n = np.maximum(np.searchsorted(cover_lo, end, side="left") - first, 0)
    labels = None
    if label is not None:
        # cut at every interval's bounds too: each part is then covered by the same intervals
        # all along, and the one reaching furthest among those started by its start covers it
        bounds = np.sort(np.concatenate([lo, hi]))
        bounds = bounds[np.concatenate([[True], bounds[1:] != bounds[:-1]])]
        reach = np.maximum.accumulate(hi)
        furthest = np.maximum.accumulate(np.where(hi == reach, np.arange(len(hi)), 0))
        labels = (bounds, lo, label[order][furthest])
    # pieces in blocks of about CLAIM_PAIRS (piece, run) pairs: memory bounded by a block's
    # arrays, not by every pair of a capture's millions of calls at once
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


CLAIM_PAIRS = 1 << 21  # (piece, run) pairs that :func:`claim` visits at once


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
    rest = _outside(pieces, n, a, b)
    if labels is None:
        return cut, np.empty(0, np.int64), rest
    bounds, lo, furthest_label = labels
    cut = _split_at(cut, bounds)
    at = np.searchsorted(lo, cut[0], side="right") - 1
    return cut, furthest_label[at], rest


def _outside(pieces: Pieces, n: np.ndarray, a: np.ndarray, b: np.ndarray) -> Pieces:
    """What is left of each piece once its ``n`` covered parts [a, b) (in order, piece by
    piece) are cut out: in each piece's n + 1 slots, the stretch before each part and the one
    after the last, put in place by index (no sort). A claim that touches few pieces (a rare
    class of CUDA call) works on those alone and splices what is left of them back in: the
    pieces it does not touch are copied once, not indexed slot by slot."""
    start, end, owner = pieces
    touched = np.flatnonzero(n)
    if len(touched) * SPARSE_CLAIM >= len(start):
        return _slots(pieces, n, a, b)
    firsts = start[touched]
    lo, hi, own = _slots((firsts, end[touched], owner[touched]), n[touched], a, b)
    # each stretch left belongs to the touched piece it lies in; they go where it was
    left = np.bincount(np.searchsorted(firsts, lo, side="right") - 1, minlength=len(touched))
    at = np.repeat(touched - np.arange(len(touched)), left)  # its place once it is deleted
    return tuple(  # type: ignore[return-value]
        np.insert(np.delete(x, touched), at, y) for x, y in ((start, lo), (end, hi), (owner, own))
    )


SPARSE_CLAIM = 16  # a claim touching under 1/16 of the pieces splices (see _outside)


def _slots(pieces: Pieces, n: np.ndarray, a: np.ndarray, b: np.ndarray) -> Pieces:
    """:func:`_outside` slot by slot: piece p's n + 1 slots start at its first part's index
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


def merged(a: Pieces, b: Pieces) -> Pieces:
    """Two sets of disjoint sorted pieces, disjoint from each other, as one in order."""
    joined = [np.concatenate([x, y]) for x, y in zip(a, b, strict=True)]
    order = np.argsort(joined[0], kind="stable")
    return joined[0][order], joined[1][order], joined[2][order]
