"""Across ranks: clocks put on one timeline, collective instances matched across ranks, wait
vs transfer in collectives, the rank survey (fingerprints, groups of like ranks,
representatives) and skew only between like ranks. Ranks that time-slice one GPU are
recognised, so no straggler or jitter claim is made from time-slicing.

The map step (:func:`collectives_of`) keeps each rank's collective kernels; the reduce step
(:func:`cross_rank`) takes one dict per rank (small and picklable):
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

import polars as pl

from traceclf.measures import communication
from traceclf.measures.window import RankWindow

MAX_SHIFT = 8  # instances a rank's capture may start early or late relative to the reference
WAIT_DOMINATES = 0.5  # share of communication time above which waiting, not transfer, is the cost
# Waiting for a late rank is worth chasing only when it costs a noteworthy share of the step
# (as scoring.noteworthy in rules/scoring.yaml): at most wait share x exposed communication.
WAIT_COST_NOTEWORTHY = 0.05
FINGERPRINT_TOLERANCE = 0.1  # relative difference under which two ranks' counts match
# A straggler's compute skew must exceed twice the step-time spread, and at least this.
STRAGGLER_MIN_SKEW = 0.05

INSTANCE_SCHEMA = {
    "rank": pl.Int64,
    "ordinal": pl.Int64,
    "kind": pl.String,
    "seq": pl.Int64,
    "start": pl.Int64,
    "end": pl.Int64,
    "in_window": pl.Boolean,
}


def collectives_of(w: RankWindow) -> dict[str, list]:
    """Every collective kernel of the rank in the capture (not only the window: matching
    across ranks needs the order from the start), as columns stream_id, kind, start, end."""
    kernels = w.trace.kernels
    # the patterns run once per distinct name; only communication kernels are classified
    names = w.taxonomy.classify(kernels.select("name").unique())
    comm_names = names.filter(pl.col("is_comm"))["name"].implode()
    kern = w.taxonomy.classify(
        kernels.select("name", "pid", "stream_id", "correlation_id", "start", "end").filter(
            pl.col("name").is_in(comm_names)
        )
    )
    comm = communication.refine_kinds(kern, w).sort("start")
    return {
        "stream_id": comm["stream_id"].fill_null(-1).to_list(),
        "kind": comm["comm_kind"].cast(pl.String).to_list(),
        "start": comm["start"].to_list(),
        "end": comm["end"].to_list(),
    }


def rank_collectives(rank: dict) -> pl.DataFrame:
    """The rank's collectives with ``ordinal`` (its communication streams numbered by first
    use: stream ids are per process, the order in which a rank first uses its communicators
    is not) and ``seq`` (order within ordinal and kind)."""
    cols = rank.get("collectives") or {}
    df = pl.DataFrame(
        {k: cols.get(k, []) for k in ("stream_id", "kind", "start", "end")},
        schema={"stream_id": pl.Int64, "kind": pl.String, "start": pl.Int64, "end": pl.Int64},
    )
    lo, hi = rank.get("window") or (None, None)
    first = df.group_by("stream_id").agg(first=pl.col("start").min())
    ordinal = first.sort("first").with_columns(ordinal=pl.int_range(pl.len()).cast(pl.Int64))
    return (
        df.join(ordinal.select("stream_id", "ordinal"), on="stream_id")
        .sort("start")
        .with_columns(seq=pl.int_range(pl.len()).over("ordinal", "kind").cast(pl.Int64))
        .with_columns(
            rank=pl.lit(rank["rank"], pl.Int64),
            in_window=(pl.col("start") >= lo) & (pl.col("start") < hi)
            if lo is not None
            else pl.lit(True),
        )
        .select(list(INSTANCE_SCHEMA))
    )


def clock_offsets(ranks: list[dict]) -> tuple[dict[int, int], str | None]:
    """Offset (ns) to add to each rank's timestamps to put all on one clock, and how it was
    obtained: ranks of one export share its timeline; separate exports are rebased on their
    session start (TARGET_INFO_SESSION_START_TIME) relative to the first rank."""
    exports = {r["clock"].get("export") for r in ranks}
    if len(exports) <= 1:
        return {r["rank"]: 0 for r in ranks}, "one export"
    utc = [r["clock"].get("utc_offset_ns") for r in ranks]
    if any(u is None for u in utc):
        return {r["rank"]: 0 for r in ranks}, None
    base = utc[0]
    return {r["rank"]: int(u - base) for r, u in zip(ranks, utc, strict=True)}, "session start"


def match_instances(coll: pl.DataFrame, offsets: dict[int, int]) -> pl.DataFrame:
    """Collective instances across ranks: a rank's (ordinal, kind, seq) is matched to the
    reference rank's (the one with most rows of that ordinal and kind) at the sequence shift
    (|shift| <= MAX_SHIFT) whose end times agree best, so a capture that starts a few
    collectives early or late on one rank still matches. Returns the rows with ``instance``
    (the reference's seq) and aligned ``a_start``/``a_end``."""
    if coll.is_empty():
        return coll.with_columns(instance=pl.lit(None, pl.Int64), a_start=None, a_end=None)
    off = pl.DataFrame(
        {"rank": list(offsets), "offset": list(offsets.values())},
        schema={"rank": pl.Int64, "offset": pl.Int64},
    )
    coll = coll.join(off, on="rank", how="left").with_columns(
        a_start=pl.col("start") + pl.col("offset").fill_null(0),
        a_end=pl.col("end") + pl.col("offset").fill_null(0),
    )
    counts = coll.group_by("ordinal", "kind", "rank").len()
    ref = (
        counts.sort(["len", "rank"], descending=[True, False])
        .unique(["ordinal", "kind"], keep="first")
        .select("ordinal", "kind", ref_rank="rank")
    )
    coll = coll.join(ref, on=["ordinal", "kind"])
    ref_rows = coll.filter(pl.col("rank") == pl.col("ref_rank")).select(
        "ordinal", "kind", ref_seq="seq", ref_end="a_end"
    )
    others = coll.filter(pl.col("rank") != pl.col("ref_rank"))
    shifts = pl.DataFrame({"shift": list(range(-MAX_SHIFT, MAX_SHIFT + 1))})
    trial = (
        others.select("rank", "ordinal", "kind", "seq", "a_end")
        .join(shifts, how="cross")
        .with_columns(ref_seq=pl.col("seq") - pl.col("shift"))
        .join(ref_rows, on=["ordinal", "kind", "ref_seq"])
        .group_by("rank", "ordinal", "kind", "shift")
        .agg(err=(pl.col("a_end") - pl.col("ref_end")).abs().median(), n=pl.len())
    )
    # Among shifts that pair at least half of what could pair, the one whose ends agree best.
    best = (
        trial.with_columns(most=pl.col("n").max().over("rank", "ordinal", "kind"))
        .filter(pl.col("n") * 2 >= pl.col("most"))
        .sort("err", pl.col("shift").abs())
        .unique(["rank", "ordinal", "kind"], keep="first")
        .select("rank", "ordinal", "kind", "shift")
    )
    return (
        coll.join(best, on=["rank", "ordinal", "kind"], how="left")
        .with_columns(
            instance=pl.when(pl.col("rank") == pl.col("ref_rank"))
            .then(pl.col("seq"))
            .otherwise(pl.col("seq") - pl.col("shift"))
        )
        .drop("shift", "offset")
    )


def refine_offsets(
    matched: pl.DataFrame, ranks: list[dict], offsets: dict[int, int]
) -> dict[int, int]:
    """Across hosts the session starts come from different clocks: shift each rank on another
    host than the first rank (or of unknown host, in another export) by the median difference
    of its matched collective end times from the first rank's (a collective completes on all
    participants together)."""
    pairs = _end_pairs(matched, ranks[0]["rank"])
    host0 = ranks[0]["clock"].get("host")
    remote = {
        r["rank"]
        for r in ranks[1:]
        if r["clock"].get("export") != ranks[0]["clock"].get("export")
        and (host0 is None or r["clock"].get("host") != host0)
    }
    shift = pairs.group_by("rank").agg(pl.col("delta").median())
    refined = dict(offsets)
    for rank, delta in shift.iter_rows():  # one row per rank
        if rank in remote:
            refined[rank] = offsets.get(rank, 0) - round(delta)
    return refined


def alignment_error_us(matched: pl.DataFrame, ref_rank: int) -> float | None:
    """95th percentile of |end time - the first rank's end time| over matched collectives,
    after alignment (µs): how far apart the clocks may still be."""
    pairs = _end_pairs(matched, ref_rank)
    if pairs.is_empty():
        return None
    return round(float(pairs["delta"].abs().quantile(0.95)) / 1e3, 3)


def _end_pairs(matched: pl.DataFrame, ref_rank: int) -> pl.DataFrame:
    """(rank, delta): aligned end time of each matched collective minus the reference rank's."""
    keys = ["ordinal", "kind", "instance"]
    ref = matched.filter(pl.col("rank") == ref_rank).select(*keys, ref_end="a_end")
    return (
        matched.filter(pl.col("rank") != ref_rank)
        .join(ref, on=keys)
        .select("rank", delta=pl.col("a_end") - pl.col("ref_end"))
    )


def realign(matched: pl.DataFrame, offsets: dict[int, int]) -> pl.DataFrame:
    off = pl.DataFrame(
        {"rank": list(offsets), "offset": list(offsets.values())},
        schema={"rank": pl.Int64, "offset": pl.Int64},
    )
    return (
        matched.join(off, on="rank", how="left")
        .with_columns(
            a_start=pl.col("start") + pl.col("offset"), a_end=pl.col("end") + pl.col("offset")
        )
        .drop("offset")
    )


def wait_transfer(matched: pl.DataFrame) -> dict:
    """Per matched instance (every rank that uses that stream ordinal and kind took part) the
    transfer proxy is the shortest participant's duration and each rank's jitter wait is its
    duration minus that; totals per kind over instances inside every participant's window,
    the counts, and the rank that arrives last most often."""
    keys = ["ordinal", "kind", "instance"]
    with_parts = matched.filter(pl.col("instance").is_not_null()).with_columns(
        participants=pl.len().over(keys),
        expected=pl.col("rank").n_unique().over("ordinal", "kind"),
    )
    full = with_parts.filter(
        (pl.col("participants") >= 2) & (pl.col("participants") == pl.col("expected"))
    )
    n_matched = full.select(keys).unique().height
    unmatched = matched.height - full.height
    inside = full.filter(pl.col("in_window").all().over(keys)).with_columns(
        dur=pl.col("end") - pl.col("start")
    )
    inside = inside.with_columns(proxy=pl.col("dur").min().over(keys)).with_columns(
        wait=pl.col("dur") - pl.col("proxy")
    )
    total = int(inside["dur"].sum())
    wait = int(inside["wait"].sum())
    by_kind = (
        inside.group_by("kind")
        .agg(
            instances=pl.struct(keys).n_unique(),
            comm_ms=pl.col("dur").sum() / 1e6,
            wait_ms=pl.col("wait").sum() / 1e6,
            transfer_ms=pl.col("proxy").sum() / 1e6,
        )
        .sort("comm_ms", descending=True)
    )
    last = (
        inside.sort("a_start")
        .group_by(keys)
        .agg(last=pl.col("rank").last(), spread=pl.col("a_start").max() - pl.col("a_start").min())
    )
    counts = last.group_by("last").len().sort(["len", "last"], descending=[True, False])
    return {
        "collectives_matched": n_matched,
        "collectives_unmatched": unmatched,
        "comm_wait_frac": round(wait / total, 4) if total else None,
        "comm_transfer_frac": round(1 - wait / total, 4) if total else None,
        "comm_by_kind": {
            row["kind"]: {
                "instances": row["instances"],
                "comm_ms": round(row["comm_ms"], 3),
                "wait_ms": round(row["wait_ms"], 3),
                "transfer_ms": round(row["transfer_ms"], 3),
            }
            for row in by_kind.to_dicts()
        },
        "last_arriver_rank": int(counts["last"][0]) if len(counts) else None,
        "last_arriver_share": round(counts["len"][0] / len(last), 3) if len(counts) else None,
    }


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
    coll = pl.concat([rank_collectives(r) for r in ranks])
    offsets, how = clock_offsets(ranks)
    matched = match_instances(coll, offsets)
    refined = refine_offsets(matched, ranks, offsets)
    if refined != offsets:
        how = f"{how} + matched collective ends"
        matched = realign(matched, refined)
    spread = alignment_error_us(matched, ranks[0]["rank"])
    # One export: one clock, nothing to align; the end spread is the collectives' own.
    error = 0.0 if how == "one export" else spread
    out |= wait_transfer(matched)
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
