"""One side of a comparison, per step: each rank's step account and kernels (the report's
``ranks[].step_kernels``, measures/step_kernels.py), NVTX phases, exposed communication by
kind and peak memory, as means over ranks (peak memory: the largest rank). A saved report is
untrusted: a block of the wrong shape leaves the side without per-step detail, never fails."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from traceclf.report.contract import Report

ACCOUNT = ("step_ms", "kernel_ms", "overlap_ms", "copy_ms", "idle_ms", "graph_ms")
PHASE_VALUES = ("ms_per_step", "busy_ms", "idle_ms")
SHAPES = 8  # launch shapes kept per kernel (as measured: measures/step_kernels.py)


@dataclass
class Side:
    """Means over ranks of per-step times (ms)."""

    steps: int  # steady steps per rank (the fewest of any rank)
    account: dict[str, float]  # ACCOUNT keys
    idle_sd_ms: float | None
    idle_by_cause: dict[str, float]
    kernels: dict[str, dict]  # full name -> short_name, family, ms, sd_ms, instances, shapes
    other_ms: float
    truncated: bool  # some rank listed only its longest kernels (the rest are in other_ms)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    ranges: dict[str, dict[str, float]] = field(default_factory=dict)  # other recurring NVTX
    exposed_by_kind: dict[str, float] = field(default_factory=dict)
    blocking_comm_ms: float | None = None


def side_of(report: Report) -> Side | None:
    """The side's per-step detail, or None when a rank has no ``step_kernels`` (no steps, or
    a report saved by a traceclf before it)."""
    ranks = report.ranks if isinstance(report.ranks, list) else []
    if not all(isinstance(r, dict) for r in ranks):
        return None
    blocks = [_block(r) for r in ranks]
    if not blocks or any(b is None for b in blocks):
        return None
    count = len(blocks)
    account = {k: sum(b[k] for b in blocks) / count for k in ACCOUNT}
    sds = [b["idle_sd_ms"] for b in blocks]
    causes = dict.fromkeys(c for b in blocks for c in b["idle_by_cause_ms"])
    return Side(
        steps=min(b["steps"] for b in blocks),
        account=account,
        idle_sd_ms=None if None in sds else sum(sds) / count,
        idle_by_cause={
            c: sum(number(b["idle_by_cause_ms"].get(c)) or 0.0 for b in blocks) / count
            for c in causes
        },
        kernels=_kernels([b["kernels"] for b in blocks]),
        other_ms=sum(number(b["other"].get("ms")) or 0.0 for b in blocks) / count,
        truncated=any((number(b["other"].get("kernels")) or 0) > 0 for b in blocks),
        phases=_phases([r.get("phases") for r in ranks], "phase", "ms_per_step"),
        ranges=_phases([b.get("ranges") for b in blocks], "name", "ms"),
        exposed_by_kind=_exposed([(r, b) for r, b in zip(ranks, blocks, strict=True)]),
        blocking_comm_ms=_blocking([(r, b) for r, b in zip(ranks, blocks, strict=True)]),
    )


def peak_memory(report: Report) -> tuple[int | None, int | None]:
    """The largest rank's peak of allocated device memory, and the GPU's capacity (bytes)."""
    ranks = report.ranks if isinstance(report.ranks, list) else []
    peaks = [
        number((r.get("metrics") or {}).get("peak_memory_bytes"))
        for r in ranks
        if isinstance(r, dict) and isinstance(r.get("metrics"), dict)
    ]
    peaks = [p for p in peaks if p is not None]
    gpus = report.gpus if isinstance(report.gpus, list) else []
    capacity = next(
        (
            number(g.get("memory_bytes"))
            for g in gpus
            if isinstance(g, dict) and g.get("memory_bytes")
        ),
        None,
    )
    return (
        int(max(peaks)) if peaks else None,
        int(capacity) if capacity else None,
    )


def _block(rank: dict) -> dict | None:
    """A rank's ``step_kernels`` when it has the expected shape and steps."""
    b = rank.get("step_kernels")
    if not isinstance(b, dict) or not isinstance(b.get("steps"), int) or b["steps"] < 1:
        return None
    if any(number(b.get(k)) is None for k in ACCOUNT):
        return None
    if not isinstance(b.get("kernels"), list) or not isinstance(b.get("other"), dict):
        return None
    if not isinstance(b.get("idle_by_cause_ms"), dict):
        return None
    return b | {k: number(b[k]) for k in ACCOUNT} | {"idle_sd_ms": number(b.get("idle_sd_ms"))}


