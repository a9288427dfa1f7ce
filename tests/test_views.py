"""Views tied to the timeline (issue 14, part B): the NVTX phase table, one representative step
per rank as lanes, memory over the capture, the slowest step and "open in nsys at t = …" in
every format, and figures only where they carry information. Numbers are checked against an
independent reading of the export with sqlite3 (tests/helpers/independent.py)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from helpers.independent import Window, covered, gpu_of, length, read_export, taxonomy
from realtraces import trace_path

import traceclf
from traceclf.figures import draw
from traceclf.render.html import render_html
from traceclf.render.markdown import render_markdown
from traceclf.render.terminal import render_terminal
from traceclf.report.contract import Report

PHASED = ("h100_memory_offload", "h100_host_launch_gpumetrics")  # forward/backward/optimizer


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    names = (*PHASED, "h100_comm_ep2", "h100_compute_dense_gpumetrics", "h100_host_cudagraph")
    return {name: traceclf.analyze(trace_path(name)) for name in names}


# independent: phases ---------------------------------------------------------------------------

PID = "((globalTid >> 24) & 16777215)"


def phase_spans(path: Path, pid: int) -> list[tuple[str, int, int]]:
    """(phase, gpu start, gpu end) per outermost forward/backward/optimizer NVTX range of the
    process: the first start and last end of the GPU work launched by CUDA calls made inside
    it (any thread), read with sqlite3."""
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    strings = dict(con.execute("SELECT id, value FROM StringIds"))
    patterns = taxonomy()["nvtx"]
    ranges = []
    for start, end, text, text_id in con.execute(
        f"SELECT start, end, text, textId FROM NVTX_EVENTS WHERE end IS NOT NULL "
        f"AND eventType IN (59, 60) AND {PID} = ?",
        (pid,),
    ):
        text = text or strings.get(text_id, "")
        phase = next(
            (p for p in ("forward", "backward", "optimizer") if patterns[p].search(text)), None
        )
        if phase:
            ranges.append((start, end, phase))
    outer, reach = [], -1
    for start, end, phase in sorted(ranges):
        if start >= reach:
            outer.append((start, end, phase))
        reach = max(reach, end)
    calls = sorted(
        con.execute(
            f"SELECT start, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE {PID} = ?", (pid,)
        )
    )
    work: dict[int, list[tuple[int, int]]] = {}
    gpu_pid = PID.replace("globalTid", "globalPid")
    for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                  "CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"):  # fmt: skip
        if table in tables:
            for start, end, corr in con.execute(
                f"SELECT start, end, correlationId FROM {table} WHERE {gpu_pid} = ?", (pid,)
            ):
                work.setdefault(corr, []).append((start, end))
    con.close()
    starts = np.array([c[0] for c in calls])
    out = []
    for start, end, phase in outer:
        inside = [
            c
            for _t, c in calls[
                np.searchsorted(starts, start) : np.searchsorted(starts, end, "right")
            ]
        ]
        spans = [iv for c in inside for iv in work.get(c, [])]
        if spans:
            out.append((phase, min(s for s, _ in spans), max(e for _, e in spans)))
    return out


def independent_phases(path: Path, pid: int, window: tuple[int, int], steps: int) -> dict:
    """ms per step of each phase and of compute within it, with later phases starting where
    the earlier ones ended (the phases partition the window)."""
    lo, hi = window
    spans = sorted(
        (max(s, lo), min(e, hi), p) for p, s, e in phase_spans(path, pid) if s < hi and e > lo
    )
    parts, reach = [], lo
    for s, e, p in spans:
        s = max(s, reach)
        if e > s:
            parts.append((p, s, e))
        reach = max(reach, e)
    ex = read_export(path)
    mine = {t: [r for r in rows if r.get("pid") == pid] for t, rows in ex.items()}
    w = Window(mine, lo, hi, hi - lo, steps, gpu_of(path, pid))
    compute = covered(
        w.compute, np.array([s for _, s, _ in parts]), np.array([e for *_, e in parts])
    )
    out: dict[str, dict] = {}
    for (p, s, e), c in zip(parts, compute, strict=True):
        row = out.setdefault(p, {"time": 0, "compute": 0})
        row["time"] += e - s
        row["compute"] += int(c)
    return {p: {k: v / 1e6 / steps for k, v in row.items()} for p, row in out.items()}


@pytest.mark.parametrize("name", PHASED)
def test_phase_table_matches_an_independent_projection(name: str, reports) -> None:
    report = reports[name]
    rank = report.ranks[0]
    window, steps = tuple(rank["steps"]["window_ns"]), rank["steps"]["used"]
    expected = independent_phases(trace_path(name), rank["pid"], window, steps)
    got = {p["phase"]: p for p in rank["phases"]}
    assert set(expected) == {"forward", "backward", "optimizer"} <= set(got)
    for phase, row in expected.items():
        assert got[phase]["ms_per_step"] == pytest.approx(row["time"], rel=1e-3, abs=2e-4)
        assert got[phase]["compute_ms"] == pytest.approx(row["compute"], rel=1e-3, abs=2e-4)
        assert got[phase]["steps"] == steps


@pytest.mark.parametrize("name", PHASED)
def test_a_phase_spread_from_step_to_step_matches_an_independent_projection(
    name: str, reports
) -> None:
    """sd_ms: the sample standard deviation of a phase's time per steady step (what compare
    judges a phase's change against), from the same projection, each part in the step its
    start falls in."""
    rank = reports[name].ranks[0]
    steps = rank["steps"]
    lo, hi = steps["window_ns"]
    durations = [
        ms for ms, steady in zip(steps["durations_ms"], steps["steady"], strict=True) if steady
    ]
    bounds = lo + np.concatenate([[0], np.cumsum(np.array(durations) * 1e6)])
    spans = sorted(
        (max(s, lo), min(e, hi), p)
        for p, s, e in phase_spans(trace_path(name), rank["pid"])
        if s < hi and e > lo
    )
    per_step: dict[str, np.ndarray] = {}
    reach = lo
    for s, e, p in spans:
        s = max(s, reach)
        if e > s:
            step = int(np.searchsorted(bounds, s, side="right")) - 1
            per_step.setdefault(p, np.zeros(len(durations)))[step] += e - s
        reach = max(reach, e)
    got = {p["phase"]: p for p in rank["phases"]}
    for phase, times in per_step.items():
        assert got[phase]["sd_ms"] == pytest.approx(times.std(ddof=1) / 1e6, rel=1e-3, abs=2e-4)


@pytest.mark.parametrize("name", PHASED)
def test_phases_add_up_to_the_step(name: str, reports) -> None:
    rank = reports[name].ranks[0]
    step_ms = rank["metrics"]["step_time_ms"]
    rows = rank["phases"]
    assert sum(p["ms_per_step"] for p in rows) == pytest.approx(step_ms, rel=1e-3)
    for p in rows:
        assert p["busy_ms"] + p["idle_ms"] == pytest.approx(p["ms_per_step"], abs=1e-3)
        assert sum(p["idle_by_cause_ms"].values()) == pytest.approx(p["idle_ms"], abs=1e-3)
    # the host-bound run idles in its phases, the memory-bound one copies in them
    forward = next(p for p in rows if p["phase"] == "forward")
    if name == "h100_host_launch_gpumetrics":
        assert forward["idle_by_cause_ms"]["launch"] > 0.5 * forward["ms_per_step"]
    else:
        assert forward["copy_ms"] > 0.5 * forward["ms_per_step"]


def test_no_phase_table_without_phase_ranges(reports) -> None:
    report = reports["h100_comm_ep2"]  # NVTX Iteration / moe_dispatch / experts only
    assert all(r["phases"] == [] for r in report.ranks)
    assert "NVTX phases" not in render_markdown(report)


# lanes, memory, slowest step -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ("h100_comm_ep2", "h100_memory_offload", "h100_host_launch_gpumetrics")
)
def test_lanes_show_the_median_step_as_the_gpu_ran_it(name: str, reports) -> None:
    report = reports[name]
    for s, rank in zip(report.series, report.ranks, strict=True):
        view = s["step_lanes"]
        durations = [
            d
            for d, steady in zip(
                rank["steps"]["durations_ms"], rank["steps"]["steady"], strict=True
            )
            if steady
        ]
        median = float(np.median(durations))
        assert (
            abs((view["end_ns"] - view["start_ns"]) / 1e6 - median)
            <= min(abs(d - median) for d in durations) + 1e-3
        )
        ex = read_export(trace_path(name))
        mine = {t: [r for r in rows if r.get("pid") == rank["pid"]] for t, rows in ex.items()}
        w = Window(mine, view["start_ns"], view["end_ns"], 1, 1, None)
        for lane, intervals in (
            ("compute", w.compute),
            ("communication", w.comm),
            ("copies", w.copies),
        ):
            busy = sum(b for _s, _e, b in view["lanes"][lane])
            assert busy == length(intervals), lane  # merged stretches keep the real coverage


def test_memory_series_peaks_where_the_measure_does(reports) -> None:
    report = reports["h100_memory_offload"]
    memory = report.series[0]["memory"]
    assert max(v for _t, v in memory["points"]) == report.ranks[0]["metrics"]["peak_memory_bytes"]
    # (the device's own memory: pinned and pageable host buffers are not on the GPU)
    events = [e for e in read_export(trace_path("h100_memory_offload"))["memory"] if not e["host"]]
    level = np.cumsum([e["bytes"] if e["op"] == 0 else -e["bytes"] for e in events])
    assert max(v for _t, v in memory["points"]) == int(level.max())
    assert memory["events"] == len(events)


def test_slowest_step_is_the_longest_steady_step(reports) -> None:
    for report in reports.values():
        worst = report.steps["worst"]
        steady = [
            (d, r["rank"])
            for r in report.ranks
            for d, ok in zip(r["steps"]["durations_ms"], r["steps"]["steady"], strict=True)
            if ok
        ]
        assert worst["ms"] == pytest.approx(max(steady)[0], abs=1e-3)
        assert (worst["end_ns"] - worst["start_ns"]) / 1e6 == pytest.approx(worst["ms"], abs=1e-3)


def test_every_format_says_where_to_open_nsys(reports) -> None:
    report = reports["h100_memory_offload"]
    lo, hi = report.steps["window_ns"]
    worst = report.steps["worst"]
    window = f"t = {lo / 1e9:.3f}–{hi / 1e9:.3f} s"
    slowest = f"t = {worst['start_ns'] / 1e9:.3f}–{worst['end_ns'] / 1e9:.3f} s"
    for text in (
        render_terminal(report, to_string=True, width=200),
        render_markdown(report),
        render_html(report),
    ):
        assert f"open in nsys at {window}" in " ".join(text.split())
        assert f"open in nsys at {slowest}" in " ".join(text.split())


# figures only where informative ----------------------------------------------------------------


def _idle_share(report: Report) -> float:
    return float(np.mean([r["metrics"]["gpu_idle_frac"] for r in report.ranks]))


def test_figures_only_where_they_carry_information(reports) -> None:
    shown = {name: draw.informative(r.series) for name, r in reports.items()}
    # the GPU idles 0.3% of the step: no idle-gap histogram
    for name in ("h100_comm_ep2", "h100_compute_dense_gpumetrics", "h100_host_cudagraph"):
        assert _idle_share(reports[name]) < draw.MIN_IDLE_SHARE
        assert "idle_gaps" not in shown[name], name
    for name in PHASED:
        assert _idle_share(reports[name]) >= draw.MIN_IDLE_SHARE
        assert "idle_gaps" in shown[name], name
    # communication only where there is some
    assert "comm_overlap" in shown["h100_comm_ep2"]
    assert "comm_overlap" not in shown["h100_compute_dense_gpumetrics"]
    # memory: near capacity on the memory-bound run; flat and small elsewhere
    assert "memory" in shown["h100_memory_offload"]
    assert reports["h100_comm_ep2"].series[0]["memory"]["points"]  # events exist ...
    assert "memory" not in shown["h100_comm_ep2"]  # ... but say nothing
    assert all("step_lanes" in s for s in shown.values())
    html = render_html(reports["h100_comm_ep2"])
    assert 'id="fig-idle_gaps"' not in html and 'id="fig-step_lanes"' in html


def test_lanes_and_memory_figures_are_labelled(reports) -> None:
    figures = draw.report_figures(reports["h100_memory_offload"].series)
    lanes, memory = figures["step_lanes"], figures["memory"]
    labels = [t.get_text() for t in lanes.axes[0].get_yticklabels()]
    assert labels == ["compute", "communication", "copies", "forward", "backward", "optimizer"]
    assert re.search(r"\(ms\)", lanes.axes[-1].get_xlabel())
    assert "(GB)" in memory.axes[0].get_ylabel()
    assert {"capacity", "steady state"} <= {t.get_text() for t in memory.legends[0].get_texts()}
