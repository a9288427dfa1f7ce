"""Collectives across ranks: each rank's collective kernels (the map step keeps them:
:func:`collectives_of`), their instances matched across ranks, clocks put on one timeline and
wait vs transfer in collectives (:func:`matched`, for
:func:`traceclf.measures.cross_rank.collective_waits` when a report has several ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from traceclf.steps.steady import Steps

MAX_SHIFT = 8  # instances a rank's capture may start early or late relative to the reference
RUN_BLOCK = 1 << 32  # instances of one shared run are numbered run * RUN_BLOCK + place in it

INSTANCE_SCHEMA = {
    "rank": pl.Int64,
    "ordinal": pl.String,  # the communicator, or the stream's place in order of first use
    "kind": pl.String,
    "start": pl.Int64,
    "end": pl.Int64,
    "in_window": pl.Boolean,
    "row": pl.Int64,  # the collective's row in the rank's list (collectives_of)
    "call": pl.String,
    "msg_bytes": pl.Int64,
}


@dataclass(frozen=True)
class Matching:
    """The collectives of several ranks matched (:func:`matched`)."""

    waits: dict  # wait vs transfer: the keys of the ``cross_rank`` block it fills
    offsets: dict[int, int]  # each rank's clock offset (ns)
    aligned_by: str | None  # how the clocks were aligned
    spread_us: float | None  # the spread of matched collective ends
    # one row per rank and collective: INSTANCE_SCHEMA, ``run`` (the shared run it ends in),
    # ``seq`` (its place in its ordinal, kind and run), ``instance``, aligned ``a_start``/``a_end``
    instances: pl.DataFrame
    # per rank, its analysed steps that overlap the shared runs (steps_in_runs); none: all
    steps_in_runs: dict[int, int]

    def steps_matched(self, rank: dict) -> int:
        """How many of ``rank``'s steps the matched collectives come from: its analysed steps,
        or with shared runs those of them that overlap the runs."""
        analysed = (rank.get("steps") or {}).get("analysed") or 1
        return max(self.steps_in_runs.get(rank["rank"], analysed), 1)


def matched(ranks: list[dict]) -> Matching:
    """The collectives of ``ranks`` matched across them (:class:`Matching`)."""
    coll = pl.concat([rank_collectives(r) for r in ranks])
    offsets, how = clock_offsets(ranks)
    runs = shared_runs(ranks, offsets)
    instances = match_instances(coll, offsets, runs)
    refined = refine_offsets(instances, ranks, offsets)
    if refined != offsets:
        how = f"{how} + matched collective ends"
        if runs is None:
            instances = realign(instances, refined)
        else:  # the runs every rank analysed, laid over each other on the refined clocks
            runs = shared_runs(ranks, refined)
            instances = match_instances(coll, refined, runs)
    instances = undrifted(instances, longest_step_ns(ranks))
    spread = alignment_error_us(instances, ranks[0]["rank"])
    steps = steps_in_runs(ranks, refined, runs)
    return Matching(wait_transfer(instances), refined, how, spread, instances, steps)


def collectives_of(keyed: pl.DataFrame, steps: Steps) -> dict[str, list]:
    """Every collective kernel of the rank that was read (``keyed``: its communication kernels
    with their communicators, :func:`traceclf.measures.communicators.with_keys`; not only the
    window: matching across ranks needs the order from the start), as columns stream_id, kind,
    start, end, and the communicator (``group``), NCCL call and message bytes of each; and
    ``spans``, the analysed spans of the rank's ``steps`` ([start, end) ns: several when steps
    are sampled), which :func:`shared_runs` lays over the other ranks', with ``steps``, the
    analysed steps' own ([GPU start, + step time]: :func:`steps_in_runs`)."""
    analysed = steps.steady.filter(
        pl.col("gpu_start").is_not_null() & pl.col("duration").is_not_null()
    )
    return {
        "spans": [[int(lo), int(hi)] for lo, hi in steps.spans],
        "steps": [  # (lists, as the cached result reads back)
            [int(lo), int(lo + d)]
            for lo, d in zip(analysed["gpu_start"], analysed["duration"], strict=True)
        ],
        "stream_id": keyed["stream_id"].fill_null(-1).to_list(),
        "kind": keyed["comm_kind"].cast(pl.String).to_list(),
        "start": keyed["start"].to_list(),
        "end": keyed["end"].to_list(),
        "group": keyed["group"].to_list(),
        "call": keyed["call"].to_list(),
        "msg_bytes": keyed["msg_bytes"].to_list(),
    }


