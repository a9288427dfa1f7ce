"""The dependency logic of the critical-path split on CONSTRUCTED exports (tests/helpers/
constructed.py: small SQLite files written here, not captured), each with a known answer:
stream order, cross-stream CUDA event waits, event handles CUDA reused, relayed events, host
syncs, CUDA-graph launches and what cannot be resolved. Times are ns; every kernel's launch call
lasts 100 ns (``launch_at`` .. ``launch_at + 100``)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from helpers.constructed import Export

from traceclf.ingest.load import load_trace
from traceclf.measures import critical_path
from traceclf.measures.window import prepare
from traceclf.model.taxonomy import bundled
from traceclf.steps.steady import Steps, empty_steps_table

NCCL = "ncclDevKernel_SendRecv"


def budget(x: Export, tmp_path: Path, window: tuple[int, int]) -> dict[str, int]:
    """The window's budget in ns (one row: no steps), from the export ``x`` builds."""
    trace = load_trace(x.write(tmp_path / "constructed.sqlite"))
    steps = Steps("none", empty_steps_table(), window, "")
    w = prepare(trace, steps, trace.gpu_of(x.pid), bundled())
    _, per_step = critical_path.budget_ns(w)
    assert per_step.height == 1
    return per_step.row(0, named=True)


def classes(b: dict[str, int]) -> dict[str, int]:
    """The non-zero classes of compute-absent time (blocking by producer, not its total)."""
    names = (
        "launch_starved",
        *critical_path.BLOCKING,
        "dependency_stalled",
        "graph_internal",
        "residual",
    )
    return {n: b[n] for n in names if b[n]}


def test_stream_order_blames_the_collective_then_the_copy(tmp_path):
    # one stream: gemm, then NCCL (waits for the other rank), then a D2D copy, then gemm; the
    # host issued everything long before the GPU got there
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel(NCCL, 2_000, 9_000, launch_at=200)
    x.copy(9_000, 9_500, kind="DtoD", launch_at=300)
    x.kernel("gemm", 9_700, 10_000, launch_at=400)
    b = budget(x, tmp_path, (1_000, 10_000))
    assert b["compute_absent"] == 9_700 - 2_000
    # NCCL ran 2000-9000, the copy 9000-9500, then the gemm waited 200 ns to start
    assert classes(b) == {
        "blocking_comm": 7_000,
        "blocking_copy": 500,
        "dependency_stalled": 200,
    }
    assert b["exposed_comm"] == 7_000 and b["exposed_copy"] == 500


def test_launch_starved_until_the_launch_call_returns(tmp_path):
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel("gemm", 6_000, 7_000, launch_at=5_800)  # issued at 5900, started at 6000
    b = budget(x, tmp_path, (1_000, 7_000))
    assert classes(b) == {"launch_starved": 3_900, "dependency_stalled": 100}


def test_cross_stream_event_wait_blames_the_recorded_work(tmp_path):
    # NCCL runs on stream 13; an event recorded after it gates the gemm on stream 7
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100, stream=7)
    x.kernel(NCCL, 1_500, 9_000, launch_at=150, stream=13)
    x.record(7, stream=13, at=200)
    x.wait(7, stream=7, at=300)
    x.kernel("gemm", 9_100, 10_000, launch_at=400, stream=7)
    b = budget(x, tmp_path, (1_000, 10_000))
    # NCCL overlaps the first gemm until 2000: blocking only once compute stopped
    assert classes(b) == {"blocking_comm": 7_000, "dependency_stalled": 100}
    assert b["exposed_comm"] == 7_000


def test_without_the_event_wait_the_same_gap_is_stalled_not_blocking(tmp_path):
    # the same timeline without cudaStreamWaitEvent: no dependency explains the wait
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100, stream=7)
    x.kernel(NCCL, 1_500, 9_000, launch_at=150, stream=13)
    x.kernel("gemm", 9_100, 10_000, launch_at=400, stream=7)
    b = budget(x, tmp_path, (1_000, 10_000))
    assert classes(b) == {"dependency_stalled": 7_100}
    assert b["exposed_comm"] == 7_000  # exposed is not blocking: only the upper bound


