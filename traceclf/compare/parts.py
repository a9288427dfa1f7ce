"""Phase by phase and cause by cause: what changed inside the step between two runs, and how
the parts add up to the step change (the reconciliation). Each side comes from its report
alone (:mod:`traceclf.compare.side`), so saved reports compare like traces."""

from __future__ import annotations

import math

from traceclf.compare.kernel_diff import kernel_diff
from traceclf.compare.side import Side, peak_memory, side_of
from traceclf.report.breakdown import (
    Breakdown,
    CommunicationChange,
    IdleChange,
    MemoryChange,
    PartChange,
    PhaseChange,
    Reconciliation,
    Thresholds,
)
from traceclf.report.contract import Report
from traceclf.rulebook.entries import ComparisonSettings

NVTX_ORDER = ("forward", "backward", "optimizer")
IN_GRAPHS, OUTSIDE_GRAPHS = "in CUDA-graph replays", "outside CUDA-graph replays"


def breakdown(
    before: Report,
    after: Report,
    steps_ms: tuple[float | None, float | None],
    labels: tuple[str, str],
    settings: ComparisonSettings,
    noise_ms: float | None = None,
) -> Breakdown:
    """Kernels, phases, idle, communication and the reconciliation for two reports whose mean
    steady steps are ``steps_ms``; only peak memory when a side has no steps (no per-step
    figure is made up for it) or no per-step detail. An idle cause or a collective kind has
    no spread of its own (nor a phase of a report saved without one): its change is material
    past the step's ``noise_ms`` too."""
    memory = _memory(before, after, settings)
    thresholds = Thresholds(settings.part_share, None, settings.memory_share)
    missing = [label for label, ms in zip(labels, steps_ms, strict=True) if ms is None]
    if missing:
        return Breakdown(
            memory=memory,
            thresholds=thresholds,
            detail_missing=f"no steps in {' and '.join(missing)}",
        )
    sides = side_of(before), side_of(after)
    if None in sides:
        bare = [label for label, s in zip(labels, sides, strict=True) if s is None]
        return Breakdown(
            memory=memory,
            thresholds=thresholds,
            detail_missing=f"no per-kernel detail in {' and '.join(bare)} (a report saved by "
            "an earlier traceclf: analyse the trace again)",
        )
    b, a = sides
    step_b, step_a = steps_ms
    floor = settings.part_share * step_b
    thresholds.part_floor_ms, thresholds.step_noise_ms = floor, noise_ms
    kernels, other = kernel_diff(b, a, settings, step_b)
    band = max(floor, noise_ms or 0.0)  # (material past it: ``>=``, the floor's test)
    return Breakdown(
        thresholds=thresholds,
        kernels=kernels,
        other_kernels=other,
        phases=_phases(b, a, floor, band, settings),
        idle=_idle(b, a, settings, floor, band),
        communication=_communication(b, a, band),
        reconciliation=_reconciliation(b, a, step_b, step_a),
        memory=memory,
    )


def _part(before: float, after: float, floor: float) -> PartChange:
    return PartChange(before, after, after - before, abs(after - before) >= floor)


def _phases(
    b: Side, a: Side, floor: float, band: float, settings: ComparisonSettings
) -> list[PhaseChange]:
    """NVTX phases either run has, in step order; the other recurring NVTX ranges both runs
    have (longest first); then the time inside and outside CUDA-graph replays when either run
    replays graphs. A phase's or a range's change is material past ``floor`` and its own noise
    (from its step-to-step spread, as a kernel's); without a spread (a report saved before
    they had one, the time outside phases), past ``band``."""

    def bar(before: dict | None, after: dict | None) -> float:
        if before is None or after is None:
            return band
        noise = _noise(before.get("sd_ms"), after.get("sd_ms"), b, a, settings)
        return band if noise is None else max(floor, math.nextafter(noise, math.inf))

    names = sorted(
        {*b.phases, *a.phases},
        key=lambda p: NVTX_ORDER.index(p) if p in NVTX_ORDER else len(NVTX_ORDER),
    )
    rows = [
        _phase(
            name,
            "nvtx",
            b.phases.get(name),
            a.phases.get(name),
            bar(b.phases.get(name), a.phases.get(name)),
        )
        for name in names
    ]
    shared = sorted(set(b.ranges) & set(a.ranges), key=lambda r: (-b.ranges[r]["ms_per_step"], r))
    for name in shared:
        rows.append(
            _phase(
                name, "range", b.ranges[name], a.ranges[name], bar(b.ranges[name], a.ranges[name])
            )
        )
    if b.account["graph_ms"] or a.account["graph_ms"]:
        for name in (IN_GRAPHS, OUTSIDE_GRAPHS):
            rows.append(_phase(name, "graph", _graph_part(b, name), _graph_part(a, name), band))
    return rows


