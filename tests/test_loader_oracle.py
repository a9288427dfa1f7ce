"""The loader against NVIDIA's own numbers: `nsys stats` CSVs for the same real exports.

Kernel, CUDA API and copy totals per name must match the oracle exactly in count and within
0.1% in time. The trimmed fixtures only keep part of the events, so for them the oracle gives
bounds (no more instances than NVIDIA counted, no kernel shorter than its minimum or longer
than its maximum) and SQLite itself, queried directly, gives the exact totals.
"""

from __future__ import annotations

import io
import sqlite3
import time
from collections.abc import Iterator
from functools import cache

import polars as pl
import pytest
from conftest import FIXTURES, FULL_TRACES, fixture_trace, oracle_csv
from rich.console import Console

from traceclf.ingest.load import LOAD_STAGES, load_trace
from traceclf.model.trace import Trace
from traceclf.support.progress import LoadProgress, status, stderr_console

# Traces whose kernels, API calls and copies are all in the fixture.
COMPLETE = (*FULL_TRACES, "h100_compute_dense_gpumetrics")
TRIMMED = "h100_host_launch_gpumetrics"
TIME_TOLERANCE = 1e-3
# nsys stats labels for copyKind; all copies in these traces are one of them.
COPY_OPERATIONS = {
    1: "[CUDA memcpy Host-to-Device]",
    2: "[CUDA memcpy Device-to-Host]",
    8: "[CUDA memcpy Device-to-Device]",
    10: "[CUDA memcpy Peer-to-Peer]",
}


@pytest.fixture(scope="module", autouse=True)
def _no_stray_files() -> Iterator[None]:
    """Loading must leave nothing beside the fixtures (no journal, no lock, no cache)."""
    before = sorted(p.name for p in FIXTURES.iterdir())
    yield
    assert sorted(p.name for p in FIXTURES.iterdir()) == before


@cache
def trace(name: str) -> Trace:
    return load_trace(fixture_trace(name))


def per_name(frame: pl.DataFrame, name: str = "name") -> pl.DataFrame:
    # names are categorical in the model; the oracle's are plain strings
    return (
        frame.with_columns(pl.col(name).cast(pl.String))
        .group_by(name)
        .agg(
            count=pl.len(),
            total=(pl.col("end") - pl.col("start")).sum(),
            shortest=(pl.col("end") - pl.col("start")).min(),
            longest=(pl.col("end") - pl.col("start")).max(),
        )
    )


def api_per_name(t: Trace) -> pl.DataFrame:
    # nsys stats drops a four-digit version suffix (cudaLaunchKernel_v7000) and keeps others
    # (cudaStreamIsCapturing_v10000, cuGetProcAddress_v2).
    return per_name(t.api.with_columns(pl.col("name").cast(pl.String).str.replace(r"_v\d{4}$", "")))


def copies_per_operation(t: Trace) -> pl.DataFrame:
    operation = (
        pl.when(pl.col("op") == "memset")
        .then(pl.lit("[CUDA memset]"))
        .otherwise(pl.col("copy_kind").replace_strict(COPY_OPERATIONS, default=None))
    )
    return (
        t.copies.with_columns(operation=operation)
        .group_by("operation")
        .agg(count=pl.len(), total=(pl.col("end") - pl.col("start")).sum(), bytes=pl.sum("bytes"))
    )


def joined(ours: pl.DataFrame, oracle: pl.DataFrame, left: str, right: str) -> pl.DataFrame:
    both = ours.join(oracle, left_on=left, right_on=right, how="full", coalesce=True)
    missing = both.filter(pl.col("count").is_null() | pl.col(oracle.columns[0]).is_null())
    assert missing.is_empty(), f"names on one side only:\n{missing}"
    return both


def assert_totals(both: pl.DataFrame, count_col: str, time_col: str) -> None:
    wrong = both.filter(
        (pl.col("count") != pl.col(count_col))
        | ((pl.col("total") - pl.col(time_col)).abs() > TIME_TOLERANCE * pl.col(time_col))
    )
    assert wrong.is_empty(), f"differs from nsys stats:\n{wrong}"


@pytest.mark.parametrize("name", COMPLETE)
def test_kernels_match_nsys_stats(name: str) -> None:
    oracle = pl.read_csv(oracle_csv(name, "cuda_gpu_kern_sum"))
    both = joined(per_name(trace(name).kernels), oracle, "name", "Name")
    assert_totals(both, "Instances", "Total Time (ns)")


@pytest.mark.parametrize("name", COMPLETE)
def test_cuda_api_calls_match_nsys_stats(name: str) -> None:
    oracle = pl.read_csv(oracle_csv(name, "cuda_api_sum"))
    both = joined(api_per_name(trace(name)), oracle, "name", "Name")
    assert_totals(both, "Num Calls", "Total Time (ns)")


@pytest.mark.parametrize("name", COMPLETE)
def test_copies_match_nsys_stats(name: str) -> None:
    sizes, times = (
        oracle_csv(name, "cuda_gpu_mem_size_sum"),
        oracle_csv(name, "cuda_gpu_mem_time_sum"),
    )
    ours = copies_per_operation(trace(name))
    if not sizes.exists():  # nsys writes no copy reports for a trace without copies
        assert ours.is_empty()
        return
    both = joined(ours, pl.read_csv(times), "operation", "Operation")
    assert_totals(both, "Count", "Total Time (ns)")
    both = joined(ours, pl.read_csv(sizes), "operation", "Operation")
    megabytes = both.filter((pl.col("bytes") / 1e6 - pl.col("Total (MB)")).abs() > 0.0006)
    assert megabytes.is_empty(), f"copy sizes differ from nsys stats:\n{megabytes}"
    assert (both["count"] == both["Count"]).all()


