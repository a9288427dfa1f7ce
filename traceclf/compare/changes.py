"""What explains a change between two runs, besides the measures that moved: how CUDA graphs
were traced in each, fixes that became applied or stopped being proposed, and launch counts
that include CUDA-graph launches. Read from saved reports of any version (fields missing or of
the wrong type are skipped, never trusted)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.compare.side import number

if TYPE_CHECKING:
    from traceclf.report.comparison import Run
    from traceclf.report.contract import Report

# Per-kernel measures: what they count depends on how CUDA graphs were traced.
PER_KERNEL = frozenset({"kernels_per_step", "median_kernel_us", "small_grid_kernel_frac"})

_MODE = {"graph": "graph-level", "node": "node-level"}


def graph_tracing(report: Report) -> str | None:
    """How the run's CUDA graphs were traced: "graph" (one row per graph execution), "node"
    (one row per kernel inside it) or None (no graphs). Read from the report's capture block
    (``graph_trace_mode``) when it says one of those, else from the measures: graph
    executions appear as their own rows only under graph-level tracing."""
    capture = getattr(report, "capture", None)
    mode = capture.get("graph_trace_mode") if isinstance(capture, dict) else None
    if mode in ("graph", "node"):
        return mode
    m = metrics_of(report)
    if not m.get("uses_cuda_graphs") and not (number(m.get("graph_frac")) or 0) > 0:
        return None
    return "graph" if (number(m.get("graph_launches_per_step")) or 0) > 0 else "node"


def metrics_of(report: Report) -> dict:
    """The run's measures, with launches counted together with CUDA-graph launches: the launch
    calls of the steps include each ``cudaGraphLaunch``, so there are at least as many as
    graph executions; a report saved before they were counted so (it read 0 launches on
    graph runs: calls clipped to the GPU window by time) has the executions stand in."""
    m = dict(report.metrics) if isinstance(report.metrics, dict) else {}
    launches, graphs = (
        number(m.get("launch_calls_per_step")),
        number(m.get("graph_launches_per_step")),
    )
    if launches is not None or graphs is not None:
        m["launches_per_step"] = max(launches or 0.0, graphs or 0.0)
    return m


def per_step_known(metrics: dict, run: Run) -> dict:
    """The run's measures, less those per step when it has no steps (they would count the
    whole capture as one step)."""
    if run.step_mean_ms is not None:
        return metrics
    return {k: v for k, v in metrics.items() if not k.endswith("_per_step")}


def explanations(before: Report, after: Report) -> list[str]:
    """Fixes that became applied (or stopped being), and proposals that came or went."""
    out = []
    applied_b, applied_a = _applied(before), _applied(after)
    out += [f"now applied: {t}" for t in applied_a if t not in applied_b]
    out += [f"no longer applied: {t}" for t in applied_b if t not in applied_a]
    fixes_b, fixes_a = _fix_ids(before), _fix_ids(after)
    gone = [f for f in fixes_b if f not in fixes_a]
    new = [f for f in fixes_a if f not in fixes_b]
    if gone:
        out.append(f"no longer proposed: {', '.join(gone)}")
    if new:
        out.append(f"newly proposed: {', '.join(new)}")
    return out


def _applied(report: Report) -> list[str]:
    items = report.applied if isinstance(report.applied, list) else []
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):  # a structured entry (report_version 2)
            text = item.get("sentence") or item.get("text") or item.get("title") or item.get("id")
            if isinstance(text, str):
                out.append(text)
    return out


def _fix_ids(report: Report) -> list[str]:
    fixes = report.fixes if isinstance(report.fixes, list) else []
    return [f["id"] for f in fixes if isinstance(f, dict) and isinstance(f.get("id"), str)]


def shapes_note(runs: list[tuple[Run, Report]]) -> str | None:
    """Which runs' kernel sizes (median kernel, grids below the SM count) come from outside
    their window: graph-level tracing hides the replays' kernels, and the eager warm-up right
    before graph capture stands in (measures/compute.py)."""
    from_warmup = [
        Path(run.source).name
        for run, report in runs
        if metrics_of(report).get("kernel_stats_outside_window") is True
    ]
    if not from_warmup:
        return None
    return (
        f"kernel sizes of {' and '.join(from_warmup)} (median kernel, grids below the SM count) "
        "come from the eager warm-up right before graph capture, not the replays: graph-level "
        "tracing hides their kernels"
    )


def tracing_note(b: Run, a: Run) -> str | None:
    """The tracing-mode difference, said instead of flagging per-kernel counts."""
    if b.graph_tracing and a.graph_tracing and b.graph_tracing != a.graph_tracing:
        return (
            f"CUDA graphs traced differently ({_MODE[b.graph_tracing]} → "
            f"{_MODE[a.graph_tracing]}): kernels per step, kernel sizes and durations count "
            "different things, so they are not compared"
        )
    return None
