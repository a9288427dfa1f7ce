"""The documented Python API (docs/api.md) on a real trace."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from matplotlib.figure import Figure

import traceclf
from traceclf import api
from traceclf.model.trace import Trace
from traceclf.report.contract import WALLS, Report
from traceclf.support.errors import TraceError

REPO = Path(__file__).resolve().parents[1]
TRACE_DIRS = (REPO / "fixtures", Path("/work/shared/traces"))
NAME = "h100_comm_ep2"  # two ranks in one export


def real_trace(name: str) -> Path:
    for folder in TRACE_DIRS:
        if (folder / f"{name}.sqlite").is_file():
            return folder / f"{name}.sqlite"
    pytest.skip(f"real trace {name} not found")


@pytest.fixture(scope="module")
def trace() -> Trace:
    return traceclf.open(real_trace(NAME), use_cache=False)


@pytest.fixture(scope="module")
def report() -> Report:
    return traceclf.analyze(real_trace(NAME), use_cache=False)


def test_package_exports_open_and_analyze() -> None:
    assert traceclf.open is api.open and traceclf.analyze is api.analyze
    assert set(api.__all__) <= set(dir(api))


def test_import_is_light() -> None:
    """`import traceclf` must not pull in polars or matplotlib (the CLI starts with it)."""
    code = "import sys, traceclf; print('polars' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_open_loads_the_trace_model(trace: Trace) -> None:
    assert trace.rank_pids == [1191, 1192]
    assert trace.nsys_version and trace.schema_version
    assert {"start", "end", "short_name", "pid"} <= set(trace.kernels.columns)


def test_open_refuses_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"missing\.sqlite"):
        traceclf.open(tmp_path / "missing.sqlite")
    for name in ("a.sqlite", "b.sqlite"):
        shutil.copyfile(real_trace(NAME), tmp_path / name)
    with pytest.raises(TraceError, match="2 exports"):
        traceclf.open(tmp_path)


def test_sql_and_polars_over_the_kernel_table(trace: Trace) -> None:
    pytest.importorskip("duckdb")
    top = trace.sql(
        'SELECT short_name, sum("end" - start) AS ns FROM kernels '
        "GROUP BY short_name ORDER BY ns DESC LIMIT 1"
    )
    assert top["short_name"][0] == "ncclDevKernel_SendRecv"
    by_polars = (
        trace.kernels.filter(pl.col("short_name") == "ncclDevKernel_SendRecv")
        .select((pl.col("end") - pl.col("start")).sum())
        .item()
    )
    assert top["ns"][0] == by_polars


def test_names_take_string_operations(trace: Trace) -> None:
    """Names in the frames `open` returns are text: polars' `.str` works on them, and the
    measures of the same trace read as Categoricals are the same."""
    nccl = trace.kernels.filter(pl.col("name").str.contains("nccl"))
    assert len(nccl) == trace.kernels["short_name"].str.starts_with("nccl").sum() > 0
    assert trace.api["name"].str.starts_with("cuda").any()
    assert {trace.kernels.schema[c] for c in ("name", "short_name")} == {pl.String}
    from traceclf.ingest.cache import open_trace

    model = open_trace(real_trace(NAME), use_cache=False)
    assert model.kernels.schema["name"] == pl.Categorical  # the analysis's own frames
    assert trace.kernels.equals(model.kernels.with_columns(pl.col(pl.Categorical).cast(pl.String)))
    assert trace.with_categories().kernels.schema["name"] == pl.Categorical
    pid = trace.rank_pids[0]
    assert api.measure(trace, pid=pid).metrics == api.measure(model, pid=pid).metrics


def test_steps_and_measure_per_rank(trace: Trace) -> None:
    steps = api.steps(trace)
    assert steps.source == "nvtx" and steps.label == "Iteration"
    lo, hi = steps.window
    assert steps.used >= 5 and hi > lo
    assert {"index", "duration", "steady"} <= set(steps.table.columns)
    other = api.measure(trace, pid=trace.rank_pids[1])
    assert other.metrics["exposed_comm_frac"] > 0.8  # the all-to-all is exposed on both ranks
    assert len(other.step_breakdown) == api.steps(trace, pid=trace.rank_pids[1]).used
    with pytest.raises(TraceError, match="pid 1"):
        api.steps(trace, pid=1)


def test_analyze_returns_the_report(report: Report) -> None:
    assert report.bound in WALLS
    assert len(report.ranks) == 2 and report.steps["source"] == "nvtx"
    assert Report.from_dict(report.to_dict()) == report


def test_analyze_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="colour"):
        traceclf.analyze(real_trace(NAME), colour="red")
    with pytest.raises(TraceError):
        traceclf.analyze()
    custom = traceclf.analyze(real_trace(NAME), step_range=r"^Iteration \d+$", use_cache=False)
    assert custom.steps["label"] == "Iteration"


def test_frames(report: Report) -> None:
    metrics = api.metrics_frame(report)
    assert metrics["rank"].to_list() == [0, 1]
    assert metrics["exposed_comm_frac"].min() > 0.8
    steps = api.steps_frame(report)
    assert steps.columns == [
        "rank",
        "step",
        "compute",
        "exposed_comm",
        "copy",
        "idle",
        "comm_total",
    ]
    per_rank = steps.group_by("rank").agg(pl.len())["len"].to_list()
    assert per_rank == [report.steps["used"]] * 2
    step_ms = steps.filter(pl.col("rank") == 0).select(
        pl.sum_horizontal("compute", "exposed_comm", "copy", "idle").mean()
    )
    assert step_ms.item() == pytest.approx(report.ranks[0]["metrics"]["step_time_ms"], rel=0.02)


def test_figures(report: Report) -> None:
    figs = api.figures(report)
    # the GPU idles 0.3% of the step here: no idle-gap histogram (figures only where informative)
    assert list(figs) == ["step_timeline", "step_lanes", "comm_overlap"]
    assert all(isinstance(f, Figure) for f in figs.values())


@pytest.mark.parametrize(
    ("section", "value", "said"),
    [
        ("ranks", None, "'ranks' is null"),
        ("series", None, "'series' is null"),
        ("steps", "x", "'steps' is a string"),
        ("ranks", ["x"], "'ranks' holds an entry that is not an object"),
    ],
)
def test_a_misshapen_saved_report_is_one_error(
    report: Report, tmp_path: Path, section: str, value, said: str
) -> None:
    """Constructed (a fuzzing run of the API): each loaded, then its tables, figures or
    Markdown failed with a TypeError or an AttributeError."""
    data = report.to_dict() | {section: value}
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(traceclf.TraceError, match=f"not a report traceclf can render: {said}"):
        api.load_report(saved)


def test_load_report_and_compare(report: Report, tmp_path: Path) -> None:
    saved = tmp_path / "report.json"
    saved.write_text(report.to_json(), encoding="utf-8")
    assert api.load_report(saved) == report
    same = api.compare(saved, report)
    assert same.verdict == "no significant change" and same.moved == []
    assert same.before.source == str(saved) and same.after.source == "report"
