"""Across ranks: clocks put on one timeline, collective instances matched across ranks, wait
vs transfer in collectives, the rank survey (fingerprints, groups of like ranks,
representatives) and skew only between like ranks. Ranks that time-slice one GPU are
recognised, so no straggler or jitter claim is made from time-slicing.

The map step (:func:`traceclf.measures.collectives.collectives_of`) keeps each rank's
collective kernels; the reduce step (:func:`cross_rank`) takes one dict per rank (small and
picklable; this module needs neither polars nor a trace, so a cached re-analysis of one rank
imports neither):
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

WAIT_DOMINATES = 0.5  # share of communication time above which waiting, not transfer, is the cost
# Waiting for a late rank is worth chasing only when it costs a noteworthy share of the step
# (as scoring.noteworthy in rules/scoring.yaml): at most wait share x exposed communication.
WAIT_COST_NOTEWORTHY = 0.05
FINGERPRINT_TOLERANCE = 0.1  # relative difference under which two ranks' counts match
# A straggler's compute skew must exceed twice the step-time spread, and at least this.
STRAGGLER_MIN_SKEW = 0.05


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


def rank_groups(prints: list[dict]) -> list[list[int]]:
    """Ranks whose work matches: the same collective kinds with counts per step within
    FINGERPRINT_TOLERANCE, and kernels per step within it (pipeline stages differ in both;
    step time and compute are left out: they are what differs when one rank is slow)."""
    groups: list[list[dict]] = []
    for p in prints:  # a handful of ranks: compare each with the groups found so far
        home = next((g for g in groups if _alike(g[0], p)), None)
        if home is None:
            groups.append([p])
        else:
            home.append(p)
    return [[p["rank"] for p in g] for g in groups]


def _alike(a: dict, b: dict) -> bool:
    ca, cb = a["collectives_per_step"], b["collectives_per_step"]
    if set(ca) != set(cb):
        return False
    counts = [(ca[k], cb[k]) for k in ca] + [(a["kernels_per_step"], b["kernels_per_step"])]
    return all(_close(x, y) for x, y in counts)


def _close(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return abs(x - y) <= FINGERPRINT_TOLERANCE * max(abs(x), abs(y), 1e-9)


def representatives(prints: list[dict], groups: list[list[int]]) -> list[int]:
    """The slowest rank plus, for each group, its rank with the median step time."""
    step = {p["rank"]: p["step_ms"] or 0 for p in prints}
    chosen = [max(step, key=step.__getitem__)] if step else []
    for g in groups:
        ordered = sorted(g, key=lambda r: (step[r], r))
        chosen.append(ordered[(len(ordered) - 1) // 2])
    return sorted(set(chosen))


def skews(prints: list[dict], groups: list[list[int]], apart: set[int]) -> dict:
    """Step-time and compute spread within each group of like ranks (the one with the largest
    compute spread), and its straggler (most compute per step) when that spread is beyond the
    noise: twice the step-time spread (CV), at least STRAGGLER_MIN_SKEW. Never across unlike
    ranks, and never with ranks in ``apart`` (sharing a GPU, or unsure whether they do:
    time-slicing is not a late rank)."""
    by_rank = {p["rank"]: p for p in prints}
    best: dict = {
        "straggler_rank": None,
        "step_time_skew_frac": None,
        "compute_skew_frac": None,
        "noise_band_frac": None,
    }
    for g in groups:
        members = [r for r in g if r not in apart]
        if len(members) < 2:
            continue
        compute = _skew([by_rank[r]["compute_ms"] for r in members])
        if compute is not None and (best["compute_skew_frac"] or -1) < compute:
            cvs = [by_rank[r]["step_cv"] for r in members if by_rank[r]["step_cv"] is not None]
            noise = max(STRAGGLER_MIN_SKEW, 2 * (statistics.fmean(cvs) if cvs else 0))
            best = {
                "straggler_rank": max(members, key=lambda r: by_rank[r]["compute_ms"] or 0)
                if compute > noise
                else None,
                "step_time_skew_frac": _skew([by_rank[r]["step_ms"] for r in members]),
                "compute_skew_frac": compute,
                "noise_band_frac": round(noise, 4),
            }
    return best


def _straggler_note(cr: dict, unsure: list[list[int]]) -> str | None:
    """Why no straggler is named, when none is."""
    if cr["straggler_rank"] is not None:
        return None
    if cr["shared_gpu"]:
        return "ranks share one GPU: they time-slice it, so compute skew is not imbalance"
    if unsure:
        return "ranks report the same device and the export cannot say whether it is one GPU"
    if cr["compute_skew_frac"] is None:
        return "no two like ranks to compare" if len(cr["fingerprints"]) > 1 else None
    return (
        f"compute skew within the noise band ({cr['noise_band_frac']:.0%}: 2 x step-time "
        "spread, min 5%)"
    )


def _skew(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    if len(vals) < 2 or not statistics.mean(vals):
        return None
    return round((max(vals) - min(vals)) / statistics.mean(vals), 4)


def cross_rank(ranks: list[dict], capture: dict | None = None) -> dict:
    """The report's ``cross_rank`` block (``capture``: the report's capture block, which says
    whether ranks with one GPU identity share that GPU)."""
    prints = [fingerprint(r) for r in ranks]
    groups = rank_groups(prints)
    shared, unsure = shared_gpus(ranks, capture)
    out: dict = {
        "rank_groups": groups,
        "representatives": representatives(prints, groups),
        "shared_gpu": shared,
        "fingerprints": prints,
    }
    out |= skews(prints, groups, {r for g in shared + unsure for r in g})
    out["straggler_note"] = _straggler_note(out, unsure)
    empty = {
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
    }
    if len(ranks) < 2:
        return out | empty | {"verdict": _verdict(out | empty, unsure)}
    from traceclf.measures.collectives import matched  # (polars: only with several ranks)

    waits, refined, how, spread = matched(ranks)
    # One export: one clock, nothing to align; the end spread is the collectives' own.
    error = 0.0 if how == "one export" else spread
    out |= waits
    out["clock"] = {
        "aligned_by": how,
        "offsets_us": {str(r): round(o / 1e3, 3) for r, o in refined.items()},
        "alignment_error_us": error,
        "end_spread_us": spread,
    }
    out["verdict"] = _verdict(out, unsure, _exposed_comm(ranks))
    return out


def _exposed_comm(ranks: list[dict]) -> float | None:
    """Mean share of the step in which communication runs with no compute (what waiting in
    collectives can cost at most), or None when no rank measured it."""
    vals = [(r.get("metrics") or {}).get("exposed_comm_frac") for r in ranks]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def _verdict(cr: dict, unsure: list[list[int]], exposed: float | None = None) -> str | None:
    if unsure:
        groups = "; ".join(", ".join(map(str, g)) for g in unsure)
        return (
            f"ranks {groups} report the same device and the export cannot say whether it is "
            "one GPU: no straggler or jitter verdict"
        )
    if cr["shared_gpu"]:
        groups = "; ".join(", ".join(map(str, g)) for g in cr["shared_gpu"])
        return (
            f"ranks {groups} time-slice one GPU: their waits in collectives are the GPU "
            "serving the other process, not a late rank (no straggler or jitter verdict)"
        )
    wait = cr.get("comm_wait_frac")
    if wait is None:
        return None
    if wait >= WAIT_DOMINATES:
        said = (
            f"waiting for the last rank is {wait:.0%} of collective time (rank "
            f"{cr['last_arriver_rank']} arrives last most often)"
        )
        if exposed is not None and wait * exposed < WAIT_COST_NOTEWORTHY:
            # 56% of 4% exposed communication is 2% of the step: not where the time goes
            return (
                f"{said}, but communication with no compute beside it is only {exposed:.1%} "
                f"of the step, so the waiting costs at most {wait * exposed:.1%}: not worth "
                "chasing"
            )
        return f"{said}: fix the late rank (imbalance, data, host), not the fabric"
    said = f"transfer is {1 - wait:.0%} of collective time"
    if exposed is not None and exposed < WAIT_COST_NOTEWORTHY:
        return (
            f"{said}, and communication with no compute beside it is only {exposed:.1%} of the step"
        )
    return (
        f"{said}: the collectives themselves are the cost (message sizes are not in the "
        "export, so no bus-bandwidth figure)"
    )
