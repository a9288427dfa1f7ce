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
steps counts. Warm-up steps at the start, a cut-off last step and outliers are dropped from the
statistics; the window spans the kept steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import polars as pl

from traceclf.model.taxonomy import Taxonomy, matches
from traceclf.model.trace import Trace, outermost
from traceclf.support.errors import TraceError, TraceWarning

if TYPE_CHECKING:
    from traceclf.steps.plan import StepPlan

WARMUP_FACTOR = 1.5  # a leading step slower than this times the median is warm-up
OUTLIER_FACTOR = 2.0  # a step outside [median/f, median*f] is left out of the statistics


@dataclass(frozen=True)
class Steps:
    """The steps of one rank and the part of them the measures cover.

    ``table`` has every step found (index, name, gpu_start, gpu_end, duration, steady,
    outlier, analysed, and cpu_start/cpu_end: the NVTX range of a step found on the host,
    null for steps found on the GPU). By default (window mode) a long capture is analysed on a sample of its
    steady steps, in runs spread evenly over the steady state: ``analysed`` marks them, and
    ``spans`` are the GPU time spans they cover (the measures' window; ``window`` is their
    hull). With every steady step analysed, ``spans`` is the one span ``window``.
    """

    source: str  # "nvtx" | "graph" | "pattern" | "none"
    table: pl.DataFrame
    window: tuple[int, int]
    label: str = ""  # the range name or kernel that defined the steps
    spans: tuple[tuple[int, int], ...] = ()
    # the next anchor's step time, as a cross-check (cross_check); None when there is none
    second: dict | None = None

    def __post_init__(self) -> None:
        if not self.spans:
            object.__setattr__(self, "spans", (self.window,))
        if "analysed" not in self.table.columns:
            object.__setattr__(self, "table", self.table.with_columns(analysed=pl.col("steady")))
        missing = [c for c in ("cpu_start", "cpu_end") if c not in self.table.columns]
        if missing:
            nulls = [pl.lit(None, pl.Int64).alias(c) for c in missing]
            object.__setattr__(self, "table", self.table.with_columns(nulls))

    @property
    def count(self) -> int:
        """Steps found."""
        return len(self.table)

    @property
    def steady(self) -> pl.DataFrame:
        """The steady-state steps the measures cover (all of them, or the analysed sample)."""
        return self.table.filter(pl.col("steady") & pl.col("analysed"))

    @property
    def used(self) -> int:
        """Steady-state steps found (warm-up and a cut-off last step left out)."""
        return int(self.table["steady"].sum()) if self.count else 0

    @property
    def analysed(self) -> int:
        """Steady-state steps measured: ``used``, or fewer when a long capture is sampled."""
        return int((self.table["steady"] & self.table["analysed"]).sum()) if self.count else 0

    @property
    def wall(self) -> int:
        """ns of the window: the total length of ``spans``, at least 1."""
        return max(sum(hi - lo for lo, hi in self.spans), 1)

    def durations(self) -> pl.Series:
        """Durations (ns) of the analysed steady, non-outlier steps."""
        return self.steady.filter(~pl.col("outlier"))["duration"]


def find_steps(
    trace: Trace,
    step_regex: str | None = None,
    taxonomy: Taxonomy | None = None,
    plan: StepPlan | None = None,
) -> Steps:
    """Steps of a single-rank trace (see :meth:`Trace.for_pid`); ``taxonomy`` (default: the
    bundled one) names step ranges and graph launches. With a ``plan`` (window mode: the
    steps found in the first pass and those chosen for analysis) only the chosen steps are
    projected onto the GPU, from the rows ``trace`` holds for them."""
    from traceclf.model.taxonomy import bundled

    if plan is not None:
        from traceclf.steps.plan import planned_steps

        return planned_steps(trace, plan)
    taxonomy = taxonomy or bundled()
    finders = (_nvtx_steps, _graph_steps, _pattern_steps)
    for i, finder in enumerate(finders):
        found = finder(trace, step_regex, taxonomy)
        if found is not None and len(found[0]) >= 1:
            table, source, label = found
            steps = _choose_window(table, source, label, trace)
            second = cross_check(steps, trace, taxonomy, finders[i + 1 :])
            return replace(steps, second=second)
    lo, hi = trace.span
    return Steps("none", _empty_table(), (lo, hi), "")


def _empty_table() -> pl.DataFrame:
    return pl.DataFrame(
        schema={
            "index": pl.Int64,
            "name": pl.String,
            "gpu_start": pl.Int64,
            "gpu_end": pl.Int64,
            "duration": pl.Int64,
            "steady": pl.Boolean,
            "outlier": pl.Boolean,
            "analysed": pl.Boolean,
            "cpu_start": pl.Int64,
            "cpu_end": pl.Int64,
        }
    )


