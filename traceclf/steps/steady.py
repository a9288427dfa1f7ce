"""Steps of one rank and the steady state among them: each step's duration (to the next
step's start, so host time between steps counts), warm-up steps at the start, the last step
(no step time) and outliers left out of the statistics, and the steady-state window the
measures cover.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from traceclf.model.trace import Trace
from traceclf.steps.settings import StepSettings

# The columns of every Steps.table, before ``analysed`` and the NVTX range's cpu_start/cpu_end.
STEP_COLUMNS = (
    "index",
    "name",
    "gpu_start",
    "gpu_end",
    "duration",
    "complete",
    "steady",
    "outlier",
)


@dataclass(frozen=True)
class Steps:
    """The steps of one rank and the part of them the measures cover.

    ``table`` has every step found (index, name, gpu_start, gpu_end, duration, complete,
    steady, outlier, analysed, and cpu_start/cpu_end: the NVTX range of a step found on the
    host, null for steps found on the GPU). A step is ``complete`` when the next step's start
    ends it: the last one's duration is only its own GPU span, no step time. By default (step sampling) a long capture is analysed on a sample of its
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
        if "complete" not in self.table.columns:
            object.__setattr__(self, "table", self.table.with_columns(complete=pl.lit(True)))
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
        """Steady-state steps found (warm-up and the last step left out)."""
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
        """Durations (ns) of the analysed steady, non-outlier, complete steps: the step times
        every statistic is taken over. With no complete steady step (two steps, the first
        warm-up), the last one's own GPU span, for want of a step time."""
        usable = self.steady.filter(~pl.col("outlier"))
        complete = usable.filter(pl.col("complete"))
        return (complete if len(complete) else usable)["duration"]


def empty_steps_table() -> pl.DataFrame:
    return pl.DataFrame(
        schema={
            "index": pl.Int64,
            "name": pl.String,
            "gpu_start": pl.Int64,
            "gpu_end": pl.Int64,
            "duration": pl.Int64,
            "complete": pl.Boolean,
            "steady": pl.Boolean,
            "outlier": pl.Boolean,
            "analysed": pl.Boolean,
            "cpu_start": pl.Int64,
            "cpu_end": pl.Int64,
        }
    )


def with_durations(table: pl.DataFrame) -> pl.DataFrame:
    """``table`` (gpu_start, gpu_end) sorted, with each step's duration (to the next step's
    start, so host time between steps counts; the last one: its own GPU span), step_end and
    whether the next step's start ends it (``complete``)."""
    return (
        table.sort("gpu_start")
        .with_columns(next_start=pl.col("gpu_start").shift(-1))
        .with_columns(
            duration=pl.coalesce("next_start", pl.max_horizontal("gpu_end", pl.lit(0)))
            - pl.col("gpu_start"),
            step_end=pl.coalesce("next_start", "gpu_end"),
            complete=pl.col("next_start").is_not_null(),
        )
    )


@dataclass(frozen=True)
class Allocations:
    """Whether steps call the allocator (cudaMalloc/cudaFree), where the steps' own calls are
    known (NVTX steps): ``calls(i)`` for step i (None: unknown), ``typical()`` for the median
    step (asked only once a leading step calls it, and once: step sampling answers it by
    looking through the calls of several steps)."""

    calls: Callable[[int], bool | None]
    typical: Callable[[], bool]


def steady_range(
    durations: list[int], settings: StepSettings, allocs: list[int | None] | None = None
) -> tuple[int, int]:
    """First and last position of the steady state among steps of these durations: warm-up
    steps at the start (``allocs``: allocator calls per step, when known) and the last step
    left out."""
    reference = _median(durations[1:]) if len(durations) >= 3 else 0.0
    growth = (
        Allocations(
            lambda i: None if allocs[i] is None else allocs[i] > 0,
            lambda: _median([a for a in allocs[1:] if a is not None]) > 0,
        )
        if allocs and len(allocs) >= 3
        else None
    )
    return steady_bounds(len(durations), durations.__getitem__, reference, settings, growth)


def steady_bounds(
    n: int,
    duration: Callable[[int], float | None],
    reference: float,
    settings: StepSettings,
    allocs: Allocations | None = None,
) -> tuple[int, int]:
    """:func:`steady_range` of ``n`` steps whose durations ``duration(i)`` gives (None:
    unknown) against ``reference`` (the median step): step sampling asks only for the few
    durations the decision needs, each measured on its own.

    Warm-up: the first step, then leading steps slower than ``warmup_step_factor`` times the
    median, or that still call the allocator while the median step makes no such call (the
    caching allocator still growing). The last step is never steady: nothing after it says
    when it ended (its duration is only its own GPU span; a recurring kernel's last period
    runs to the end of the GPU work), so it has no step time, and the window holds complete
    steps only: its time over the steps is the mean step time."""
    factor = settings.warmup_step_factor

    def slower(i: int, than: float) -> bool:
        d = duration(i)
        return d is not None and d > than

    def growing(i: int) -> bool:
        return allocs is not None and bool(allocs.calls(i)) and not allocs.typical()

    first, last = 0, n - 1
    if n == 2 and slower(0, factor * (duration(1) or 0)):
        first = 1  # of two steps, a much slower first one is warm-up
    if n >= 3:
        first = 1  # the first step always pays for compilation, autotuning, allocation
        while first < last - 1 and (slower(first, factor * reference) or growing(first)):
            first += 1
    if last > first:
        last -= 1  # (with one step left, that step, for want of a complete one)
    return first, last


def flag_outliers(table: pl.DataFrame, among: pl.Expr, settings: StepSettings) -> pl.DataFrame:
    """``outlier``: a step of ``among`` whose duration is far from their median."""
    factor = settings.outlier_step_factor
    median = _median(table.filter(among)["duration"].to_list()) or 1
    return table.with_columns(
        outlier=among
        & ((pl.col("duration") > factor * median) | (pl.col("duration") < median / factor)),
    )


def choose_window(
    table: pl.DataFrame, source: str, label: str, trace: Trace, settings: StepSettings
) -> Steps:
    """The steady state among the steps of ``table`` (with an ``allocs`` column: allocator
    calls per step, where the steps' own calls are known) and the window it spans."""
    capture_end = trace.span[1]
    table = with_durations(table)
    allocs = table["allocs"].to_list() if "allocs" in table.columns else None
    first, last = steady_range(table["duration"].to_list(), settings, allocs)
    table = flag_outliers(
        table.with_columns(steady=pl.int_range(pl.len()).is_between(first, last)),
        pl.col("steady"),
        settings,
    )
    window = (int(table["gpu_start"][first]), int(table["step_end"][last]))
    if window[1] <= window[0]:
        window = (window[0], max(capture_end, window[0] + 1))
    cpu = [c for c in ("cpu_start", "cpu_end") if c in table.columns]
    return Steps(
        source,
        table.select(*STEP_COLUMNS, *cpu),
        window,
        label,
    )


def _median(values: list[int]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


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
