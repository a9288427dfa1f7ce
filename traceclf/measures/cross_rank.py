"""Across ranks, the numbers: each rank's fingerprint (what it does per step), groups of ranks
doing like work, representatives, the spread of step time and compute within each group,
ranks that time-slice one GPU, and the collectives matched across ranks (wait vs transfer,
clocks on one timeline: :mod:`traceclf.measures.collectives`). What they mean — which rank is
the straggler, what the waits call for — the judge decides (:mod:`traceclf.judge.straggler`,
with the thresholds of rules/thresholds.yaml).

The map step (:func:`traceclf.measures.collectives.collectives_of`) keeps each rank's
collective kernels; these functions take one dict per rank (small and picklable; this module
needs neither polars nor a trace, so a cached re-analysis of one rank imports neither):
- ``rank``: its number in the report;
- ``collectives``: columns stream_id, kind, start, end (ns, the export's session timeline) of
  every collective kernel of the rank in the capture;
- ``clock``: ``utc_offset_ns`` (add to a timestamp for UTC ns; null when the export has no
  session start time), ``host`` (hostname or null), ``export`` (its path), ``gpu`` (the
  placement key of the capture block: equal for two ranks on one GPU);
- ``window``: [start, end] of its steady state; ``metrics``, ``comm_by_kind``, ``steps``.
"""

from __future__ import annotations

import statistics


def shared_gpus(ranks: list[dict], capture: dict | None = None) -> tuple[list, list]:
    """Groups of ranks with one GPU identity (``clock.gpu``): (shared, unsure). They
    time-slice one GPU when the capture block says so (``gpu_assignment`` "shared": the
    export maps their devices to one physical GPU); "unknown" (two ranks saw the same device
    ordinal, unmapped) leaves them unsure; without a capture block equal identities share."""
    by_gpu: dict[str, list[int]] = {}
    for r in ranks:
        gpu = r["clock"].get("gpu")
        if gpu is not None:
            by_gpu.setdefault(str(gpu), []).append(r["rank"])
    groups = [sorted(v) for v in by_gpu.values() if len(v) > 1]
    assignment = (capture or {}).get("gpu_assignment", "shared" if groups else "own")
    if assignment == "unknown":
        return [], groups
    return (groups if assignment == "shared" else []), []


def fingerprint(rank: dict) -> dict:
    """What a rank does per step: step time, compute busy, collective kinds and counts."""
    m = rank.get("metrics") or {}
    used = max((rank.get("steps") or {}).get("used") or 1, 1)
    step = m.get("step_time_ms")
    return {
        "rank": rank["rank"],
        "step_ms": step,
        "step_cv": m.get("step_time_cv"),
        "compute_ms": (m.get("compute_frac") or 0) * step if step is not None else None,
        "kernels_per_step": m.get("kernels_per_step"),
        "collectives_per_step": {
            k: round(v.get("kernels", 0) / used, 2)
            for k, v in sorted((rank.get("comm_by_kind") or {}).items())
        },
    }


def rank_groups(prints: list[dict], tolerance: float) -> list[list[int]]:
    """Ranks whose work matches: the same collective kinds with counts per step within
    ``tolerance`` (relative), and kernels per step within it (pipeline stages differ in both;
    step time and compute are left out: they are what differs when one rank is slow)."""
    groups: list[list[dict]] = []
    for p in prints:  # a handful of ranks: compare each with the groups found so far
        home = next((g for g in groups if _alike(g[0], p, tolerance)), None)
        if home is None:
            groups.append([p])
        else:
            home.append(p)
    return [[p["rank"] for p in g] for g in groups]


def _alike(a: dict, b: dict, tolerance: float) -> bool:
    ca, cb = a["collectives_per_step"], b["collectives_per_step"]
    if set(ca) != set(cb):
        return False
    counts = [(ca[k], cb[k]) for k in ca] + [(a["kernels_per_step"], b["kernels_per_step"])]
    return all(_close(x, y, tolerance) for x, y in counts)


def _close(x: float | None, y: float | None, tolerance: float) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return abs(x - y) <= tolerance * max(abs(x), abs(y), 1e-9)