def step_ranges(nvtx: pl.DataFrame, pattern: str) -> pl.DataFrame | None:
    """The NVTX ranges matching ``pattern`` that no other match contains, numbered (index),
    in time order; None when there are none."""
    ranges = nvtx.filter(matches(nvtx["text"], pattern))
    if ranges.is_empty():
        return None
    # Nested matches (a "step" inside another "step") would double count: keep the outermost.
    return outermost(ranges).with_columns(index=pl.int_range(pl.len()).cast(pl.Int64))


def _nvtx_steps(trace: Trace, step_regex: str | None, taxonomy: Taxonomy):
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
    return table, "nvtx", label


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
            f"--step-range {pattern!r} is not a valid regular expression ({_regex_problem(e)})",
        ) from None


def _regex_problem(error: Exception) -> str:
    """The regex engine's own one-line reason ("unclosed character class"), without the
    polars expression it was raised from."""
    lines = [line.strip() for line in str(error).splitlines()]
    reason = next(
        (line[len("error:") :].strip() for line in lines if line.startswith("error:")), ""
    )
    return reason or "not supported by the regex engine (no look-around, no backreferences)"


def range_label(names: pl.Series) -> str:
    stripped = names.str.replace(r"[#:=_\-\s]*\d+\s*$", "")
    return str(stripped.mode()[0]) if len(stripped) else ""


def _graph_steps(trace: Trace, _regex: str | None, taxonomy: Taxonomy):
    launches = trace.api.filter(matches(trace.api["name"], taxonomy.cuda_api["graph_launch"]))
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


def _pattern_steps(trace: Trace, _regex: str | None, _taxonomy: Taxonomy):
    """Steps from the kernel that recurs most regularly: the steady state of a training loop
    repeats the same sequence, so one kernel of it recurs at the step period."""
    kernels = trace.kernels.select("name", "start", "end").sort("start")
    best = recurring_kernel(kernels)
    if best is None:
        return None
    starts = kernels.filter(pl.col("name") == best)["start"]
    table = pl.DataFrame({"gpu_start": starts}).with_columns(
        index=pl.int_range(pl.len()).cast(pl.Int64),
        name=pl.lit(str(best)),
        gpu_end=pl.col("gpu_start").shift(-1).fill_null(int(kernels["end"].max())),
    )
    return table, "pattern", str(best)


