"""Interop (issue 14, part B): the tables as CSV/Parquet (--export-dir, --format csv), the
steady-state window as a Chrome/Perfetto trace (--export-trace), Markdown with its figures
beside it, and the notebook display (Report._repr_html_, Trace repr, to_pandas). Numbers are
checked against the report and against sqlite3 reads of the export; names with commas, quotes,
newlines and formulas are constructed into a copy of a real export."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sqlite3
import statistics
from pathlib import Path

import polars as pl
import pytest
from conftest import oracle_csv
from helpers.cli import run_cli
from helpers.files import copy_export, file_state, folder_listing, prefix_kernel_names
from realtraces import trace_path

import traceclf
from traceclf.figures.draw import informative
from traceclf.report.contract import Report
from traceclf.report.frames import TABLES
from traceclf.support.errors import TraceError

EP2 = "h100_comm_ep2"
GPU_PID = "((globalPid >> 24) & 16777215)"


@pytest.fixture(scope="module")
def ep2() -> Report:
    return traceclf.analyze(trace_path(EP2))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """--export-dir of the two-rank trace, CSV."""
    folder = tmp_path_factory.mktemp("tables")
    result = run_cli("analyze", trace_path(EP2), "-q", "--export-dir", folder / "out")
    assert result.code == 0, result.stderr
    return folder / "out"


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def kernels_in(path: Path, pid: int, window: tuple[int, int]) -> dict[str, list[int]]:
    """Durations of the kernels of ``pid`` starting in the window, by demangled name (sqlite3)."""
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    rows = con.execute(
        f"SELECT s.value, k.end - k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
        f"ON s.id = k.demangledName WHERE {GPU_PID} = ? AND k.start >= ? AND k.start < ?",
        (pid, *window),
    ).fetchall()
    con.close()
    out: dict[str, list[int]] = {}
    for name, dur in rows:
        out.setdefault(name, []).append(dur)
    return out


# tables -------------------------------------------------------------------------------------


def test_export_dir_writes_one_file_per_table(exported: Path) -> None:
    assert sorted(p.name for p in exported.iterdir()) == sorted(f"{t}.csv" for t in TABLES)


def test_kernels_csv_matches_an_independent_count(exported: Path, ep2: Report) -> None:
    rows = read_csv(exported / "kernels.csv")
    assert list(rows[0]) == ["rank", "name", "short_name", "family", "time_pct", "total_ns",
                             "instances", "avg_ns", "med_ns", "min_ns", "max_ns", "stddev_ns"]  # fmt: skip
    for rank in ep2.ranks:
        mine = {r["name"]: r for r in rows if int(r["rank"]) == rank["rank"]}
        expected = kernels_in(trace_path(EP2), rank["pid"], tuple(rank["steps"]["window_ns"]))
        assert set(mine) == set(expected)
        total = sum(sum(d) for d in expected.values())
        for name, durations in expected.items():
            row = mine[name]
            assert int(row["instances"]) == len(durations)
            assert int(row["total_ns"]) == sum(durations)
            assert (int(row["min_ns"]), int(row["max_ns"])) == (min(durations), max(durations))
            assert float(row["med_ns"]) == pytest.approx(statistics.median(durations))
            std = statistics.stdev(durations) if len(durations) > 1 else 0.0
            assert float(row["stddev_ns"]) == pytest.approx(std, abs=0.1)
            assert float(row["time_pct"]) == pytest.approx(100 * sum(durations) / total, abs=1e-3)


def test_kernel_summary_agrees_with_nvidia_over_the_whole_capture() -> None:
    """The same summary over the whole capture and every process is NVIDIA's
    cuda_gpu_kern_sum (nsys stats), row for row."""
    from types import SimpleNamespace

    from traceclf.measures.compute import kernel_summary
    from traceclf.model.taxonomy import bundled

    trace = traceclf.open(trace_path(EP2))
    lo, hi = trace.span
    w = SimpleNamespace(window=(lo, hi + 1), trace=trace, taxonomy=bundled())
    ours = {r["name"]: r for r in kernel_summary(w)}
    with oracle_csv(EP2, "cuda_gpu_kern_sum").open(newline="") as f:
        nvidia = list(csv.DictReader(f))
    assert len(ours) == len(nvidia)
    for row in nvidia:
        mine = ours[row["Name"]]
        assert mine["instances"] == int(row["Instances"])
        assert mine["total_ns"] == int(row["Total Time (ns)"])
        assert (mine["min_ns"], mine["max_ns"]) == (int(row["Min (ns)"]), int(row["Max (ns)"]))
        assert mine["stddev_ns"] == pytest.approx(float(row["StdDev (ns)"]), abs=0.1)
        assert 100 * mine["time_frac"] == pytest.approx(float(row["Time (%)"]), abs=0.05)


def test_the_other_tables_carry_the_reports_numbers(exported: Path, ep2: Report) -> None:
    ranks = read_csv(exported / "ranks.csv")
    assert [int(r["rank"]) for r in ranks] == [r["rank"] for r in ep2.ranks]
    for row, rank in zip(ranks, ep2.ranks, strict=True):
        assert int(row["pid"]) == rank["pid"]
        for key in ("step_time_ms", "gpu_busy_frac", "exposed_comm_frac", "idle_sync_frac"):
            assert float(row[key]) == pytest.approx(rank["metrics"][key], abs=1e-9)
    steps = read_csv(exported / "steps.csv")
    assert len(steps) == sum(len(s["step_breakdown"]) for s in ep2.series)
    for row in steps:
        parts = sum(float(row[f"{k}_ms"]) for k in ("compute", "exposed_comm", "copy", "idle"))
        assert float(row["step_ms"]) == pytest.approx(parts)
    rank0 = [float(r["step_ms"]) for r in steps if r["rank"] == "0"]
    assert statistics.fmean(rank0) == pytest.approx(
        ep2.ranks[0]["metrics"]["step_time_ms"], rel=0.02
    )
    collectives = read_csv(exported / "collectives.csv")
    a2a = [r for r in collectives if r["kind"] == "all_to_all"]
    assert len(a2a) == 2 and all(r["libraries"] == "nccl" for r in a2a)
    matched = ep2.cross_rank["comm_by_kind"]["all_to_all"]
    assert all(int(r["instances"]) == matched["instances"] for r in a2a)
    gaps = read_csv(exported / "idle_gap_bins.csv")
    for rank, series in zip(ep2.ranks, ep2.series, strict=True):
        mine = [g for g in gaps if int(g["rank"]) == rank["rank"]]
        hist = series["idle_gaps"]
        assert sum(int(g["gaps"]) for g in mine) == sum(
            sum(hist[c]) for c in ("launch", "sync", "input", "host", "other")
        )
        idle_ms = sum(float(g["total_ms"]) for g in mine)
        wall_ms = rank["metrics"]["step_time_ms"] * rank["steps"]["used"]
        assert idle_ms == pytest.approx(rank["metrics"]["gpu_idle_frac"] * wall_ms, rel=0.02)


def test_parquet_tables_hold_the_same_numbers(tmp_path: Path, exported: Path) -> None:
    out = tmp_path / "pq"
    result = run_cli(
        "analyze", trace_path(EP2), "-q", "--export-dir", out, "--export-format", "parquet"
    )
    assert result.code == 0, result.stderr
    for table in TABLES:
        parquet = pl.read_parquet(out / f"{table}.parquet")
        from_csv = pl.read_csv(exported / f"{table}.csv", schema=parquet.schema)
        assert parquet.equals(from_csv), table


def test_format_csv_prints_the_rank_table(ep2: Report) -> None:
    result = run_cli("analyze", trace_path(EP2), "-q", "-f", "csv")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [int(r["rank"]) for r in rows] == [0, 1]
    assert float(rows[1]["compute_frac"]) == pytest.approx(ep2.ranks[1]["metrics"]["compute_frac"])


HOSTILE = '=HYPERLINK("http://x"),a "quoted",\nname\x1b[31m'


def hostile_copy(folder: Path) -> Path:
    """Constructed: every kernel name and NVTX range of a small real export starts with a
    formula, commas, quotes, a newline and an escape sequence."""
    folder.mkdir(parents=True, exist_ok=True)
    export = copy_export(trace_path("h100_host_input_stall"), folder / "run.sqlite")
    with sqlite3.connect(export) as con:
        prefix_kernel_names(con, HOSTILE)
        con.execute("UPDATE NVTX_EVENTS SET text = ? || text WHERE text IS NOT NULL", (HOSTILE,))
    return export


def test_csv_and_trace_are_safe_for_hostile_names(tmp_path: Path) -> None:
    export = hostile_copy(tmp_path / "in")
    out, trace = tmp_path / "out", tmp_path / "trace.json"
    result = run_cli(
        "analyze", export, "-q", "--no-cache", "--step-range", r"batch \d+$",
        "--export-dir", out, "--export-trace", trace,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    raw = (out / "kernels.csv").read_text(encoding="utf-8")
    assert "\x1b" not in raw
    rows = read_csv(out / "kernels.csv")
    assert rows and all(len(r) == 12 for r in rows)  # commas and quotes did not split cells
    for row in rows:
        for key in ("name", "short_name"):
            assert row[key].startswith('\'=HYPERLINK("http://x"),a "quoted",\\nname\\x1b[31m')
            assert "\n" not in row[key]
    events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    names = [e["name"] for e in events if e.get("cat") in ("kernel", "nvtx")]
    assert names and all("\x1b" not in n and "\n" not in n for n in names)
    assert any(n.startswith('=HYPERLINK("http://x"),a "quoted",\\nname\\x1b[31m') for n in names)


# Perfetto ------------------------------------------------------------------------------------


def gpu_rows(path: Path, pid: int, window: tuple[int, int]) -> list[tuple[int, str]]:
    """(stream, table) of every kernel, memcpy and memset of ``pid`` overlapping the window."""
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    out = []
    for table in ("KERNEL", "MEMCPY", "MEMSET"):
        out += [
            (stream, table)
            for (stream,) in con.execute(
                f"SELECT streamId FROM CUPTI_ACTIVITY_KIND_{table} WHERE {GPU_PID} = ? "
                "AND start < ? AND end > ?",
                (pid, window[1], window[0]),
            )
        ]
    con.close()
    return out


def test_perfetto_trace_has_one_track_per_rank_and_stream(tmp_path: Path, ep2: Report) -> None:
    out = tmp_path / "trace.json"
    result = run_cli("analyze", trace_path(EP2), "-q", "--export-trace", out)
    assert result.code == 0, result.stderr
    # written atomically, no temporary left; two ranks: a file per rank for HTA beside it
    assert folder_listing(tmp_path) == [
        "trace.hta", "trace.hta/rank0.json", "trace.hta/rank1.json", "trace.json"
    ]  # fmt: skip
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert "distributedInfo" not in doc  # two ranks in one file: HTA reads trace.hta/
    events = doc["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} == {"M", "X", "s", "f"}  # no GPU metrics in this export
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert set(processes) == {0, 1}
    for rank in ep2.ranks:
        assert processes[rank["rank"]].startswith(f"rank {rank['rank']} · pid {rank['pid']} · ")
        lo, hi = rank["steps"]["window_ns"]
        expected = gpu_rows(trace_path(EP2), rank["pid"], (lo, hi))
        gpu = [e for e in complete if e["pid"] == rank["rank"] and "stream" in e["args"]]
        # one track per CUDA stream, named so, and every event of the window on it
        assert {e["tid"] for e in gpu} == {s for s, _t in expected}
        for stream in {s for s, _t in expected}:
            assert threads[(rank["rank"], stream)] == f"stream {stream}"
        assert sum(e["cat"] == "kernel" for e in gpu) == sum(t == "KERNEL" for _s, t in expected)
        assert len(gpu) == len(expected)
        assert all(lo / 1e3 - e["dur"] <= e["ts"] < hi / 1e3 for e in gpu)
        nvtx = [e for e in complete if e["pid"] == rank["rank"] and e["cat"] == "nvtx"]
        assert nvtx and all(
            threads[(e["pid"], e["tid"])].startswith("NVTX · thread ") for e in nvtx
        )
    for e in complete:
        assert (e["pid"], e["tid"]) in threads
        assert isinstance(e["ts"], float | int) and e["dur"] >= 0
    arrows = [e for e in events if e["ph"] == "s"]  # arrows of two ranks never join
    assert arrows and len({e["id"] for e in arrows}) == len(arrows)
    assert all(e["id"] >> 32 == e["pid"] for e in arrows)


def sql_rows(path: Path, query: str, *args) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        return con.execute(query, args).fetchall()
    finally:
        con.close()


def test_trace_export_has_the_fields_hta_reads(tmp_path: Path, ep2: Report) -> None:
    """What Holistic Trace Analysis needs (hta/common/trace_parser.py, trace_filter.py): GPU
    work with args.stream/correlation/device, the launching call with args.correlation, one
    rank per file named in distributedInfo; and launch -> kernel flow arrows. Each value is
    the export's own (sqlite3)."""
    out = tmp_path / "trace.json"
    assert run_cli("analyze", trace_path(EP2), "-q", "--export-trace", out).code == 0
    for rank in ep2.ranks:
        text = (tmp_path / "trace.hta" / f"rank{rank['rank']}.json").read_text(encoding="utf-8")
        # HTA finds the rank with the pattern '"rank":\s+(\d+)', before any event
        assert re.search(r'"rank":\s+(\d+)', text).group(1) == str(rank["rank"])
        doc = json.loads(text)
        assert doc["distributedInfo"] == {"rank": rank["rank"], "world_size": 2}
        events = doc["traceEvents"]
        lo, hi = rank["steps"]["window_ns"]
        expected = sql_rows(
            trace_path(EP2),
            f"SELECT start, streamId, correlationId, deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL "
            f"WHERE {GPU_PID} = ? AND start < ? AND end > ?",
            rank["pid"], hi, lo,
        )  # fmt: skip
        kernels = [e for e in events if e.get("cat") == "kernel"]
        assert sorted(
            (round(e["ts"] * 1e3), e["args"]["stream"], e["args"]["correlation"],
             e["args"]["device"]) for e in kernels
        ) == sorted(expected)  # fmt: skip
        assert {e["pid"] for e in events} == {rank["rank"]}
        # every GPU event's launching call is there, and an arrow joins the two
        gpu = [e for e in events if e["ph"] == "X" and "stream" in e["args"]]
        calls = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime"}
        launches = dict(sql_rows(
            trace_path(EP2),
            "SELECT correlationId, start FROM CUPTI_ACTIVITY_KIND_RUNTIME "
            "WHERE ((globalTid >> 24) & 16777215) = ?",
            rank["pid"],
        ))  # fmt: skip
        assert {e["args"]["correlation"] for e in gpu} == set(calls)
        assert all(round(c["ts"] * 1e3) == launches[k] for k, c in calls.items())
        starts = {e["id"]: e for e in events if e["ph"] == "s"}
        ends = {e["id"]: e for e in events if e["ph"] == "f"}
        assert set(starts) == set(ends) == set(calls)  # one id per correlation id
        for e in gpu:
            corr = e["args"]["correlation"]
            call, start, end = calls[corr], starts[corr], ends[corr]
            assert (start["tid"], start["ts"]) == (call["tid"], call["ts"])
            assert (end["tid"], end["bp"]) == (e["tid"], "e")
            assert end["ts"] == min(g["ts"] for g in gpu if g["args"]["correlation"] == corr)


