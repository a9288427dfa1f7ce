"""What `traceclf compare` says changed inside the step (issue 24), on real pairs: the eager
host-launch run against its CUDA-graph fix, the two EP traces, dense against low-occupancy
compute, and the Ulysses window against itself. The reconciliation (kernel deltas + idle delta
against the step change, and what is left) is recomputed here straight from the SQLite rows
with sqlite3 and numpy; only where the steady steps lie is taken from the report."""

from __future__ import annotations

import sqlite3
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from realtraces import trace_path

import traceclf
from traceclf.compare.regression import compare_reports
from traceclf.report.contract import Report

EAGER, GRAPH = "h100_host_launch_gpumetrics", "h100_host_cudagraph"
EP, EP_OVERLAP = "h100_comm_ep2", "h100_comm_ep2_overlap"
DENSE, LOW_OCC = "h100_compute_dense_gpumetrics", "h100_compute_low_occupancy"
ULYSSES = "ulysses_2gpu_forward_window"
PAIRS = [(EAGER, GRAPH), (EP, EP_OVERLAP), (DENSE, LOW_OCC), (ULYSSES, ULYSSES)]
GPU_WORK = (  # (table, whether its rows are kernels) as the export names them
    ("CUPTI_ACTIVITY_KIND_KERNEL", True),
    ("CUPTI_ACTIVITY_KIND_GRAPH_TRACE", True),  # a graph-level replay: one kernel row
    ("CUPTI_ACTIVITY_KIND_MEMCPY", False),
    ("CUPTI_ACTIVITY_KIND_MEMSET", False),
)


@cache
def report(name: str) -> Report:
    return traceclf.analyze(trace_path(name), use_cache=False)


@cache
def compared(before: str, after: str):
    return compare_reports(report(before), report(after), labels=(before, after))


# An independent account of one rank's steady step, from the export's rows -----------------


def work(path: Path, pid: int, table: str) -> np.ndarray:
    """(start, end) of one table's rows of the process, from the SQLite file itself."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        exists = con.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
        found = (
            con.execute(
                f"SELECT start, end FROM {table} WHERE ((globalPid >> 24) & 16777215) = ?", (pid,)
            ).fetchall()
            if exists
            else []
        )
    finally:
        con.close()
    return np.array(found, dtype=np.int64).reshape(-1, 2)


def kernel_names(path: Path, pid: int) -> list[tuple[str, int, int]]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(
            "SELECT s.value, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s"
            " ON s.id = k.demangledName WHERE ((k.globalPid >> 24) & 16777215) = ?",
            (pid,),
        ).fetchall()
    finally:
        con.close()


def union_length(iv: np.ndarray) -> int:
    """ns covered by intervals (start, end): a plain sweep, the clearest reference."""
    total, reach_start, reach_end = 0, None, None
    for s, e in iv[np.argsort(iv[:, 0], kind="stable")]:
        if reach_end is None or s > reach_end:
            total += 0 if reach_end is None else reach_end - reach_start
            reach_start, reach_end = s, e
        else:
            reach_end = max(reach_end, e)
    return int(total + (0 if reach_end is None else reach_end - reach_start))


def account(name: str) -> dict[str, float]:
    """Per step (ms), mean over ranks, from the export: the kernels' own time (graph-level
    replays count as kernels), the time any kernel runs, copies with no kernel running, idle;
    and the window per step, against the report's mean steady step."""
    path, rep = trace_path(name), report(name)
    sums: dict[str, float] = dict.fromkeys(("kernel", "kernel_busy", "copy", "idle", "window"), 0)
    for rank, series in zip(rep.ranks, rep.series, strict=True):
        starts = [row["step_start"] for row in series["step_breakdown"]]
        lo, hi = rank["steps"]["window_ns"]
        assert starts[0] == lo and rank["steps"]["analysed"] == rank["steps"]["used"]  # one span
        n = len(starts)
        parts = {t: np.clip(work(path, rank["pid"], t), lo, hi) for t, _ in GPU_WORK}
        parts = {t: iv[iv[:, 1] > iv[:, 0]] for t, iv in parts.items()}
        kernels = np.concatenate([parts[t] for t, is_kernel in GPU_WORK if is_kernel])
        everything = np.concatenate(list(parts.values()))
        kernel_busy, busy = union_length(kernels), union_length(everything)
        sums["kernel"] += (kernels[:, 1] - kernels[:, 0]).sum() / 1e6 / n
        sums["kernel_busy"] += kernel_busy / 1e6 / n
        sums["copy"] += (busy - kernel_busy) / 1e6 / n
        sums["idle"] += (hi - lo - busy) / 1e6 / n
        sums["window"] += (hi - lo) / 1e6 / n
    ranks = len(rep.ranks)
    return {k: v / ranks for k, v in sums.items()} | {"mean_step": rep.steps["mean_ms"]}