def _kernels(per_rank: list[list]) -> dict[str, dict]:
    """Each kernel's mean over ranks (a rank that did not list it counts 0; spread: the mean
    of the ranks' spreads, as if the ranks varied together)."""
    count = len(per_rank)
    out: dict[str, dict] = {}
    for rows in per_rank:
        for row in rows:
            ms = number(row.get("ms")) if isinstance(row, dict) else None
            if ms is None or not isinstance(row.get("name"), str):
                continue
            k = out.setdefault(
                row["name"],
                {
                    "short_name": str(row.get("short_name") or row["name"]),
                    "family": row.get("family") if isinstance(row.get("family"), str) else None,
                    "ms": 0.0,
                    "sd_ms": 0.0,
                    "instances": 0.0,
                    "shapes": {},
                },
            )
            k["ms"] += ms / count
            k["instances"] += (number(row.get("instances")) or 0.0) / count
            sd = number(row.get("sd_ms"))
            k["sd_ms"] = None if sd is None or k["sd_ms"] is None else k["sd_ms"] + sd / count
            shapes = row.get("shapes")
            for shape in shapes if isinstance(shapes, list) else []:
                if _shape(shape):
                    key = (shape[0], shape[1])
                    k["shapes"][key] = k["shapes"].get(key, 0.0) + shape[2] / count
    for k in out.values():
        shapes = sorted(k["shapes"].items(), key=lambda kv: (-kv[1], str(kv[0])))[:SHAPES]
        k["shapes"] = [[g, b, round(n, 4)] for (g, b), n in shapes]
    return out


def _shape(shape) -> bool:
    """``[grid blocks, threads per block, instances per step]`` (grid or block may be null)."""
    return (
        isinstance(shape, list)
        and len(shape) == 3
        and all(v is None or number(v) is not None for v in shape[:2])
        and number(shape[2]) is not None
    )


def _phases(per_rank: list, key: str, time: str) -> dict[str, dict[str, float]]:
    """Each NVTX phase's (or recurring range's) time per step, busy and idle, mean over ranks
    (absent: 0); ``key`` and ``time`` name its name and time per step in the rows."""
    count = len(per_rank)
    out: dict[str, dict[str, float]] = {}
    for rows in per_rank:
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                continue
            values = [number(row.get(k)) for k in (time, "busy_ms", "idle_ms")]
            if None in values:
                continue
            phase = out.setdefault(row[key], dict.fromkeys(PHASE_VALUES, 0.0) | {"sd_ms": 0.0})
            for column, value in zip(PHASE_VALUES, values, strict=True):
                phase[column] += value / count
            sd = number(row.get("sd_ms"))  # (none in a report saved before it had one: unknown)
            phase["sd_ms"] = (
                None if sd is None or phase["sd_ms"] is None else phase["sd_ms"] + sd / count
            )
    return out


def _exposed(ranks: list[tuple[dict, dict]]) -> dict[str, float]:
    """Each collective kind's exposed time per step (its share of the rank's window times the
    window per step), mean over ranks."""
    out: dict[str, float] = {}
    for rank, block in ranks:
        kinds = rank.get("comm_by_kind")
        for kind, row in (kinds if isinstance(kinds, dict) else {}).items():
            frac = number(row.get("exposed_frac")) if isinstance(row, dict) else None
            if frac is not None:
                out[str(kind)] = out.get(str(kind), 0.0) + frac * block["step_ms"] / len(ranks)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _blocking(ranks: list[tuple[dict, dict]]) -> float | None:
    """Compute-absent time per step blocked on a communication kernel, mean over ranks."""
    values = [
        number((rank.get("metrics") or {}).get("blocking_comm_frac"))
        if isinstance(rank.get("metrics"), dict)
        else None
        for rank, _ in ranks
    ]
    if None in values:
        return None
    return sum(v * b["step_ms"] for v, (_, b) in zip(values, ranks, strict=True)) / len(ranks)


# The largest quantity a report holds (ms, bytes, counts, shares are all less): 1e15 ms is 31
# years, 1e15 bytes a petabyte. Beyond it, sums over a thousand ranks could still overflow.
MAX_QUANTITY = 1e15


def number(v) -> float | None:
    """A value of a saved report as a number, if it is a quantity a report can hold: finite,
    0 or more, at most :data:`MAX_QUANTITY` (not a bool, a string, NaN, an infinity, an
    integer too large for a float, a negative time); else None. Every reader of a
    comparison's sides uses this: no sum of them overflows, nor a difference turns a
    negative time into a gain."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        value = float(v)
    except OverflowError:  # (an integer of 400 digits)
        return None
    return value if math.isfinite(value) and 0 <= value <= MAX_QUANTITY else None
