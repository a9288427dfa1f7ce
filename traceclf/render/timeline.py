"""What ties the report's numbers back to the timeline, as strings every format shows: where
to look in Nsight Systems (the steady-state window and the slowest step, in the capture's own
seconds as the nsys timeline shows them) and the NVTX phase table."""

from __future__ import annotations

import math
from pathlib import Path

from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.report.contract import Report
from traceclf.support.units import fmt_ms

PHASE_COLUMNS = (
    "rank",
    "phase",
    "ms/step",
    "busy",
    "compute",
    "exposed comm",
    "copies",
    "idle",
    "idle: launching",
    "sync",
    "input",
    "host",
    "graph",
    "other",
    "steps",
)


def seconds(lo_ns: int, hi_ns: int) -> str:
    """'14.853–15.889 s': enough decimals that the span reads with two significant digits."""
    span = max(hi_ns - lo_ns, 1) / 1e9
    decimals = max(3, math.ceil(-math.log10(span)) + 1)
    return f"{lo_ns / 1e9:.{decimals}f}–{hi_ns / 1e9:.{decimals}f} s"


def nsys_rows(report: Report) -> list[tuple[str, str]]:
    """("Window", "open in nsys at t = 14.853–15.889 s ..."), and the slowest step."""
    steps = report.steps or {}
    lo, hi = (steps.get("window_ns") or [0, 0])[:2]
    if hi <= lo:
        return []
    several = len(report.inputs) > 1
    first = Path(report.inputs[0]["path"]).name if report.inputs else ""
    where = f" of {first} (rank 0)" if several else ""
    # (no steps found: the window is the whole GPU span, no steady state of anything)
    what = "steady state" if steps.get("source") not in (None, "none") else "the whole GPU span"
    rows = [("Window", f"open in nsys at t = {seconds(lo, hi)}{where} ({what})")]
    worst = steps.get("worst")
    if worst:
        where = f" of {Path(worst['file']).name}" if several and worst.get("file") else ""
        rows.append(
            (
                "Slowest step",
                f"open in nsys at t = {seconds(worst['start_ns'], worst['end_ns'])}{where}: "
                f"step {worst['index']} of rank {worst['rank']}, {fmt_ms(worst['ms'])} "
                f"(median {fmt_ms(steps.get('median_ms'))})",
            )
        )
    return rows + gap_rows(report)


SHOWN_GAPS = 3  # the longest idle gaps each format lists (the rest: --export-dir's idle_gaps)


def longest_gaps(report: Report, n: int = SHOWN_GAPS) -> list[tuple[dict, dict]]:
    """(rank, gap) of the ``n`` longest idle gaps over every rank (``series[].longest_gaps``),
    longest first."""
    gaps = [
        (rank, gap)
        for rank, s in zip(report.ranks, report.series, strict=False)
        for gap in s.get("longest_gaps") or []
    ]
    return sorted(gaps, key=lambda rg: (-rg[1]["duration_ns"], rg[1]["start_ns"]))[:n]


def gap_rows(report: Report) -> list[tuple[str, str]]:
    """("Idle gap", 'open in nsys at t = 1.377–1.728 s: 351 ms idle (cause: host), inside NVTX
    range "..."')
    for the longest idle gaps of the steady state."""
    several_ranks = len(report.ranks) > 1
    several_files = len(report.inputs) > 1
    rows = []
    for rank, gap in longest_gaps(report):
        start, dur = gap["start_ns"], gap["duration_ns"]
        where = f" of {Path(rank['file']).name}" if several_files and rank.get("file") else ""
        who = f"rank {rank['rank']}, " if several_ranks else ""
        nvtx = f', inside NVTX range "{gap["nvtx"]}"' if gap.get("nvtx") else ""
        rows.append(
            (
                "Idle gap",
                f"open in nsys at t = {seconds(start, start + dur)}{where}: {who}"
                f"{fmt_ms(dur / 1e6)} idle (cause: {gap['cause']}){nvtx}",
            )
        )
    return rows


def phase_rows(report: Report) -> list[list[str]]:
    """PHASE_COLUMNS per rank and NVTX phase (forward, backward, optimizer, outside phases):
    ms per steady step; [] when no rank has phase ranges."""
    rows = []
    for rank in report.ranks:
        for p in rank.get("phases") or []:
            idle = p.get("idle_by_cause_ms") or {}
            rows.append(
                [
                    str(rank["rank"]),
                    str(p["phase"]),
                    _ms(p["ms_per_step"]),
                    _ms(p["busy_ms"]),
                    _ms(p["compute_ms"]),
                    _ms(p["exposed_comm_ms"]),
                    _ms(p["copy_ms"]),
                    _ms(p["idle_ms"]),
                    *(_ms(idle.get(c)) for c in IDLE_CAUSES),
                    "–" if p.get("steps") is None else str(p["steps"]),
                ]
            )
    return rows


PHASE_NOTE = (
    "ms per steady step, from the NVTX forward/backward/optimizer ranges projected onto the GPU "
    "work they launched; busy = compute + exposed communication + copies; idle split by what "
    "the host was doing; steps: steady steps the phase ran in."
)


def _ms(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"
