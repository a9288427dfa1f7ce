"""Runs vs ranks: which of several exports are ranks of one job (the multi-run report that
results otherwise is :class:`traceclf.report.runset.RunSet`).

Several exports are merged into one report only when the evidence says they are one job:

- nothing contradicts it: the same GPU model, the same step anchor (steps found the same way,
  under the same NVTX label; a recurring kernel may differ per rank), step times within
  ``STEP_TOLERANCE`` of each other, captures
  that overlap in time when both say when they ran, and no rank id claimed twice;
- and something positive ties them: one profiling session (its UUID), captures that overlap
  in wall-clock time, or file names that differ only in a rank number (``rank_0``,
  ``rank_1``) with distinct rank ids (from the name or from NCCL's payloads).

Exports are grouped greedily in input order: each joins the first group all of whose members
it matches, else starts a run of its own. ``--job`` (all inputs are one job) and ``--runs``
(one report per export) override the guess; the report says which was used and why.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.render.text import anchor_label
from traceclf.support.errors import TraceWarning

if TYPE_CHECKING:
    from traceclf.measures.handoff import ExportResult, RankResult

# Ranks of one synchronous job wait for each other every step: their step times agree closely.
STEP_TOLERANCE = 0.25
# Clocks of different hosts agree to well under this (NTP); captures are compared with it.
CLOCK_SLACK_NS = 2_000_000_000
# A rank number in a file name: a whole token of the name (between separators) such as
# "rank3", "rank_3", "r3", "proc3", "gpu3"; the last such token counts. Counts are not ranks
# ("2gpu", "8gpus"), nor suffixed numbers ("r2s"), nor node indices ("node0").
RANK_IN_NAME = re.compile(r"(?:^|[-_.])(?:rank|proc|gpu|r)[-_.]?(\d+)(?=$|[-_.])", re.IGNORECASE)
DIGITS = re.compile(r"\d+")


@dataclass
class Evidence:
    """What one export says about the job it belongs to."""

    name: str
    gpus: frozenset[str]
    anchor: tuple[str, str]  # (step source, step label) of its first rank
    step_ms: float | None
    session_uuid: str | None
    capture_utc_ns: tuple[int, int] | None
    name_pattern: str
    rank_ids: frozenset[int]


def evidence(result: ExportResult) -> Evidence:
    """``result``: a :class:`~traceclf.measures.handoff.ExportResult`."""
    job = result.job or {}
    first = result.ranks[0].steps if result.ranks else None
    step_ms = [r.steps.median_ms for r in result.ranks if r.steps.median_ms]
    start, span = job.get("start_utc_ns"), job.get("gpu_span_ns")
    capture = (start + span[0], start + span[1]) if start is not None and span else None
    stem = Path(result.path).stem
    part = result.part
    # Rank ids describe a whole file: one process split off a file of several has none of its
    # own (it is compared on GPU, step anchor and step time only), and a number in the name
    # is a rank only when the file holds one rank.
    ranks: set[int] = set()
    if part is None:
        ranks = set(job.get("nccl_ranks") or []) or set(job.get("env_ranks") or [])
        if not ranks and len(result.ranks) == 1:
            ranks = set(rank_in_name(stem))
    return Evidence(
        name=Path(result.path).name + (f" ({part})" if part else ""),
        gpus=frozenset((r.gpu or {}).get("name") or "unknown GPU" for r in result.ranks),
        anchor=(first.source, first.label) if first else ("none", ""),
        step_ms=sum(step_ms) / len(step_ms) if step_ms else None,
        session_uuid=job.get("session_uuid"),
        capture_utc_ns=capture,
        name_pattern=DIGITS.sub("#", stem),
        rank_ids=frozenset(ranks),
    )


def rank_in_name(stem: str) -> list[int]:
    """The rank number a file name (without suffix) carries, if it follows a rank pattern
    (:data:`RANK_IN_NAME`): ``run_rank3`` → [3], ``ulysses_2gpu_1s_window`` → []."""
    found = RANK_IN_NAME.findall(stem)
    return [int(found[-1])] if found else []


def match(a: Evidence, b: Evidence) -> tuple[list[str], list[str]]:
    """(evidence for one job, evidence against) for two exports."""
    against, support = [], []
    if a.gpus != b.gpus:
        against.append(f"different GPUs ({_names(a.gpus)} vs {_names(b.gpus)})")
    if _anchor_key(a) != _anchor_key(b):
        against.append(f"steps found differently ({_anchor(a)} vs {_anchor(b)})")
    if a.step_ms and b.step_ms:
        skew = abs(a.step_ms - b.step_ms) / min(a.step_ms, b.step_ms)
        if skew > STEP_TOLERANCE:
            against.append(
                f"step times differ by {skew:.0%} ({a.step_ms:.3g} vs {b.step_ms:.3g} ms; "
                f"ranks of one job agree within {STEP_TOLERANCE:.0%})"
            )
    elif bool(a.step_ms) != bool(b.step_ms):
        against.append("steps found in one and not the other")
    if a.capture_utc_ns and b.capture_utc_ns:
        if _overlap(a.capture_utc_ns, b.capture_utc_ns):
            support.append("their captures overlap in time")
        else:
            against.append("captured at different times")
    if a.session_uuid and a.session_uuid == b.session_uuid:
        support.append("same profiling session")
    if a.rank_ids and b.rank_ids:
        if a.rank_ids & b.rank_ids:
            against.append(f"both are rank {min(a.rank_ids & b.rank_ids)}")
        elif a.name_pattern == b.name_pattern:
            support.append("file names differ only in the rank number")
        else:
            support.append("distinct rank ids")
    return support, against


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] + CLOCK_SLACK_NS and b[0] <= a[1] + CLOCK_SLACK_NS


@dataclass
class Grouping:
    groups: list[list[int]]  # indices of the exports in each run, input order
    mode: str  # "job" | "runs"
    decided_by: str  # "one export" | "evidence" | "--job" | "--runs"
    reason: str

    def for_report(self) -> dict:
        return {"mode": self.mode, "decided_by": self.decided_by, "reason": self.reason}


def without_repeats(results: list[ExportResult], each_process: bool = True) -> list[ExportResult]:
    """``results`` with each capture once: an export whose capture started and ran its GPU
    work at the same ns as an earlier one's, with the same processes, is that capture again
    (a copy, or a folder holding a copy and a link), said so, not a second rank of a job.
    Then, with ``each_process``, each process once: a process that an earlier export holds too
    (an export of every rank beside its own per-rank split) is left out of the later one, said
    so, and an export left with none is left out whole."""
    seen: dict[tuple, str] = {}
    processes: dict[tuple, str] = {}
    out = []
    for result in results:
        capture = evidence(result).capture_utc_ns  # (when its GPU work ran, in UTC ns)
        key = None if capture is None else (capture, tuple(sorted(r.pid for r in result.ranks)))
        same = "the same capture as {} (its start, GPU span and processes)"
        if _seen_before(seen, key, result.path, same):
            continue
        kept = []
        for rank in result.ranks:
            process = _process(rank) if each_process else None
            also = (
                f"process {rank.pid} is also in {{}} (the same host, pid and steady-state window)"
            )
            if not _seen_before(processes, process, result.path, also):
                kept.append(rank)
        if len(kept) < len(result.ranks) and kept:
            pids = ", ".join(str(rank.pid) for rank in kept)
            result = replace(result, ranks=tuple(kept), part=f"pid{'s' * (len(kept) > 1)} {pids}")
        if kept:
            out.append(result)
    return out


def _seen_before(seen: dict[tuple, str], key: tuple | None, path: str, same: str) -> bool:
    """Whether an earlier input held ``key`` (warned: ``path``, then ``same`` with that input's
    name in its ``{}``); else ``key`` is noted as ``path``'s. A None key is never seen."""
    if key is None:
        return False
    if key in seen:
        warnings.warn(
            f"{path}: {same.format(seen[key])}: analysed once", TraceWarning, stacklevel=3
        )
        return True
    seen[key] = path
    return False