def _noise(
    sd_b: float | None, sd_a: float | None, b: Side, a: Side, settings: ComparisonSettings
) -> float | None:
    """The noise band of a part's mean per step, from its step-to-step spreads (as a
    kernel's); None when a spread is unknown or a side has one step."""
    if sd_b is None or sd_a is None or min(b.steps, a.steps) < 2:
        return None
    return settings.noise_standard_errors * math.hypot(
        sd_b / math.sqrt(b.steps), sd_a / math.sqrt(a.steps)
    )


def _graph_part(side: Side, name: str) -> dict[str, float]:
    """The time inside CUDA-graph replays (their spans), or the rest. The idle inside them is
    the idle of cause "graph" (between a node-traced replay's kernels; none is seen with
    graph-level tracing); the rest of the idle is outside."""
    acc = side.account
    graph, inside = acc["graph_ms"], side.idle_by_cause.get("graph", 0.0)
    if name == IN_GRAPHS:
        return {"ms_per_step": graph, "busy_ms": graph - inside, "idle_ms": inside}
    rest, idle = acc["step_ms"] - graph, acc["idle_ms"] - inside
    return {"ms_per_step": rest, "busy_ms": rest - idle, "idle_ms": idle}


def _phase(name: str, kind: str, b: dict | None, a: dict | None, floor: float) -> PhaseChange:
    """One phase's row; a side without the phase (no such NVTX range) has no numbers, and
    then no change is judged."""
    delta = a["ms_per_step"] - b["ms_per_step"] if a and b else None
    return PhaseChange(
        phase=name,
        kind=kind,
        before_ms_per_step=b and b["ms_per_step"],
        after_ms_per_step=a and a["ms_per_step"],
        delta_ms_per_step=delta,
        before_busy_ms=b and b["busy_ms"],
        after_busy_ms=a and a["busy_ms"],
        before_idle_ms=b and b["idle_ms"],
        after_idle_ms=a and a["idle_ms"],
        material=delta is not None and abs(delta) >= floor,
    )


def _idle(b: Side, a: Side, settings: ComparisonSettings, floor: float, band: float) -> IdleChange:
    """Idle per step, judged against its step-to-step spread like a kernel; by cause, against
    ``band`` (a cause has no spread of its own)."""
    before, after = b.account["idle_ms"], a.account["idle_ms"]
    delta = after - before
    noise = None
    if b.idle_sd_ms is not None and a.idle_sd_ms is not None and min(b.steps, a.steps) > 1:
        noise = settings.noise_standard_errors * math.hypot(
            b.idle_sd_ms / math.sqrt(b.steps), a.idle_sd_ms / math.sqrt(a.steps)
        )
    causes = dict.fromkeys([*b.idle_by_cause, *a.idle_by_cause])
    return IdleChange(
        before_ms_per_step=before,
        after_ms_per_step=after,
        delta_ms_per_step=delta,
        material=abs(delta) >= floor and abs(delta) > (noise or 0.0),
        noise_ms=noise,
        by_cause={
            c: _part(b.idle_by_cause.get(c, 0.0), a.idle_by_cause.get(c, 0.0), band) for c in causes
        },
    )


def _communication(b: Side, a: Side, floor: float) -> CommunicationChange:
    kinds = dict.fromkeys([*b.exposed_by_kind, *a.exposed_by_kind])
    blocking = (
        _part(b.blocking_comm_ms, a.blocking_comm_ms, floor)
        if b.blocking_comm_ms is not None and a.blocking_comm_ms is not None
        else None
    )
    return CommunicationChange(
        exposed_by_kind={
            k: _part(b.exposed_by_kind.get(k, 0.0), a.exposed_by_kind.get(k, 0.0), floor)
            for k in kinds
        },
        blocking=blocking,
    )


def _reconciliation(b: Side, a: Side, step_b: float, step_a: float) -> Reconciliation:
    """Kernels and idle against the step change; what is left, term by term. On each rank the
    window per step is kernel time - overlap + copies + idle (measures/step_kernels.py), so
    the terms add up to the step change exactly (up to rounding)."""

    def delta(key: str) -> float:
        return a.account[key] - b.account[key]

    change = step_a - step_b
    kernels, idle = delta("kernel_ms"), delta("idle_ms")
    return Reconciliation(
        step_change_ms=change,
        kernels_ms=kernels,
        idle_ms=idle,
        unexplained_ms=change - kernels - idle,
        overlap_ms=0.0 - delta("overlap_ms"),  # (not -0.0 when nothing changed)
        copies_ms=delta("copy_ms"),
        outlier_steps_ms=(step_a - a.account["step_ms"]) - (step_b - b.account["step_ms"]),
    )


def _memory(before: Report, after: Report, settings: ComparisonSettings) -> MemoryChange | None:
    (b, capacity), (a, capacity_after) = peak_memory(before), peak_memory(after)
    if b is None and a is None:
        return None
    delta = a - b if a is not None and b is not None else None
    scale = capacity or capacity_after or b
    material = delta is not None and bool(scale) and abs(delta) >= settings.memory_share * scale
    return MemoryChange(b, a, delta, capacity or capacity_after, material)
