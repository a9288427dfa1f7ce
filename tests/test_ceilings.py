"""Gain ceilings (issue 22, docs/judgement.md "Gain ceilings"): the formula and the rule that
never counts the same time twice, unit-tested on synthetic ceilings; each real ceiling a user
acts on recomputed independently from the SQLite rows (plain sqlite3, no traceclf code) over the
report's own window; the ceilings that cannot be bounded carry no multiplier; the one
confidence figure; the sync fix beside the bound on CloverLeaf; premises the capture
contradicts.

The independent values were first worked out in the issue's investigation
(/tmp/notes/issue22_recompute.py): input pipeline ×8.28 with 8 workers, grouped GEMM 2.20 ms
(×1.70) against 4.27 ms of real GEMM time, allocator 4.17 ms, fusion 4.07 / 4.24 ms per rank
on the Ulysses window and 0.44 ms on h100_comm_a2a, CloverLeaf's syncs 6.3% of the window.
"""

from __future__ import annotations

import bisect
import math
import sqlite3
from functools import cache
from pathlib import Path

import pytest
from realtraces import trace_path

import traceclf
from traceclf.judge import ceiling as ceil
from traceclf.judge.engine import evaluate
from traceclf.render.html import render_html
from traceclf.render.markdown import render_markdown
from traceclf.render.terminal import render_terminal
from traceclf.report.contract import Report
from traceclf.rulebook.entries import parse_fix

# ---------------------------------------------------------------------------------------------
# The formula, on synthetic fixes

NAMES = frozenset({"step_time_ms", "a", "b", "workers", "busy"})


def fix(recovers: dict, fix_id: str = "x") -> object:
    raw = {"id": fix_id, "wall": "host", "title": "t", "why": "w", "config": "c"}
    return parse_fix(raw | {"recovers": recovers}, Path("synthetic.yaml"), 0, NAMES)


def test_ceiling_per_step_states_assumption_and_bound():
    f = fix({"from": "x/y", "frac": "a", "assumes": "a is {a:.0%}", "bound_by": ["a", "b"]})
    c = ceil.ceiling(f, {"step_time_ms": 100.0, "a": 0.25, "b": None})
    assert c["recoverable_ms"] == 25.0
    assert c["throughput_gain"] == pytest.approx(100 / 75 - 1, abs=1e-4)
    assert c["unit"] == "step" and c["step_after_ms"] == 75.0 and c["floor_ms"] is None
    assert c["assumes"] == "a is 25%"
    assert c["bound_by"] == {"a": 0.25}  # a null value bounds nothing
    # clamped to the step; the whole step is no finite ceiling
    whole = ceil.ceiling(f, {"step_time_ms": 100.0, "a": 1.7})
    assert whole["recoverable_ms"] == 100.0 and whole["throughput_gain"] is None
    assert ceil.ceiling(f, {"step_time_ms": 100.0, "a": None})["recoverable_ms"] is None


def test_a_lone_fix_and_the_combined_ceiling_agree_on_a_short_step():
    """A 0.0525 ms step of which the fix wins back 73% (0.03833 ms: an OpenACC loop nobody
    here wrote, its numbers): the combined ceiling of that one fix gives the fix's own
    throughput (×3.7), where summing its ms rounded to 0.038 gave ×3.63 beside it."""
    f = fix({"from": "x/y", "frac": "a", "assumes": "-", "bound_by": ["a"]})
    c = ceil.ceiling(f, {"step_time_ms": 0.0525, "a": 0.73})
    together = ceil.combined([{"id": "x", "ceiling": c}], 0.0525)
    assert c["throughput_gain"] == pytest.approx(0.0525 / (0.0525 * 0.27) - 1, abs=2e-3)
    assert together["throughput_gain"] == pytest.approx(c["throughput_gain"], abs=2e-3)
    assert together["recoverable_ms"] == c["recoverable_ms"] == 0.03832


def test_floor_binds_the_step_after_the_fix():
    """The input pipeline of h100_host_input_stall by hand: T 371.0 ms, 358.6 ms of it idle
    waiting for input, 8 workers: the step is no shorter than 358.6 / 8 = 44.8 ms."""
    f = fix(
        {
            "from": "compute-absent/launch-starved",
            "frac": "a",
            "floor_ms": "a * step_time_ms / workers",
            "assumes": "parallel",
        }
    )
    c = ceil.ceiling(f, {"step_time_ms": 371.0, "a": 358.6 / 371.0, "workers": 8})
    assert c["floor_ms"] == pytest.approx(44.825) and c["step_after_ms"] == pytest.approx(44.825)
    assert c["recoverable_ms"] == pytest.approx(371.0 - 44.825, abs=1e-3)
    assert 1 + c["throughput_gain"] == pytest.approx(371.0 / 44.825, rel=1e-4)  # ×8.28
    # a floor above what is left: the floor does not grow R
    loose = ceil.ceiling(f, {"step_time_ms": 371.0, "a": 0.1, "workers": 8})
    assert loose["recoverable_ms"] == pytest.approx(37.1)


