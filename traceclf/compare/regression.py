"""Compare runs (``traceclf compare BASELINE CANDIDATE...``): did the step get slower, beyond
noise, and what explains the change?

Each side is a trace input (anything ``analyze`` takes) or a saved JSON report (report_version
1 or 2; a version-2 report may abstain: ``classification.bound`` null with an
``abstain_reason``). With several candidates each is compared with the baseline and the CLI
exits 1 if any regresses.

Noise band. For each run the standard error of its mean step time is
``SE = cv * mean / sqrt(n)``, with ``cv`` the coefficient of variation of its steady-state step
times (mean over ranks) and ``n`` the steady steps used. The band is two standard errors of the
difference of the means, ``noise = 2 * sqrt(SE_before² + SE_after²)`` (about a 95% interval for
steps that vary independently around their mean). A CV no step times can have (see
:attr:`traceclf.report.comparison.Run.standard_error_ms`) leaves the band unknown: the verdict rests on the threshold.

Verdict. ``regression`` when the mean step time grew by more than ``threshold`` (a fraction,
default 5%) and by more than the noise band; ``improvement`` when it shrank by as much;
``no significant change`` otherwise; ``inconclusive`` when the comparison cannot be made: a run
has no step time (no steps were found), traceclf abstained on it, or the two step times
measure different things (:func:`_incomparable`: different GPUs, steps found differently, rank
counts, CUDA graphs traced at another level). A regression makes the CLI
exit 1, an inconclusive comparison exit 3 (0 with ``--allow-inconclusive``).

Measures that moved. Fractions of the step (busy, exposed communication, copies, idle causes,
...) compare in percentage points; per-step counts and sizes (kernels, syncs, bytes) compare
relative to before. A change is material past the thresholds of ``comparison`` in
rules/scoring.yaml (and the floors in ``MEASURES``). A run without steps has no per-step
figure: its per-step measures are left out, not compared.

What changed inside the step (:mod:`traceclf.compare.parts`): kernel by kernel, NVTX phase by
phase, idle by cause and exposed communication by kind, reconciled with the step change. Launch counts
include CUDA-graph launches, so a run that moved its kernels into a graph shows fewer launches,
not none (``launch_calls_per_step`` counts each step's ``cudaGraphLaunch``; a report saved by a
traceclf that missed them, counting the calls made while the GPU ran the window, has its graph
executions per step stand in).

Tracing mode. Nsight Systems traces CUDA graphs either as one row per graph execution
(graph-level, the default) or one row per kernel inside it (``--cuda-graph-trace=node``). The
same run then shows 1 or 290 "kernels" per step; when the modes differ, per-kernel measures are
not compared, and the step time is not gated: node-level tracing adds its own cost to every
replay (2.4% of the shared CUDA-graph run's).

What explains a result. Besides measures that moved: fixes applied in one run and not the
other (the report's ``applied`` sentences), and fixes proposed before that no longer are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from traceclf.compare.changes import (
    PER_KERNEL,
    explanations,
    graph_tracing,
    metrics_of,
    per_step_known,
    shapes_note,
    tracing_note,
)
from traceclf.compare.parts import breakdown
from traceclf.compare.side import number
from traceclf.pipeline.analysis import AnalysisOptions
from traceclf.report.comparison import Comparison, MeasureChange, MultiComparison, Run
from traceclf.report.contract import REPORT_VERSION, Report
from traceclf.rulebook.entries import ComparisonSettings
from traceclf.support.errors import TraceError
from traceclf.support.units import fmt_ms, signed_pct


@dataclass(frozen=True)
class Measure:
    key: str
    label: str
    unit: str  # "frac" (compared in points) | "count" | "bytes" | "us" (compared relatively)
    floor: float = 0.0  # an absolute change below this is never material (counts)


# Factors of a saved report's confidence read at most, and the characters of a name kept
# (a report is untrusted: a hostile one may hold thousands of long names)
MAX_FACTORS = 16
MAX_FACTOR_NAME = 40
MEASURES = (
    Measure("gpu_busy_frac", "GPU busy", "frac"),
    Measure("compute_frac", "compute", "frac"),
    Measure("comm_frac", "communication", "frac"),
    Measure("exposed_comm_frac", "exposed communication", "frac"),
    Measure("comm_overlap_frac", "communication hidden under compute (of comm)", "frac"),
    Measure("compute_under_comm_frac", "compute under communication (of compute)", "frac"),
    Measure("copy_frac", "copies", "frac"),
    Measure("offload_copy_frac", "host↔device copies", "frac"),
    Measure("idle_launch_frac", "idle: launch-bound", "frac"),
    Measure("idle_sync_frac", "idle: after a sync", "frac"),
    Measure("idle_input_frac", "idle: input", "frac"),
    Measure("idle_other_frac", "idle: other", "frac"),
    Measure("graph_frac", "busy time in CUDA graphs", "frac"),
    Measure("small_grid_kernel_frac", "kernels with grid below SM count", "frac"),
    Measure("sm_active_mean", "SM active", "frac"),
    Measure("tensor_active_mean", "tensor active", "frac"),
    Measure("kernels_per_step", "kernels/step", "count", 1),
    Measure("launches_per_step", "launch calls/step (incl. CUDA-graph launches)", "count", 1),
    Measure("sync_calls_per_step", "syncs/step", "count", 1),
    Measure("small_d2h_per_step", "tiny D2H copies/step", "count", 1),
    Measure("alloc_calls_per_step", "cudaMalloc/Free per step", "count", 1),
    Measure("pageable_copies_per_step", "pageable copies/step", "count", 1),
    Measure("h2d_d2h_bytes_per_step", "H2D+D2H bytes/step", "bytes", 1e6),
    Measure("median_kernel_us", "median kernel", "us", 0.5),
)


def run_of(source: str, report: Report) -> Run:
    """One side of a comparison: a report's step statistics and verdict, read defensively
    (a saved report of any version: fields of the wrong type are left out)."""
    s = report.steps if isinstance(report.steps, dict) else {}
    cls_ = report.classification if isinstance(report.classification, dict) else {}
    bound = cls_.get("bound")
    basis = cls_.get("confidence_basis") if isinstance(cls_.get("confidence_basis"), dict) else {}
    factors = basis.get("factors") if isinstance(basis.get("factors"), dict) else {}
    label = s.get("label") if isinstance(s.get("label"), str) else ""
    gpus = [g for g in report.gpus if isinstance(g, dict)] if isinstance(report.gpus, list) else []
    return Run(
        source=source,
        bound=bound if isinstance(bound, str) else None,
        confidence=number(cls_.get("confidence")),
        step_mean_ms=_step_ms(s.get("mean_ms")),
        step_median_ms=_step_ms(s.get("median_ms")),
        step_cv=number(s.get("cv")),
        steps_used=int(number(s.get("used")) or 0),
        step_source=str(s.get("source", "none")) + (f' "{label}"' if label else ""),
        ranks=len(report.ranks) if isinstance(report.ranks, list) else 0,
        gpus=sorted({str(g.get("name") or "unknown GPU") for g in gpus}),
        report_version=report.report_version if isinstance(report.report_version, int) else None,
        abstain_reason=cls_.get("abstain_reason") if bound is None else None,
        graph_tracing=graph_tracing(report),
        confidence_explained=number(basis.get("explained")),
        confidence_factors={
            str(k)[:MAX_FACTOR_NAME]: float(v)  # type: ignore[arg-type]
            for k, v in list(factors.items())[:MAX_FACTORS]
            if number(v) is not None
        },
    )


def compare_many(
    baseline: str,
    candidates: list[str],
    *,
    threshold: float = 0.05,
    opts: AnalysisOptions | None = None,
) -> Comparison | MultiComparison:
    """One candidate: a :class:`Comparison`; several: each against the baseline, which is
    analysed (or loaded) once."""
    _check_threshold(threshold)
    opts = opts or AnalysisOptions(quiet=True)
    settings = comparison_settings(opts)
    base = load_run(baseline, opts)
    results = [
        compare_reports(
            base,
            load_run(c, opts),
            threshold=threshold,
            labels=(str(baseline), str(c)),
            settings=settings,
        )
        for c in candidates
    ]
    return results[0] if len(results) == 1 else MultiComparison(str(baseline), results)


def _check_threshold(threshold: float) -> None:
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise TraceError(None, f"--threshold must be a finite number, 0 or more (got {threshold})")


def comparison_settings(opts: AnalysisOptions | None = None) -> ComparisonSettings:
    """The ``comparison`` thresholds of the rule set (bundled, with ``opts.rules_dir`` merged
    over it); without ``opts``, the bundled ones, nothing written to the cache."""
    from traceclf.pipeline.analysis import rule_set

    return rule_set(opts or AnalysisOptions(quiet=True, use_cache=False)).scoring.comparison


def load_run(source: str | Path, opts: AnalysisOptions) -> Report:
    """A saved JSON report, or a trace input analysed now; one run (several unrelated runs
    cannot be compared as one side)."""
    if str(source).lower().endswith(".json"):
        return Report.load(source)
    from traceclf.pipeline.analysis import analyze_inputs

    report = analyze_inputs([str(source)], opts)
    if not isinstance(report, Report):
        raise TraceError(
            source,
            f"holds {len(report.runs)} separate runs; compare one run at a time "
            "(or analyse it with --job and compare the saved JSON)",
        )
    return report


def compare_reports(
    before: Report,
    after: Report,
    *,
    threshold: float = 0.05,
    labels: tuple[str, str] = ("before", "after"),
    settings: ComparisonSettings | None = None,
) -> Comparison:
    """Compare two reports; ``settings``: the bundled rules' ``comparison`` thresholds."""
    settings = settings or comparison_settings()
    b, a = run_of(labels[0], before), run_of(labels[1], after)
    change_ms, change_frac = _change(b.step_mean_ms, a.step_mean_ms)
    _, median_frac = _change(b.step_median_ms, a.step_median_ms)
    noise = _noise_ms(b, a, settings)
    apart = _incomparable(b, a)
    verdict = "inconclusive" if apart else _verdict(change_ms, change_frac, noise, threshold, b, a)
    mb, ma = metrics_of(before), metrics_of(after)
    tracing_changed = b.graph_tracing and a.graph_tracing and b.graph_tracing != a.graph_tracing
    measures = [
        _measure_change(
            m,
            per_step_known(mb, b),
            per_step_known(ma, a),
            settings,
            comparable=not (tracing_changed and m.key in PER_KERNEL),
        )
        for m in MEASURES
    ]
    return Comparison(
        before=b,
        after=a,
        threshold=threshold,
        verdict=verdict,
        summary=_summary(verdict, b, a, change_frac, noise, threshold, apart),
        step_change_ms=change_ms,
        step_change_frac=change_frac,
        median_change_frac=median_frac,
        noise_ms=noise,
        bound_changed=b.bound != a.bound,
        measures=measures,
        notes=_comparability(b, a, apart),
        explanations=[n for n in (tracing_note(b, a), shapes_note([(b, before), (a, after)])) if n]
        + explanations(before, after),
        breakdown=breakdown(
            before,
            after,
            (b.step_mean_ms, a.step_mean_ms),
            (b.source, a.source),
            settings,
            noise,
        ),
    )


