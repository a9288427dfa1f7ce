"""The communication section every format shows, as strings: one row per communicator (its
dimension, kinds, ranks, exposed and blocking ms per step, bytes per step, bandwidth against
the link's peak), the evidence for each dimension, the late arrivals and their causes, what
overlap costs compute, and what would add the message sizes when the export lacks them."""

from __future__ import annotations

from traceclf.report.contract import Report
from traceclf.support.units import fmt_bytes, pct

GROUP_COLUMNS = (
    "communicator",
    "dim",
    "kinds",
    "ranks",
    "calls",
    "exposed",
    "blocking",
    "bytes",
    "algbw",
    "busbw",
    "link peak",
)
LATE_COLUMNS = ("rank", "late ms/step", "cause", "ms/step", "detail")
TITLE = "Communicators"
NOTE = (
    "per communicator (NCCL's communicator id; without NCCL payloads, the ranks' communication "
    "streams numbered by first use, with the nsys stream ids), averaged over its ranks: calls, "
    "exposed and blocking ms, bytes per step; exposed = its kernels with no compute running "
    "(shared while several run), blocking = compute waited for it; bytes as nccl-tests counts "
    "them; algorithm and bus bandwidth (nccl-tests' formula) and the link's peak per direction "
    "in GB/s"
)


def group_rows(report: Report) -> list[list[str]]:
    """GROUP_COLUMNS per communicator, most exposed first."""
    return [
        [
            str(g["id"]),  # (the streams' nsys ids in its note: the table stays narrow)
            str(g["dimension"]),
            ", ".join(g["kinds"]),
            ", ".join(map(str, g["ranks"]))
            + (f" of {g['nranks']}" if g.get("nranks") not in (None, len(g["ranks"])) else ""),
            _num(g.get("calls_per_step")),
            _num(g.get("exposed_ms_per_step")),
            _num(g.get("blocking_ms_per_step")),
            fmt_bytes(g.get("bytes_per_step")),
            _num(g.get("algbw_gbs")),
            _num(g.get("busbw_gbs")),
            _num(g.get("link_peak_gbs")),
        ]
        for g in (report.communication or {}).get("groups") or []
    ]


def _streams(group: dict) -> str:
    """For a communicator numbered by stream (no NCCL payload names it): the nsys ids of the
    streams its kernels ran on, which the timeline shows; else nothing."""
    ids = group.get("stream_ids") or []
    if not ids or str(group["id"]).startswith("0x"):
        return ""
    return f"; nsys stream{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}"


def group_notes(report: Report) -> list[str]:
    """Per communicator: the evidence for its dimension, what its bandwidth rests on and the
    link; then what would add the message sizes, when they are missing, and the matched
    instances that late arrivals left out as drifted matches."""
    comm = report.communication or {}
    notes = []
    for g in comm.get("groups") or []:
        parts = ["; ".join(g.get("dimension_evidence") or [])]
        if g.get("busbw_gbs") is not None:
            parts.append(f"bandwidth on the {g['bandwidth_basis']}")
        link = g.get("link")
        if link and g.get("link_peak_gbs") is not None:
            share = (
                f", bus bandwidth {pct(g['busbw_gbs'] / g['link_peak_gbs'])} of it"
                if g.get("busbw_gbs") is not None and g["link_peak_gbs"]
                else ""
            )
            parts.append(f"link {link} ({g['link_peak_gbs']:g} GB/s per direction{share})")
        if g.get("link_note"):
            parts.append(str(g["link_note"]))
        notes.append(
            f"{g['id']} ({str(g['dimension']).upper()}{_streams(g)}): "
            + " · ".join(p for p in parts if p)
        )
    if comm.get("sizes_note"):
        notes.append(f"Message sizes: {comm['sizes_note']}")
    drifted = int((report.cross_rank or {}).get("late_arrivals_left_out") or 0)
    if drifted:
        notes.append(
            f"Late arrivals: {drifted} matched collective instances left out as matches that "
            "drifted (the ranks' collectives counted from different steps), not ranks arriving "
            "late: ranks wait inside a step, and there a rank would have started later than "
            "the longest step after its group's median rank, or been later per step than the "
            "ranks' mean step lasts"
        )
    return notes


def late_rows(report: Report) -> list[list[str]]:
    """LATE_COLUMNS: each late rank, then one row per cause (largest first)."""
    rows = []
    for late in (report.cross_rank or {}).get("late_arrivals") or []:
        head = [str(late["rank"]), _num(late["late_ms_per_step"])]
        causes = late.get("causes") or []
        for i, c in enumerate(causes or [{"cause": "–", "ms_per_step": None, "detail": ""}]):
            rows.append(
                (head if i == 0 else ["", ""])
                + [str(c["cause"]), _num(c.get("ms_per_step")), str(c.get("detail") or "")]
            )
    return rows


def late_lines(report: Report) -> list[tuple[str, str]]:
    """(label, text) per late rank for a list: how late, then each cause with its ms per
    step and what it is."""
    out = []
    for late in (report.cross_rank or {}).get("late_arrivals") or []:
        causes = "; ".join(
            f"{c['cause']} {_num(c.get('ms_per_step'))} ms ({c.get('detail') or ''})"
            for c in late.get("causes") or []
        )
        out.append(
            (f"rank {late['rank']}", f"{_num(late['late_ms_per_step'])} ms/step late: {causes}")
        )
    return out


def late_notes(report: Report) -> list[str]:
    """How late arrivals are measured, and for ranks that share a GPU, that the median rank's
    waiting collective kernel held it meanwhile."""
    arrivals = (report.cross_rank or {}).get("late_arrivals") or []
    if not arrivals:
        return []
    notes = [
        "ms per step that a rank starts matched collectives after its group's median rank, and "
        "where its timeline since the previous matched collective differs from that rank's; "
        "the causes add up to it"
    ]
    for late in arrivals:
        shared = late.get("shared_gpu")
        if shared:
            others = ", ".join(map(str, shared["ranks"]))
            notes.append(
                f"rank {late['rank']} shares its GPU with rank {others}: that rank's collective "
                f"kernel held the GPU, waiting, for the {_num(shared['held_ms_per_step'])} ms per "
                f"step rank {late['rank']} was late, so rank {late['rank']}'s kernels ran in time "
                "slices beside it"
            )
    return notes


def overlap_line(report: Report) -> str | None:
    """What overlap costs compute, with its largest kernel shape and the shared-GPU caveat."""
    tax = (report.communication or {}).get("overlap_tax") or {}
    if tax.get("frac") is None:
        return None
    line = (
        f"compute beside communication costs {_num(tax.get('ms_per_step'))} ms per step "
        f"({pct(tax['frac'])} of the step)"
    )
    kernels = tax.get("kernels") or []
    if kernels:
        k = kernels[0]
        line += (
            f"; {k['kernel']} (grid {k['grid']}, block {k['block']}) on rank {k['rank']}: "
            f"{k['alone_us']:g} µs alone, {k['beside_us']:g} µs beside communication "
            f"({pct(k['slowdown_frac'])} slower, {k['beside_per_step']:g} launches per step)"
        )
    if tax.get("note"):
        line += f"; {tax['note']}"
    return line


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