def test_reused_event_handle_is_joined_on_event_sync_id(tmp_path):
    # event handle 1 is recorded after NCCL and waited on; then destroyed, and a new event gets
    # the same handle, recorded after a short copy on another stream. The wait belongs to the
    # first record (eventSyncId 10); the latest record of handle 1 would wrongly blame the copy.
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100, stream=7)
    x.kernel(NCCL, 1_500, 9_000, launch_at=150, stream=13)
    x.record(10, stream=13, at=200, event_id=1)
    x.wait(10, stream=7, at=300, event_id=1)
    x.copy(1_200, 1_400, kind="DtoD", launch_at=350, stream=14)
    x.record(11, stream=14, at=450, event_id=1)
    x.kernel("gemm", 9_100, 10_000, launch_at=500, stream=7)
    b = budget(x, tmp_path, (1_000, 10_000))
    assert classes(b) == {"blocking_comm": 7_000, "dependency_stalled": 100}


def test_relayed_event_is_followed_to_the_producer(tmp_path):
    # stream 14 waits for NCCL on stream 13 and records an event right away (no work of its
    # own); stream 7 waits for that event: the producer is NCCL, two streams away
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100, stream=7)
    x.kernel(NCCL, 1_500, 9_000, launch_at=150, stream=13)
    x.record(1, stream=13, at=200)
    x.wait(1, stream=14, at=250)
    x.record(2, stream=14, at=300)
    x.wait(2, stream=7, at=350)
    x.kernel("gemm", 9_100, 10_000, launch_at=400, stream=7)
    b = budget(x, tmp_path, (1_000, 10_000))
    assert classes(b) == {"blocking_comm": 7_000, "dependency_stalled": 100}


def test_host_sync_relays_to_the_copy_it_waited_for(tmp_path):
    # a D2H copy, the host blocked in cudaStreamSynchronize until just after it, then the host
    # launches the next gemm: not launch-starved while the host was waiting for the copy
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.copy(2_000, 6_000, kind="DtoH", launch_at=200)
    x.stream_sync(1_500, 6_100)
    x.kernel("gemm", 6_300, 7_000, launch_at=6_200)
    b = budget(x, tmp_path, (1_000, 7_000))
    assert classes(b) == {
        "blocking_copy": 4_000,  # the copy ran
        "blocking_host_sync": 100,  # the sync returned 100 ns after it
        "launch_starved": 200,  # then the host launched the gemm
    }


def test_a_blocking_copy_returning_before_its_last_bytes_is_the_copy_not_the_sync(tmp_path):
    # a blocking cudaMemcpy of pageable memory: the call stages the copy and returns 50 µs
    # before its last bytes land (a public export: 0.15 ms before 100 ms copies, all of whose
    # time had read as the call's return latency); the next gemm runs after the copy
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.copy(2_500, 150_000, launch_at=2_200, call="cudaMemcpy_v3020", call_ns=97_800)
    x.kernel("gemm", 150_200, 151_000, launch_at=100_100)
    b = budget(x, tmp_path, (1_000, 151_000))
    assert classes(b) == {
        # before the call, and after it until the gemm's launch returned (the copy running)
        "launch_starved": 200 + 200,
        "blocking_host_sync": 300,  # in the call before the copy began: staging it
        # the copy ran until the call returned, then from the gemm's launch to its end
        "blocking_copy": (100_000 - 2_500) + (150_000 - 100_200),
        "dependency_stalled": 200,  # the gemm started 200 ns after the copy ended
    }


@pytest.mark.parametrize("lands", [99_999, 100_001])
def test_a_blocking_copy_is_the_copy_whether_it_lands_before_or_after_the_return(tmp_path, lands):
    # the same blocking call, its copy's last bytes landing 1 ns before or after it returns:
    # the copy ran, the call staged it for 300 ns first and returned at most 1 ns after it
    # (a walk from the copy had blamed the gemm that ended before the call began)
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.copy(2_500, lands, launch_at=2_200, call="cudaMemcpy_v3020", call_ns=97_800)
    x.kernel("gemm", 150_200, 151_000, launch_at=100_100)
    b = classes(budget(x, tmp_path, (1_000, 151_000)))
    assert b["blocking_copy"] == min(lands, 100_000) - 2_500
    assert b["blocking_host_sync"] == 300 + max(100_000 - lands, 0)
    assert "blocking_compute" not in b and "residual" not in b


