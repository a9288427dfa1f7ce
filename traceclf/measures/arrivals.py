"""Why a rank arrives late at a collective: its timeline since the previous collective it shares
with the others, set against the group's median rank.

Map step (:func:`arrival_clock`, per rank, from the trace): for each collective kernel of the
rank, how much of the window before its start and before its end the rank spent in each state
— compute, communication with no compute beside it, copies alone, GPU idle by the host's cause
(docs/measures.md: launch, sync, input, host, other), idle while the host was in each of the
NVTX ranges that hold the most idle time, and the time and launches of the compute kernels that
take the most time. Any stretch between two instants is then a difference of two rows.

Reduce step (:func:`late_arrivals`, across ranks, no trace): for each collective matched across
ranks inside every participant's window, a rank that starts it after the group's median rank
(the lower median of the participants' start times) is late by the difference. Both ranks'
stretches since the previous matched collective they share are set side by side: the late
rank's extra time in each state is a cause, and with the difference of the previous
collective's ends the causes add up to the lateness. Ranks wait inside a step, so lateness
beyond a step is a match that drifted: left out and counted (:func:`_drifted`).
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.collectives import longest_step_ns
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import matches

TOP_NAMES = 4  # NVTX ranges and compute kernels followed by name
NCCL_DOMAIN = "NCCL"  # the NVTX domain of NCCL's own ranges (its API calls)
MIN_NS = 1_000  # a remainder below 1 µs is rounding, not a cause
MAX_COLLECTIVES = 100_000  # collectives of the window clocked (more: no late-arrival walk)
# a clock's states: compute, communication, copies, the followed NVTX ranges, each idle cause
# and the followed kernels; what a clock read back may hold (:class:`_Clock`), no more
MAX_STATES = 3 + TOP_NAMES + len(IDLE_CAUSES) + TOP_NAMES
NS_PER_MS = 1e6


def arrival_clock(w: RankWindow, keyed: pl.DataFrame, gaps: pl.DataFrame) -> dict:
    """For each collective of ``keyed`` (the rank's communication kernels, in the order the
    cross-rank matching lists them), ns of the window before its start and before its end in
    each state: ``states`` names them, ``at_start``/``at_end`` hold one row of values per
    collective; ``launches_at_start``/``_at_end``: launches of each compute kernel followed by
    name before those instants. The states partition the window: compute, communication with
    no compute, copies alone, GPU idle while the host was inside one of the NVTX ranges that
    hold the most idle time (``nvtx:<name>``; a range nested in one before it in that order
    counts for the first), and the rest of the idle time by its cause (``idle:<cause>``,
    ``gaps``: :func:`traceclf.measures.host.idle_gaps`)."""
    if keyed.is_empty():
        return {}
    layers = w.layers
    work = layers.work
    # only the collectives from the one before the window to the last starting in it are
    # walked: their rows, first_row on
    lo, hi = w.window
    all_starts = keyed["start"].to_numpy()
    first = max(int(np.searchsorted(all_starts, lo, side="left")) - 1, 0)
    last = int(np.searchsorted(all_starts, hi, side="left"))
    if last <= first or last - first > MAX_COLLECTIVES:
        return {}
    starts, ends = all_starts[first:last], keyed["end"].to_numpy()[first:last]
    at: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def upto(busy: Busy) -> tuple[np.ndarray, np.ndarray]:
        return busy.upto(starts), busy.upto(ends)

    compute, kernels, busy = upto(layers.compute), upto(layers.compute_comm), upto(work)
    at["compute"] = compute
    at["communication"] = (kernels[0] - compute[0], kernels[1] - compute[1])
    at["copies"] = (busy[0] - kernels[0], busy[1] - kernels[1])
    # idle inside the followed ranges: the first i ranges' union, less the first i - 1's
    covered, with_work = busy, work
    followed: Busy | None = None
    for name, ranges in _host_ranges(w):
        with_work = with_work | ranges
        followed = ranges if followed is None else followed | ranges
        idle = upto(with_work)
        at[f"nvtx:{name}"] = (idle[0] - covered[0], idle[1] - covered[1])
        covered = idle
    # idle by its cause, less the part inside the followed ranges: |gap ∩ ranges| = |gap| +
    # |ranges| - |gap ∪ ranges| (each cause's gaps by a mask of their cause codes: millions of
    # gaps, not a filter of the whole frame per cause)
    g_start, g_end = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    g_cause = gaps["cause"].cast(pl.Enum(IDLE_CAUSES), strict=False).to_physical().to_numpy()
    ranges_upto = upto(followed) if followed is not None else None
    for code, cause in enumerate(IDLE_CAUSES):
        mine = g_cause == code
        gap = Busy.of_arrays(g_start[mine], g_end[mine])
        g = upto(gap)
        if ranges_upto is not None and followed is not None:
            both = upto(gap | followed)
            g = (both[0] - ranges_upto[0], both[1] - ranges_upto[1])
        at[f"idle:{cause}"] = g
    compute_kernels = w.kern.select("short_name", "start", "end", "is_comm").filter(
        ~pl.col("is_comm").fill_null(False)
    )
    top_kernels = (
        compute_kernels.group_by("short_name")
        .agg(ns=(pl.col("end") - pl.col("start")).sum())
        .sort("ns", "short_name", descending=[True, False])
        .head(TOP_NAMES)["short_name"]
        .cast(pl.String)
        .to_list()
    )
    launches = {}
    # (each name's kernels by a mask: the names compared as categories, not cast to text)
    short_names = compute_kernels["short_name"]
    k_start, k_end = compute_kernels["start"].to_numpy(), compute_kernels["end"].to_numpy()
    none = np.zeros(len(k_start), bool)  # (a kernel without a name: matched by none)
    for name in top_kernels:
        mine = (short_names == name).fill_null(False).to_numpy() if name is not None else none
        at[f"kernel:{name}"] = upto(Busy.of_arrays(k_start[mine], k_end[mine]))
        launches[name] = np.sort(k_start[mine])
    names = list(at)
    return {
        "states": names,
        "first_row": first,
        "at_start": packed(np.column_stack([at[k][0] for k in names])),
        "at_end": packed(np.column_stack([at[k][1] for k in names])),
        "launches_at_start": {
            k: packed(np.searchsorted(v, starts, side="left")) for k, v in launches.items()
        },
        "launches_at_end": {
            k: packed(np.searchsorted(v, ends, side="left")) for k, v in launches.items()
        },
    }


def packed(values: np.ndarray) -> str:
    """Integers of a clock (ns, launch counts: one column, or rows of one value per state, each
    column not decreasing down the rows) as text: each column's steps from the row before,
    column after column as little-endian int64, deflated, in base64. The clock travels in the
    rank's result (the result cache's JSON, a worker's pickle); an ``--all-steps`` clock of
    every collective written as lists of numbers was 45 MB of a 62 MB result (EP input) and
    seconds of encoding and decoding, its steps deflated 0.2 MB."""
    values = np.asarray(values, dtype=np.int64)
    steps = np.diff(values, axis=0, prepend=np.zeros((1, *values.shape[1:]), np.int64))
    raw = np.ascontiguousarray(steps.T, dtype="<i8").tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def _unpacked(text: str | None, width: int | None = None, rows: int | None = None) -> np.ndarray:
    """The integers :func:`packed` wrote: rows of ``width`` values when given, else one column;
    ``rows`` of them when given, else at most :data:`MAX_COLLECTIVES` (a result file is read:
    what it may inflate to is bounded, and a clock of another shape is an error)."""
    if not text:
        values = np.empty((0, width) if width is not None else 0, np.int64)
    else:
        size = (MAX_COLLECTIVES if rows is None else rows) * (width or 1) * 8
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(text, validate=True), size)
        if inflate.unconsumed_tail or inflate.unused_data or not inflate.eof:
            raise ValueError("a damaged or oversized arrival clock")
        steps = np.frombuffer(raw, dtype="<i8")
        if width is not None:
            steps = steps.reshape(width, -1).T
        values = np.ascontiguousarray(np.cumsum(steps, axis=0))
    if rows is not None and len(values) != rows:
        raise ValueError("an arrival clock whose columns differ in length")
    return values


def _host_ranges(w: RankWindow) -> list[tuple[str, Busy]]:
    """The NVTX ranges of the rank that hold the most GPU-idle time in the window, by name
    (at most :data:`TOP_NAMES`, most idle first): ranges the host was in, not steps, the
    forward/backward/optimizer phases or communication calls (NCCL's own ranges, PyTorch's
    collective ranges: the taxonomy's communication activity)."""
    nvtx, tax = w.trace.nvtx, w.taxonomy
    if nvtx.is_empty():
        return []
    generic = tax.step_or_phase()
    step_names = w.steps.table["name"].unique().implode() if w.steps.count else []
    named = nvtx.filter(
        ~pl.col("text").is_in(step_names)
        & ~matches(nvtx["text"], generic)
        & (pl.col("domain") != NCCL_DOMAIN)
    )
    ranges = intervals.clip(
        named.with_columns(activity=tax.host_activity_of(named["text"])).filter(
            pl.col("activity").fill_null("") != "communication"
        ),
        w.spans,
    )
    if ranges.is_empty():
        return []
    work = w.layers.work
    # ranked by the idle time inside each range, summed per name (one pass over the ranges:
    # PyTorch's emit_nvtx writes thousands of names), then each of the first names' union
    start, end = ranges["start"].to_numpy(), ranges["end"].to_numpy()
    idle = (end - start) - work.covered(start, end)
    top = (
        ranges.select("text", idle=pl.Series(idle))
        .group_by("text")
        .agg(pl.col("idle").sum())
        .filter(pl.col("idle") > 0)
        .sort("idle", "text", descending=[True, False])
        .head(TOP_NAMES)["text"]
        .to_list()
    )
    return [(str(name), Busy.of(ranges.filter(pl.col("text") == name))) for name in top]


# --------------------------------------------------------------------------- reduce step


def late_arrivals(
    instances: pl.DataFrame,
    ranks: list[dict],
    shared: list[list[int]],
    steps: dict[int, int],
) -> tuple[list, int]:
    """The ranks that start matched collectives after their group's median rank, with how
    late per step and why (``instances``: matched collectives, one row per rank and instance:
    rank, ordinal, kind, instance, row (the collective's row in the rank's list), a_start,
    a_end (aligned), in_window; ``ranks``: the cross-rank dicts, with ``arrivals``
    (:func:`arrival_clock`) and ``steps``; ``shared``: groups of ranks that time-slice one
    GPU; ``steps``: how many of each rank's steps the matched collectives come from:
    :meth:`traceclf.measures.collectives.Matching.steps_matched`);
    and how many late instances were left out as drifted matches (:func:`_drifted`)."""
    clocks = {r["rank"]: r.get("arrivals") or {} for r in ranks}
    if instances.is_empty() or not all(c.get("states") for c in clocks.values()):
        return [], 0
    keys = ["ordinal", "kind", "instance"]
    inside = instances.filter(
        pl.col("instance").is_not_null() & pl.col("in_window").all().over(keys)
    ).filter(pl.len().over(keys) >= 2)
    if inside.is_empty():
        return [], 0
    # each rank's previous matched collective (of any communicator) ...
    inside = inside.sort("rank", "a_start").with_columns(
        [pl.col(k).shift(1).over("rank").alias(f"p_{k}") for k in keys]
        + [
            pl.col("row").shift(1).over("rank").alias("p_row"),
            pl.col("a_end").shift(1).over("rank").alias("p_end"),
        ]
    )
    median = (
        inside.sort(*keys, "a_start", "rank")
        .group_by(keys, maintain_order=True)
        .agg(
            m_rank=pl.col("rank").get((pl.len() - 1) // 2),
            m_start=pl.col("a_start").get((pl.len() - 1) // 2),
            m_row=pl.col("row").get((pl.len() - 1) // 2),
        )
    )
    # ... and the median rank's row of that same collective, where it took part in it
    theirs = inside.select(
        m_rank="rank", **{f"p_{k}": k for k in keys}, p_row_m="row", p_end_m="a_end"
    )
    late = (
        inside.join(median, on=keys)
        .filter(pl.col("a_start") > pl.col("m_start"))
        .with_columns(late=pl.col("a_start") - pl.col("m_start"))
        .join(theirs, on=["m_rank", *[f"p_{k}" for k in keys]], how="left")
    )
    late, drifted = _drifted(late, ranks)
    if late.is_empty():
        return [], drifted
    mates = {r: [x for x in g if x != r] for g in shared for r in g}
    # each rank's clock as arrays once, whichever late rank or median rank reads it (an
    # ``--all-steps`` clock is rows of every collective: 14 k x 20 values a rank)
    built: dict[int, _Clock] = {}

    def clock_of(rank: int) -> _Clock:
        if rank not in built:
            built[rank] = _Clock(clocks.get(rank) or {})
        return built[rank]

    # the waits at a step's collectives are stretches of the waiting rank's step, so a rank
    # later per step than the ranks' steps last on average is drifted matches, not lateness
    mean_step = NS_PER_MS * max((r.get("steps") or {}).get("mean_ms") or 0.0 for r in ranks)
    out = []
    for (rank,), rows in late.group_by(["rank"], maintain_order=True):
        n = steps.get(rank, 1)
        late_ns = float(rows["late"].sum())
        if mean_step and late_ns / n > mean_step:
            drifted += rows.height
            continue
        item = {
            "rank": int(rank),
            "late_ms_per_step": round(late_ns / NS_PER_MS / n, 4),
            "instances": rows.height,
            "median_ranks": sorted(set(rows["m_rank"].to_list())),
            "causes": [
                {"cause": c, "ms_per_step": round(ns / NS_PER_MS / n, 4), "detail": d} | extra
                for c, ns, d, extra in _causes(rows, clock_of, int(rank), n)
            ],
        }
        held = sorted(set(mates.get(int(rank), [])) & set(item["median_ranks"]))
        if held:
            # on a time-sliced GPU the median rank's collective kernel was already running,
            # waiting, for the whole of the lateness: it held the GPU beside this rank's work
            item["shared_gpu"] = {"ranks": held, "held_ms_per_step": item["late_ms_per_step"]}
        out.append(item)
    return sorted(out, key=lambda x: -x["late_ms_per_step"]), drifted


def _drifted(late: pl.DataFrame, ranks: list[dict]) -> tuple[pl.DataFrame, int]:
    """``late`` without the instances later than the longest step of any rank, and how many
    those were. The ranks waiting at a collective wait inside one of their steps, so no rank
    arrives later than a step lasts: such an instance is a match that drifted (the ranks'
    collectives counted from different steps: windows sampled apart, captures started at
    different steps), and its "lateness" the time between two different collectives. (The
    previous collectives are matched instances, whose ends matching already holds within a
    step: :func:`traceclf.measures.collectives.undrifted`.)"""
    longest = longest_step_ns(ranks)
    if not longest:  # (no step: nothing bounds it)
        return late, 0
    kept = late.filter(pl.col("late") <= longest)
    return kept, late.height - kept.height


def _causes(
    rows: pl.DataFrame, clock_of: Callable[[int], _Clock], rank: int, steps: int
) -> list[tuple[str, float, str, dict]]:
    """The late rank's extra time per state over its median ranks' (summed over instances),
    as (cause, ns, detail, extra keys: ``nvtx``, the range's name), largest first; the previous collective's later end on the late
    rank as its own cause. Instances whose previous collective the median rank did not take
    part in are left out of the causes (not of the lateness)."""
    mine = clock_of(rank)
    states = mine.states
    sums: dict[str, float] = {}
    prior_end = walked = 0.0
    extra_launches = dict.fromkeys(mine.launch_names, 0)
    late, done = rows["late"].to_numpy(), np.zeros(rows.height, bool)
    # every instance of one median rank at once (the stretches are differences of two rows
    # of each clock: whole columns, not a dict per instance)
    for (m_rank,), part in rows.with_row_index("_i").group_by("m_rank", maintain_order=True):
        theirs = clock_of(m_rank)
        col = {c: part[c].fill_null(-1).to_numpy() for c in ("p_row", "row", "p_row_m", "m_row")}
        ok = mine.holds(col["p_row"], col["row"]) & theirs.holds(col["p_row_m"], col["m_row"])
        if not ok.any():
            continue
        a = mine.stretches(col["p_row"][ok], col["row"][ok])
        b = theirs.stretches(col["p_row_m"][ok], col["m_row"][ok])
        for clock, values, sign in ((mine, a, 1), (theirs, b, -1)):
            for state, total in zip(clock.states, values.sum(axis=0).tolist(), strict=True):
                sums[state] = sums.get(state, 0.0) + sign * total
        ends = (part["p_end"] - part["p_end_m"]).to_numpy()
        prior_end += float(ends[ok].sum())
        for name in extra_launches:
            extra_launches[name] += int(
                mine.launches(name, col["p_row"][ok], col["row"][ok]).sum()
                - theirs.launches(name, col["p_row_m"][ok], col["m_row"][ok]).sum()
            )
        done[part["_i"].to_numpy()[ok]] = True
    walked, unwalked = float(late[done].sum()), float(late[~done].sum())
    out = []
    kernels = {s[7:]: v for s, v in sums.items() if s.startswith("kernel:") and v > 0}
    for state in states:
        value = sums.get(state, 0.0)
        if state.startswith("kernel:") or value <= 0:
            continue
        if state == "compute":
            out.append(
                ("longer_compute", value, _kernel_detail(kernels, extra_launches, steps), {})
            )
        elif state == "communication":
            out.append(
                ("other_communication", value, "communication kernels, no compute beside", {})
            )
        elif state == "copies":
            out.append(("copies", value, "memcpy/memset with no kernel running", {}))
        elif state.startswith("nvtx:"):
            name = state[5:]
            detail = f"GPU idle, host in NVTX '{name}'"
            out.append(("host_idle_nvtx", value, detail, {"nvtx": name}))
        elif state == "idle:launch":
            out.append(("later_launch", value, "GPU idle while the host issued CUDA calls", {}))
        else:
            out.append((f"idle_{state[5:]}", value, f"GPU idle ({state[5:]})", {}))
    if prior_end > 0:
        out.append(("previous_collective_ended_later", prior_end, "the collective before it", {}))
    out.sort(key=lambda x: -x[1])
    # the states partition both stretches, so what the late rank spent less time on than the
    # median rank closes the sum: the causes add up to the lateness
    rest = walked - sum(v for _, v, _, _ in out)
    if abs(rest) >= MIN_NS:
        detail = "less time than the median rank in the other states"
        out.append(("less_elsewhere", rest, detail, {}))
    if unwalked >= MIN_NS:
        detail = "no matched collective before it, in the window, that both ranks took part in"
        out.append(("not_walked", unwalked, detail, {}))
    return out


class _Clock:
    """One rank's :func:`arrival_clock` as arrays: ns in each state before each collective's
    start and end, and launches of its followed kernels before them (rows ``first_row`` on).
    An empty clock holds no row."""

    def __init__(self, clock: dict) -> None:
        self.states: list[str] = clock.get("states") or []
        self.first = int(clock.get("first_row", 0))
        width = len(self.states)
        starts, ends = clock.get("launches_at_start") or {}, clock.get("launches_at_end") or {}
        # (read from a result file: no larger than arrival_clock writes, every column as long)
        if width > MAX_STATES or len(starts) > TOP_NAMES or len(ends) > TOP_NAMES:
            raise ValueError("an arrival clock larger than any traceclf writes")
        self.at_start = _unpacked(clock.get("at_start"), width)
        rows = len(self.at_start)
        self.at_end = _unpacked(clock.get("at_end"), width, rows)
        self.starts = {k: _unpacked(v, None, rows) for k, v in starts.items()}
        self.ends = {k: _unpacked(v, None, rows) for k, v in ends.items()}
        self.launch_names = list(self.starts)

    def holds(self, prev: np.ndarray, this: np.ndarray) -> np.ndarray:
        """Whether the clock holds both rows of each pair (row numbers; -1: none, which no
        clock holds: its rows start at ``first_row`` >= 0)."""
        n = len(self.at_start)
        return _within(prev - self.first, n) & _within(this - self.first, n)

    def stretches(self, prev: np.ndarray, this: np.ndarray) -> np.ndarray:
        """ns in each state from the end of collective ``prev`` to the start of ``this``,
        one row per pair (rows the clock holds)."""
        return self.at_start[this - self.first] - self.at_end[prev - self.first]

    def launches(self, name: str, prev: np.ndarray, this: np.ndarray) -> np.ndarray:
        """Launches of compute kernel ``name`` between collective ``prev``'s end and
        ``this``'s start, per pair (none where the clock does not follow it)."""
        if name not in self.starts or name not in self.ends:
            return np.zeros(len(prev), np.int64)
        return self.starts[name][this - self.first] - self.ends[name][prev - self.first]


def _within(i: np.ndarray, n: int) -> np.ndarray:
    return (i >= 0) & (i < n)


def _kernel_detail(kernels: dict[str, float], launches: dict[str, int], steps: int) -> str:
    """The compute kernels that took longer on the late rank, per step: extra time and extra
    launches (more launches: more work, not a slower GPU)."""
    if not kernels:
        return "compute kernels"
    parts = []
    for name, ns in sorted(kernels.items(), key=lambda kv: -kv[1]):
        more = launches.get(name, 0) / steps
        extra = f", {more:+.3g} launches" if more else ""
        parts.append(f"{name} +{ns / NS_PER_MS / steps:.3g} ms{extra}")
    return "per step: " + "; ".join(parts)