def _change(before: float | None, after: float | None) -> tuple[float | None, float | None]:
    if before is None or after is None:
        return None, None
    return after - before, (after - before) / before if before else None


def _noise_ms(b: Run, a: Run, settings: ComparisonSettings) -> float | None:
    se = [b.standard_error_ms, a.standard_error_ms]
    if any(s is None for s in se):
        return None
    return settings.noise_standard_errors * math.hypot(*se)


def _verdict(
    change_ms: float | None,
    change_frac: float | None,
    noise: float | None,
    threshold: float,
    b: Run,
    a: Run,
) -> str:
    if change_ms is None or change_frac is None or b.bound is None or a.bound is None:
        return "inconclusive"
    beyond_noise = abs(change_ms) > (noise or 0.0)
    if beyond_noise and change_frac > threshold:
        return "regression"
    if beyond_noise and change_frac < -threshold:
        return "improvement"
    return "no significant change"


def _summary(
    verdict: str,
    b: Run,
    a: Run,
    change: float | None,
    noise: float | None,
    threshold: float,
    apart: list[str],
) -> str:
    steps = f"step {fmt_ms(b.step_mean_ms)} → {fmt_ms(a.step_mean_ms)} ({signed_pct(change)})"
    if verdict == "inconclusive" and apart and change is not None:
        return (
            f"Inconclusive: the runs are not comparable ({'; '.join(n.split(': ')[0] for n in apart)}), "
            f"so their {steps} is not gated."
        )
    if verdict == "inconclusive":
        missing = " and ".join(r.source for r in (b, a) if r.step_mean_ms is None)
        if missing:
            return (
                f"Inconclusive: no step time for {missing} (no steps found, or a step time no "
                "run can have), so nothing to gate on."
            )
        abstained = "; ".join(
            r.source + (f" ({r.abstain_reason})" if r.abstain_reason else "")
            for r in (b, a)
            if r.bound is None
        )
        return (
            f"Inconclusive: traceclf did not name a bound for {abstained}, so nothing to gate on."
        )
    band = (
        f"±{fmt_ms(noise)}"
        if noise is not None
        else "unknown (fewer than 2 steady steps, or a step-time spread no run can have)"
    )
    if verdict == "regression":
        return f"Regression: {steps}, beyond the noise band ({band}) and the {threshold:.0%} threshold."
    if verdict == "improvement":
        return f"Improvement: {steps}, beyond the noise band ({band}) and the {threshold:.0%} threshold."
    within_noise = (
        noise is not None and change is not None and abs(change) * b.step_mean_ms <= noise
    )
    if within_noise:
        return f"No significant change: {steps}, within the noise band ({band})."
    allowed = f"±{fmt_ms(threshold * b.step_mean_ms)}"
    return (
        f"No significant change: {steps}, beyond the noise band ({band}) but within the "
        f"{threshold:.0%} threshold ({allowed})."
    )


