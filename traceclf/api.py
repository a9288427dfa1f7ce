"""The stable Python API, for notebooks and scripts (documented in docs/api.md).

    import traceclf
    from traceclf import api

    trace = traceclf.open("run.sqlite")          # the trace model: polars frames + trace.sql()
    steps = api.steps(trace)                      # steps and steady-state window of one rank
    report = traceclf.analyze("run.sqlite")       # the JSON report's object
    api.figures(report)["step_timeline"]          # matplotlib figures of the report
    api.compare("before.sqlite", "after.sqlite")  # regression check

Names here stay compatible across minor versions; everything else in the package may change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.report.contract import Report
from traceclf.support.errors import TraceError

if TYPE_CHECKING:  # `import traceclf` stays light: polars and matplotlib load on first use
    import polars as pl
    from matplotlib.figure import Figure

    from traceclf.compare.regression import Comparison
    from traceclf.measures import RankMeasures
    from traceclf.model.trace import Trace
    from traceclf.pipeline.analysis import AnalysisOptions
    from traceclf.report.runset import RunSet
    from traceclf.steps.steady import Steps

__all__ = [
    "analyze",
    "compare",
    "figures",
    "load_report",
    "measure",
    "metrics_frame",
    "open",
    "steps",
    "steps_frame",
]


def open(path: str | Path, *, use_cache: bool = True, cache_dir: Path | None = None) -> Trace:
    """Load one export (``.sqlite``) or Nsight Systems report (``.nsys-rep``, exported once
    with nsys) into the trace model, through the Parquet cache.

    Names (kernels, CUDA calls, GPU metrics) are plain text, so polars' ``.str`` operations
    work on them (:meth:`~traceclf.model.trace.Trace.with_text`).

    Raises :class:`~traceclf.support.errors.TraceError` when ``path`` is missing, is not an export,
    or names several exports (a folder): open those one at a time.
    """
    from traceclf.ingest.cache import open_trace

    return open_trace(path, use_cache=use_cache, cache_dir=cache_dir).with_text()


def analyze(*paths: str | Path, step_range: str | None = None, **options) -> Report | RunSet:
    """Analyse one run (one or more exports, reports or folders; all their ranks) into a
    :class:`~traceclf.report.contract.Report`, as ``traceclf analyze`` does; inputs that are
    several runs (unrelated exports, or ``grouping="runs"``) into a
    :class:`~traceclf.report.runset.RunSet` of them.

    ``step_range`` is the regular expression for the NVTX ranges that mark a step;
    ``options`` are those of :class:`~traceclf.pipeline.analysis.AnalysisOptions` (``use_cache``,
    ``cache_dir``, ``rules_dir``, ``jobs``, ``nsys``, ``dask_address``, ``quiet``).
    Progress bars are off unless ``quiet=False``.
    """
    from traceclf.pipeline.analysis import analyze_inputs

    if not paths:
        raise TraceError(None, "analyze() needs at least one path")
    return analyze_inputs([str(p) for p in paths], _options(step_range, options))


def compare(
    before: str | Path | Report,
    after: str | Path | Report,
    *,
    threshold: float = 0.05,
    step_range: str | None = None,
    **options,
) -> Comparison:
    """Compare two runs as ``traceclf compare`` does. Each side is a trace input, a saved
    JSON report path, or a :class:`Report` already in memory."""
    from traceclf.compare.regression import compare_reports, comparison_settings, load_run

    opts = _options(step_range, options)
    reports = [
        side if isinstance(side, Report) else load_run(side, opts) for side in (before, after)
    ]
    labels = tuple("report" if isinstance(s, Report) else str(s) for s in (before, after))
    return compare_reports(
        *reports, threshold=threshold, labels=labels, settings=comparison_settings(opts)
    )


def load_report(path: str | Path) -> Report:
    """A report saved with ``traceclf analyze --format json -o report.json``; TraceError where
    a section is not of the contract's type (``"ranks": null``: its tables, figures and
    renderings would fail on it)."""
    report = Report.load(path)
    if wrong := report.misshapen():
        raise TraceError(path, f"not a report traceclf can render: {'; '.join(wrong[:3])}")
    return report


def figures(report: Report) -> dict[str, Figure]:
    """The report's figures by name (``step_timeline``, ``step_lanes``, ``comm_overlap``,
    ``idle_gaps``, ``memory``, ``gpu_metrics``), each a matplotlib Figure; only those that say
    something for this report (:func:`traceclf.figures.draw.report_figures`)."""
    from traceclf.figures.draw import report_figures

    return report_figures(report.series)


def steps(trace: Trace, *, pid: int | None = None, step_range: str | None = None) -> Steps:
    """The steps of one rank (default: the first process with GPU work) and its steady-state
    window: ``.source``, ``.label``, ``.window`` (ns), ``.table`` (a polars frame with index,
    name, gpu_start, gpu_end, duration, steady, outlier), ``.used``, ``.durations()``."""
    from traceclf.steps.find import find_steps

    return find_steps(_rank(trace, pid), step_range)


def measure(trace: Trace, *, pid: int | None = None, step_range: str | None = None) -> RankMeasures:
    """The steady-state measures of one rank: ``.metrics`` (the report's per-rank metrics),
    ``.comm_by_kind``, ``.top_kernels``, ``.step_breakdown``, ``.idle_gaps``."""
    from traceclf.measures import measure_rank

    rank = _rank(trace, pid)
    return measure_rank(rank, steps(rank, step_range=step_range), trace.gpu_of(_pid(trace, pid)))


def metrics_frame(report: Report) -> pl.DataFrame:
    """One row per rank, one column per measure (plus rank and pid)."""
    import polars as pl

    return pl.DataFrame(
        [{"rank": r["rank"], "pid": r["pid"]} | r["metrics"] for r in report.ranks],
        infer_schema_length=None,
    )


def steps_frame(report: Report) -> pl.DataFrame:
    """One row per rank and steady step: ms of compute, exposed communication, copies and
    idle, and all communication (overlapped or not)."""
    import polars as pl

    rows = [
        {"rank": s["rank"], "step": row["index"]}
        | {key: row[key] / 1e6 for key in ("compute", "exposed_comm", "copy", "idle", "comm_total")}
        for s in report.series
        for row in s.get("step_breakdown") or []
    ]
    schema = ["rank", "step", "compute", "exposed_comm", "copy", "idle", "comm_total"]
    return pl.DataFrame(rows) if rows else pl.DataFrame(schema=schema)


def _options(step_range: str | None, options: Mapping) -> AnalysisOptions:
    from traceclf.pipeline.analysis import AnalysisOptions

    known = {f.name for f in fields(AnalysisOptions)} - {"step_regex"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; known: {sorted(known)}")
    return AnalysisOptions(step_regex=step_range, **({"quiet": True} | dict(options)))


def _pid(trace: Trace, pid: int | None) -> int:
    pids = trace.rank_pids
    if not pids:
        raise TraceError(trace.path, "no process ran GPU work in this trace")
    if pid is None:
        return pids[0]
    if pid not in pids:
        raise TraceError(trace.path, f"pid {pid} ran no GPU work here (ranks: {pids})")
    return pid


def _rank(trace: Trace, pid: int | None) -> Trace:
    """One rank of ``trace``, its names Categoricals again as the measures read them."""
    return trace.with_categories().for_pid(_pid(trace, pid))
