"""Idle gaps one by one (issue 28, item 7): each rank's longest gaps in the report
(``series[].longest_gaps``), in ``--export-dir``'s ``idle_gaps`` table (one row per gap, with
the time to open in nsys; the histogram is ``idle_gap_bins``) and in every format's timeline
rows, checked against gaps computed independently from sqlite3 reads of real exports."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import run_cli
from helpers.independent import merged, read_export
from realtraces import trace_path

import traceclf
from traceclf.measures.handoff import IDLE_CAUSES
from traceclf.measures.host import LONGEST_GAPS
from traceclf.render.terminal import render_terminal
from traceclf.report.contract import Report

NVFUSER = "nvfuser_matmul_test_h100"  # one rank: 313 ms of compile the verdict names
EP2 = "h100_comm_ep2"  # two ranks in one export, thousands of short gaps


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    return {name: traceclf.analyze(trace_path(name)) for name in (NVFUSER, EP2)}


def independent_gaps(path: Path, pid: int, window: tuple[int, int]) -> list[tuple[int, int]]:
    """(start, duration) of every stretch of the window with no kernel, graph replay, memcpy or
    memset of ``pid``: longest first, ties earliest first."""
    ex = read_export(path)
    lo, hi = window
    work = [
        (max(r["start"], lo), min(r["end"], hi))
        for table in ("kernels", "graphs", "memcpy", "memset")
        for r in ex[table]
        if r["pid"] == pid and r["start"] < hi and r["end"] > lo
    ]
    busy = merged(work)
    edges = np.concatenate([[lo], busy.ravel(), [hi]]).reshape(-1, 2)
    gaps = [(int(s), int(e - s)) for s, e in edges if e > s]
    return sorted(gaps, key=lambda g: (-g[1], g[0]))


@pytest.mark.parametrize("name", [NVFUSER, EP2])
def test_longest_gaps_are_the_exports_own(reports: dict[str, Report], name: str) -> None:
    report = reports[name]
    for rank, series in zip(report.ranks, report.series, strict=True):
        expected = independent_gaps(trace_path(name), rank["pid"], rank["steps"]["window_ns"])
        listed = series["longest_gaps"]
        assert len(listed) == min(len(expected), LONGEST_GAPS) > 0
        assert [(g["start_ns"], g["duration_ns"]) for g in listed] == expected[:LONGEST_GAPS]
        # the histogram still counts every gap
        hist = series["idle_gaps"]
        assert sum(sum(hist[c]) for c in IDLE_CAUSES) == len(expected)
        assert {g["cause"] for g in listed} <= set(IDLE_CAUSES)


def test_a_gap_names_the_nvtx_range_open_over_it(reports: dict[str, Report]) -> None:
    report = reports[NVFUSER]
    (rank,), (series,) = report.ranks, report.series
    top = series["longest_gaps"][0]
    mid = top["start_ns"] + top["duration_ns"] // 2
    steps = {report.steps["label"]}
    ranges = [
        r for r in read_export(trace_path(NVFUSER))["nvtx"]
        if r["pid"] == rank["pid"] and r["start"] <= mid < r["end"] and r["text"] not in steps
    ]  # fmt: skip
    innermost = max(ranges, key=lambda r: r["start"])["text"]
    assert top["nvtx"] == innermost == "executor_utils::Nvrtc::CompileProgram"
    assert top["cause"] == "host" and top["duration_ns"] == pytest.approx(351e6, rel=0.01)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_export_dir_writes_one_row_per_gap_and_the_bins(
    tmp_path: Path, reports: dict[str, Report]
) -> None:
    out = tmp_path / "tables"
    assert run_cli("analyze", trace_path(EP2), "-q", "--export-dir", out).code == 0
    report = reports[EP2]
    rows = read_csv(out / "idle_gaps.csv")
    assert list(rows[0]) == [
        "rank", "start_ns", "duration_ns", "cause", "nvtx", "open_in_nsys_s"
    ]  # fmt: skip
    for rank, series in zip(report.ranks, report.series, strict=True):
        mine = [r for r in rows if int(r["rank"]) == rank["rank"]]
        expected = independent_gaps(trace_path(EP2), rank["pid"], rank["steps"]["window_ns"])
        assert [(int(r["start_ns"]), int(r["duration_ns"])) for r in mine] == (
            expected[:LONGEST_GAPS]
        )
        for row in mine:
            assert float(row["open_in_nsys_s"]) == pytest.approx(int(row["start_ns"]) / 1e9)
        assert [r["cause"] for r in mine] == [g["cause"] for g in series["longest_gaps"]]
    bins = read_csv(out / "idle_gap_bins.csv")
    assert list(bins[0])[:4] == ["rank", "cause", "gap_min_ns", "gap_max_ns"]
    for rank in report.ranks:
        expected = independent_gaps(trace_path(EP2), rank["pid"], rank["steps"]["window_ns"])
        mine = [b for b in bins if int(b["rank"]) == rank["rank"]]
        assert sum(int(b["gaps"]) for b in mine) == len(expected)
        total_ms = sum(float(b["total_ms"]) for b in mine)
        assert total_ms == pytest.approx(sum(d for _s, d in expected) / 1e6)


@pytest.mark.parametrize("width", [80, 200])
def test_every_format_lists_the_longest_gaps_to_open_in_nsys(
    tmp_path: Path, reports: dict[str, Report], width: int
) -> None:
    report = reports[NVFUSER]
    terminal = " ".join(render_terminal(report, to_string=True, width=width).split())
    line = (
        "open in nsys at t = 1.377–1.728 s: 351 ms idle (cause: host), inside NVTX range "
        '"executor_utils::Nvrtc::CompileProgram"'
    )
    assert line in terminal
    assert terminal.count("Idle gap open in nsys at t = ") == 3
    md = run_cli("analyze", trace_path(NVFUSER), "-q", "-f", "md").stdout
    assert "| **Idle gap** | open in nsys at t = 1.377–1.728 s: 351 ms idle (cause: host)" in md
    html = tmp_path / "r.html"
    assert run_cli("analyze", trace_path(NVFUSER), "-q", "-f", "html", "-o", html).code == 0
    assert "<dt>Idle gap</dt><dd>open in nsys at t = 1.377–1.728 s: 351 ms idle" in (
        html.read_text(encoding="utf-8")
    )