def _measure_change(
    m: Measure, before: dict, after: dict, settings: ComparisonSettings, comparable: bool = True
) -> MeasureChange:
    b, a = before.get(m.key), after.get(m.key)
    if number(b) is None or number(a) is None or not comparable:
        return MeasureChange(m.key, m.label, m.unit, number(b), number(a), None, False)
    if m.unit == "frac":
        change = a - b
        material = abs(change) >= settings.material_points
    else:
        change = (a - b) / b if b else None
        big = change is None or abs(change) >= settings.material_relative
        material = a != b and big and abs(a - b) >= m.floor
    return MeasureChange(m.key, m.label, m.unit, b, a, change, material)


# A step time a run can have: at least the 1 ns nsys counts in, at most the 2^62 ns its clock
# reaches. A saved report with another (zero, negative, 1e-300 ms) has no usable step time:
# the verdict is inconclusive, never an "improvement" from a negative baseline.
STEP_MS = (1e-6, float(1 << 62) / 1e6)


def _step_ms(v) -> float | None:
    ms = number(v)
    return ms if ms is not None and STEP_MS[0] <= ms <= STEP_MS[1] else None


def _incomparable(b: Run, a: Run) -> list[str]:
    """What makes the two runs' step times measure different things: a change between them is
    no change of the code, and the comparison gates on nothing (inconclusive)."""
    notes = []
    if b.gpus != a.gpus:
        notes.append(f"different GPUs: {', '.join(b.gpus) or '?'} vs {', '.join(a.gpus) or '?'}")
    if b.step_mean_ms is not None and a.step_mean_ms is not None and b.step_source != a.step_source:
        notes.append(f"steps found differently: {b.step_source} vs {a.step_source}")
    if b.ranks != a.ranks:
        notes.append(f"different rank counts: {b.ranks} vs {a.ranks}")
    if b.graph_tracing and a.graph_tracing and b.graph_tracing != a.graph_tracing:
        notes.append(
            f"CUDA graphs traced differently ({b.graph_tracing}-level → {a.graph_tracing}-level): "
            "node-level tracing adds its own cost to every replay"
        )
    return notes


def _comparability(b: Run, a: Run, apart: list[str]) -> list[str]:
    """Why the runs may not be comparable: ``apart`` (:func:`_incomparable`), then a run
    without steps or a bound, or of a newer report version."""
    notes = list(apart)
    for run in (b, a):
        if run.step_mean_ms is None:
            notes.append(f"{run.source}: no steps found (or a step time no run can have)")
    for run in (b, a):
        if run.bound is None:
            why = f" ({run.abstain_reason})" if run.abstain_reason else ""
            notes.append(f"{run.source}: traceclf did not name a bound{why}")
    for run in (b, a):
        if run.report_version is not None and run.report_version > REPORT_VERSION:
            notes.append(
                f"{run.source}: report version {run.report_version}, newer than this "
                f"traceclf's ({REPORT_VERSION}): what it does not know is left out"
            )
    return notes


def _factor(ratio: float) -> str:
    return f"{ratio:,.0f}" if ratio >= 100 else f"{ratio:.3g}"