def test_a_blocking_copy_after_another_streams_collective_blames_the_collective(tmp_path):
    # the copy starts right after a collective on another stream ends, an order the export
    # does not record (the legacy default stream's): the collective held it, then 100 ns of
    # staging; not 37.9 µs of staging
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel(NCCL, 1_500, 40_000, launch_at=150, stream=13)
    x.copy(40_100, 100_000, launch_at=2_200, call="cudaMemcpy_v3020", call_ns=97_800)
    x.kernel("gemm", 150_200, 151_000, launch_at=100_100)
    b = classes(budget(x, tmp_path, (1_000, 151_000)))
    assert b["blocking_comm"] == 40_000 - 2_200 and b["blocking_host_sync"] == 100


def test_graph_launch_is_one_operation_and_its_inside_is_unresolved(tmp_path):
    # graph-level tracing: a replay on stream 7 after NCCL on the same stream
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel(NCCL, 2_000, 9_000, launch_at=200)
    x.graph(9_000, 20_000, launch_at=300)
    b = budget(x, tmp_path, (1_000, 20_000))
    assert classes(b) == {"blocking_comm": 7_000}
    assert b["compute_busy"] == 1_000 + 11_000
    assert b["in_graph"] == 11_000  # what the trace cannot resolve


def test_node_traced_graph_gaps_inside_a_replay_are_graph_internal(tmp_path):
    # --cuda-graph-trace=node: two nodes of one replay share the launch's correlationId; the
    # 2000 ns between them has no launch or dependency in the trace, so it is not split by
    # the walk, but no kernel runs then: compute-absent, of its own class (issue 22: it was
    # counted as compute, as if the replay's span were kernels running)
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    launch = x.graph_launch(5_000)
    x.kernel("gemm", 6_000, 7_000, corr=launch, graph_node=1)
    x.kernel("gemm", 9_000, 10_000, corr=launch, graph_node=2)
    b = budget(x, tmp_path, (1_000, 10_000))
    assert b["compute_absent"] == 6_000  # 2000-6000 before the replay, 7000-9000 inside it
    assert classes(b) == {
        "launch_starved": 3_100,
        "dependency_stalled": 900,
        "graph_internal": 2_000,
    }
    assert b["compute_busy"] == b["device_busy"] == 3_000  # the kernels, not the replay's span
    assert b["in_graph"] == 0  # node-level tracing shows what runs inside: nothing unresolved


def test_what_cannot_be_resolved_is_the_residual(tmp_path):
    # the last gemm has no launch call in the export (CUDA API not traced for it), and no
    # compute follows the window's last gap
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel("gemm", 5_000, 6_000)  # no launch row
    b = budget(x, tmp_path, (1_000, 8_000))
    assert classes(b) == {"residual": 3_000 + 2_000}
    assert b["compute_absent"] == 5_000


def test_budget_reconciles(tmp_path):
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel(NCCL, 1_500, 5_000, launch_at=150, stream=13)
    x.copy(5_000, 6_000, kind="HtoD", launch_at=160, stream=13)
    x.copy(6_000, 6_500, kind="DtoD", launch_at=170, stream=13)
    x.kernel("gemm", 7_000, 8_000, launch_at=6_800)
    b = budget(x, tmp_path, (1_000, 9_000))
    assert b["compute_busy"] <= b["non_transfer_busy"] <= b["device_busy"] <= b["iteration"]
    assert (b["compute_busy"], b["non_transfer_busy"], b["device_busy"]) == (2_000, 2_500, 6_500)
    assert b["occupied_not_computing"] == b["device_busy"] - b["compute_busy"]
    assert b["compute_absent"] == sum(classes(b).values())


@pytest.mark.parametrize("drop_ids", [True, False])
def test_exports_without_event_sync_ids_leave_waits_unresolved(tmp_path, drop_ids):
    """nsys 2022 wrote no eventSyncId: the wait is not joined on the reused handle instead."""
    import sqlite3

    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100, stream=7)
    x.kernel(NCCL, 1_500, 9_000, launch_at=150, stream=13)
    x.record(7, stream=13, at=200)
    x.wait(7, stream=7, at=300)
    x.kernel("gemm", 9_100, 10_000, launch_at=400, stream=7)
    path = x.write(tmp_path / "old.sqlite")
    if drop_ids:
        with sqlite3.connect(path) as con:
            con.execute("UPDATE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION SET eventSyncId = NULL")
        con.close()
    trace = load_trace(path)
    w = prepare(trace, Steps("none", empty_steps_table(), (1_000, 10_000), ""), None, bundled())
    m, _ = critical_path.measure(w)
    assert m["event_waits_unresolved"] == (1 if drop_ids else 0)
    assert (m["blocking_comm_frac"] > 0) is not drop_ids