def test_no_multiplier_where_nothing_bounds_it():
    f = fix({"from": "c", "frac": "a", "multiplier": False, "assumes": "no bytes"})
    c = ceil.ceiling(f, {"step_time_ms": 115.0, "a": 0.975})
    assert c["recoverable_ms"] == pytest.approx(112.125) and c["throughput_gain"] is None


def test_samples_and_gpus_are_their_own_units():
    micro = fix(
        {
            "from": "compute-absent/launch-starved",
            "unit": "sample",
            "gain": "min(2, 1 / busy)",
            "floor_ms": "max(step_time_ms, 2 * busy * step_time_ms)",
            "assumes": "twice the batch",
        }
    )
    launch_bound = ceil.ceiling(micro, {"step_time_ms": 200.0, "busy": 0.125})
    assert launch_bound["recoverable_ms"] is None  # the step does not get shorter
    assert launch_bound["throughput_gain"] == pytest.approx(1.0)  # ×2 samples per second
    assert launch_bound["step_after_ms"] == 200.0
    busy = ceil.ceiling(micro, {"step_time_ms": 200.0, "busy": 0.8})
    assert busy["throughput_gain"] == pytest.approx(1 / 0.8 - 1) and busy["step_after_ms"] == 320
    pp = fix(
        {"from": "x", "unit": "gpu", "frac": "a", "gain": "1 / (1 - a) / 2", "assumes": "2x GPUs"}
    )
    c = ceil.ceiling(pp, {"step_time_ms": 203.9, "a": 105.0 / 203.9})
    assert c["recoverable_ms"] == pytest.approx(105.0)
    assert c["throughput_gain"] == pytest.approx(203.9 / 98.9 / 2 - 1, abs=1e-4)  # +3.1% per GPU


@pytest.mark.parametrize(
    ("missing", "recovers"),
    [
        ("assumes", {"from": "x", "frac": "a"}),
        ("gain", {"from": "x", "unit": "sample", "assumes": "s"}),
        ("frac", {"from": "x", "unit": "gpu", "gain": "2", "assumes": "s"}),
    ],
)
def test_every_ceiling_states_its_assumption_and_what_its_unit_needs(missing, recovers):
    from traceclf.support.errors import TraceError

    with pytest.raises(TraceError, match=f"missing '{missing}'"):
        fix(recovers)


def block(fix_id: str, ms: float | None, classes: str, **more) -> dict:
    c = {"recoverable_ms": ms, "throughput_gain": 0.1, "unit": "step", "from": classes}
    return {"id": fix_id, "ceiling": c | {"floor_ms": None} | more}


def test_combined_never_counts_the_same_time_twice():
    fixes = [
        block("deepep", 112.0, "compute-absent/blocking/comm"),
        block("ep-overlap", 2.4, "compute-absent/blocking/comm"),
        block("syncs", 4.0, "compute-absent/launch-starved + compute-absent/blocking/host-sync"),
        block("graphs", 10.0, "compute-absent/launch-starved"),
        block("absent", 50.0, "compute-absent"),  # nests over every compute-absent class
        block("fusion", 1.0, "compute-busy/elementwise"),
        block("micro", None, "compute-absent/launch-starved", unit="sample"),
        block("pp", 200.0, "compute-absent/blocking/copy", unit="gpu"),
    ]
    together = ceil.combined(fixes, 200.0)
    # largest first: per class the largest only (ep-overlap out), nested classes not added
    # (compute-absent holds blocking/comm, taken), a fix of several classes one block (syncs
    # shares launch-starved with graphs, taken); samples and GPUs never added
    assert together["fixes"] == ["deepep", "graphs", "fusion"]
    assert together["recoverable_ms"] == pytest.approx(123.0)
    assert together["from"] == [
        "compute-absent/blocking/comm",
        "compute-absent/launch-starved",
        "compute-busy/elementwise",
    ]
    ceil.mark_shared(fixes)
    shares = {f["id"]: f["ceiling"]["shares_with"] for f in fixes}
    assert shares["ep-overlap"] == ["deepep", "absent"]
    assert set(shares["graphs"]) == {"syncs", "absent", "micro"}
    assert shares["fusion"] == []


def test_combined_floor_and_missing_multiplier():
    fixes = [
        block("input", 326.2, "compute-absent/launch-starved", floor_ms=44.8),
        block("pinned", 8.9, "compute-absent/blocking/copy"),
    ]
    together = ceil.combined(fixes, 371.0)
    # 371 - 326.2 - 8.9 = 35.9 ms would beat the workers: the floor binds
    assert together["recoverable_ms"] == pytest.approx(371.0 - 44.8)
    assert together["floor_ms"] == 44.8
    fixes[1]["ceiling"]["throughput_gain"] = None  # nothing bounds it: "up to", no ×
    assert ceil.combined(fixes, 371.0)["throughput_gain"] is None
    assert ceil.combined([], 371.0)["recoverable_ms"] is None


# ---------------------------------------------------------------------------------------------
# Real traces: each ceiling against an independent computation from the SQLite rows


@cache
def report(name: str) -> Report:
    return traceclf.analyze(trace_path(name))


def ceiling_of(r: Report, fix_id: str) -> dict:
    return next(f for f in r.fixes if f["id"] == fix_id)["ceiling"]


