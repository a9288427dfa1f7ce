"""Every measure of one rank (:func:`measure_rank`), and the ``MEASURES`` table gathered from
the wall modules (each owns its definitions). :mod:`traceclf.measures` hands both out on first
use, so that importing one light module of the package (:mod:`.cross_rank` in a cached
re-analysis) does not import polars and every wall."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import polars as pl

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
    host_calls,
    host_nvtx,
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
from traceclf.measures.window import RankWindow, prepare
from traceclf.model.taxonomy import Taxonomy
from traceclf.model.trace import Trace
from traceclf.steps.steady import Steps
from traceclf.support.cpus import second_lane

T = TypeVar("T")

MEASURES: dict[str, str] = (
    budget.MEASURES
    | critical_path.MEASURES
    | communication.MEASURES
    | memory.MEASURES
    | host.MEASURES
    | host_calls.MEASURES
    | hostsources.MEASURES
    | overlap_tax.MEASURES
    | pauses.MEASURES
    | compute.MEASURES
)


def measure_rank(
    trace: Trace, steps: Steps, gpu: dict | None, taxonomy: Taxonomy | None = None
) -> RankMeasures:
    """Every measure of one rank (``trace`` restricted to it: :meth:`Trace.for_pid`) over its
    steady-state window; ``taxonomy`` defaults to the bundled rules/kernels.yaml.

    The GPU-side measures (:func:`_gpu_side`) run on a second thread beside the host side and
    communication (when the analysis may keep two cores busy: :func:`second_lane`): each
    lane's heavy work is numpy and polars, which mostly run without the GIL, so both cores
    work where one did. Both read the idle gaps, found on this thread while the GPU side
    measures the critical path (which needs none); the lanes share nothing they write; what
    needs both comes after, and the metrics keep their order."""
    from traceclf.model.taxonomy import bundled

    w = prepare(trace, steps, gpu, taxonomy or bundled())
    # (found below while the GPU lane starts; by that lane itself, first, when second_lane
    # runs it on this thread)
    find_gaps = _once(lambda: host.idle_gaps(w))
    # (read from the rank's rows alone: by whichever lane is done with the rest first)
    facts = _once(lambda: capture.capture_facts(w))
    with second_lane("traceclf-gpu-side") as pool:
        lane = pool.submit(_gpu_side, w, gpu, find_gaps, facts)
        gaps = find_gaps()
        keyed = communicators.with_keys(communication.all_comm(w))
        comm = intervals.clip(keyed, w.spans)
        comm_by_kind = communication.by_kind(w, comm)
        walls = communication.a2a(comm_by_kind)
        walls |= communication.dp_tp_exposed(w, comm)
        tax, tax_shapes = overlap_tax.overlap_tax(w)
        walls |= tax
        walls |= memory.copies(w)
        walls |= host.calls(w)
        walls |= host_calls.host_call_ms(w)
        walls |= host.idle(gaps, w)
        # (the NVTX host activities over the long gaps: what idle_nvtx names and host
        # attribution credits, found once)
        activities = host_nvtx.activity_cover(host_nvtx.long_gaps(gaps), w)
        attribution = hostsources.attribute(w, gaps, activities)
        walls |= attribution.measures
        idle_gaps = series.gap_histogram(gaps)
        longest_gaps = host.longest_gaps(gaps, w)
        idle_nvtx = host_nvtx.idle_by_nvtx(gaps, w, activities)
        arrivals_clock = arrivals.arrival_clock(w, keyed, gaps)
        facts()
        g = lane.result()
    m = g.budget | g.path | walls | g.starved_by_cause | g.gpu
    return RankMeasures(
        metrics={k: _round(v) for k, v in m.items()},
        capture=facts() | {"kernel_mix_source": g.mix_source},
        comm_by_kind=comm_by_kind,
        top_kernels=g.top_kernels,
        step_breakdown=g.breakdown,
        idle_gaps=idle_gaps,
        longest_gaps=longest_gaps,
        gpu_metrics_series=g.metrics_series,
        idle_nvtx=idle_nvtx,
        step_budget=g.step_budget,
        collectives=collectives.collectives_of(keyed, w.steps),
        comm_groups=communicators.groups_of(w, keyed, g.comm_blocking),
        overlap_tax=tax_shapes,
        arrivals=arrivals_clock,
        phases=g.phases,
        step_lanes=g.step_lanes,
        memory_series=g.memory_series,
        kernel_summary=g.kernel_summary,
        step_kernels=g.step_kernels,
        host_attribution=attribution.rows,
    )


@dataclass
class _GpuSide:
    """What :func:`_gpu_side` measures: metrics in the report's order (``budget``, the
    critical path's ``path``, then, after the host side's, ``starved_by_cause`` and ``gpu``),
    and the tables."""

    budget: dict
    path: dict
    step_budget: list[dict]
    comm_blocking: list
    starved_by_cause: dict
    gpu: dict
    mix_source: str
    top_kernels: list[dict]
    breakdown: list[dict]
    metrics_series: dict[str, list]
    phases: list[dict]
    step_lanes: dict
    memory_series: dict
    kernel_summary: list[dict]
    step_kernels: dict


def _gpu_side(
    w: RankWindow,
    gpu: dict | None,
    find_gaps: Callable[[], pl.DataFrame],
    facts: Callable[[], dict],
) -> _GpuSide:
    """The measures read from the GPU's rows (and the launches of its work) and the idle
    gaps (``find_gaps()``, asked for once the critical path is measured), none of which needs
    the host's sources or the communication keys; then the capture facts (``facts()``) if the
    host side has not begun them."""
    comm_blocking: list = []
    starved: list = []
    path, step_budget = critical_path.measure(w, comm_blocking, starved)
    m = pauses.pauses(w)
    mix, mix_source = compute.kernel_mix(w)
    m |= mix
    # (the NVTX ranges of a phase: recompute's forward and backward, and the phase spans)
    phase_ranges = phases.labelled(w)
    m |= memory.recompute(w, phase_ranges)
    # (the whole capture's events of the GPU's own memory: filtered once, read twice)
    device_memory = memory.device_memory(w.trace.memory)
    m |= memory.peak(w, device_memory)
    gpu_samples = w.trace.metrics_of_gpu((gpu or {}).get("gpu_id"))
    m |= compute.gpu_metric_means(gpu_samples, w.steps.spans)
    phase_spans = phases.projected(w, phase_ranges)
    breakdown = series.step_breakdown(w)
    gaps = find_gaps()
    side = _GpuSide(
        budget=budget.measure(w),
        path=path,
        step_budget=step_budget,
        comm_blocking=comm_blocking,
        starved_by_cause=critical_path.starved_by_cause(starved, gaps, w),
        gpu=m,
        mix_source=mix_source,
        top_kernels=compute.top_kernels(w),
        breakdown=breakdown,
        metrics_series=series.metric_series(gpu_samples, w.steps.spans),
        phases=phases.phase_table(w, gaps, phase_spans),
        step_lanes=series.step_lanes(w, phase_spans),
        memory_series=series.memory_series(
            device_memory, (gpu or {}).get("memory_bytes"), w.steps.window
        ),
        kernel_summary=compute.kernel_summary(w),
        step_kernels=step_kernels.step_kernels(w, gaps, breakdown),
    )
    facts()
    return side


def _once(make: Callable[[], T]) -> Callable[[], T]:
    """``make()`` called once, by whichever thread asks first; the others wait for it."""
    lock = threading.Lock()
    made: list[T] = []

    def get() -> T:
        with lock:
            if not made:
                made.append(make())
        return made[0]

    return get


def _round(v):
    return round(v, 6) if isinstance(v, float) else v