def representatives(prints: list[dict], groups: list[list[int]]) -> list[int]:
    """The slowest rank plus, for each group, its rank with the median step time."""
    step = {p["rank"]: p["step_ms"] or 0 for p in prints}
    chosen = [max(step, key=step.__getitem__)] if step else []
    for g in groups:
        ordered = sorted(g, key=lambda r: (step[r], r))
        chosen.append(ordered[(len(ordered) - 1) // 2])
    return sorted(set(chosen))


def group_spreads(prints: list[dict], groups: list[list[int]], apart: set[int]) -> list[dict]:
    """Per group of like ranks (ranks in ``apart`` left out: sharing a GPU, or unsure whether
    they do; time-slicing is not a late rank), when two or more remain: the spread of compute
    and of step time across them (a fraction of the mean), their mean step-time CV (null when
    none measured one), and the rank with the most compute per step."""
    by_rank = {p["rank"]: p for p in prints}
    out = []
    for g in groups:
        members = [r for r in g if r not in apart]
        if len(members) < 2:
            continue
        cvs = [by_rank[r]["step_cv"] for r in members if by_rank[r]["step_cv"] is not None]
        out.append(
            {
                "members": members,
                "compute_skew_frac": _skew([by_rank[r]["compute_ms"] for r in members]),
                "step_time_skew_frac": _skew([by_rank[r]["step_ms"] for r in members]),
                "step_cv_mean": statistics.fmean(cvs) if cvs else None,
                "heaviest": max(members, key=lambda r: by_rank[r]["compute_ms"] or 0),
            }
        )
    return out


def _skew(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    if len(vals) < 2 or not statistics.mean(vals):
        return None
    return round((max(vals) - min(vals)) / statistics.mean(vals), 4)


def collective_waits(ranks: list[dict], shared: list[list[int]] | None = None) -> dict:
    """The collectives matched across ranks (the ``cross_rank`` keys they fill: counts, wait
    and transfer shares, by kind, the rank that arrives last, the late arrivals and their
    causes: :func:`traceclf.measures.arrivals.late_arrivals`, and the late instances it left
    out as drifted matches; ``shared`` the ranks that time-slice one GPU) and the clock
    alignment; with ``transfers``, per communicator and kind the matched collectives' message
    bytes and transfer time (for its bandwidth). Nulls for fewer than two ranks."""
    if len(ranks) < 2:
        return {
            "collectives_matched": 0,
            "collectives_unmatched": 0,
            "comm_wait_frac": None,
            "comm_transfer_frac": None,
            "comm_by_kind": {},
            "last_arriver_rank": None,
            "last_arriver_share": None,
            "clock": {
                "aligned_by": None,
                "offsets_us": {},
                "alignment_error_us": None,
                "end_spread_us": None,
            },
            "late_arrivals": [],
            "late_arrivals_left_out": 0,
            "transfers": {},
        }
    # (polars: only with several ranks)
    from traceclf.measures.arrivals import late_arrivals
    from traceclf.measures.collectives import group_transfers, matched

    m = matched(ranks)
    late, drifted = late_arrivals(
        m.instances, ranks, shared or [], {r["rank"]: m.steps_matched(r) for r in ranks}
    )
    # One export: one clock, nothing to align; the end spread is the collectives' own.
    error = 0.0 if m.aligned_by == "one export" else m.spread_us
    return m.waits | {
        "clock": {
            "aligned_by": m.aligned_by,
            "offsets_us": {str(r): round(o / 1e3, 3) for r, o in m.offsets.items()},
            "alignment_error_us": error,
            "end_spread_us": m.spread_us,
        },
        "late_arrivals": late,
        "late_arrivals_left_out": drifted,
        "transfers": group_transfers(m.instances),
    }


def exposed_comm(ranks: list[dict]) -> float | None:
    """Mean share of the step in which communication runs with no compute (what waiting in
    collectives can cost at most), or None when no rank measured it."""
    vals = [(r.get("metrics") or {}).get("exposed_comm_frac") for r in ranks]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None