def connect(name: str) -> sqlite3.Connection:
    con = sqlite3.connect(f"file:{trace_path(name)}?mode=ro", uri=True)
    con.text_factory = lambda b: b.decode("utf-8", "replace")
    return con


def merged(rows) -> list[list[int]]:
    out: list[list[int]] = []
    for s, e in sorted(rows):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def gpu_work(con: sqlite3.Connection, pid: int | None = None) -> list[list[int]]:
    tables = {t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    kinds = [t for t in ("KERNEL", "MEMCPY", "MEMSET") if f"CUPTI_ACTIVITY_KIND_{t}" in tables]
    where = f" WHERE globalPid / 16777216 % 16777216 = {pid}" if pid is not None else ""
    sql = " UNION ALL ".join(
        f"SELECT start, end FROM CUPTI_ACTIVITY_KIND_{t}{where}" for t in kinds
    )
    return merged(con.execute(sql).fetchall())


def idle_gaps(work: list[list[int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """GPU idle stretches inside [lo, hi)."""
    gaps, reach = [], lo
    for s, e in work:
        if e <= lo:
            continue
        if s >= hi:
            break
        if s > reach:
            gaps.append((reach, s))
        reach = max(reach, e)
    if reach < hi:
        gaps.append((reach, hi))
    return gaps


def calls(con: sqlite3.Connection, like: tuple[str, ...]) -> list[tuple[int, int]]:
    cond = " OR ".join("s.value LIKE ?" for _ in like)
    return con.execute(
        "SELECT r.start, r.end FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s "
        f"ON s.id = r.nameId WHERE {cond}",
        like,
    ).fetchall()


def window(r: Report, rank: int = 0) -> tuple[int, int, int]:
    steps = r.ranks[rank]["steps"]
    lo, hi = steps["window_ns"]
    return lo, hi, steps["analysed"]


def test_input_pipeline_is_bounded_by_the_workers():
    """h100_host_input_stall: the host preprocesses each batch (~359 ms) while the GPU waits.
    With the suggested 8 workers that work still takes 1/8 of it per step: ×8.28, not ×30.
    Independent: idle gaps >= 1 ms that end where a host->device copy of >= 1 MiB starts."""
    r = report("h100_host_input_stall")
    lo, hi, n = window(r)
    con = connect("h100_host_input_stall")
    work = gpu_work(con)
    batch = {
        s
        for (s,) in con.execute(
            "SELECT start FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE copyKind = 1 AND bytes >= 1048576"
        )
    }
    host_work = sum(e - s for s, e in idle_gaps(work, lo, hi) if e - s >= 1e6 and e in batch)
    step, per_batch = (hi - lo) / n / 1e6, host_work / n / 1e6
    after = max(step - per_batch, per_batch / 8)
    c = ceiling_of(r, "input-pipeline")
    assert c["recoverable_ms"] == pytest.approx(step - after, rel=0.01)
    assert 1 + c["throughput_gain"] == pytest.approx(step / after, rel=0.01)
    assert 8.1 < 1 + c["throughput_gain"] < 8.5
    assert c["floor_ms"] == pytest.approx(per_batch / 8, rel=0.01)
    assert c["bound_by"]["input_workers"] == 8 and "8 worker processes" in c["assumes"]
    # all fixes together cannot beat the workers either
    together = r.combined_ceiling
    assert 1 + together["throughput_gain"] == pytest.approx(step / after, rel=0.01)


@pytest.mark.parametrize(
    ("name", "binds"), [("h100_host_input_stall", True), ("h100_nccl_groups", False)]
)
def test_a_floor_is_said_beside_the_ceiling_only_where_it_binds(name: str, binds: bool):
    """The input pipeline's floor is its host work per step spread over the workers. On
    input_stall that is what the ceiling stops at (44.8 ms, the step without it 35.9 ms); on
    nccl_groups it is 0.29 ms beside a step the fixes leave at ~21 ms, which says nothing
    there: the ceiling lines name it only where it binds, the assumption always states it.
    Independent: the step after the fixes against the floor, from the report's own numbers."""
    r = report(name)
    c, together = ceiling_of(r, "input-pipeline"), r.combined_ceiling
    step = r.metrics["step_time_ms"]
    assert (step - c["recoverable_ms"] <= c["floor_ms"] + 1e-3) is binds
    assert (step - together["recoverable_ms"] <= together["floor_ms"] + 1e-3) is binds
    floor = f"no shorter than {c['floor_ms']:.3g}"
    assert floor in c["assumes"].replace("less", "shorter")  # (the same number, in the rule)
    for text in (render_markdown(r), render_terminal(r, to_string=True, width=1000)):
        said = " ".join(text.split())
        assert (f"the step {floor} ms" in said) is binds, name


def test_allocator_cache_is_bounded_by_the_allocator_idle():
    """h100_memory_offload: keep-allocator-cache wins back the GPU idle while cudaMalloc/cudaFree
    run (4.5 ms per step over complete steps), not every host stall (10.5 ms)."""
    r = report("h100_memory_offload")
    lo, hi, n = window(r)
    con = connect("h100_memory_offload")
    gaps = idle_gaps(gpu_work(con), lo, hi)
    alloc = merged(
        (max(s, lo), min(e, hi))
        for s, e in calls(con, ("cudaMalloc%", "cudaFree%"))
        if e > lo and s < hi
    )
    idle_in_alloc = sum(
        max(0, min(b, y) - max(a, x)) for a, b in gaps for x, y in alloc if x < b and y > a
    )
    c = ceiling_of(r, "keep-allocator-cache")
    assert c["recoverable_ms"] == pytest.approx(idle_in_alloc / n / 1e6, rel=0.01)
    assert 4.0 < c["recoverable_ms"] < 4.7  # 4.5 ms over complete steps
    assert c["bound_by"]["alloc_idle_frac"] == pytest.approx(r.metrics["alloc_idle_frac"], abs=1e-4)


def test_host_attribution_counts_the_calls_in_the_idle_gaps_and_says_so():
    """h100_memory_offload: host attribution's allocator row counts the cudaMalloc/cudaFree
    calls that overlap the GPU's idle gaps (102 of the window's 182), and its evidence said
    "102 calls in 8 steps", read as all of them beside the fix's 23 a step. Independent: the
    calls overlapping an idle gap of the report's window."""
    from traceclf.render.hostlines import counted_over, evidence

    r = report("h100_memory_offload")
    lo, hi, n = window(r)
    con = connect("h100_memory_offload")
    gaps = idle_gaps(gpu_work(con), lo, hi)
    alloc = [(s, e) for s, e in calls(con, ("cudaMalloc%", "cudaFree%")) if e > lo and s < hi]
    starts = [a for a, _ in gaps]
    touching = 0
    for s, e in alloc:
        i = bisect.bisect_right(starts, e) - 1  # the last gap starting before the call ends
        touching += i >= 0 and gaps[i][1] > s
    row = next(x for x in r.host_attribution if x["what"] == "allocator")
    assert row["detail"]["calls"] == touching < len(alloc)
    said = evidence(row, counted_over(r), len(r.ranks))
    assert said.startswith(f"{touching} calls in idle gaps in {n} steps")


def test_grouped_gemm_is_bounded_by_real_gemm_time():
    """h100_compute_low_occupancy (graph-level CUDA graphs): the replay records 1024 GEMM
    launches of 64 blocks on 132 SMs, 4.175 µs each in the eager warm-up: 4.27 ms of real GEMM
    time per replay, of which a grouped GEMM filling every SM wins back 1 - 64/132."""
    r = report("h100_compute_low_occupancy")
    con = connect("h100_compute_low_occupancy")
    begin, end = (
        con.execute(
            "SELECT min(r.start) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s "
            f"ON s.id = r.nameId WHERE s.value LIKE '{name}%'"
        ).fetchone()[0]
        for name in ("cudaStreamBeginCapture", "cudaStreamEndCapture")
    )
    recorded = con.execute(
        "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
        "WHERE r.start BETWEEN ? AND ? AND s.value LIKE 'cuLaunchKernelEx%'",
        (begin, end),
    ).fetchone()[0]
    eager = con.execute(
        "SELECT k.end - k.start, k.gridX * k.gridY * k.gridZ FROM CUPTI_ACTIVITY_KIND_KERNEL k "
        "JOIN StringIds s ON s.id = k.demangledName WHERE s.value LIKE '%gemm%' "
        "OR s.value LIKE '%nvjet%' OR s.value LIKE '%cutlass%'"
    ).fetchall()
    sms = con.execute("SELECT smCount FROM TARGET_INFO_GPU").fetchone()[0]
    gemm_ms = recorded * sum(d for d, _ in eager) / len(eager) / 1e6
    fill = sum(d * min(1, g / sms) for d, g in eager) / sum(d for d, _ in eager)
    c = ceiling_of(r, "grouped-gemm")
    assert c["recoverable_ms"] <= gemm_ms  # never more than the GEMMs themselves take
    assert c["recoverable_ms"] == pytest.approx(gemm_ms * (1 - fill), rel=0.03)  # 2.20 ms
    step = r.metrics["step_time_ms"]
    assert 1 + c["throughput_gain"] == pytest.approx(step / (step - gemm_ms * (1 - fill)), rel=0.03)


CHAIN = ("elementwise", "reduction")


@cache
def families():
    """rules/kernels.yaml's kernel families, in order (first match wins)."""
    import re

    import yaml

    doc = yaml.safe_load((Path(__file__).parents[1] / "rules" / "kernels.yaml").read_text())
    return [(e["family"], re.compile(e["match"])) for e in doc["taxonomy"]["families"]]


def family(name: str) -> str:
    return next((f for f, p in families() if p.search(name)), "other")


def chain_ms(name: str, pid: int, lo: int, hi: int, n: int) -> float:
    """Per stream, runs of >= 2 consecutive elementwise/normalisation kernels: sum - max."""
    con = connect(name)
    rows = con.execute(
        "SELECT k.streamId, k.start, k.end, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
        "JOIN StringIds s ON s.id = k.demangledName "
        "WHERE k.globalPid / 16777216 % 16777216 = ? AND k.start >= ? AND k.end <= ? "
        "ORDER BY k.streamId, k.start",
        (pid, lo, hi),
    ).fetchall()
    removable, run, stream = 0, [], None
    for sid, s, e, kernel in [*rows, (None, 0, 0, "end")]:
        if sid == stream and family(kernel) in CHAIN:
            run.append(e - s)
            continue
        removable += sum(run) - max(run) if len(run) > 1 else 0
        run, stream = ([e - s] if family(kernel) in CHAIN else []), sid
    return removable / n / 1e6


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("ulysses_2gpu_forward_window", 3.9, 4.4), ("h100_comm_a2a_gpumetrics", 0.4, 0.5)],
)
def test_fusion_removes_round_trips_not_the_work(name, low, high):
    """Fusing a chain of elementwise/normalisation kernels keeps one pass over memory: the
    Ulysses window wins back ~4.1 ms per step (+30%), not all 5.2 ms of those kernels (+40%)."""
    r = report(name)
    per_rank = [chain_ms(name, rank["pid"], *window(r, i)) for i, rank in enumerate(r.ranks)]
    c = ceiling_of(r, "kernel-fusion")
    assert c["recoverable_ms"] == pytest.approx(sum(per_rank) / len(per_rank), rel=0.03)
    assert low < c["recoverable_ms"] < high
    step = r.metrics["step_time_ms"]
    whole = (r.metrics["elementwise_time_frac"] + r.metrics["reduction_time_frac"]) * step
    assert c["recoverable_ms"] < whole * r.metrics["compute_frac"]  # not every such kernel


@pytest.mark.parametrize("name", ["h100_comm_ep2", "h100_comm_ep2_overlap"])
def test_all_to_all_without_message_sizes_has_no_multiplier(name):
    """No message size in the trace: DeepEP / EP in the NVLink domain can win back up to the
    exposed all-to-all (~110 ms of ~115), with no throughput figure (it said ×23-×41)."""
    r = report(name)
    step = r.metrics["step_time_ms"]
    for fix_id in ("deepep", "ep-in-nvlink-domain"):
        c = ceiling_of(r, fix_id)
        assert c["throughput_gain"] is None
        exposed = min(r.metrics["a2a_exposed_frac"], r.metrics["exposed_comm_frac"]) * step
        assert c["recoverable_ms"] <= exposed + 1e-3
        assert f"up to {c['recoverable_ms']:.0f} ms of exposed all-to-all per step" in c["assumes"]
    assert r.combined_ceiling["throughput_gain"] is None
    md = render_markdown(r)
    assert "×2" not in md.split("## What to change", 1)[1].split("ep-overlap")[0]
    assert "no throughput figure" in md


def test_larger_micro_batch_is_counted_in_samples():
    """h100_host_launch_gpumetrics: a larger micro-batch does not shorten a launch-bound step;
    twice the batch is ×2.0 samples per second while the GPU stays mostly idle."""
    r = report("h100_host_launch_gpumetrics")
    c = ceiling_of(r, "larger-micro-batch")
    busy = r.metrics["gpu_busy_frac"]
    assert c["unit"] == "sample" and c["recoverable_ms"] is None
    assert 1 + c["throughput_gain"] == pytest.approx(min(2, 1 / busy), rel=1e-3)
    assert c["step_after_ms"] == pytest.approx(r.metrics["step_time_ms"], rel=1e-3)
    assert "larger-micro-batch" not in r.combined_ceiling["fixes"]
    text = render_markdown(r).split("Larger micro-batch", 1)[1]
    assert "samples per second" in text and "per step back" not in text.split("###")[0]


def test_pipeline_layout_is_counted_per_gpu():
    """h100_memory_offload: more pipeline stages free the memory offload needs, on twice the
    GPUs: the same 105 ms as fine-grained offload (not additive), at most ×1.03 per GPU."""
    r = report("h100_memory_offload")
    pp, offload = ceiling_of(r, "pp-layout"), ceiling_of(r, "fine-grained-offload")
    step = r.metrics["step_time_ms"]
    assert pp["unit"] == "gpu" and pp["recoverable_ms"] == offload["recoverable_ms"]
    assert 1 + pp["throughput_gain"] == pytest.approx(
        step / (step - pp["recoverable_ms"]) / 2, rel=1e-3
    )
    assert pp["throughput_gain"] < 0.05
    assert "fine-grained-offload" in pp["shares_with"] and "pp-layout" in offload["shares_with"]
    assert "pp-layout" not in r.combined_ceiling["fixes"]


# ---------------------------------------------------------------------------------------------
# CloverLeaf: the one fix its trace supports is proposed though the host wall is not the bound


def test_cloverleaf_sync_after_every_kernel_is_worth_removing():
    """A cudaDeviceSynchronize after each of its kernels: the GPU idles after each returns.
    Independent: idle gaps in which a wait-only call returned (the GPU already idle), over the
    report's window."""
    r = report("cloverleaf_a100")
    assert r.bound == "compute"
    fix = next(f for f in r.fixes if f["id"] == "remove-host-syncs")
    assert fix["beside_bound"] and fix["advice"] == "generic"
    assert "cudaDeviceSynchronize" in fix["config"]
    lo, hi, _ = window(r)
    con = connect("cloverleaf_a100")
    waits = sorted(
        e
        for _, e in calls(
            con, ("cudaDeviceSynchronize%", "cudaStreamSynchronize%", "cudaEventSynchronize%")
        )
    )
    idle = 0
    for a, b in idle_gaps(gpu_work(con), lo, hi):
        i = bisect.bisect_left(waits, a)
        idle += b - a if i < len(waits) and waits[i] <= b else 0
    share = fix["ceiling"]["recoverable_ms"] / r.metrics["step_time_ms"]
    assert share == pytest.approx(idle / (hi - lo), abs=0.005)  # 6.3% of the window
    assert 0.05 < share < 0.08
    # what the trace does not support stays out: the allocator (0.06% of the step) and
    # framework advice for a loop that is not a framework's
    assert [f["id"] for f in r.fixes] == ["remove-host-syncs"]
    md = render_markdown(r)
    assert "Also worth doing: the host wall is not the bound" in md


WAITS = ("cudaDeviceSynchronize%", "cudaStreamSynchronize%", "cudaEventSynchronize%")


def waited_ns(con: sqlite3.Connection, lo: int, hi: int) -> int:
    """ns of [lo, hi) in which some thread sat in a call that only waits (a union)."""
    waits = merged((max(s, lo), min(e, hi)) for s, e in calls(con, WAITS) if e > lo and s < hi)
    return sum(e - s for s, e in waits)


def test_removing_syncs_gives_back_no_more_than_the_host_waited():
    """h100_host_launch: the GPU idles 1.8% of the window after a wait-only call returns, but
    the host sat in those calls only 0.5% of it: the rest of each gap is the host's own work
    (Python, launches), which stays once the syncs go. The ceiling is the host's waiting
    time (a public OpenACC loop read "+97%" where its wait was 10% of each period).
    Independent: the union of the wait-only calls over the report's window, per step (here
    the steps' calls are those the window's time holds). The steps' calls, not the window's:
    h100_host_cudagraph's one cudaDeviceSynchronize after the loop, which the GPU window
    overlaps, is no wait of its steps (it read 100% of the step)."""
    r = report("h100_host_launch_gpumetrics")
    lo, hi, n = window(r)
    waited = waited_ns(connect("h100_host_launch_gpumetrics"), lo, hi)
    c = ceiling_of(r, "remove-host-syncs")
    assert r.metrics["wait_call_frac"] == pytest.approx(waited / (hi - lo), abs=1e-4)
    assert r.metrics["idle_after_wait_frac"] > 3 * r.metrics["wait_call_frac"]
    assert c["recoverable_ms"] == pytest.approx(waited / n / 1e6, rel=0.01)
    assert "gains no more than the host waited in them (0.5% of it)" in c["assumes"]
    # CloverLeaf's host waits through most of each kernel: there the GPU's idle after each
    # wait (6.4% of the window) is the smaller bound, as above
    clover = report("cloverleaf_a100")
    lo, hi, _ = window(clover)
    assert clover.metrics["wait_call_frac"] == pytest.approx(
        waited_ns(connect("cloverleaf_a100"), lo, hi) / (hi - lo), abs=1e-4
    )
    assert clover.metrics["wait_call_frac"] > 10 * clover.metrics["idle_after_wait_frac"]
    graphed = report("h100_host_cudagraph")
    lo, hi, _ = window(graphed)
    assert waited_ns(connect("h100_host_cudagraph"), lo, hi) > 0.9 * (hi - lo)  # (after the loop)
    assert graphed.metrics["sync_calls_per_step"] == graphed.metrics["wait_call_frac"] == 0


def test_a_fix_beside_the_bound_needs_a_measurable_ceiling(tmp_path: Path):
    """The host-syncs rule fires on CloverLeaf at a score above `noteworthy`; with the gain
    bar raised above its 6% ceiling the fix is left out again."""
    r = report("cloverleaf_a100")
    assert any(f["id"] == "remove-host-syncs" for f in r.fixes)
    (tmp_path / "worth.yaml").write_text("thresholds:\n  worth_doing_frac: 0.2\n")
    strict = traceclf.analyze(trace_path("cloverleaf_a100"), rules_dir=tmp_path)
    assert strict.fixes == []


# ---------------------------------------------------------------------------------------------
# Premises the capture contradicts


def test_ep_group_across_nodes_is_contradicted_when_ranks_share_a_gpu():
    r = report("h100_comm_ep2")
    ids = [f["id"] for f in r.fixes]
    nvlink = next(f for f in r.fixes if f["id"] == "ep-in-nvlink-domain")
    (premise,) = nvlink["contradicted_premises"]
    assert "spans nodes" in premise["premise"]
    assert premise["facts"]["gpu_assignment"] == "shared" == r.capture["gpu_assignment"]
    assert not any("spans nodes" in p for p in nvlink["preconditions"])
    # DeepEP's premise of an EP group across nodes too (it read as a condition to check beside
    # the other fix's "the trace shows otherwise")
    (deepep,) = next(f for f in r.fixes if f["id"] == "deepep")["contradicted_premises"]
    assert "spans nodes" in deepep["premise"] and "time-slice one GPU" in deepep["trace_shows"]
    # listed after the fixes of its wall whose premises the trace does not contradict
    assert ids.index("ep-in-nvlink-domain") > ids.index("ep-overlap")
    assert ids.index("deepep") > ids.index("ep-overlap")
    for text in (render_markdown(r), render_terminal(r, to_string=True, width=200)):
        assert "The trace shows otherwise: the 2 ranks of this trace time-slice one GPU" in text


def ep_facts(hosts: list[str | None]) -> dict:
    """An EP run of 8 ranks, each on a GPU of its own, whose all-to-all is half the step."""
    metrics = {
        "gpu_busy_frac": 0.98, "gpu_idle_frac": 0.02, "compute_frac": 0.45, "comm_frac": 0.55,
        "exposed_comm_frac": 0.5, "a2a_frac": 0.55, "a2a_exposed_frac": 0.5,
        "step_time_ms": 100.0,
    }  # fmt: skip
    gpu = {"name": "NVIDIA H100 80GB HBM3", "chip": "GH100", "sm_count": 132}
    return {
        "metrics": metrics,
        "gpu": gpu,
        "rank_count": 8,
        "hosts": hosts,
        "comm_by_kind": {"all_to_all": {"frac": 0.55, "libraries": ["nccl"], "exposed_frac": 0.5}},
        "capture": {"training_loop": "training", "moe_evidence": True, "gpu_assignment": "own"},
        "steps": {"source": "nvtx", "used": 10, "cv": 0.02},
    }


def test_premise_is_a_condition_to_check_unless_the_capture_contradicts_it():
    def nvlink(hosts):
        return next(f for f in evaluate(ep_facts(hosts)).fixes if f["id"] == "ep-in-nvlink-domain")

    one_host = nvlink(["node0"] * 8)
    assert "ran on one host" in one_host["contradicted_premises"][0]["trace_shows"]
    for hosts in (["node0"] * 4 + ["node1"] * 4, [None] * 8):  # two hosts, or unknown
        fix = nvlink(hosts)
        assert fix["contradicted_premises"] == []
        assert any("spans nodes" in p for p in fix["preconditions"])


# ---------------------------------------------------------------------------------------------
# One confidence figure, and every format shows each ceiling's assumption and bound

FORMAT_TRACES = ("h100_host_input_stall", "h100_memory_offload", "cloverleaf_a100")


@pytest.mark.parametrize("name", FORMAT_TRACES)
def test_one_confidence_figure_explained(name):
    r = report(name)
    cls = r.classification
    basis = cls["confidence_basis"]
    assert cls["confidence"] == pytest.approx(basis["explained"] * basis["reliability"], abs=2e-3)
    assert basis["reliability"] == pytest.approx(math.prod(basis["factors"].values()), abs=2e-3)
    for text in (
        render_markdown(r),
        render_terminal(r, to_string=True, width=250),
        render_html(r),
    ):
        head = text.split("Evidence", 1)[0] if "Evidence" in text else text.split("•", 1)[0]
        assert head.count("confidence") == 1, head
        assert "rule score" not in text
        # (as many decimals as the product printed needs: test_report_wording)
        assert any(
            f"{cls['confidence']:.{d}f} = {basis['explained']:.{d}f} of the step explained" in text
            for d in (2, 3, 4)
        )


@pytest.mark.parametrize("name", FORMAT_TRACES)
def test_every_format_shows_each_ceilings_assumption_and_bound(name):
    from html import escape

    r = report(name)
    texts = {
        "md": render_markdown(r),
        "terminal": " ".join(render_terminal(r, to_string=True, width=1000).split()),
        "html": render_html(r),
        "json": r.to_json(),
    }
    for fix in r.fixes:
        c = fix["ceiling"]
        if not c:
            continue
        assert c["assumes"] and "n/a" not in c["assumes"]
        opening = " ".join(c["assumes"].split()[:4])  # (plain words: no escaping differs)
        for fmt, text in texts.items():
            shown = escape(opening, quote=False) if fmt == "html" else opening
            assert shown in " ".join(text.split()), (fmt, fix["id"])
            if fmt != "json":
                assert "ounded by" in text
        for key, value in c["bound_by"].items():
            assert (
                key in texts["md"]
                and value == r.to_dict()["fixes"][r.fixes.index(fix)]["ceiling"]["bound_by"][key]
            )
    if r.combined_ceiling.get("recoverable_ms") is not None:
        assert "Ceiling, all fixes" in texts["md"]


def test_thresholds_behind_ceilings_are_rule_data():
    """The factors ceilings assume are thresholds a --rules folder can set (the worker count
    matches the fix's own config)."""
    from traceclf.judge.vocabulary import load_rules

    rs = load_rules()
    assert rs.thresholds["input_workers"] == 8
    assert "num_workers = 8" in rs.fixes["input-pipeline"].config
    assert "micro_batch_size = 2" in rs.fixes["larger-micro-batch"].config
    assert rs.thresholds["micro_batch_factor"] == 2
    assert "pipeline_model_parallel_size = 2" in rs.fixes["pp-layout"].config
    assert rs.thresholds["pp_stages"] == 2
    for f in rs.fixes.values():
        if f.recovers is not None:
            assert f.recovers.assumes is not None and f.recovers.unit in ("step", "sample", "gpu")


# ---------------------------------------------------------------------------------------------
# Invariants every reviewed report keeps (tests/snapshots: the reports of every fixture)

SNAPSHOTS = sorted((Path(__file__).parent / "snapshots").glob("*.json"))
# The measured share of the step each class of time can be at most.
CLASS_LIMIT = {"compute-absent": "compute_absent_frac", "compute-busy": "compute_frac"}


@pytest.mark.parametrize("snapshot", SNAPSHOTS, ids=lambda p: p.stem)
def test_ceilings_keep_their_invariants(snapshot: Path):
    import json

    r = json.loads(snapshot.read_text())
    step = r["metrics"].get("step_time_ms")
    ceilings = {f["id"]: f["ceiling"] for f in r["fixes"] if f.get("ceiling")}
    for fix_id, c in ceilings.items():
        ms = c["recoverable_ms"]
        if c["unit"] == "sample":
            assert ms is None and c["step_after_ms"] >= step - 1e-3, fix_id
            continue
        if ms is None:
            continue
        assert 0 <= ms <= step + 1e-3 and c["step_after_ms"] == pytest.approx(step - ms, abs=2e-3)
        if c["floor_ms"] is not None:
            assert c["step_after_ms"] >= c["floor_ms"] - 2e-3, fix_id
        tops = {cls.split("/")[0] for cls in c["from"].split(" + ")}
        assert ms <= sum(r["metrics"][CLASS_LIMIT[t]] for t in tops) * step + 1e-3, fix_id
        if c["unit"] == "step" and c["throughput_gain"] is not None:
            assert c["throughput_gain"] == pytest.approx(step / (step - ms) - 1, abs=2e-3)
        for other in c["shares_with"]:  # sharing is mutual
            assert fix_id in ceilings[other]["shares_with"]
    together = r["combined_ceiling"]
    if together.get("recoverable_ms") is not None:
        assert together["recoverable_ms"] <= step
        taken = [ceilings[f] for f in together["fixes"]]
        assert all(c["unit"] == "step" for c in taken)
        assert together["recoverable_ms"] <= sum(c["recoverable_ms"] for c in taken) + 1e-3
        for a in together["fixes"]:  # never two fixes that share time
            assert not set(ceilings[a]["shares_with"]) & set(together["fixes"])


def test_cuda_graphs_leave_the_waits_for_input_to_the_input_pipeline():
    """A graph replays the step's launches; the host's input work before a batch lies outside
    it. The CUDA-graphs ceiling takes the launch-starved time less the part in gaps where the
    host was loading input (launch_starved_input_frac), which is the input-pipeline fix's.
    Constructed numbers (no shared trace has both: slow_loader and nccl_groups starve on input
    and propose no graphs; host_launch and the MoE run propose graphs and starve on no input)."""
    from traceclf.judge.vocabulary import load_rules

    graphs = load_rules().fixes["cuda-graphs"]
    env = {
        "step_time_ms": 100.0,
        "launch_starved_frac": 0.6,
        "attribution_residual_frac": 0.0,
        "launch_starved_bound": 0.6,  # (rules/definitions.yaml: the two above added)
        "launch_starved_input_frac": 0.45,
        "launch_starved_host_frac": 0.05,
        "launch_calls_per_step": 900,
    }
    c = ceil.ceiling(graphs, env)
    assert c["recoverable_ms"] == pytest.approx(15.0)
    assert "(15% of the step, waits for input not counted" in c["assumes"]
    assert c["bound_by"]["launch_starved_input_frac"] == 0.45
    # a capture whose idle causes are unknown: every launch-starved ns, as before
    unknown = ceil.ceiling(graphs, env | {"launch_starved_input_frac": None})
    assert unknown["recoverable_ms"] == pytest.approx(60.0)


def test_pinned_memory_counts_the_staging_inside_pageable_copy_calls():
    """The slow loader copies each batch from pageable memory: the call stages the copy before
    the GPU starts it, the host's own time, which pinned memory removes. It had been walked
    back as "blocking compute" (the kernel that ended before the call began), and pinned
    memory's ceiling left it out (0.135 ms per step; now 0.278). Independent: plain SQL over
    the window's pageable host-to-device copies, their call's start to the copy's."""
    r = report("h100_host_slow_loader")
    m = r.metrics
    lo, hi = r.steps["window_ns"]
    path = trace_path("h100_host_slow_loader")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        ((staging,),) = con.execute(
            "SELECT sum(max(c.start - r.start, 0)) FROM CUPTI_ACTIVITY_KIND_MEMCPY c "
            "JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = c.correlationId "
            "WHERE c.copyKind = 1 AND c.srcKind = 0 AND c.start >= ? AND c.start < ?",
            (lo, hi),
        ).fetchall()
    per_step = staging / 1e6 / r.steps["analysed"]
    assert m["blocking_compute_frac"] == 0.0
    assert m["blocking_host_sync_frac"] * m["step_time_ms"] == pytest.approx(per_step, rel=0.1)
    pinned = ceiling_of(r, "pinned-memory")
    both = (m["blocking_copy_frac"] + m["blocking_host_sync_frac"]) * m["step_time_ms"]
    assert pinned["recoverable_ms"] == pytest.approx(both, abs=0.002)