def test_hta_reads_the_trace_export_and_agrees(tmp_path: Path, ep2: Report, monkeypatch) -> None:
    """HTA's own parser on the per-rank files: its GPU kernels, their launches and its idle
    time agree with the report (HTA rounds ns to µs unless told not to)."""
    pytest.importorskip("hta")
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    # HTA parses ranks in a pool it forks; a fork of this process, whose polars threads may
    # hold a lock at that moment, hung CI for an hour. Its own parser, in this process.
    load = Trace.load_traces
    monkeypatch.setattr(
        Trace, "load_traces", lambda t, *a, **k: load(t, *a, **k, use_multiprocessing=False)
    )
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("HTA forked this test process"))
    out = tmp_path / "trace.json"
    assert run_cli("analyze", trace_path(EP2), "-q", "--export-trace", out).code == 0
    analysis = TraceAnalysis(trace_dir=str(tmp_path / "trace.hta"))
    assert sorted(analysis.t.traces) == [0, 1]
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    for rank in ep2.ranks:
        lo, hi = rank["steps"]["window_ns"]
        df = analysis.t.get_trace(rank["rank"])
        kernel = analysis.t.symbol_table.sym_index["kernel"]
        kernels = df[(df["stream"] > 0) & (df["cat"] == kernel)]
        (count,) = sql_rows(
            trace_path(EP2),
            f"SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE {GPU_PID} = ? "
            "AND start < ? AND end > ?",
            rank["pid"], hi, lo,
        )[0]  # fmt: skip
        assert len(kernels) == count > 0
        assert (kernels["index_correlation"] > 0).all()  # each linked to its launching call
        # HTA spans the exported GPU work, first start to last end (work overlapping the
        # window, whole): its idle is the window's up to the edges the work spills over
        hull = [
            sql_rows(
                trace_path(EP2),
                f"SELECT min(start), max(end) FROM CUPTI_ACTIVITY_KIND_{table} "
                f"WHERE {GPU_PID} = ? AND start < ? AND end > ?",
                rank["pid"], hi, lo,
            )[0]
            for table in ("KERNEL", "MEMCPY", "MEMSET")
        ]  # fmt: skip
        first = min(a for a, _b in hull if a is not None)
        last = max(b for _a, b in hull if b is not None)
        row = breakdown.loc[rank["rank"]]
        assert row["kernel_time(us)"] == pytest.approx((last - first) / 1e3, abs=0.01)
        spill_us = (abs(first - lo) + abs(last - hi)) / 1e3
        idle_us = rank["metrics"]["gpu_idle_frac"] * (hi - lo) / 1e3
        rounding_us = 5e-7 * (hi - lo) / 1e3  # (metrics hold 6 decimals)
        assert row["idle_time(us)"] == pytest.approx(idle_us, abs=spill_us + rounding_us + 0.01)
        assert spill_us < 0.001 * (hi - lo) / 1e3


