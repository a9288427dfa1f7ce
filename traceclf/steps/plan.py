"""Step sampling (issue 12): which steady steps of a long capture are read and analysed.

The first pass of :mod:`traceclf.pipeline.twopass` finds every step cheaply; :func:`plan_steps`
chooses runs of consecutive steady steps, spread evenly over the steady state and within a row
budget, and :func:`planned_steps` turns the steps read in the second pass into the
:class:`~traceclf.steps.steady.Steps` the measures use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import polars as pl

from traceclf.model.trace import Trace
from traceclf.steps.settings import StepSettings
from traceclf.steps.steady import (
    STEP_COLUMNS,
    Steps,
    flag_outliers,
    steady_range,
    with_durations,
)

# Analysed steps come in at most this many runs of consecutive steps, spread evenly over the
# steady state, so that drift over the capture is still seen.
RUNS = 16


@dataclass(frozen=True)
class StepPlan:
    """The steps of one rank as the first pass of step sampling finds them, and the runs of
    steady steps chosen for analysis.

    ``table``: index, name, start, end, duration, steady — GPU times when ``exact`` (steps
    from graph launches or a recurring kernel), else the CPU times of the NVTX ranges (whose
    GPU projection needs the CUDA calls and GPU rows that only the second pass reads).
    ``runs``: (first, last) step index of each analysed run, inclusive.
    """

    source: str
    label: str
    table: pl.DataFrame
    runs: tuple[tuple[int, int], ...]
    exact: bool

    @property
    def needed(self) -> list[int]:
        """Step indexes whose GPU rows the second pass reads: each run and the step after it
        (its start ends the run's last step)."""
        last = int(self.table["index"].max())  # type: ignore[arg-type]
        return sorted({i for a, b in self.runs for i in range(a, min(b + 1, last) + 1)})


def plan_steps(
    table: pl.DataFrame,
    source: str,
    label: str,
    exact: bool,
    analysable: int,
    settings: StepSettings,
    steady: tuple[int, int] | None = None,
    within: tuple[int, int] | None = None,
) -> StepPlan:
    """Choose the steps to analyse: every steady step when ``analysable`` (how many the row
    budget allows) covers them, else ``analysable`` of them in up to :data:`RUNS` runs of
    consecutive steps spread evenly over the steady state (or over ``within``, positions of
    steady steps that other ranks share: :func:`shared_steady`). ``table``: index, name,
    start, end (GPU times when ``exact``, else CPU times, and then ``steady``, the first and
    last position of the steady state, decided on GPU durations: :func:`steady_bounds`)."""
    table = with_durations(table.rename({"start": "gpu_start", "end": "gpu_end"}))
    first, last = steady or steady_range(table["duration"].to_list(), settings)
    table = table.with_columns(
        steady=pl.int_range(pl.len()).is_between(first, last),
        position=pl.int_range(pl.len()),
    )
    index = table["index"].to_list()
    if within is not None:
        first, last = max(first, within[0]), min(last, within[1])
    merged = spread_runs(first, last, analysable)
    return StepPlan(
        source,
        label,
        table.select(
            "index", "name", start="gpu_start", end="gpu_end", duration="duration", steady="steady"
        ),
        tuple((index[a], index[b]) for a, b in merged),
        exact,
    )


def spread_runs(first: int, last: int, n: int) -> list[tuple[int, int]]:
    """Positions (first, last, inclusive) of the runs of consecutive steps that analyse
    ``n`` (at least one) of the steps at positions ``first`` to ``last``: all of them when
    ``n`` covers them, else up to :data:`RUNS` runs spread evenly, those that touch merged."""
    count = last - first + 1
    n = max(1, min(n, count))
    if n >= count:
        return [(first, last)]
    k = min(RUNS, n)
    length = n // k
    starts = [first + round(i * (count - length) / max(k - 1, 1)) for i in range(k)]
    merged: list[tuple[int, int]] = []
    for a in starts:
        b = a + length - 1
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def at_most_alike(steps: list[Steps], n: int, settings: StepSettings) -> list[Steps]:
    """The steps of each rank of a capture read whole with at most ``n`` steady steps
    analysed, in the runs step sampling would choose (:func:`spread_runs`): the default mode's
    cost follows the steps analysed, not those found, whichever way the rows were read (a
    capture of a million 10 µs periods of one kernel, within the row budget, analysed all of
    them: 41 s, 8 GB, a report of a million step rows). Ranks whose steps match one to one (as
    many, found the same way) analyse the same steps, spread over the steady positions they
    all share, as :func:`shared_steady` puts sampled ones: their collectives are matched."""
    if all(s.used <= n for s in steps):
        return steps
    bounds = [_steady_bounds(s.table) for s in steps]
    within = _common_steady([(s.source, s.count) for s in steps], bounds)
    return [_at_most(s, n, settings, within or b) for s, b in zip(steps, bounds, strict=True)]


def _steady_bounds(table: pl.DataFrame) -> tuple[int, int] | None:
    """The first and last position of a step table's steady steps (None: none)."""
    steady = table.with_row_index("position").filter(pl.col("steady"))["position"]
    return None if steady.is_empty() else (int(steady.min()), int(steady.max()))  # type: ignore[arg-type]


def _common_steady(
    kinds: list[tuple[str, int]], bounds: list[tuple[int, int] | None]
) -> tuple[int, int] | None:
    """The positions of the steady steps every rank has (``bounds``: each rank's first and
    last), when the ranks' steps match one to one (``kinds``: each rank's source and number
    of steps, all equal); None otherwise."""
    if len(bounds) < 2 or len(set(kinds)) > 1 or None in bounds:
        return None
    first, last = max(b[0] for b in bounds), min(b[1] for b in bounds)  # type: ignore[index]
    return (first, last) if first <= last else None


def _at_most(steps: Steps, n: int, settings: StepSettings, steady: tuple[int, int] | None) -> Steps:
    """``steps`` with at most ``n`` of the steady ones between positions ``steady`` analysed
    (Steps found in a whole read keep their GPU times)."""
    if steady is None:
        return steps
    table = steps.table
    runs = spread_runs(*steady, n)
    position = pl.int_range(pl.len())
    chosen = pl.lit(False)
    for a, b in runs:
        chosen = chosen | position.is_between(a, b)
    table = table.with_columns(analysed=pl.col("steady") & chosen)
    table = flag_outliers(table, pl.col("analysed"), settings)
    starts, durations = table["gpu_start"].to_list(), table["duration"].to_list()
    # (a run's last step ends where the next step starts, as its duration says: the
    # capture's last one at its own end)
    spans = [(starts[a], max(starts[b] + durations[b], starts[a] + 1)) for a, b in runs]
    return replace(steps, table=table, window=(spans[0][0], spans[-1][1]), spans=tuple(spans))


def shared_steady(plans: list[StepPlan]) -> tuple[int, int] | None:
    """The positions of the steady steps every one of ``plans`` has, when they are the plans
    of ranks whose steps match one to one (as many, found the same way: the ranks of one
    export) but not the same runs, some rank's in several; None otherwise. Matching
    collectives across ranks needs the same steps: each rank's steady state, and so its
    runs, is decided on its own durations, and runs of other steps on each rank share little
    time (whose collectives alone can be matched:
    :func:`traceclf.measures.collectives.shared_runs`)."""
    if len({p.runs for p in plans}) == 1 or all(len(p.runs) <= 1 for p in plans):
        return None  # (one run each: matching numbers each rank's collectives from the first)
    kinds = [(p.source, p.table.height) for p in plans]
    return _common_steady(kinds, [_steady_bounds(p.table) for p in plans])


def planned_steps(trace: Trace, plan: StepPlan, settings: StepSettings) -> Steps:
    """Steps of a sampled trace: the plan's steps, with GPU times and exact durations for
    those of its runs (NVTX ranges projected through the CUDA calls the trace holds)."""
    table = plan.table
    if plan.exact:
        gpu = table.select("index", gpu_start="start", gpu_end="end")
    else:
        ranges = table.filter(pl.col("index").is_in(plan.needed)).select("index", "start", "end")
        gpu = trace.gpu_spans(ranges, "index")
    measured = []
    for a, b in plan.runs:
        run = with_durations(
            gpu.filter(pl.col("index").is_between(a, b + 1) & pl.col("gpu_start").is_not_null())
        ).sort("index")
        measured.append(
            run.filter(pl.col("index") <= b).select(
                "index", "gpu_start", "gpu_end", "duration", "step_end", "complete", run=pl.lit(a)
            )
        )
    exact = pl.concat(measured) if measured else None
    if exact is None or exact.is_empty():
        exact = pl.DataFrame(
            schema={
                "index": pl.Int64,
                "gpu_start": pl.Int64,
                "gpu_end": pl.Int64,
                "duration": pl.Int64,
                "step_end": pl.Int64,
                "complete": pl.Boolean,
                "run": pl.Int64,
            }
        )
    cpu = (  # an NVTX step's range on the host
        [pl.col("start").alias("cpu_start"), pl.col("end").alias("cpu_end")]
        if not plan.exact
        else [pl.lit(None, pl.Int64).alias("cpu_start"), pl.lit(None, pl.Int64).alias("cpu_end")]
    )
    steps = (
        table.with_columns(cpu)
        .join(exact, on="index", how="left", suffix="_gpu")
        .with_columns(
            duration=pl.coalesce("duration_gpu", "duration"),
            analysed=pl.col("steady") & pl.col("gpu_start").is_not_null(),
            complete=pl.col("complete").fill_null(False),
        )
        .sort("index")
    )
    steps = flag_outliers(steps, pl.col("analysed"), settings)
    spans = _merge_spans(
        [
            (int(rows["gpu_start"].min()), int(rows["step_end"].max()))  # type: ignore[arg-type]
            for (_run,), rows in steps.filter(pl.col("analysed")).group_by(["run"])
        ]
    )
    if not spans:  # nothing of the plan found on the GPU: the rows read are the window
        lo, hi = trace.span
        spans = [(lo, max(hi, lo + 1))]
    return Steps(
        plan.source,
        steps.select(*STEP_COLUMNS, "analysed", "cpu_start", "cpu_end"),
        (spans[0][0], spans[-1][1]),
        plan.label,
        tuple(spans),
    )


def _merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out