def per_kernel(name: str) -> dict[str, float]:
    """Each kernel's ms per steady step (by demangled name), mean over ranks."""
    path, rep = trace_path(name), report(name)
    out: dict[str, float] = {}
    for rank in rep.ranks:
        lo, hi = rank["steps"]["window_ns"]
        n = rank["steps"]["used"]
        for kernel, start, end in kernel_names(path, rank["pid"]):
            ns = min(end, hi) - max(start, lo)
            if ns > 0:
                out[kernel] = out.get(kernel, 0.0) + ns / 1e6 / n / len(rep.ranks)
    return out


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=lambda n: n.replace("h100_", ""))
def test_reconciliation_recomputed_from_the_sqlite_rows(before: str, after: str) -> None:
    b, a = account(before), account(after)
    r = compared(before, after).breakdown.reconciliation
    kernels, idle = a["kernel"] - b["kernel"], a["idle"] - b["idle"]
    step_change = a["mean_step"] - b["mean_step"]
    tol = 1e-4  # ms per step: the report rounds its times to the ns
    assert r.step_change_ms == pytest.approx(step_change, abs=tol)
    assert r.kernels_ms == pytest.approx(kernels, abs=tol)
    assert r.idle_ms == pytest.approx(idle, abs=tol)
    assert r.unexplained_ms == pytest.approx(step_change - kernels - idle, abs=tol)
    # what is left, term by term: kernels overlapping each other, copies alone, outlier steps
    overlap = -((a["kernel"] - a["kernel_busy"]) - (b["kernel"] - b["kernel_busy"]))
    outliers = (a["mean_step"] - a["window"]) - (b["mean_step"] - b["window"])
    assert r.overlap_ms == pytest.approx(overlap, abs=tol)
    assert r.copies_ms == pytest.approx(a["copy"] - b["copy"], abs=tol)
    assert r.outlier_steps_ms == pytest.approx(outliers, abs=tol)
    assert kernels + idle + overlap + (a["copy"] - b["copy"]) + outliers == pytest.approx(
        step_change, abs=tol
    )


@pytest.mark.parametrize(("before", "after"), [(EP, EP_OVERLAP), (EAGER, GRAPH)])
def test_each_kernel_recomputed_from_the_sqlite_rows(before: str, after: str) -> None:
    b, a = per_kernel(before), per_kernel(after)
    result = compared(before, after).breakdown
    assert result.kernels and result.other_kernels.before_ms_per_step == 0
    for k in result.kernels:
        if k.name.startswith("CUDA graph "):  # a graph-level replay, not a kernel row
            continue
        assert k.before_ms_per_step == pytest.approx(b.get(k.name, 0.0), abs=1e-5)
        assert k.after_ms_per_step == pytest.approx(a.get(k.name, 0.0), abs=1e-5)
        assert k.status == {(True, False): "removed", (False, True): "new"}.get(
            (k.name in b, k.name in a), k.status
        )


@pytest.mark.parametrize("name", [ULYSSES, EP])
def test_identical_inputs_flag_nothing(name: str) -> None:
    c = compared(name, name)
    b = c.breakdown
    assert c.verdict == "no significant change" and not c.moved
    assert b.kernels and {k.status for k in b.kernels} == {"same"}
    assert not any(k.material for k in b.kernels) and not b.launch_changes
    assert b.phases and not any(p.material for p in b.phases)
    assert {p.delta_ms_per_step for p in b.phases} == {0.0}
    assert not b.idle.material and not any(p.material for p in b.idle.by_cause.values())
    assert not any(p.material for p in b.communication.exposed_by_kind.values())
    assert not b.memory or not b.memory.material
    r = b.reconciliation
    assert (r.step_change_ms, r.kernels_ms, r.idle_ms, r.unexplained_ms) == (0, 0, 0, 0)


def test_eager_to_graph_kernels_move_into_the_replay_and_launch_idle_goes() -> None:
    c = compared(EAGER, GRAPH)
    b = c.breakdown
    assert c.verdict == "improvement"
    replay = next(k for k in b.kernels if k.name == "CUDA graph 1")
    assert replay.status == "new" and replay.material and b.kernels[0] is replay
    eager = [k for k in b.kernels if k.status == "removed"]
    assert len(eager) >= 60 and all(k.after_ms_per_step == 0 for k in eager)
    launch = b.idle.by_cause["launch"]
    assert launch.material and launch.delta_ms_per_step < -150  # ~171 ms -> 0 per step
    assert b.idle.delta_ms_per_step == pytest.approx(b.reconciliation.idle_ms)
    in_graphs = next(p for p in b.phases if p.phase == "in CUDA-graph replays")
    assert in_graphs.before_ms_per_step == 0 and in_graphs.after_ms_per_step > 4
    forward = next(p for p in b.phases if p.phase == "forward")  # the graph run has no NVTX phase
    assert forward.after_ms_per_step is None and forward.delta_ms_per_step is None