def _process(rank: RankResult) -> tuple | None:
    """What names one process of one capture across exports: its host and pid, and its
    steady-state window in UTC ns, to the ns (the ranks of a job in containers on several
    nodes may share a pid and no host name, never a window to the ns); None without a UTC
    clock (a window in session time alone would match another session's)."""
    offset = rank.clock.utc_offset_ns
    window = rank.steps.window_ns
    if offset is None or len(window) != 2:
        return None
    return (rank.clock.host, rank.pid, offset + window[0], offset + window[1])


def split_unrelated_ranks(results: list[ExportResult], how: str = "auto") -> list[ExportResult]:
    """Processes of one export that cannot be ranks of one job (another GPU model, steps found
    another way, step times more than ``STEP_TOLERANCE`` apart) are split into one result
    each, so that :func:`group` reports them as separate runs instead of averaging two
    workloads. ``--job`` keeps every export whole."""
    if how == "job":
        return results
    out = []
    for result in results:
        if len(result.ranks) < 2:
            out.append(result)
            continue
        parts = [replace(result, ranks=(rank,), part=f"pid {rank.pid}") for rank in result.ranks]
        first = evidence(parts[0])
        if any(match(first, evidence(p))[1] for p in parts[1:]):
            out.extend(parts)
        else:
            out.append(result)
    return out