def test_measures_match_the_budget(tmp_path):
    x = Export()
    x.kernel("gemm", 1_000, 2_000, launch_at=100)
    x.kernel(NCCL, 2_000, 9_000, launch_at=200)
    x.kernel("gemm", 9_000, 10_000, launch_at=300)
    trace = load_trace(x.write(tmp_path / "m.sqlite"))
    w = prepare(trace, Steps("none", empty_steps_table(), (1_000, 10_000), ""), None, bundled())
    m, rows = critical_path.measure(w)
    assert m["compute_absent_frac"] == pytest.approx(7 / 9)
    assert m["blocking_comm_frac"] == pytest.approx(7 / 9)
    assert m["launch_starved_frac"] == 0 and m["attribution_residual_frac"] == 0
    assert rows[0]["blocking_comm"] == pytest.approx(0.007)  # ms
    assert pl.DataFrame(rows).height == 1


def test_long_streams_keep_their_stream_order():
    """CONSTRUCTED frames, no export: 70,000 back-to-back kernels on one stream (a kernel-dense
    capture has millions). Each waits for the one before it. An earlier sweep packed (segment,
    completion rank) into 32 bits and lost every dependency past ~2**16 operations."""
    from traceclf.measures import dependencies

    n = 70_000
    ops = pl.DataFrame(
        {
            "pid": [1] * n,
            "device_id": [0] * n,
            "stream_id": [7] * n,
            "correlation_id": list(range(10, 10 + n)),
            "start": [i * 10 for i in range(n)],
            "end": [i * 10 + 5 + i % 3 for i in range(n)],
        },
        schema_overrides={"device_id": pl.Int32, "stream_id": pl.Int32},
    )
    empty = pl.DataFrame(
        schema={
            c: pl.Int64
            for c in ("pid", "device_id", "stream_id", "correlation_id", "event_sync_id")
        }
    )
    dep_end, dep_op, unresolved = dependencies.resolve_arrays(ops, empty, empty)
    assert dep_end[0] == dependencies.NULL and dep_op[0] < 0  # (the first op depends on none)
    assert dep_end[1:].tolist() == ops["end"].to_list()[:-1]
    assert dep_op[1:].tolist() == list(range(n - 1))
    assert not unresolved.any()


def test_per_step_rows_are_rounded_as_python_rounds_them() -> None:
    """The per-step budget's floats are rounded in numpy where that is exact (the scaled value
    not within its error of a half) and by ``round`` elsewhere: the same floats as ``round``,
    sign of zero included, on values near halves, exact halves in binary, negatives, large and
    non-finite values and nulls. (Constructed values: the edge cases of rounding.)"""
    import math

    import numpy as np

    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            rng.random(20_000) * 1e3,
            rng.random(5_000) * 1e-3,
            (rng.integers(0, 10**6, 20_000) + 0.5) / 1e4,  # scaled values at halves
            rng.integers(0, 10**7, 20_000) / 1e4 + 5e-5,
            -rng.random(5_000) * 50,
            rng.random(1_000) * 1e15,
            [0.0, -0.0, -1e-9, 2.675, 0.00005, 1.00005, -5e-5, 1e300, np.inf, -np.inf, np.nan],
        ]
    )

    def same(a: float | None, b: float | None) -> bool:
        if a is None or b is None:
            return a is b
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)

    for digits in (1, 4, 6):
        want = [round(float(v), digits) for v in values]
        got = critical_path._rounded(pl.Series(values), digits)
        assert all(same(a, b) for a, b in zip(want, got, strict=True)), digits
    with_nulls = pl.Series([1.23456, None, -0.00004])
    assert critical_path._rounded(with_nulls, 4) == [1.2346, None, -0.0]
    rows = pl.DataFrame({"step_start": [0, 10], "iteration": [0.123456, 2.5e-5]})
    assert critical_path._rounded_rows(rows, 4) == [
        {"step_start": 0, "iteration": 0.1235},
        {"step_start": 10, "iteration": round(2.5e-5, 4)},
    ]
