"""What the cross-rank numbers mean: which ranks are compared (like work, within
``like_ranks_tolerance``), which rank is the straggler (compute skew beyond the noise band),
why none is named, and the verdict on the collectives' waiting — every threshold from
rules/thresholds.yaml (and ``scoring.noteworthy``), the numbers from
:mod:`traceclf.measures.cross_rank`. Ranks that time-slice one GPU are recognised, so no
straggler or jitter claim is made from time-slicing."""

from __future__ import annotations

from dataclasses import dataclass

from traceclf.judge.vocabulary import load_rules
from traceclf.measures.cross_rank import (
    collective_waits,
    exposed_comm,
    fingerprint,
    group_spreads,
    rank_groups,
    representatives,
    shared_gpus,
)
from traceclf.rulebook.layers import RuleSet


@dataclass(frozen=True)
class Limits:
    """The thresholds the cross-rank judgement uses."""

    like_ranks: float  # relative difference under which two ranks' counts match
    min_skew: float  # a straggler's compute skew is at least this ...
    noise_factor: float  # ... and beyond this many times the step-time spread (CV)
    wait_dominates: float  # share of collective time from which waiting is the cost
    clock_error_us: float  # matched ends of ranks on other hosts agree within this, aligned
    noteworthy: float  # share of the step below which a cost is not worth chasing

    @classmethod
    def of(cls, rs: RuleSet) -> Limits:
        t = rs.thresholds
        return cls(
            like_ranks=t["like_ranks_tolerance"],
            min_skew=t["straggler_min_skew"],
            noise_factor=t["straggler_noise_factor"],
            wait_dominates=t["wait_dominates_frac"],
            clock_error_us=t["clock_alignment_max_us"],
            noteworthy=rs.scoring.noteworthy,
        )

    @classmethod
    def bundled(cls) -> Limits:
        return cls.of(load_rules(None))


def cross_rank_block(
    ranks: list[dict], capture: dict | None = None, limits: Limits | None = None
) -> dict:
    """The report's ``cross_rank`` block from one dict per rank (the shape
    :mod:`traceclf.measures.cross_rank` describes); ``capture``: the report's capture block,
    which says whether ranks with one GPU identity share that GPU; ``limits``: the rule set's
    (default: the bundled rules')."""
    limits = limits or Limits.bundled()
    prints = [fingerprint(r) for r in ranks]
    groups = rank_groups(prints, limits.like_ranks)
    shared, unsure = shared_gpus(ranks, capture)
    out: dict = {
        "rank_groups": groups,
        "representatives": representatives(prints, groups),
        "shared_gpu": shared,
        "fingerprints": prints,
    }
    out |= straggler(group_spreads(prints, groups, {r for g in shared + unsure for r in g}), limits)
    out["straggler_note"] = straggler_note(out, unsure, limits)
    out |= collective_waits(ranks, shared)
    out |= misaligned(out, limits)
    exposed = exposed_comm(ranks) if len(ranks) >= 2 else None
    out["verdict"] = verdict(out, unsure, exposed, limits)
    return out | unmeasured_waits(out, shared + unsure)


def misaligned(cr: dict, limits: Limits) -> dict:
    """Ranks of other hosts are aligned on their matched collective ends; when those ends
    still disagree by more than ``limits.clock_error_us`` (p95), the matching paired
    different collectives (their clocks lie further apart than the sequence shift matching
    tries), so neither waiting, nor the last rank, nor late arrivals are claimed, and
    ``wait_transfer_note`` says why (nothing changes when the alignment holds)."""
    clock = cr.get("clock") or {}
    error = clock.get("alignment_error_us")
    refined = "matched collective ends" in (clock.get("aligned_by") or "")
    if not refined or error is None or error <= limits.clock_error_us:
        return {}
    late = cr.get("late_arrivals") or []
    note = (
        f"not measurable, clocks not aligned: matched collective ends of ranks on other hosts "
        f"still disagree by {error:,.0f} µs (95th percentile) once aligned, over "
        f"{limits.clock_error_us:,.0f} µs: the matches may pair different collectives (clocks "
        "further apart than a few collectives), so no wait, transfer or late arrival is measured"
    )
    return _no_waits(cr, note) | {
        "late_arrivals": [],
        "late_arrivals_left_out": (cr.get("late_arrivals_left_out") or 0)
        + sum(x.get("instances", 0) for x in late),
        "transfers": {},
    }