def test_trace_export_of_one_rank_with_gpu_metric_counters(tmp_path: Path) -> None:
    """One rank: one file, its rank in distributedInfo, no per-rank folder; GPU metrics as
    counter tracks, one sample per event, as the export holds them in the window."""
    export = trace_path("h100_comm_a2a_gpumetrics_trimmed")
    report = traceclf.analyze(export)
    out = tmp_path / "one.json"
    assert run_cli("analyze", export, "-q", "--export-trace", out).code == 0
    assert folder_listing(tmp_path) == ["one.json"]
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["distributedInfo"] == {"rank": 0, "world_size": 1}
    lo, hi = report.ranks[0]["steps"]["window_ns"]
    rows = sql_rows(
        export,
        "SELECT g.timestamp, n.metricName, g.value FROM GPU_METRICS g JOIN "
        "TARGET_INFO_GPU_METRICS n USING (typeId, metricId) WHERE g.timestamp BETWEEN ? AND ? "
        "AND n.metricName IN ('SMs Active [Throughput %]', 'SM Issue [Throughput %]', "
        "'Tensor Active [Throughput %]')",
        lo, hi,
    )  # fmt: skip
    labels = {"SMs Active [Throughput %]": "SM active %", "SM Issue [Throughput %]":
              "SM issue %", "Tensor Active [Throughput %]": "tensor active %"}  # fmt: skip
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert len(rows) > 100
    assert sorted((round(e["ts"] * 1e3), e["name"], e["args"]["value"]) for e in counters) == (
        sorted((t, labels[n], round(v, 2)) for t, n, v in rows)
    )
    assert {e["pid"] for e in counters} == {0}


