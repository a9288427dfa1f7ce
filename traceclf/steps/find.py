"""Find training steps of one rank and choose its steady-state window.

Sources, in order of preference:
- ``nvtx``: ranges named like ``step 12`` / ``iteration 3`` / ``batch 7`` / ``ProfilerStep#5``
  (the ``nvtx.step`` pattern of rules/kernels.yaml, or ``--step-range REGEX``). A range is CPU
  time; it is projected onto the GPU through the correlationIds of the CUDA calls made inside it
  by the same process (any thread: PyTorch launches backward kernels from its autograd thread),
  as NVIDIA's ``nvtx_gpu_proj_trace`` does.
- ``graph``: each launch of the most frequently replayed CUDA graph is one step.
- ``pattern``: occurrences of the kernel that repeats most regularly, once per period.
- ``none``: the whole GPU span is one window.

Step time is the distance between the GPU starts of consecutive steps, so host time between
steps counts. Warm-up steps at the start, the last step (no step time) and outliers are
dropped from the statistics; the window spans the kept steps.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import polars as pl

from traceclf.model.taxonomy import Taxonomy, matches
from traceclf.model.trace import Trace, outermost
from traceclf.steps.plan import StepPlan, at_most_alike, planned_steps
from traceclf.steps.settings import StepSettings, bundled_settings
from traceclf.steps.steady import Steps, choose_window, empty_steps_table
from traceclf.support.cpus import second_lane
from traceclf.support.errors import TraceError, TraceWarning
from traceclf.support.regex import regex_problem
from traceclf.support.units import counted


def find_steps(
    trace: Trace,
    step_regex: str | None = None,
    taxonomy: Taxonomy | None = None,
    plan: StepPlan | None = None,
    settings: StepSettings | None = None,
) -> Steps:
    """Steps of a single-rank trace (see :meth:`Trace.for_pid`); ``taxonomy`` (default: the
    bundled one) names step ranges and graph launches, ``settings`` (default: the bundled
    thresholds) decide warm-up, outliers and regularity. With a ``plan`` (step sampling: the
    steps found in the first pass and those chosen for analysis) only the chosen steps are
    projected onto the GPU, from the rows ``trace`` holds for them."""
    from traceclf.model.taxonomy import bundled

    settings = settings or bundled_settings()
    if plan is not None:
        return planned_steps(trace, plan, settings)
    taxonomy = taxonomy or bundled()
    if len(_graph_launches(trace, taxonomy)) >= 2:
        finders = (_nvtx_steps, _graph_steps, _pattern_steps)
        return _first_found(trace, step_regex, taxonomy, settings, finders)
    # no graph steps: the recurring kernel is asked for, as the anchor or as the cross-check,
    # whatever the NVTX ranges show; it is found beside them
    pattern = second_lane("traceclf-steps").submit(_pattern_steps, trace, None, taxonomy, settings)
    finders = (_nvtx_steps, _no_steps, lambda *_: pattern.result())
    steps = _first_found(trace, step_regex, taxonomy, settings, finders)
    # (settled before returning, even where no finder asked for it: no thread is left at work
    # after the call, which a fork, a --jobs worker or HTA's pool, would copy mid-lock)
    pattern.exception()
    return steps


def steps_alike(
    trace: Trace,
    pids: list[int],
    step_regex: str | None,
    taxonomy: Taxonomy,
    settings: StepSettings,
    most: int,
) -> dict[int, Steps]:
    """The steps of each rank of a capture read whole, at most ``most`` steady ones analysed
    (:func:`~traceclf.steps.plan.at_most_alike`: the ranks whose steps match one to one on
    the same steps, as step sampling's plans put them)."""
    found = [find_steps(trace.for_pid(pid), step_regex, taxonomy, None, settings) for pid in pids]
    return dict(zip(pids, at_most_alike(found, most, settings), strict=True))


def _first_found(
    trace: Trace, step_regex: str | None, taxonomy: Taxonomy, settings: StepSettings, finders
) -> Steps:
    """The steps of the first of ``finders`` that finds any, cross-checked by the finders
    after it; the whole GPU span as one window when none does."""
    for i, finder in enumerate(finders):
        found = finder(trace, step_regex, taxonomy, settings)
        if found is not None and len(found[0]) >= 1:
            table, source, label = found
            steps = choose_window(table, source, label, trace, settings)
            second = cross_check(steps, trace, taxonomy, finders[i + 1 :], settings)
            return replace(steps, second=second)
    lo, hi = trace.span
    return Steps("none", empty_steps_table(), (lo, hi), "")


def step_ranges(nvtx: pl.DataFrame, pattern: str) -> pl.DataFrame | None:
    """The NVTX ranges matching ``pattern`` that no other match contains, numbered (index),
    in time order; None when there are none."""
    ranges = nvtx.filter(matches(nvtx["text"], pattern))
    if ranges.is_empty():
        return None
    # Nested matches (a "step" inside another "step") would double count: keep the outermost.
    return outermost(ranges).with_columns(index=pl.int_range(pl.len()).cast(pl.Int64))


def _nvtx_steps(trace: Trace, step_regex: str | None, taxonomy: Taxonomy, _settings=None):
    pattern = step_regex or taxonomy.nvtx["step"]
    check_step_regex(pattern)
    ranges = step_ranges(trace.nvtx, pattern)
    if ranges is None:
        return None
    label = range_label(ranges["text"])
    gpu = trace.gpu_spans(ranges, "index")
    table = (
        ranges.select("index", name="text", cpu_start="start", cpu_end="end")
        .join(gpu, on="index", how="left")
        .filter(pl.col("gpu_start").is_not_null())
        .sort("index")
    )
    return table.with_columns(allocs=alloc_calls(trace, table, taxonomy)), "nvtx", label


def alloc_calls(trace: Trace, ranges: pl.DataFrame, taxonomy: Taxonomy) -> pl.Series:
    """Allocator calls (cudaMalloc/cudaFree: taxonomy ``cuda_api.alloc``) of the process made
    inside each NVTX step range (cpu_start, cpu_end), on any thread; null without the CUDA
    API trace."""
    if trace.api.is_empty():
        return pl.repeat(None, len(ranges), dtype=pl.Int64, eager=True)
    # (the pattern runs once per distinct call name, not on each of millions of calls)
    alloc = matches(trace.api["name"], taxonomy.cuda_api["alloc"])
    starts = np.sort(trace.api.filter(alloc)["start"].to_numpy())
    inside = np.searchsorted(starts, ranges["cpu_end"].to_numpy(), side="right") - np.searchsorted(
        starts, ranges["cpu_start"].to_numpy(), side="left"
    )
    return pl.Series(inside, dtype=pl.Int64)


def check_step_regex(pattern: str | None) -> None:
    """Reject a --step-range that polars' regex engine (Rust ``regex``: no look-around, no
    backreferences) cannot run, before any trace is loaded."""
    if pattern is None:
        return
    try:
        pl.Series([""]).str.contains(pattern)
    except pl.exceptions.PolarsError as e:
        raise TraceError(
            None,
            f"--step-range {pattern!r} is not a valid regular expression ({regex_problem(e)})",
        ) from None


def range_label(names: pl.Series) -> str:
    stripped = names.str.replace(r"[#:=_\-\s]*\d+\s*$", "")
    return str(stripped.mode()[0]) if len(stripped) else ""


def _graph_launches(trace: Trace, taxonomy: Taxonomy) -> pl.DataFrame:
    """The trace's CUDA calls that launch a graph."""
    return trace.api.filter(matches(trace.api["name"], taxonomy.cuda_api["graph_launch"]))


def _no_steps(*_args) -> None:
    """A finder that finds nothing (graph steps, where the trace launches no graph)."""
    return None


def _graph_steps(trace: Trace, _regex: str | None, taxonomy: Taxonomy, _settings=None):
    launches = _graph_launches(trace, taxonomy)
    if len(launches) < 2:
        return None
    launched = launches["correlation_id"].implode()
    work = pl.concat(
        [
            f.select("start", "end", "correlation_id").filter(
                pl.col("correlation_id").is_in(launched)
            )
            for f in (trace.kernels, trace.graphs, trace.copies)
        ]
    )
    if work.is_empty():
        return None
    per_launch = work.group_by("correlation_id").agg(
        gpu_start=pl.col("start").min(), gpu_end=pl.col("end").max()
    )
    # With several graphs per step, step boundaries are the launches of the graph that is
    # replayed most often (graph rows carry graphExecId; node-traced kernels their graphId).
    execs = pl.concat(
        [
            trace.graphs.select("correlation_id", key=pl.col("graph_exec_id")),
            trace.kernels.filter(pl.col("graph_node_id").is_not_null()).select(
                "correlation_id", key=pl.col("graph_id")
            ),
        ]
    ).unique("correlation_id")
    per_launch = per_launch.join(execs, on="correlation_id", how="left")
    return graph_launch_steps(per_launch, "gpu_start", "gpu_end"), "graph", "cudaGraphLaunch"


def graph_launch_steps(per_launch: pl.DataFrame, start: str, end: str) -> pl.DataFrame:
    """One step per launch of the graph replayed most often (``key``: its graph exec or graph
    id; launches with no key count only when no launch has one), in ``start`` order."""
    top = per_launch["key"].drop_nulls().mode()
    if len(top):
        per_launch = per_launch.filter(pl.col("key") == top[0])
    return per_launch.sort(start).select(
        index=pl.int_range(pl.len()).cast(pl.Int64),
        name=pl.lit("graph launch"),
        **{start: start, end: end},
    )


def _pattern_steps(trace: Trace, _regex: str | None, _taxonomy: Taxonomy, settings: StepSettings):
    """Steps from the kernel that recurs most regularly: the steady state of a training loop
    repeats the same sequence, so one kernel of it recurs at the step period."""
    kernels = trace.kernels.select("name", "start", "end").sort("start")
    best = recurring_kernel(kernels, settings)
    if best is None:
        return None
    starts = kernels.filter(pl.col("name") == best)["start"]
    table = pl.DataFrame({"gpu_start": starts}).with_columns(
        index=pl.int_range(pl.len()).cast(pl.Int64),
        name=pl.lit(str(best)),
        gpu_end=pl.col("gpu_start").shift(-1).fill_null(int(kernels["end"].max())),
    )
    return table, "pattern", str(best)


def recurring_kernel(kernels: pl.DataFrame, settings: StepSettings):
    """The ``name`` (any dtype) of the kernel that recurs most regularly in ``kernels``
    (name, start, end; sorted by start) with the longest period, or None.

    Regular: the spread of the later half of its gaps (warm-up is irregular) is at most
    ``recurring_kernel_max_spread``; with ``recurring_kernel_robust_periods`` gaps or more, the
    robust spread, 1.4826 x their median absolute deviation over their median (the CV of
    normally spread gaps, which one host stall among them does not move: a steady loop that
    one stall interrupts is still one), else their CV. And its periods tile the time: their
    mean is at most ``recurring_kernel_max_mean_ratio`` times their median. A kernel launched
    in a burst once per step (a per-tensor optimizer kernel, 12 launches 0.2 ms apart, then a
    200 ms gap) has a small robust spread too, but its median period covers a sliver of the
    time: it marks no step. Nor does a regular burst that spans under
    ``recurring_kernel_min_work_share`` of the kernel time (a TensorRT engine's reformat copies
    in one inference): the loop is where the work is."""
    if len(kernels) < 6:
        return None
    candidates = (
        kernels.with_columns(gap=pl.col("start").diff().over("name"))
        .group_by("name")
        .agg(
            n=pl.len(),
            first=pl.col("start").min(),
            last=pl.col("start").max(),
            gaps=pl.col("gap").drop_nulls(),
        )
        .filter(pl.col("n") >= 4)
    )
    if candidates.is_empty():
        return None
    # the kernel time that starts between a candidate's first and last occurrence (a prefix
    # sum over the kernels in start order, looked up at both ends)
    starts = kernels["start"]
    # (a row without an end, which a damaged export's probe may hold, adds no time)
    done = (kernels["end"] - kernels["start"]).fill_null(0).cum_sum()
    total = done[-1] if len(done) else 0
    lo = starts.search_sorted(candidates["first"], side="left")
    hi = starts.search_sorted(candidates["last"], side="right")
    before = pl.Series([0], dtype=done.dtype).append(done)
    spanned = before.gather(hi) - before.gather(lo)
    candidates = candidates.filter(
        pl.Series(spanned >= settings.recurring_kernel_min_work_share * total)
    )
    if candidates.is_empty():
        return None
    gap = pl.col("gaps")
    candidates = (
        candidates.with_columns(gaps=gap.list.slice(gap.list.len() // 2))
        .explode("gaps")
        .group_by("name", "n", "first")
        .agg(
            period=gap.median(),
            robust=MAD_TO_SD * (gap - gap.median()).abs().median() / gap.median(),
            cv=gap.std() / gap.mean(),
            mean=gap.mean(),
            periods=pl.len(),
        )
        .with_columns(
            spread=pl.when(pl.col("periods") >= settings.recurring_kernel_robust_periods)
            .then("robust")
            .otherwise("cv")
        )
        .filter(
            (pl.col("period") > 0)
            & (pl.col("spread") <= settings.recurring_kernel_max_spread)
            & (pl.col("mean") <= settings.recurring_kernel_max_mean_ratio * pl.col("period"))
        )
    )
    if candidates.is_empty():
        return None
    # Longest regular period = whole step rather than one layer of it; of kernels as regular
    # and as frequent (one launched beside the other every step), the first to run, whether
    # ``name`` is the text or its id (the grouping has no order: a tie went either way)
    return candidates.sort(
        [pl.col("period"), pl.col("n"), pl.col("first"), pl.col("name").cast(pl.String)],
        descending=[True, False, False, False],
    )["name"][0]


# A normal distribution's standard deviation is 1.4826 times its median absolute deviation.
MAD_TO_SD = 1.4826


def cross_check(
    steps: Steps, trace: Trace, taxonomy: Taxonomy, finders, settings: StepSettings
) -> dict | None:
    """The step time the next anchor that finds steps implies, beside this one's, and whether
    the two agree (NVIDIA's method: "cross-check with a second anchor when possible; state the
    ambiguity when candidate anchors imply materially different step times"); ``comparable``
    is false when it recurs so much more (or less) often that any ratio would be near a whole
    multiple: then it is no second anchor, and neither agrees nor disagrees."""
    first = steps.durations()
    if not len(first):
        return None
    for finder in finders:
        found = finder(trace, None, taxonomy, settings)
        if found is None or len(found[0]) < 3:
            continue
        table, source, label = found
        other = choose_window(table, source, label, trace, settings).durations()
        if not len(other):
            continue
        ratio = float(other.median()) / float(first.median())
        agrees = anchors_agree(ratio, settings)
        return {
            "source": source,
            "label": label,
            "median_ms": round(float(other.median()) / 1e6, 4),
            "ratio": round(ratio, 4),
            "agrees": agrees,
            "comparable": agrees is not None,
        }
    return None


def anchors_agree(ratio: float, settings: StepSettings) -> bool | None:
    """Whether a second anchor's step time (``ratio`` times the first's) agrees: the same
    within ``anchor_same_frac``, or a whole multiple (2x, 1/3x, ...) up to
    ``anchor_max_multiple`` within ``anchor_multiple_frac`` of it. None beyond that multiple:
    with a tolerance that grows with the multiple, any ratio is near one, so it says nothing."""
    if ratio <= 0:
        return False
    multiple = max(ratio, 1 / ratio)
    if abs(ratio - 1) <= settings.anchor_same_frac:
        return True
    whole = round(multiple)
    if multiple > settings.anchor_max_multiple + 0.5:
        return None
    return whole >= 2 and abs(multiple - whole) <= settings.anchor_multiple_frac * whole


def warn_unmatched_step_regex(
    sources_per_export: list[list[str]], paths: list[str], step_regex: str | None
) -> None:
    """--step-range names NVTX ranges: say where it matched none (steps then came from CUDA
    graphs or a repeating kernel, or there were none), rather than stay silent."""
    if step_regex is None:
        return
    for sources, path in zip(sources_per_export, paths, strict=True):
        missed = [source for source in sources if source != "nvtx"]
        if missed:
            found = missed[0] or "none"
            instead = "no steps were found" if found == "none" else f"steps came from {found}"
            warnings.warn(
                f"{path}: --step-range {step_regex!r} matched no NVTX range "
                f"on {len(missed)} of {counted(len(sources), 'rank')}; {instead} instead",
                TraceWarning,
                stacklevel=3,
            )
