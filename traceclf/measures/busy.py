"""Unions of intervals and their length inside parts of the window, on numpy arrays in start
order: one linear pass per union instead of sorting every interval's start and end events
(millions of kernels in a kernel-dense capture; :func:`traceclf.measures.timeline.timeline`
is the general sweep when the counts per layer matter, not just whether any is active)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the same time as ``start``/``end`` (sorted by start;
    intervals that touch merge, as in :func:`traceclf.measures.timeline.union`)."""
    if not len(start):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    reach = np.maximum.accumulate(end)
    new = np.ones(len(start), bool)
    new[1:] = start[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(start) - 1)
    return start[first], reach[last]


class Busy:
    """Disjoint sorted intervals and the time they cover before any instant."""

    def __init__(self, start: np.ndarray, end: np.ndarray) -> None:
        self.start, self.end = start, end
        self.before = np.concatenate([[0], np.cumsum(end - start)])  # covered before run i

    def upto(self, t: np.ndarray) -> np.ndarray:
        """ns covered before each instant of ``t``."""
        if not len(self.start):
            return np.zeros(len(t), np.int64)
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = np.clip(t - self.start[j], 0, self.end[j] - self.start[j])
        return np.where(i >= 0, self.before[j] + inside, 0)

    def within(self, bounds: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """ns covered in each part i = [bounds[i], bounds[i + 1]) of the window's spans."""
        out = np.zeros(len(bounds) - 1, np.int64)
        for lo, hi in spans:
            a, b = np.clip(bounds[:-1], lo, hi), np.clip(bounds[1:], lo, hi)
            out += self.upto(b) - self.upto(a)
        return out


def within_spans(bounds: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """ns of the window's spans in each part i = [bounds[i], bounds[i + 1])."""
    out = np.zeros(len(bounds) - 1, np.int64)
    for lo, hi in spans:
        out += np.clip(bounds[1:], lo, hi) - np.clip(bounds[:-1], lo, hi)
    return out