@pytest.mark.parametrize("name", COMPLETE)
def test_ranks_are_the_processes_nsys_saw_on_the_gpu(name: str) -> None:
    oracle = pl.read_csv(oracle_csv(name, "gpu_time_util"))
    assert trace(name).rank_pids == sorted(oracle["PID"].unique().to_list())


def test_both_ranks_of_a_two_process_report() -> None:
    for name in ("h100_comm_ep2", "h100_comm_ep2_overlap"):
        t = trace(name)
        assert len(t.rank_pids) == 2
        for pid in t.rank_pids:
            rank = t.for_pid(pid)
            assert rank.kernels.height > 0 and rank.api.height > 0 and rank.nvtx.height > 0


@pytest.mark.parametrize("name", [*COMPLETE, TRIMMED])
def test_versions_and_gpu(name: str) -> None:
    t = trace(name)
    assert (t.nsys_version, t.schema_version) == ("2025.3.2.0", "3.20.3")
    gpu = t.gpu_of(t.rank_pids[0])
    assert gpu is not None
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["chip"] == "GH100"
    assert gpu["sm_count"] == 132
    assert gpu["memory_bytes"] == 85017493504
    assert (gpu["max_warps_per_sm"], gpu["threads_per_warp"]) == (64, 32)


def test_trimmed_kernels_and_calls_stay_within_nsys_stats_bounds() -> None:
    t = trace(TRIMMED)
    for ours, report, count_col in (
        (per_name(t.kernels), "cuda_gpu_kern_sum", "Instances"),
        (api_per_name(t), "cuda_api_sum", "Num Calls"),
    ):
        oracle = pl.read_csv(oracle_csv(TRIMMED, report))
        both = ours.join(oracle, left_on="name", right_on="Name", how="left")
        outside = both.filter(
            pl.col(count_col).is_null()
            | (pl.col("count") > pl.col(count_col))
            | (pl.col("shortest") < pl.col("Min (ns)"))
            | (pl.col("longest") > pl.col("Max (ns)"))
        )
        assert outside.is_empty(), (
            f"{report}: outside NVIDIA's totals for the full trace\n{outside}"
        )


def test_trimmed_totals_match_sqlite_directly() -> None:
    path = fixture_trace(TRIMMED)
    query = """
        SELECT s.value AS name, COUNT(*) AS n, SUM(k."end" - k.start) AS total
        FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName
        GROUP BY s.value
    """
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        expected = {name: (n, total) for name, n, total in con.execute(query)}
    finally:
        con.close()
    ours = per_name(trace(TRIMMED).kernels)
    assert {r["name"]: (r["count"], r["total"]) for r in ours.iter_rows(named=True)} == expected


def test_trimmed_gpu_metrics_cover_the_kept_steps() -> None:
    t = trace(TRIMMED)
    steps = t.nvtx.filter(pl.col("text").str.starts_with("step "))["text"].to_list()
    assert steps == [f"step {i}" for i in range(6)]
    metrics = set(t.gpu_metrics["metric"].unique())
    assert {"sm_active", "sm_issue", "tensor_active"} <= metrics
    assert t.gpu_metrics["value"].min() >= 0


def test_graph_level_tracing_keeps_graph_rows() -> None:
    graph, node = trace("h100_host_cudagraph"), trace("h100_host_cudagraph_nodetrace")
    assert graph.graphs.height > 0 and node.graphs.is_empty()
    assert node.kernels["graph_node_id"].drop_nulls().len() > 0


def test_window_restricts_every_timed_frame() -> None:
    full = trace("h100_comm_ep2")
    lo, hi = full.span
    mid = (lo + hi) // 2
    part = load_trace(fixture_trace("h100_comm_ep2"), span=(lo, mid))
    for name in ("kernels", "copies", "api", "nvtx"):
        frame = getattr(part, name)
        assert 0 < frame.height < getattr(full, name).height, name
        assert frame.filter((pl.col("start") >= mid) | (pl.col("end") <= lo)).is_empty(), name


def test_progress_callback_sees_every_stage_in_order() -> None:
    seen: list[str] = []
    load_trace(fixture_trace("h100_host_input_stall"), progress=seen.append)
    assert tuple(seen) == LOAD_STAGES


def recording_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def test_load_progress_appears_only_for_slow_loads() -> None:
    console, out = recording_console()
    with LoadProgress("run.sqlite", console=console, delay=10) as progress:
        load_trace(fixture_trace("h100_host_input_stall"), progress=progress)
    assert out.getvalue() == ""

    console, out = recording_console()
    with LoadProgress("run.sqlite", console=console, delay=0.01) as progress:
        progress("kernels")
        time.sleep(0.3)
    assert "Loading run.sqlite: kernels" in out.getvalue()


def test_progress_is_silent_when_quiet_or_not_a_terminal(capfd: pytest.CaptureFixture) -> None:
    assert stderr_console(quiet=True) is None
    assert stderr_console() is None  # pytest's captured stderr is not a terminal
    with LoadProgress("run.sqlite", delay=0) as progress:
        progress("kernels")
        time.sleep(0.05)
    with status("Exporting run.nsys-rep"):
        pass
    assert capfd.readouterr().err == ""