def test_export_trace_never_overwrites_an_input(tmp_path: Path) -> None:
    export = copy_export(trace_path("h100_host_input_stall"), tmp_path / "run.sqlite")
    before = file_state(export)
    for target in (export, tmp_path / "." / "run.sqlite"):
        result = run_cli("analyze", export, "-q", "--export-trace", target)
        assert result.code == 2 and "output would overwrite input" in result.stderr
    assert file_state(export) == before
    result = run_cli("analyze", export, "-q", "-f", "json", "-o", tmp_path / "a.json",
                     "--export-trace", tmp_path / "a.json")  # fmt: skip
    assert result.code == 2 and not (tmp_path / "a.json").exists()


# Markdown figures, notebook ------------------------------------------------------------------


def test_markdown_writes_its_figures_beside_it(tmp_path: Path, ep2: Report) -> None:
    out = tmp_path / "ticket.md"
    result = run_cli("analyze", trace_path(EP2), "-q", "-f", "md", "-o", out)
    assert result.code == 0, result.stderr
    names = informative(ep2.series)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ticket.md", *(f"ticket.{n}.png" for n in names)]
    )
    text = out.read_text(encoding="utf-8")
    for name in names:
        assert f"](ticket.{name}.png)" in text
        assert (tmp_path / f"ticket.{name}.png").read_bytes().startswith(b"\x89PNG")
    stdout = run_cli("analyze", trace_path(EP2), "-q", "-f", "md").stdout
    assert ".png" not in stdout and "## Figures" not in stdout


