"""The report's ``communication`` block: each communicator across the ranks — which ranks use it,
the parallel dimension it serves (with the evidence, or ``unknown`` with the clues), its exposed
and blocking time per step, bytes per step, algorithm and bus bandwidth by NCCL's formulas
against the link's peak — and what overlap costs compute; plus the facts rules may use.

The numbers come from the map step (:mod:`traceclf.measures.communicators`, per rank) and the
collectives matched across ranks (:func:`traceclf.measures.collectives.group_transfers`); what
they mean is rule data (rules/communication.yaml ``communicators:``, rules/hardware.yaml
``peer_links``, the ``link_bound_frac`` threshold).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from traceclf.rulebook.comm_rules import DIMENSIONS, CommRules
from traceclf.rulebook.layers import RuleSet
from traceclf.support.units import fmt_bytes

if TYPE_CHECKING:
    from traceclf.measures.handoff import RankResult

REEXPORT = "nsys export --type sqlite --include-blobs=true"
PAYLOAD_NOTES = {
    "declared_empty": (
        "NCCL's payload schemas are in the export but not their values (message sizes, "
        f"communicators): re-export with `{REEXPORT}`"
    ),
    "absent": (
        "the export has no NCCL payloads (message sizes, communicators): capture with NVTX "
        "tracing (-t nvtx) and NCCL 2.19 or later, and export with "
        f"`{REEXPORT}`"
    ),
}


def communication_block(
    ranks: list[RankResult],
    metrics: list[dict],
    capture: dict,
    cross: dict,
    rs: RuleSet,
) -> dict:
    """``communication``: ``payload`` (capture.nccl_payload), ``sizes_note`` (what would add
    the message sizes, when the export has communication but not them), ``groups`` and
    ``overlap_tax``."""
    payload = capture.get("nccl_payload") or "absent"
    shared = [set(g) for g in cross.get("shared_gpu") or []]
    transfers = cross.get("transfers") or {}
    moe = bool(capture.get("moe_evidence"))
    groups = []
    for key in sorted({g["id"] for r in ranks for g in r.measures.comm_groups}):
        members = [
            (i, g) for i, r in enumerate(ranks) for g in r.measures.comm_groups if g["id"] == key
        ]
        groups.append(_group(key, members, ranks, shared, transfers.get(key) or [], moe, rs))
    groups.sort(key=lambda g: -(g["exposed_ms_per_step"] or 0))
    return {
        "payload": payload,
        # (said only where there is communication to size)
        "sizes_note": None if payload == "values" or not groups else PAYLOAD_NOTES.get(payload),
        "groups": groups,
        "overlap_tax": _overlap_tax(ranks, metrics, shared),
    }


def _group(
    key: str,
    members: list[tuple[int, dict]],
    ranks: list[RankResult],
    shared: list[set[int]],
    transfers: list[dict],
    moe: bool,
    rs: RuleSet,
) -> dict:
    rules = rs.communicators
    indices = [i for i, _ in members]
    first = members[0][1]
    nranks = first.get("nranks")
    n = nranks or len(indices)
    kinds = sorted({k for _, g in members for k in g["kinds"]})
    per_rank = [
        {
            "rank": i,
            "kernels_per_step": round(g["kernels"] / _steps(ranks[i]), 2),
            "busy_ms_per_step": g["busy_ms_per_step"],
            "exposed_ms_per_step": g["exposed_ms_per_step"],
            "blocking_ms_per_step": g["blocking_ms_per_step"],
            "bytes_per_step": _bytes_per_step(g["calls"], n, rules, _steps(ranks[i])),
            "stream_ids": g.get("stream_ids") or [],
        }
        for i, g in members
    ]
    dimension, evidence = infer_dimension(kinds, members, moe, rules)
    algbw, busbw, basis = _bandwidth(members, transfers, n, rules)
    link = _link(indices, nranks, ranks, shared, rs)
    bound = (
        None
        if busbw is None or link["gbps"] is None
        else busbw >= rs.thresholds["link_bound_frac"] * link["gbps"]
    )
    exposed = _mean([p["exposed_ms_per_step"] for p in per_rank])
    bytes_per_step = _mean([p["bytes_per_step"] for p in per_rank])
    calls = _mean([p["kernels_per_step"] for p in per_rank])
    # (ranks that time-slice one GPU stretch each other's kernels: no rate is measured there)
    one_gpu = any(set(indices) <= g for g in shared)
    slow = None if one_gpu else _slow_on_one_host(busbw, link, bytes_per_step, calls, rs)
    return {
        "id": key,
        "kinds": kinds,
        # (the nsys ids of the streams its kernels ran on, each rank's own: per_rank)
        "stream_ids": sorted({s for p in per_rank for s in p["stream_ids"]}),
        "ranks": indices,
        "nranks": nranks,
        "dimension": dimension,
        "dimension_evidence": evidence,
        "calls_per_step": calls,
        "exposed_ms_per_step": exposed,
        "exposed_frac": _mean([g["exposed_frac"] for _, g in members]),
        "blocking_ms_per_step": _mean([p["blocking_ms_per_step"] for p in per_rank]),
        "bytes_per_step": bytes_per_step,
        "algbw_gbs": algbw,
        "busbw_gbs": busbw,
        "bandwidth_basis": basis,
        "link": link["name"],
        "link_peak_gbs": link["gbps"],
        "link_note": "; ".join(n for n in (link["note"], slow) if n) or None,
        "spans_hosts": link["spans_hosts"],
        "link_bound": bound,
        "per_rank": per_rank,
    }


def infer_dimension(
    kinds: list[str], members: list[tuple[int, dict]], moe: bool, rules: CommRules
) -> tuple[str, list[str]]:
    """The parallel dimension the clues leave (``unknown`` when they leave several or none),
    and each clue as a sentence: the kinds it runs, where they were launched (NVTX forward
    ranges), MoE routing in the capture, NVTX ranges around the calls that name a dimension."""
    left = set(DIMENSIONS)
    evidence = []
    for kind in kinds:
        allowed = rules.kinds.get(kind)
        if allowed:
            left &= set(allowed)
            evidence.append(f"runs {kind}: {_or(allowed)}")
    clues = [g.get("clues") or {} for _, g in members]
    forward = sorted({k for c in clues for k in c.get("forward_kinds") or []})
    has_forward = any(c.get("has_forward") for c in clues)
    for kind in kinds:
        if kind in forward and kind in rules.in_forward:
            left &= set(rules.in_forward[kind])
            evidence.append(
                f"{kind} launched inside NVTX forward ranges: {_or(rules.in_forward[kind])}"
            )
        elif has_forward and kind not in forward and kind in rules.not_in_forward:
            left &= set(rules.not_in_forward[kind])
            evidence.append(
                f"no {kind} launched inside the NVTX forward ranges: "
                f"{_or(rules.not_in_forward[kind])}"
            )
        if moe and kind in rules.with_moe:
            left &= set(rules.with_moe[kind])
            evidence.append(
                f"{kind} in a capture with MoE routing (capture.moe_evidence): "
                f"{_or(rules.with_moe[kind])}"
            )
    named: dict[str, set[str]] = {}
    for c in clues:
        for entry in c.get("nvtx") or []:
            if entry.get("dimension") in DIMENSIONS:
                named.setdefault(entry["dimension"], set()).add(entry["name"])
    for dim, names in sorted(named.items()):
        quoted = ", ".join(f"'{n}'" for n in sorted(names))
        evidence.append(f"called inside NVTX {quoted}: {dim.upper()}")
    if named:
        said = set(named)
        if len(said) == 1 and said <= left:
            return next(iter(said)), evidence
        allow = f"kinds allow {_or(sorted(left))}" if left else "kinds allow none"
        evidence.append(f"the clues disagree: NVTX names {_or(sorted(said))}, {allow}")
        return "unknown", evidence
    if len(left) == 1:
        return next(iter(left)), evidence
    if left:
        evidence.append(f"the export does not say which of {_or(sorted(left))}")
    else:
        evidence.append("the clues leave no dimension")
    return "unknown", evidence


def _or(dims: list[str] | tuple[str, ...]) -> str:
    names = [d.upper() for d in dims]
    if not names:
        return "none"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _size(call: dict, n: int, rules: CommRules) -> float | None:
    """The operation's size as nccl-tests counts it (S) from NCCL's message bytes."""
    if call["msg_bytes"] is None:
        return None
    return call["msg_bytes"] * (n if call["call"] in rules.message_times_ranks else 1)


def _bytes_per_step(calls: list[dict], n: int, rules: CommRules, steps: int) -> float | None:
    sizes = [_size(c, n, rules) for c in calls]
    if not sizes or any(s is None for s in sizes):
        return None
    return round(sum(sizes) / steps, 1)  # type: ignore[arg-type]


def _bandwidth(
    members: list[tuple[int, dict]], transfers: list[dict], n: int, rules: CommRules
) -> tuple[float | None, float | None, str | None]:
    """(algbw, busbw) in GB/s and what time they rest on: the matched collectives' transfer
    time (the shortest participant's duration, no waiting for a late rank), else the kernels'
    own durations (waiting included: a lower bound)."""
    rows = [
        (t["kind"], _size(t, n, rules), t["transfer_ns"]) for t in transfers if t["transfer_ns"] > 0
    ]
    basis = "transfer time of matched collectives (the shortest participant's duration)"
    if not rows:
        rows = [
            (c["kind"], _size(c, n, rules), c["kernel_ms"] * 1e6)
            for _, g in members
            for c in g["calls"]
        ]
        basis = "kernel durations (waiting for other ranks included: a lower bound)"
    if not rows or any(size is None for _, size, _ in rows):
        return None, None, None
    ns = sum(t for _, _, t in rows)
    if ns <= 0:
        return None, None, None
    sent = sum(size for _, size, _ in rows)  # type: ignore[misc]
    bus = sum(
        size * (rules.bus_factor[k].of(n) if k in rules.bus_factor else 1.0)  # type: ignore[operator]
        for k, size, _ in rows
    )
    return round(sent / ns, 3), round(bus / ns, 3), basis  # bytes per ns = GB/s


def _link(
    indices: list[int],
    nranks: int | None,
    ranks: list[RankResult],
    shared: list[set[int]],
    rs: RuleSet,
) -> dict:
    """The link the communicator's exchange crosses, from what the export shows: none between
    ranks that share one GPU; the network between hosts (its speed not in the export); the
    GPUs' peer link (rules/hardware.yaml ``peer_links``) within one host. ``spans_hosts``:
    null when ranks of the communicator are not in the capture."""
    hosts = {_host(ranks[i]) for i in indices}
    missing = nranks is None or nranks > len(indices)
    spans = True if len(hosts) > 1 else (None if missing or None in hosts else False)
    out = {"name": None, "gbps": None, "note": None, "spans_hosts": spans}
    if any(set(indices) <= g for g in shared) and not spans:
        out["note"] = "the ranks share one GPU: the exchange crosses no link the export describes"
        return out
    if spans:
        out["note"] = f"ranks on {len(hosts)} hosts: the export does not record the network's speed"
        return out
    gpu = ranks[indices[0]].gpu or {}
    text = " ".join(str(gpu.get(k) or "") for k in ("name", "chip")).strip()
    link = next((ln for ln in rs.peer_links if text and ln.match.search(text)), None)
    if link is None:
        out["note"] = "GPU model not in rules/hardware.yaml peer_links"
        return out
    out |= {"name": link.name, "gbps": link.gbps}
    if missing:
        out["note"] = (
            "not every rank of the communicator is in the capture: across hosts, the network "
            "sets the pace"
        )
    return out


def _slow_on_one_host(
    busbw: float | None,
    link: dict,
    bytes_per_step: float | None,
    calls_per_step: float | None,
    rs: RuleSet,
) -> str | None:
    """A note where the ranks of one host, each on a GPU of its own (``link``: its
    ``spans_hosts`` is False), exchange messages big enough to measure bandwidth
    (``local_exchange_min_bytes`` a call) slower than any link between GPUs of one host
    carries (``local_exchange_slow_gbps``): a premise for the user to check, since the export
    does not say which transport NCCL chose."""
    t = rs.thresholds
    if (
        busbw is None
        or link["spans_hosts"] is not False
        or not bytes_per_step
        or not calls_per_step
    ):
        return None
    if bytes_per_step / calls_per_step < t["local_exchange_min_bytes"]:
        return None
    if busbw >= t["local_exchange_slow_gbps"]:
        return None
    return (
        f"{busbw:.3g} GB/s between GPUs of one host, on messages of "
        f"{fmt_bytes(bytes_per_step / calls_per_step)} a call: slower than any link between "
        "GPUs of one host, as when NCCL exchanges through the network stack (its socket "
        "transport, or peer-to-peer and shared memory turned off); NCCL_DEBUG=INFO names the "
        "transport it chose"
    )


def _host(rank: RankResult) -> str | None:
    """The rank's host: its export's hostname, else its export (one capture, one host)."""
    return rank.clock.host or rank.clock.export


def _overlap_tax(ranks: list[RankResult], metrics: list[dict], shared: list[set[int]]) -> dict:
    """What overlap costs compute (``metrics.overlap_tax_frac`` per rank, its ms per step and
    the kernel shapes behind it), and on a GPU that ranks share, that the slowdown also holds
    the other process's time slices."""
    fracs = [m.get("overlap_tax_frac") for m in metrics]
    measured = [i for i, f in enumerate(fracs) if f is not None]
    if not measured:
        return {"frac": None, "ms_per_step": None, "kernels": [], "note": None}
    ms = [fracs[i] * (metrics[i].get("step_time_ms") or 0) for i in measured]
    kernels = [{"rank": i} | shape for i in measured for shape in ranks[i].measures.overlap_tax]
    sharing = [i for i in measured if any(i in g for g in shared)]
    note = (
        f"rank{'s' if len(sharing) > 1 else ''} {', '.join(map(str, sharing))} share"
        f"{'' if len(sharing) > 1 else 's'} a GPU with another rank: the slowdown beside "
        "communication also holds the other process's time slices on that GPU"
        if sharing
        else None
    )
    return {
        "frac": round(statistics.fmean(fracs[i] for i in measured), 6),
        "ms_per_step": round(statistics.fmean(ms), 4),
        "kernels": kernels,
        "note": note,
    }


def rule_facts(block: dict, cross: dict, metrics: dict) -> dict:
    """Facts rules may use (judge/vocabulary.py CONTEXT_NAMES): the EP communicators' exposed
    share of the step, whether they span hosts and run near the link's peak (null when the
    export cannot say), and the latest rank's lateness and its largest causes."""
    ep = [g for g in block.get("groups") or [] if g["dimension"] == "ep"]
    step = metrics.get("step_time_ms")
    late = (cross.get("late_arrivals") or [None])[0]
    out = {
        # (each rank's communicators split the time they are exposed together, so a rank's
        # sum is at most 1; the groups' means over different ranks may pass it: capped)
        "ep_exposed_frac": (
            round(min(sum(g["exposed_frac"] or 0 for g in ep), 1.0), 4) if ep else None
        ),
        "ep_spans_hosts": _any3([g["spans_hosts"] for g in ep]),
        "ep_link_bound": _any3([g["link_bound"] for g in ep]),
        "ep_busbw_gbs": max(
            (g["busbw_gbs"] for g in ep if g["busbw_gbs"] is not None), default=None
        ),
        "ep_link_peak_gbs": max(
            (g["link_peak_gbs"] for g in ep if g["link_peak_gbs"] is not None), default=None
        ),
        "late_rank": late["rank"] if late else None,
        "late_frac": _frac(late["late_ms_per_step"], step) if late else None,
        "late_host_nvtx": None,
        "late_host_nvtx_frac": None,
        "late_compute_frac": None,
    }
    for cause in (late or {}).get("causes") or []:
        if cause["cause"] == "host_idle_nvtx" and out["late_host_nvtx"] is None:
            out["late_host_nvtx"] = cause.get("nvtx")
            out["late_host_nvtx_frac"] = _frac(cause["ms_per_step"], step)
        if cause["cause"] == "longer_compute":
            out["late_compute_frac"] = _frac(cause["ms_per_step"], step)
    return out


def _any3(values: list[bool | None]) -> bool | None:
    """True if any is true, false if all are false, else null (three-valued or)."""
    if any(v is True for v in values):
        return True
    if values and all(v is False for v in values):
        return False
    return None


def _frac(ms: float | None, step: float | None) -> float | None:
    """``ms`` per step as a share of the mean step, at most all of it (ms per analysed step
    count the window's outlier steps, which the mean leaves out)."""
    return round(min(ms / step, 1.0), 4) if ms is not None and step else None


def _steps(rank: RankResult) -> int:
    return max(rank.steps.analysed or 1, 1)


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.fmean(vals), 4) if vals else None
