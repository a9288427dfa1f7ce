"""Every measure of one rank (:func:`measure_rank`), and the ``MEASURES`` table gathered from
the wall modules (each owns its definitions). :mod:`traceclf.measures` hands both out on first
use, so that importing one light module of the package (:mod:`.cross_rank` in a cached
re-analysis) does not import polars and every wall."""

from __future__ import annotations

from traceclf.measures import (
    arrivals,
    budget,
    capture,
    collectives,
    communication,
    communicators,
    compute,
    critical_path,
    host,
    hostsources,
    intervals,
    memory,
    overlap_tax,
    pauses,
    phases,
    series,
    step_kernels,
)
from traceclf.measures.handoff import RankMeasures
from traceclf.measures.window import prepare
from traceclf.model.taxonomy import Taxonomy
from traceclf.model.trace import Trace
from traceclf.steps.steady import Steps

MEASURES: dict[str, str] = (
    budget.MEASURES
    | critical_path.MEASURES
    | communication.MEASURES
    | memory.MEASURES
    | host.MEASURES
    | hostsources.MEASURES
    | overlap_tax.MEASURES
    | pauses.MEASURES
    | compute.MEASURES
)


def measure_rank(
    trace: Trace, steps: Steps, gpu: dict | None, taxonomy: Taxonomy | None = None
) -> RankMeasures:
    """Every measure of one rank (``trace`` restricted to it: :meth:`Trace.for_pid`) over its
    steady-state window; ``taxonomy`` defaults to the bundled rules/kernels.yaml."""
    from traceclf.model.taxonomy import bundled

    w = prepare(trace, steps, gpu, taxonomy or bundled())
    m = budget.measure(w)
    comm_blocking: list = []
    starved: list = []
    path_measures, step_budget = critical_path.measure(w, comm_blocking, starved)
    m |= path_measures
    keyed = communicators.with_keys(communication.all_comm(w))
    comm = intervals.clip(keyed, w.spans)
    comm_by_kind = communication.by_kind(w, comm)
    m |= communication.a2a(comm_by_kind)
    m |= communication.dp_tp_exposed(w, comm)
    tax, tax_shapes = overlap_tax.overlap_tax(w)
    m |= tax
    m |= memory.copies(w)
    m |= host.calls(w)
    gaps = host.idle_gaps(w)
    m |= host.idle(gaps, w)
    attribution = hostsources.attribute(w, gaps)
    m |= attribution.measures
    m |= critical_path.starved_by_cause(starved, gaps, w)
    m |= pauses.pauses(w)
    mix, mix_source = compute.kernel_mix(w)
    m |= mix
    m["recompute_frac"] = memory.recompute_frac(w)
    m |= memory.peak(w)
    gpu_samples = trace.metrics_of_gpu((gpu or {}).get("gpu_id"))
    m |= compute.gpu_metric_means(gpu_samples, steps.spans)
    facts = capture.capture_facts(w) | {"kernel_mix_source": mix_source}
    phase_spans = phases.projected(w)
    breakdown = series.step_breakdown(w)
    return RankMeasures(
        metrics={k: _round(v) for k, v in m.items()},
        capture=facts,
        comm_by_kind=comm_by_kind,
        top_kernels=compute.top_kernels(w),
        step_breakdown=breakdown,
        idle_gaps=series.gap_histogram(gaps),
        longest_gaps=host.longest_gaps(gaps, w),
        gpu_metrics_series=series.metric_series(gpu_samples, steps.spans),
        idle_nvtx=host.idle_by_nvtx(gaps, w),
        step_budget=step_budget,
        collectives=collectives.collectives_of(keyed),
        comm_groups=communicators.groups_of(w, keyed, comm_blocking),
        overlap_tax=tax_shapes,
        arrivals=arrivals.arrival_clock(w, keyed, gaps),
        phases=phases.phase_table(w, gaps, phase_spans),
        step_lanes=series.step_lanes(w, phase_spans),
        memory_series=series.memory_series(
            trace.memory, (gpu or {}).get("memory_bytes"), steps.window
        ),
        kernel_summary=compute.kernel_summary(w),
        step_kernels=step_kernels.step_kernels(w, gaps, breakdown),
        host_attribution=attribution.rows,
    )


def _round(v):
    return round(v, 6) if isinstance(v, float) else v