# A communicator where no NCCL payload names one: a rank's communication stream, numbered from 1
# by first use (stream ids are each process's own); the report adds the nsys stream ids.
STREAM_KEY = "comm stream {}"


def stream_keys(rows: pl.DataFrame) -> pl.DataFrame:
    """(stream_id, stream): each communication stream of a rank's ``rows`` (stream_id, start)
    named by its place in the order of first use (:data:`STREAM_KEY`), which the ranks of a
    job share where their stream ids differ."""
    return (
        rows.group_by("stream_id")
        .agg(first=pl.col("start").min())
        .sort("first", "stream_id")
        .select("stream_id", stream=pl.format(STREAM_KEY, pl.int_range(1, pl.len() + 1)))
    )


def rank_collectives(rank: dict) -> pl.DataFrame:
    """The rank's collectives with ``ordinal``: the communicator NCCL's payloads name (its id
    is the same on every rank), else the rank's communication stream numbered by first use
    (stream ids are per process, the order in which a rank first uses its communicators is
    not); ``row``: place in the rank's list. :func:`match_instances` numbers them."""
    cols = rank.get("collectives") or {}
    n = len(cols.get("start", []))
    schema = {
        "stream_id": pl.Int64,
        "kind": pl.String,
        "start": pl.Int64,
        "end": pl.Int64,
        "group": pl.String,
        "call": pl.String,
        "msg_bytes": pl.Int64,
    }
    df = pl.DataFrame({k: cols.get(k, [None] * n) for k in schema}, schema=schema).with_row_index(
        "row"
    )
    lo, hi = rank.get("window") or (None, None)
    return (
        df.join(stream_keys(df), on="stream_id")
        .with_columns(ordinal=pl.coalesce("group", "stream"), row=pl.col("row").cast(pl.Int64))
        .sort("start")
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


def shared_runs(ranks: list[dict], offsets: dict[int, int]) -> list[tuple[int, int]] | None:
    """The spans of time (on the common clock) that every rank analysed, when some rank's
    steps were sampled (several spans); None when each rank analysed one span (every
    collective is then matched in one sequence from the start of the capture). A sampled
    rank's collectives come in runs with gaps between them that no rank's list shows, and the
    runs' first collectives differ from rank to rank (each rank's steps start at other
    times, its plan may choose other steps): numbered from the start they would pair
    different collectives, run by run further apart."""
    spans = [
        [(lo + offsets.get(r["rank"], 0), hi + offsets.get(r["rank"], 0)) for lo, hi in s]
        for r in ranks
        if (s := (r.get("collectives") or {}).get("spans"))
    ]
    if all(len(s) <= 1 for s in spans):
        return None
    common = spans[0]  # (empty when they share no time: nothing can be matched)
    for other in spans[1:]:
        common = [
            (max(a, c), min(b, d)) for a, b in common for c, d in other if max(a, c) < min(b, d)
        ]
    return sorted(common)


def steps_in_runs(
    ranks: list[dict], offsets: dict[int, int], runs: list[tuple[int, int]] | None
) -> dict[int, int]:
    """Per rank, how many of its analysed steps overlap the shared ``runs`` (none without
    them): the steps its matched collectives come from. A step the runs cut (the ranks'
    steps start at other times) counts whole: its collectives are matched but for those
    the cut leaves out."""
    if runs is None:
        return {}
    out = {}
    for r in ranks:
        steps = (r.get("collectives") or {}).get("steps") or []
        offset = offsets.get(r["rank"], 0)
        out[r["rank"]] = sum(
            any(lo + offset < hi_run and hi + offset > lo_run for lo_run, hi_run in runs)
            for lo, hi in steps
        )
    return out


def _span_of(times: pl.Series, spans: list[tuple[int, int]]) -> pl.Series:
    """The place in ``spans`` (sorted, disjoint [lo, hi] ns) of the span each of ``times``
    lies in; null in none."""
    if not spans:
        return pl.repeat(None, len(times), dtype=pl.Int64, eager=True)
    los = pl.Series([lo for lo, _ in spans], dtype=pl.Int64)
    his = pl.Series([hi for _, hi in spans], dtype=pl.Int64)
    place = los.search_sorted(times, side="right").cast(pl.Int64) - 1
    inside = (place >= 0) & (times <= his.gather(place.clip(lower_bound=0)))
    return place.zip_with(inside, pl.repeat(None, len(times), dtype=pl.Int64, eager=True))


def match_instances(
    coll: pl.DataFrame, offsets: dict[int, int], runs: list[tuple[int, int]] | None = None
) -> pl.DataFrame:
    """Collective instances across ranks: a rank's (ordinal, kind, run, seq) is matched to the
    reference rank's (the one with most rows of that ordinal and kind) at the sequence shift
    (|shift| <= MAX_SHIFT, per run) whose end times agree best, so a capture or a run that
    starts a few collectives early or late on one rank still matches. ``runs``: the shared
    runs (:func:`shared_runs`; None: one run, the whole list); a collective whose aligned end
    lies in none is left out. Returns the rows with ``seq``, ``run``, ``instance`` (the
    reference's seq, ``run * RUN_BLOCK + seq``) and aligned ``a_start``/``a_end``."""
    if coll.is_empty():
        return coll.with_columns(instance=pl.lit(None, pl.Int64), a_start=None, a_end=None)
    off = pl.DataFrame(
        {"rank": list(offsets), "offset": list(offsets.values())},
        schema={"rank": pl.Int64, "offset": pl.Int64},
    )
    coll = coll.join(off, on="rank", how="left", maintain_order="left").with_columns(
        a_start=pl.col("start") + pl.col("offset").fill_null(0),
        a_end=pl.col("end") + pl.col("offset").fill_null(0),
    )
    # (a collective outside the runs every rank analysed has nothing to be matched with)
    coll = _numbered(coll, runs).filter(pl.col("run").is_not_null())
    counts = coll.group_by("ordinal", "kind", "rank").len()
    ref = (
        counts.sort(["len", "rank"], descending=[True, False])
        .unique(["ordinal", "kind"], keep="first")
        .select("ordinal", "kind", ref_rank="rank")
    )
    coll = coll.join(ref, on=["ordinal", "kind"])
    ref_rows = coll.filter(pl.col("rank") == pl.col("ref_rank")).select(
        "ordinal", "kind", "run", ref_seq="seq", ref_end="a_end"
    )
    others = coll.filter(pl.col("rank") != pl.col("ref_rank"))
    shifts = pl.DataFrame({"shift": list(range(-MAX_SHIFT, MAX_SHIFT + 1))})
    trial = (
        others.select("rank", "ordinal", "kind", "run", "seq", "a_end")
        .join(shifts, how="cross")
        .with_columns(ref_seq=pl.col("seq") - pl.col("shift"))
        .join(ref_rows, on=["ordinal", "kind", "run", "ref_seq"])
        .group_by("rank", "ordinal", "kind", "run", "shift")
        .agg(err=(pl.col("a_end") - pl.col("ref_end")).abs().median(), n=pl.len())
    )
    # Among shifts that pair at least half of what could pair, the one whose ends agree best.
    best = (
        trial.with_columns(most=pl.col("n").max().over("rank", "ordinal", "kind", "run"))
        .filter(pl.col("n") * 2 >= pl.col("most"))
        .sort("err", pl.col("shift").abs())
        .unique(["rank", "ordinal", "kind", "run"], keep="first")
        .select("rank", "ordinal", "kind", "run", "shift")
    )
    return (
        coll.join(best, on=["rank", "ordinal", "kind", "run"], how="left")
        .with_columns(
            instance=pl.col("run") * RUN_BLOCK
            + pl.when(pl.col("rank") == pl.col("ref_rank"))
            .then(pl.col("seq"))
            .otherwise(pl.col("seq") - pl.col("shift"))
        )
        .drop("shift", "offset")
    )


def _numbered(coll: pl.DataFrame, runs: list[tuple[int, int]] | None) -> pl.DataFrame:
    """``coll`` (aligned) with ``run``: the shared run its aligned end lies in (0 for all
    without runs; null in none), and ``seq``: its place, in start order, among the rank's
    collectives of its ordinal, kind and run."""
    if runs is None:
        run = pl.repeat(0, coll.height, dtype=pl.Int64, eager=True)
    else:
        run = _span_of(coll["a_end"], runs)
    # (each rank's rows are in start order: rank_collectives, kept by match_instances' join)
    return coll.with_columns(run=run).with_columns(
        seq=pl.int_range(pl.len(), dtype=pl.Int64).over("rank", "ordinal", "kind", "run")
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


def undrifted(matched: pl.DataFrame, longest: float) -> pl.DataFrame:
    """``matched`` with the instances whose ranks' (aligned) ends lie further apart than the
    longest step (``longest``, ns; 0: no bound) unmatched. A collective's ranks wait for each
    other inside one of their steps and end it together, so such an instance pairs two
    different collectives: the ranks' lists counted from different steps (step sampling reads
    each rank's analysed runs, whose edges may hold different collectives; captures started at
    different steps) by more than the sequence shift that matching tries."""
    if not longest or matched.is_empty():
        return matched
    keys = ["ordinal", "kind", "instance"]
    spread = pl.col("a_end").max().over(keys) - pl.col("a_end").min().over(keys)
    return matched.with_columns(instance=pl.when(spread <= longest).then(pl.col("instance")))


def longest_step_ns(ranks: list[dict]) -> float:
    """The longest step of any rank (ns; 0 without steps)."""
    return 1e6 * max(
        (max((r.get("steps") or {}).get("durations_ms") or [0.0]) for r in ranks), default=0.0
    )


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
    full = _full(matched)
    n_matched = full.select(keys).unique().height
    unmatched = matched.height - full.height
    inside = _timed(full)
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


def _full(matched: pl.DataFrame) -> pl.DataFrame:
    """Matched instances every rank that uses their ordinal and kind took part in (two or
    more)."""
    keys = ["ordinal", "kind", "instance"]
    with_parts = matched.filter(pl.col("instance").is_not_null()).with_columns(
        participants=pl.len().over(keys),
        expected=pl.col("rank").n_unique().over("ordinal", "kind"),
    )
    return with_parts.filter(
        (pl.col("participants") >= 2) & (pl.col("participants") == pl.col("expected"))
    )


def _timed(full: pl.DataFrame) -> pl.DataFrame:
    """The instances inside every participant's window, with each rank's duration, the
    transfer proxy (the shortest participant's duration) and its wait (duration - proxy)."""
    keys = ["ordinal", "kind", "instance"]
    inside = full.filter(pl.col("in_window").all().over(keys)).with_columns(
        dur=pl.col("end") - pl.col("start")
    )
    return inside.with_columns(proxy=pl.col("dur").min().over(keys)).with_columns(
        wait=pl.col("dur") - pl.col("proxy")
    )


def group_transfers(matched: pl.DataFrame) -> dict[str, list[dict]]:
    """Per communicator (ordinal), kind and NCCL call, over the matched instances inside every
    participant's window: instances, NCCL message bytes (the participants' mean per
    instance; null when a participant's is unknown) and transfer time (the shortest
    participant's duration, which holds no waiting for a late rank), summed."""
    timed = _timed(_full(matched))
    if timed.is_empty():
        return {}
    keys = ["ordinal", "kind", "instance"]
    per_instance = timed.group_by(*keys).agg(
        pl.col("call").drop_nulls().first(),
        msg_bytes=pl.when(pl.col("msg_bytes").null_count() == 0).then(pl.col("msg_bytes").mean()),
        transfer_ns=pl.col("proxy").first(),
    )
    per = (
        per_instance.group_by("ordinal", "kind", "call")
        .agg(
            instances=pl.len(),
            msg_bytes=pl.when(pl.col("msg_bytes").null_count() == 0).then(
                pl.col("msg_bytes").sum()
            ),
            transfer_ns=pl.col("transfer_ns").sum(),
        )
        .sort("ordinal", "kind", "call", nulls_last=True)
    )
    out: dict[str, list[dict]] = {}
    for row in per.iter_rows(named=True):
        out.setdefault(row["ordinal"], []).append(
            {
                "kind": row["kind"],
                "call": row["call"],
                "instances": row["instances"],
                "msg_bytes": None if row["msg_bytes"] is None else float(row["msg_bytes"]),
                "transfer_ns": int(row["transfer_ns"]),
            }
        )
    return out
