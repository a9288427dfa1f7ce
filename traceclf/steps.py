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
from dataclasses import dataclass

import polars as pl

from traceclf.errors import TraceError, TraceWarning
from traceclf.kernels import Taxonomy
from traceclf.model import Trace, outermost

WARMUP_FACTOR = 1.5  # a leading step slower than this times the median is warm-up
OUTLIER_FACTOR = 2.0  # a step outside [median/f, median*f] is left out of the statistics


@dataclass(frozen=True)
class Steps:
    source: str  # "nvtx" | "graph" | "pattern" | "none"
    table: pl.DataFrame  # index, name, gpu_start, gpu_end, duration, steady, outlier
    window: tuple[int, int]
    label: str = ""  # the range name or kernel that defined the steps

    @property
    def count(self) -> int:
        return len(self.table)

    @property
    def steady(self) -> pl.DataFrame:
        return self.table.filter(pl.col("steady"))

    @property
    def used(self) -> int:
        return int(self.table["steady"].sum()) if self.count else 0

    def durations(self) -> pl.Series:
        """Durations (ns) of steady, non-outlier steps."""
        return self.steady.filter(~pl.col("outlier"))["duration"]


def find_steps(
    trace: Trace, step_regex: str | None = None, taxonomy: Taxonomy | None = None
) -> Steps:
    """Steps of a single-rank trace (see :meth:`Trace.for_pid`); ``taxonomy`` (default: the
    bundled one) names step ranges and graph launches."""
    from traceclf import kernels

    taxonomy = taxonomy or kernels.bundled()
    for finder in (_nvtx_steps, _graph_steps, _pattern_steps):
        found = finder(trace, step_regex, taxonomy)
        if found is not None and len(found[0]) >= 1:
            table, source, label = found
            return _choose_window(table, source, label, trace)
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
        }
    )


def _nvtx_steps(trace: Trace, step_regex: str | None, taxonomy: Taxonomy):
    pattern = step_regex or taxonomy.nvtx["step"]
    check_step_regex(pattern)
    ranges = trace.nvtx.filter(pl.col("text").str.contains(pattern))
    if ranges.is_empty():
        return None
    # Nested matches (a "step" inside another "step") would double count: keep the outermost.
    ranges = outermost(ranges).with_columns(index=pl.int_range(pl.len()).cast(pl.Int64))
    label = _label(ranges["text"])
    owned = trace.calls_in(ranges, "index")
    work = trace.gpu_work.join(owned, on="correlation_id")
    gpu = work.group_by("index").agg(gpu_start=pl.col("start").min(), gpu_end=pl.col("end").max())
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


def _label(names: pl.Series) -> str:
    stripped = names.str.replace(r"[#:=_\-\s]*\d+\s*$", "")
    return str(stripped.mode()[0]) if len(stripped) else ""


def _graph_steps(trace: Trace, _regex: str | None, taxonomy: Taxonomy):
    launches = trace.api.filter(taxonomy.is_api("graph_launch"))
    if len(launches) < 2:
        return None
    work = trace.gpu_work.join(launches.select("correlation_id"), on="correlation_id")
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
    top = per_launch["key"].drop_nulls().mode()
    if len(top):
        per_launch = per_launch.filter(pl.col("key") == top[0])
    table = per_launch.sort("gpu_start").select(
        index=pl.int_range(pl.len()).cast(pl.Int64),
        name=pl.lit("graph launch"),
        gpu_start="gpu_start",
        gpu_end="gpu_end",
    )
    return table, "graph", "cudaGraphLaunch"


def _pattern_steps(trace: Trace, _regex: str | None, _taxonomy: Taxonomy):
    """Steps from the kernel that recurs most regularly: the steady state of a training loop
    repeats the same sequence, so one kernel of it recurs at the step period."""
    kernels = trace.kernels.select("name", "start", "end").sort("start")
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
    best = candidates.sort(["period", "n"], descending=[True, False]).row(0, named=True)
    starts = kernels.filter(pl.col("name") == best["name"])["start"]
    table = pl.DataFrame({"gpu_start": starts}).with_columns(
        index=pl.int_range(pl.len()).cast(pl.Int64),
        name=pl.lit(best["name"]),
        gpu_end=pl.col("gpu_start").shift(-1).fill_null(int(kernels["end"].max())),
    )
    return table, "pattern", str(best["name"])


def _choose_window(table: pl.DataFrame, source: str, label: str, trace: Trace) -> Steps:
    capture_end = trace.span[1]
    table = (
        table.sort("gpu_start")
        .with_columns(next_start=pl.col("gpu_start").shift(-1))
        .with_columns(
            duration=pl.coalesce("next_start", pl.max_horizontal("gpu_end", pl.lit(0)))
            - pl.col("gpu_start"),
            step_end=pl.coalesce("next_start", "gpu_end"),
        )
    )
    n = len(table)
    durations = table["duration"].to_list()
    first, last = 0, n - 1
    if n == 2 and durations[0] > WARMUP_FACTOR * durations[1]:
        first = 1  # of two steps, a much slower first one is warm-up
    if n >= 3:
        reference = _median(durations[1:])
        first = 1  # the first step always pays for compilation, autotuning, allocation
        while first < last and durations[first] > WARMUP_FACTOR * reference:
            first += 1
        # the last step has no successor: its duration is only its own GPU span
        if last > first and durations[last] * WARMUP_FACTOR < reference:
            last -= 1
    steady_idx = range(first, last + 1)
    median = _median([durations[i] for i in steady_idx]) or 1
    table = table.with_columns(
        steady=pl.int_range(pl.len()).is_between(first, last),
    ).with_columns(
        outlier=pl.col("steady")
        & (
            (pl.col("duration") > OUTLIER_FACTOR * median)
            | (pl.col("duration") < median / OUTLIER_FACTOR)
        ),
    )
    window = (int(table["gpu_start"][first]), int(table["step_end"][last]))
    if window[1] <= window[0]:
        window = (window[0], max(capture_end, window[0] + 1))
    return Steps(
        source,
        table.select("index", "name", "gpu_start", "gpu_end", "duration", "steady", "outlier"),
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