def group(results: list[ExportResult], how: str = "auto") -> Grouping:
    """Split the map step's ExportResults into runs (see the module docstring)."""
    n = len(results)
    if n == 1:
        return Grouping([[0]], "job", "one export", "one export")
    if how == "job":
        return Grouping([list(range(n))], "job", "--job", f"--job: all {n} files are one job")
    if how == "runs":
        return Grouping([[i] for i in range(n)], "runs", "--runs", "--runs: one report per file")
    ev = [evidence(r) for r in results]
    groups: list[list[int]] = []
    support: dict[int, set[str]] = {}
    apart: list[str] = []
    for i, e in enumerate(ev):
        for g, members in enumerate(groups):
            verdicts = [match(ev[m], e) for m in members]
            if all(s and not a for s, a in verdicts):
                members.append(i)
                support[g] |= {s for sup, _ in verdicts for s in sup}
                break
        else:
            if groups:
                sup, against = match(ev[groups[-1][0]], e)
                why = (
                    "; ".join(against)
                    or "nothing ties them together ("
                    + (", ".join(sup) or "no shared session, overlapping capture or rank naming")
                    + ")"
                )
                # names in the order of the values match() gives: the earlier file first
                apart.append(f"{ev[groups[-1][0]].name} vs {e.name}: {why}")
            groups.append([i])
            support[len(groups) - 1] = set()
    # (one export's processes that run apart are split before: then they are no "files")
    what = f"{n} files" if len({r.path for r in results}) == n else f"{n} processes"
    if len(groups) == 1:
        reasons = ", ".join(sorted(support[0]))
        return Grouping(
            groups,
            "job",
            "evidence",
            f"{what} treated as ranks of one job: {reasons}; "
            "same GPU, same step anchor, step times agree (--runs to split)",
        )
    return Grouping(
        groups,
        "runs",
        "evidence",
        f"{what} are {len(groups)} separate runs (--job to merge): " + " · ".join(apart),
    )


def _names(gpus: frozenset[str]) -> str:
    return ", ".join(sorted(gpus))


def _anchor_key(e: Evidence) -> tuple[str, str]:
    """What two ranks of one job share about their steps: the NVTX label they name, but only
    the kind of a recurring-kernel anchor, whose kernel each rank picks by its own timing
    (the most regular of several per-layer kernels); step times are compared apart."""
    source, label = e.anchor
    return (source, label) if source == "nvtx" else (source, "")


def _anchor(e: Evidence) -> str:
    """The step anchor as the report names it: a recurring kernel by its function, any label
    cut to a line (a CUTLASS kernel's demangled name, 5 KB, made a summary line of 15 KB)."""
    source, label = e.anchor
    return f"{source}{anchor_label(source, label)}"