def unmeasured_waits(cr: dict, slicing: list[list[int]]) -> dict:
    """Ranks that time-slice one GPU (or may) end a collective when the GPU serves them, so
    their end-time differences measure the other process, not waiting: no wait, transfer or
    last arriver for them, and ``wait_transfer_note`` says why."""
    if not slicing:
        return {"wait_transfer_note": cr.get("wait_transfer_note")}
    groups = "; ".join(", ".join(map(str, g)) for g in slicing)
    return _no_waits(
        cr,
        f"not measurable: ranks {groups} time-slice one GPU (or may), so when a collective "
        "ends measures the other process, not waiting",
    )


def _no_waits(cr: dict, note: str) -> dict:
    """No wait, transfer or last arriver in ``cr`` (and none per kind), ``note`` saying why."""
    return {
        "comm_wait_frac": None,
        "comm_transfer_frac": None,
        "last_arriver_rank": None,
        "last_arriver_share": None,
        "comm_by_kind": {
            kind: v | {"wait_ms": None, "transfer_ms": None}
            for kind, v in (cr.get("comm_by_kind") or {}).items()
        },
        "wait_transfer_note": note,
    }


def straggler(spreads: list[dict], limits: Limits) -> dict:
    """The group with the largest compute spread, and its straggler (most compute per step)
    when that spread is beyond the noise: ``noise_factor`` times the step-time spread (CV), at
    least ``min_skew``. Never across unlike ranks."""
    best: dict = {
        "straggler_rank": None,
        "step_time_skew_frac": None,
        "compute_skew_frac": None,
        "noise_band_frac": None,
    }
    for spread in spreads:
        compute = spread["compute_skew_frac"]
        if compute is not None and (best["compute_skew_frac"] or -1) < compute:
            noise = max(limits.min_skew, limits.noise_factor * (spread["step_cv_mean"] or 0))
            best = {
                "straggler_rank": spread["heaviest"] if compute > noise else None,
                "step_time_skew_frac": spread["step_time_skew_frac"],
                "compute_skew_frac": compute,
                "noise_band_frac": round(noise, 4),
            }
    return best


def straggler_note(cr: dict, unsure: list[list[int]], limits: Limits) -> str | None:
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
        f"compute skew within the noise band ({cr['noise_band_frac']:.0%}: "
        f"{limits.noise_factor:g} x step-time spread, min {limits.min_skew:.0%})"
    )


def verdict(
    cr: dict, unsure: list[list[int]], exposed: float | None = None, limits: Limits | None = None
) -> str | None:
    """What the collectives' waiting calls for: the late rank (waiting dominates and costs a
    noteworthy share of the step), nothing (it costs less), or the collectives themselves."""
    limits = limits or Limits.bundled()
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
    if wait >= limits.wait_dominates:
        said = (
            f"waiting for the last rank is {wait:.0%} of collective time (rank "
            f"{cr['last_arriver_rank']} arrives last most often)"
        )
        if exposed is not None and wait * exposed < limits.noteworthy:
            # 56% of 4% exposed communication is 2% of the step: not where the time goes
            return (
                f"{said}, but communication with no compute beside it is only {exposed:.1%} "
                f"of the step, so the waiting costs at most {wait * exposed:.1%}: not worth "
                "chasing"
            )
        return f"{said}: fix the late rank (imbalance, data, host), not the fabric"
    said = f"transfer is {1 - wait:.0%} of collective time"
    if exposed is not None and exposed < limits.noteworthy:
        return (
            f"{said}, and communication with no compute beside it is only {exposed:.1%} of the step"
        )
    return (
        f"{said}: the collectives themselves are the cost (each communicator's bus bandwidth "
        "against its link: the communication table, where the export has NCCL's message sizes)"
    )
