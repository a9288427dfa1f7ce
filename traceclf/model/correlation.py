"""Which CUDA call launched a GPU operation: calls looked up by (pid, correlationId).

A kernel-dense capture has tens of millions of calls, so the lookup works on one sorted
integer key (a rank in a bitmap of the keys' range, or a binary search), not a join that hashes
every call. Calls come in start order, which is correlationId order for one process (one
counter), so the key usually needs no sort; a rank's trace has one process, so the key is
usually the correlationId column itself, not a copy.
"""

from __future__ import annotations

import numpy as np
import polars as pl

PID_BITS, CORR_BITS = 24, 39  # pid decoded from 24 bits; a key (pid, correlationId) in 63
# Keys are ranked in a bitmap of their range (:class:`_Ranks`, ~0.19 bytes per id in it) while
# it is smaller than the keys themselves (8 bytes per key); one process's ids span 1.8x their
# count in h100_comm_ep2, 7.2x in h100_host_launch_gpumetrics (other activity shares the
# counter). Keys of several processes span far more: a binary search.
RANKED_SPAN = 32
BLOCK = 1 << 20  # keys or queries ranked at once


class CallIndex:
    """The calls of ``api`` by (pid, correlationId): the row of the first call (in the frame's
    order) with each key."""

    def __init__(self, api: pl.DataFrame) -> None:
        self.api = api
        pid, corr = api["pid"], api["correlation_id"]
        self.pid = _single(pid) if not corr.null_count() else None
        self.rows: np.ndarray | None = None  # row of each key (None: the keys' own order)
        self._ranks: _Ranks | None = None  # built at the first lookup that uses it
        self.keys: np.ndarray | None
        if self.pid is not None:
            self.keys = corr.to_numpy().astype(np.int64, copy=False)
        elif corr.null_count() < len(corr) and (_min(corr) < 0 or _max(corr) >= 1 << CORR_BITS):
            self.keys = None  # keys beyond 63 bits (no nsys export has them): a join
            return
        else:
            keys, valid = call_key(pid, corr)
            self.rows = np.flatnonzero(valid)
            self.keys = keys[self.rows]
        if len(self.keys) > 1 and not bool(np.all(self.keys[1:] >= self.keys[:-1])):
            order = np.argsort(self.keys, kind="stable")  # the first call of a key stays first
            self.keys = self.keys[order]
            self.rows = order if self.rows is None else self.rows[order]

    def find(self, pid: pl.Series, corr: pl.Series) -> np.ndarray:
        """Row in ``api`` of the first call with each (pid, corr), or -1."""
        if self.keys is None:
            return _find_by_join(self.api, pid, corr)
        if self.pid is not None:
            query = corr.fill_null(0).to_numpy().astype(np.int64, copy=False)
            valid = (corr.is_not_null() & (pid == self.pid).fill_null(False)).to_numpy()
        else:
            query, valid = call_key(pid, corr)
        if not len(self.keys):
            return np.full(len(query), -1, np.int64)
        pos = self._positions(query, valid)
        hit = pos >= 0
        return np.where(hit, pos if self.rows is None else self.rows[np.maximum(pos, 0)], -1)

    def _positions(self, query: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Where in ``keys`` the first key equal to each query is (-1: none, or not valid):
        a rank in :class:`_Ranks` where the keys' range allows, else a binary search of
        millions of keys (~20 random reads per query)."""
        keys = self.keys
        if int(keys[-1]) - int(keys[0]) >= RANKED_SPAN * len(keys):
            pos = np.minimum(np.searchsorted(keys, query, side="left"), len(keys) - 1)
            return np.where(valid & (keys[pos] == query), pos, -1)
        if self._ranks is None:
            self._ranks = _Ranks(keys)
        return self._ranks.positions(query, valid)

    def column(self, name: str, pid: pl.Series, corr: pl.Series) -> pl.Series:
        """``name`` of the first call with each (pid, corr); null where there is none."""
        return self.gather(name, self.find(pid, corr))

    def gather(self, name: str, row: np.ndarray) -> pl.Series:
        """``name`` of the calls at rows ``row`` of :meth:`find` (null at -1)."""
        if not len(self.api):
            return pl.Series(name, [None] * len(row), dtype=self.api.schema[name])
        out = self.api[name].gather(pl.Series(np.where(row >= 0, row, 0).astype(np.uint32)))
        return pl.select(pl.when(pl.Series(row >= 0)).then(out)).to_series().alias(name)


def _min(s: pl.Series) -> int:
    return int(s.min())  # type: ignore[arg-type]


def _max(s: pl.Series) -> int:
    return int(s.max())  # type: ignore[arg-type]


def _single(pid: pl.Series) -> int | None:
    """The one process of ``pid``, if it holds one (and no null)."""
    if not len(pid) or pid.null_count() or _min(pid) != _max(pid):
        return None
    return _min(pid)


def call_key(pid: pl.Series, corr: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """(pid << CORR_BITS) | corr, and where it is valid (both known, in range)."""
    p = pid.fill_null(-1).to_numpy().astype(np.int64, copy=False)
    c = corr.fill_null(-1).to_numpy().astype(np.int64, copy=False)
    ok = (p >= 0) & (p < 1 << PID_BITS) & (c >= 0) & (c < 1 << CORR_BITS)
    return np.where(ok, (p << CORR_BITS) | c, -1), ok


def _find_by_join(api: pl.DataFrame, pid: pl.Series, corr: pl.Series) -> np.ndarray:
    first = (
        api.select("pid", "correlation_id")
        .with_row_index("_row")
        .unique(["pid", "correlation_id"], keep="first", maintain_order=True)
    )
    query = pl.DataFrame({"pid": pid, "correlation_id": corr})
    found = query.join(first, on=["pid", "correlation_id"], how="left", maintain_order="left")
    return found["_row"].fill_null(-1).to_numpy().astype(np.int64)


class _Ranks:
    """Sorted keys as a bitmap over their range, with the count of keys before each 64-bit
    word: a key's position among the distinct keys is that count plus the bits set below it
    in its word. A lookup reads two small arrays (3 bytes per 16 ids in the range) where
    a binary search reads the keys ~20 times; equal keys find the first of them. Keys and
    queries go by blocks: temporaries of a few MB, reused, not of 100s of MB mapped afresh."""

    def __init__(self, keys: np.ndarray) -> None:
        self.lo, self.span = int(keys[0]), int(keys[-1]) - int(keys[0]) + 1
        first = np.ones(len(keys), bool)  # (sorted: equal keys are neighbours)
        first[1:] = keys[1:] != keys[:-1]
        self.at = None if first.all() else np.flatnonzero(first)  # distinct key -> position
        distinct = keys if self.at is None else keys[self.at]
        self.words = np.zeros((self.span + 63) // 64, np.uint64)
        for lo in range(0, len(distinct), BLOCK):
            off = distinct[lo : lo + BLOCK] - self.lo
            word = off >> 6
            runs = np.flatnonzero(np.diff(word, prepend=-1))  # the keys of one word: a run
            bits = np.left_shift(np.uint64(1), (off & 63).astype(np.uint64))
            self.words[word[runs]] |= np.bitwise_or.reduceat(bits, runs)  # (a word two
            # blocks share gets the bits of both)
        count = np.int64 if len(keys) >= 1 << 31 else np.int32
        self.before = np.zeros(len(self.words), count)
        np.cumsum(np.bitwise_count(self.words)[:-1], dtype=count, out=self.before[1:])

    def positions(self, query: np.ndarray, valid: np.ndarray) -> np.ndarray:
        out = np.empty(len(query), np.int64)
        for lo in range(0, len(query), BLOCK):
            out[lo : lo + BLOCK] = self._block(query[lo : lo + BLOCK], valid[lo : lo + BLOCK])
        return out

    def _block(self, query: np.ndarray, valid: np.ndarray) -> np.ndarray:
        off = query - self.lo
        valid = valid & (off >= 0) & (off < self.span)
        np.multiply(off, valid, out=off)  # (id 0 where not valid: read, then masked)
        at, bit = off >> 6, (off & 63).astype(np.uint64)
        word = self.words[at]
        valid &= ((word >> bit) & np.uint64(1)).astype(bool)
        word &= (np.uint64(1) << bit) - np.uint64(1)  # the bits below the key's own
        rank = self.before[at] + np.bitwise_count(word)
        if self.at is not None:
            rank = self.at[np.where(valid, rank, 0)]
        return np.where(valid, rank, -1)