def test_notebook_display(ep2: Report) -> None:
    html = ep2._repr_html_()
    style = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    selectors = [s.strip() for rule in re.findall(r"([^{}]+)\{", style) for s in rule.split(",")]
    assert selectors and all(s.startswith(".traceclf-report") for s in selectors)  # scoped
    assert "COMMUNICATION-bound" in html and "data:image/png;base64," in html
    assert not re.search(r"<script|<link|src=\"http", html)
    text = repr(ep2)
    assert "\n" not in text and len(text) < 200 and "communication-bound" in text
    trace = traceclf.open(trace_path(EP2))
    text = repr(trace)
    assert "\n" not in text and len(text) < 300
    assert f"{len(trace.kernels):,} kernels" in text and "2 ranks" in text


def test_to_pandas(ep2: Report) -> None:
    pytest.importorskip("pandas")
    ranks = ep2.to_pandas()
    assert list(ranks["rank"]) == [0, 1]
    assert ranks["step_time_ms"].tolist() == pytest.approx(
        [r["metrics"]["step_time_ms"] for r in ep2.ranks]
    )
    kernels = ep2.to_pandas("kernels")
    assert len(kernels) == sum(len(s["kernel_summary"]) for s in ep2.series)
    trace = traceclf.open(trace_path(EP2))
    assert trace.to_pandas("kernels").shape == trace.kernels.shape
    with pytest.raises(TraceError, match="no table 'nope'"):
        ep2.to_pandas("nope")


