"""Idle time claimed source by source (host attribution, :mod:`traceclf.measures.hostsources`):
what each source claims, summed per (source, what, idle cause of the gap), and the pieces of
the gaps still to claim, cut by the interval arithmetic of :mod:`traceclf.measures.claims`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from traceclf.measures.claims import Pieces, claim, merged, subtract, touched
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.intervals import Busy


@dataclass
class IdleClaims:
    """Idle time claimed so far, summed per (source, what, idle cause of the gap), and the
    pieces of the gaps still to claim (disjoint, sorted, each with its gap). Sums, not
    pieces: a launch-bound window's millions of gaps are never a frame of strings.

    A claim by classes in turn (:meth:`take_in_order`) is summed from what the classes cover
    and cut out of the pieces only when a later source reads them (:attr:`pieces`): CUDA calls
    cut a launch-bound window's gaps into millions of slivers that no later source may
    read, and the final "what is left" is a difference of sums."""

    held: Pieces
    cause: np.ndarray  # each gap's idle cause (its code in IDLE_CAUSES)
    parts: list[pl.DataFrame] = field(default_factory=list)
    cut: Busy | None = None  # claimed from ``held`` and not cut out of it yet
    cut_ns: np.ndarray | None = None  # ns of each piece of ``held`` that ``cut`` covers

    @property
    def pieces(self) -> Pieces:
        if self.cut is not None:
            self.held = subtract(self.held, self.cut.start, self.cut.end)[0]
            self.cut = self.cut_ns = None
        return self.held

    @pieces.setter
    def pieces(self, value: Pieces) -> None:
        self.held, self.cut, self.cut_ns = value, None, None

    def left(self) -> tuple[np.ndarray, np.ndarray]:
        """Each piece's gap and the ns of it no source has claimed."""
        start, end, owner = self.held
        return owner, end - start - (0 if self.cut_ns is None else self.cut_ns)

    def take(
        self,
        source: str,
        what: str | list[str],
        lo: np.ndarray,
        hi: np.ndarray,
        label: np.ndarray | None = None,
    ) -> set[str]:
        """Claim the remaining time that [lo, hi) covers, for ``what`` (one name, or with
        ``label`` the name ``what[label[i]]`` of each interval); the names that got any."""
        if not len(lo) or not len(self.pieces[0]):
            return set()
        if label is None:  # (only summed: no covered parts cut)
            self.pieces, gap, ns = subtract(self.pieces, lo, hi)
            return self.record(source, [what], gap, ns)  # type: ignore[list-item]
        cut, labels, self.pieces = claim(self.pieces, lo, hi, label)
        if not len(cut[0]):
            return set()
        return self.record(source, what, cut[2], cut[1] - cut[0], labels)  # type: ignore[arg-type]

    def take_in_order(
        self, source: str, names: list[str], lo: np.ndarray, hi: np.ndarray, kind: np.ndarray
    ) -> set[str]:
        """Claim for each of ``names`` in turn what the intervals [lo, hi) of its class
        (``kind`` == its index) cover of what the classes before it left: the ns of each piece
        that the first classes' union covers, less what the union without it covered (the
        same sums as a :meth:`take` per class, without cutting the pieces each time); the
        names that got any."""
        start, end, owner = self.pieces
        if not len(start) or not len(lo):
            return set()
        cover = Busy(np.empty(0, np.int64), np.empty(0, np.int64))
        before = np.zeros(len(start), np.int64)
        got: set[str] = set()
        last = int(kind.max())
        for i, name in enumerate(names):
            mine = kind == i
            if not mine.any():
                continue
            runs = Busy.of_arrays(lo[mine], hi[mine])
            # only the pieces this class's runs touch gain anything (a few calls: a few pieces)
            at = touched(self.held, runs.start, runs.end)
            del mine  # (the runs of the launch class: millions, not held while summing)
            if i < last:
                cover = cover | runs
                del runs
            else:  # the last class's union with those before it is the union of every call:
                # one pass over the calls in start order, not a merge of two sets of millions
                # of runs, and neither set held beside it
                del cover, runs
                cover = _every(lo, hi, kind, len(names))
            if at is None:
                now = cover.covered(start, end)
                got |= self.record(source, [name], owner, now - before)
                before = now
            else:
                now = cover.covered(start[at], end[at])
                got |= self.record(source, [name], owner[at], now - before[at])
                before[at] = now
        self.cut, self.cut_ns = cover, before
        return got

    def record(
        self,
        source: str,
        names: list[str],
        gap: np.ndarray,
        ns: np.ndarray,
        label: np.ndarray | None = None,
    ) -> set[str]:
        """Add ``ns`` of the gaps ``gap`` to ``names[label]`` (``names[0]`` without labels);
        the names that got any."""
        key = self.cause[gap]
        if label is not None:
            key = label.astype(np.int64) * len(IDLE_CAUSES) + key
        sums = np.bincount(key, weights=ns, minlength=len(names) * len(IDLE_CAUSES))
        hit = np.flatnonzero(sums)
        if not len(hit):
            return set()
        whats = [names[k // len(IDLE_CAUSES)] for k in hit]
        self.parts.append(
            pl.DataFrame(
                {
                    "source": [source] * len(hit),
                    "what": whats,
                    "cause": [IDLE_CAUSES[k % len(IDLE_CAUSES)] for k in hit],
                    "ns": np.rint(sums[hit]).astype(np.int64),
                }
            )
        )
        return set(whats)

    def split(self, keep: np.ndarray) -> IdleClaims:
        """The pieces ``keep`` selects (the gaps of one thread), taken out to claim from on
        their own; :meth:`join` puts back what they leave."""
        start, end, owner = self.pieces
        if keep.all():  # (one launching thread: every gap, no copy)
            self.pieces = (start[:0], end[:0], owner[:0])
            return IdleClaims((start, end, owner), self.cause)
        self.pieces = (start[~keep], end[~keep], owner[~keep])
        return IdleClaims((start[keep], end[keep], owner[keep]), self.cause)

    def split_touched(self, keep: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> IdleClaims:
        """The pieces ``keep`` selects (of :attr:`held`, as they are) that the intervals
        [lo, hi) overlap, taken out to claim from on their own, with the pending claim cut out
        of them alone; the others stay as they are, their pending claim with them, and
        :meth:`join` puts back what the part leaves. A thread's few OS runtime calls meet few
        of a window's millions of pieces: cutting the CUDA calls out of all of them first took
        0.4 s of a launch-bound window's long step."""
        start, end, owner = self.held
        runs = Busy.of_arrays(lo, hi)
        at = np.searchsorted(runs.start, end, side="left") - 1
        keep = keep & (at >= 0) & (runs.end[np.maximum(at, 0)] > start)
        part = (start[keep], end[keep], owner[keep])
        if self.cut is not None:
            part = subtract(part, self.cut.start, self.cut.end)[0]
            self.cut_ns = self.cut_ns[~keep]  # type: ignore[index]
        self.held = (start[~keep], end[~keep], owner[~keep])
        return IdleClaims(part, self.cause)

    def join(self, part: IdleClaims) -> None:
        """Put back what ``part`` (:meth:`split` or :meth:`split_touched`) leaves of its
        pieces; a claim still pending here stays pending (it was cut out of the part)."""
        self.parts += part.parts
        if self.cut is None:
            self.pieces = merged(self.pieces, part.pieces)
            return
        cut_ns = np.zeros(len(part.pieces[0]), np.int64)
        *held, self.cut_ns = merged((*self.held, self.cut_ns), (*part.pieces, cut_ns))
        self.held = tuple(held)  # type: ignore[assignment]


def _every(lo: np.ndarray, hi: np.ndarray, kind: np.ndarray, classes: int) -> Busy:
    """The union of the intervals of every class (``kind`` in ``range(classes)``)."""
    valid = (kind >= 0) & (kind < classes)
    return Busy.of_arrays(lo, hi) if valid.all() else Busy.of_arrays(lo[valid], hi[valid])