def test_ep_overlap_chunks_the_gemms_and_the_experts_phase_grows() -> None:
    b = compared(EP, EP_OVERLAP).breakdown
    # tokens split in 4 chunks: the expert GEMMs launch with smaller grids, 4x as often
    changed = {k.short_name: k for k in b.launch_changes}
    assert any(name.startswith("nvjet_") for name in changed)
    shapes = next(k for name, k in changed.items() if name.startswith("nvjet_"))
    assert {(g, t) for g, t, _ in shapes.before_shapes} != {
        (g, t) for g, t, _ in shapes.after_shapes
    }
    ranges = {p.phase: p for p in b.phases if p.kind == "range"}
    assert {"moe_dispatch", "moe_combine", "experts"} <= set(ranges)
    assert ranges["experts"].delta_ms_per_step > 1 and ranges["experts"].material
    a2a = b.communication.exposed_by_kind["all_to_all"]
    assert a2a.before_ms_per_step > 100 and a2a.after_ms_per_step > 100


def test_a_recurring_range_is_judged_against_its_own_step_to_step_spread() -> None:
    """ncclAlltoAll's span moves -3.2 ms per step, within the noise its spread gives (its
    SendRecv kernels' time varies 98-120 ms from step to step: the sample SD recomputed here
    from the export), so it is not material, as its kernel is not; the experts phase moves
    +1.4 ms on a spread of microseconds, and is."""
    rank = report(EP).ranks[0]
    steps = rank["steps"]
    lo, hi = steps["window_ns"]
    durations = [
        ms for ms, steady in zip(steps["durations_ms"], steps["steady"], strict=True) if steady
    ]
    bounds = lo + np.concatenate([[0], np.cumsum(np.array(durations) * 1e6)])
    with sqlite3.connect(trace_path(EP)) as con:
        rows = con.execute(
            "SELECT k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
            "ON s.id = k.shortName WHERE s.value LIKE 'ncclDevKernel_SendRecv%' "
            "AND (k.globalPid >> 24) & 16777215 = ? AND k.start >= ? AND k.start < ?",
            (rank["pid"], lo, hi),
        ).fetchall()
    start = np.array([a for a, _ in rows])
    step = np.searchsorted(bounds, start, side="right") - 1
    per_step = np.bincount(step, weights=[b - a for a, b in rows], minlength=len(durations))
    ranges = {r["name"]: r for r in rank["step_kernels"]["ranges"]}
    assert ranges["ncclAlltoAll"]["sd_ms"] == pytest.approx(per_step.std(ddof=1) / 1e6, rel=1e-5)
    phases = {p.phase: p for p in compared(EP, EP_OVERLAP).breakdown.phases if p.kind == "range"}
    alltoall, experts = phases["ncclAlltoAll"], phases["experts"]
    assert alltoall.delta_ms_per_step < -3 and not alltoall.material
    assert experts.delta_ms_per_step > 1 and experts.material


def test_dense_to_low_occupancy_gemms_removed_and_memory_drops() -> None:
    b = compared(DENSE, LOW_OCC).breakdown
    removed = [k for k in b.kernels if k.status == "removed" and k.material]
    assert removed and all(k.family == "gemm" for k in removed[:4])
    assert b.memory.material and b.memory.delta_bytes < -5e9  # 10.4 GB -> 0.4 GB peak


def test_kernel_spread_decides_the_status() -> None:
    """A kernel moved by less than its own step-to-step noise is 'same'; by more, slower or
    faster; material only past the share of the step in rules/scoring.yaml."""
    b = compared(EP, EP_OVERLAP).breakdown
    for k in b.kernels:
        if k.status in ("slower", "faster"):
            assert abs(k.delta_ms_per_step) > (k.noise_ms or 0)
        elif k.status == "same" and k.noise_ms is not None:
            assert abs(k.delta_ms_per_step) <= k.noise_ms
    send_recv = next(k for k in b.kernels if k.short_name == "ncclDevKernel_SendRecv")
    assert send_recv.noise_ms > 1  # ms: the all-to-all's time varies a lot from step to step