def test_several_runs_export_with_a_run_column(tmp_path: Path) -> None:
    a, b = trace_path("h100_host_input_stall"), trace_path("h100_host_cudagraph")
    out = tmp_path / "t"
    result = run_cli(
        "analyze", a, b, "--runs", "-q", "-f", "md", "-o", tmp_path / "r.md",
        "--export-dir", out, "--export-trace", tmp_path / "w.json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    runs = traceclf.analyze(a, b, grouping="runs")
    for table in TABLES:
        assert (out / f"{table}.csv").read_text().startswith("run,")
    ranks = read_csv(out / "ranks.csv")
    order = [Path(run.inputs[0]["path"]).name for run in runs.runs]
    assert order == [a.name, b.name]  # the order they were named in
    # each row names its run by its file, as the summary does
    assert [(r["run"], Path(r["file"]).name) for r in ranks] == [(n, n) for n in order]
    assert runs.summary["run"].to_list() == order
    pngs = sorted(p.name for p in tmp_path.glob("r.run*.png"))
    expected = [
        f"r.run{i}.{name}.png"
        for i, run in enumerate(runs.runs, 1)
        for name in informative(run.series)
    ]
    assert pngs == sorted(expected)
    events = json.loads((tmp_path / "w.json").read_text())["traceEvents"]
    names = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert [n.split(" · ")[0] for n in names] == ["run 1", "run 2"]
    assert len({e["pid"] for e in events}) == 2  # ranks numbered on across runs