def recurring_kernel(kernels: pl.DataFrame):
    """The ``name`` (any dtype) of the kernel that recurs most regularly in ``kernels``
    (name, start, end; sorted by start) with the longest period, or None."""
    if len(kernels) < 6:
        return None
    candidates = (
        kernels.with_columns(gap=pl.col("start").diff().over("name"))
        .group_by("name")
        .agg(n=pl.len(), gaps=pl.col("gap").drop_nulls())
        .filter(pl.col("n") >= 4)
    )
    if candidates.is_empty():
        return None
    # Judge regularity on the later half of the occurrences (warm-up is irregular).
    candidates = (
        candidates.with_columns(tail=pl.col("gaps").list.slice(pl.col("gaps").list.len() // 2))
        .with_columns(
            cv=pl.col("tail").list.std() / pl.col("tail").list.mean(),
            period=pl.col("tail").list.median(),
        )
        .filter(pl.col("cv") < 0.1)
    )
    if candidates.is_empty():
        return None
    # Longest regular period = whole step rather than one layer of it.
    return candidates.sort(["period", "n"], descending=[True, False])["name"][0]


def with_durations(table: pl.DataFrame) -> pl.DataFrame:
    """``table`` (gpu_start, gpu_end) sorted, with each step's duration (to the next step's
    start, so host time between steps counts; the last one: its own GPU span) and step_end."""
    return (
        table.sort("gpu_start")
        .with_columns(next_start=pl.col("gpu_start").shift(-1))
        .with_columns(
            duration=pl.coalesce("next_start", pl.max_horizontal("gpu_end", pl.lit(0)))
            - pl.col("gpu_start"),
            step_end=pl.coalesce("next_start", "gpu_end"),
        )
    )


def steady_range(durations: list[int]) -> tuple[int, int]:
    """First and last position of the steady state among steps of these durations: warm-up
    steps at the start and a cut-off last step left out."""
    reference = _median(durations[1:]) if len(durations) >= 3 else 0.0
    return steady_bounds(len(durations), durations.__getitem__, reference)


def steady_bounds(
    n: int, duration: Callable[[int], float | None], reference: float
) -> tuple[int, int]:
    """:func:`steady_range` of ``n`` steps whose durations ``duration(i)`` gives (None:
    unknown) against ``reference`` (the median step): the window mode asks only for the few
    durations the decision needs, each measured on its own."""

    def slower(i: int, than: float) -> bool:
        d = duration(i)
        return d is not None and d > than

    first, last = 0, n - 1
    if n == 2 and slower(0, WARMUP_FACTOR * (duration(1) or 0)):
        first = 1  # of two steps, a much slower first one is warm-up
    if n >= 3:
        first = 1  # the first step always pays for compilation, autotuning, allocation
        while first < last and slower(first, WARMUP_FACTOR * reference):
            first += 1
        # the last step has no successor: its duration is only its own GPU span
        tail = duration(last)
        if last > first and tail is not None and tail * WARMUP_FACTOR < reference:
            last -= 1
    return first, last


def flag_outliers(table: pl.DataFrame, among: pl.Expr) -> pl.DataFrame:
    """``outlier``: a step of ``among`` whose duration is far from their median."""
    median = _median(table.filter(among)["duration"].to_list()) or 1
    return table.with_columns(
        outlier=among
        & (
            (pl.col("duration") > OUTLIER_FACTOR * median)
            | (pl.col("duration") < median / OUTLIER_FACTOR)
        ),
    )


# Two anchors agree when their step times match within this, or one is a whole multiple of the
# other within COMMENSURATE (a kernel that recurs once per layer, or once every other step).
AGREE = 0.1
COMMENSURATE = 0.05


def cross_check(steps: Steps, trace: Trace, taxonomy: Taxonomy, finders) -> dict | None:
    """The step time the next anchor that finds steps implies, beside this one's, and whether
    the two agree (NVIDIA's method: "cross-check with a second anchor when possible; state the
    ambiguity when candidate anchors imply materially different step times")."""
    first = steps.durations()
    if not len(first):
        return None
    for finder in finders:
        found = finder(trace, None, taxonomy)
        if found is None or len(found[0]) < 3:
            continue
        table, source, label = found
        other = _choose_window(table, source, label, trace).durations()
        if not len(other):
            continue
        ratio = float(other.median()) / float(first.median())
        return {
            "source": source,
            "label": label,
            "median_ms": round(float(other.median()) / 1e6, 4),
            "ratio": round(ratio, 4),
            "agrees": anchors_agree(ratio),
        }
    return None


def anchors_agree(ratio: float) -> bool:
    """Whether a second anchor's step time (``ratio`` times the first's) agrees: the same
    within AGREE, or a whole multiple (2x, 1/3x, ...) within COMMENSURATE."""
    if ratio <= 0:
        return False
    multiple = max(ratio, 1 / ratio)
    whole = round(multiple)
    return abs(ratio - 1) <= AGREE or (whole >= 2 and abs(multiple - whole) <= COMMENSURATE * whole)


def _choose_window(table: pl.DataFrame, source: str, label: str, trace: Trace) -> Steps:
    capture_end = trace.span[1]
    table = with_durations(table)
    first, last = steady_range(table["duration"].to_list())
    table = flag_outliers(
        table.with_columns(steady=pl.int_range(pl.len()).is_between(first, last)),
        pl.col("steady"),
    )
    window = (int(table["gpu_start"][first]), int(table["step_end"][last]))
    if window[1] <= window[0]:
        window = (window[0], max(capture_end, window[0] + 1))
    cpu = [c for c in ("cpu_start", "cpu_end") if c in table.columns]
    return Steps(
        source,
        table.select(
            "index", "name", "gpu_start", "gpu_end", "duration", "steady", "outlier", *cpu
        ),
        window,
        label,
    )


def _median(values: list[int]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def warn_unmatched_step_regex(
    ranks_per_export: list[list], paths: list[str], step_regex: str | None
) -> None:
    """--step-range names NVTX ranges: say where it matched none (steps then came from CUDA
    graphs or a repeating kernel, or there were none), rather than stay silent."""
    if step_regex is None:
        return
    for ranks, path in zip(ranks_per_export, paths, strict=True):
        missed = [r for r in ranks if r.steps.get("source") != "nvtx"]
        if missed:
            found = missed[0].steps.get("source") or "none"
            instead = "no steps were found" if found == "none" else f"steps came from {found}"
            warnings.warn(
                f"{path}: --step-range {step_regex!r} matched no NVTX range "
                f"on {len(missed)} of {len(ranks)} rank(s); {instead} instead",
                TraceWarning,
                stacklevel=3,
            )


def slowest_step(steps: Steps) -> dict | None:
    """The slowest steady step (outliers included: it is the one to look at) as its index,
    [start, end) ns on the export's clock (a step lasts until the next one starts) and ms."""
    if not steps.count or steps.steady.is_empty():
        return None
    row = steps.steady.sort(["duration", "index"], descending=[True, False]).row(0, named=True)
    start = int(row["gpu_start"])
    return {
        "index": int(row["index"]),
        "start_ns": start,
        "end_ns": start + int(row["duration"]),
        "ms": round(row["duration"] / 1e6, 4),
    }
