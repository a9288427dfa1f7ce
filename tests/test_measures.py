"""Steady-state measures on the real traces match what each run is known to show
(../shared/traces/README.md), and the definitions hold across tracing modes and ranks."""

from __future__ import annotations

import pytest
from realtraces import measured


def metrics(name: str) -> list[dict]:
    return [m.metrics for _, m in measured(name)]


def test_host_launch_bound_run():
    (m,) = metrics("h100_host_launch_gpumetrics.sqlite")  # the trimmed copy keeps 6 steps
    assert 0.09 <= m["gpu_busy_frac"] <= 0.14
    assert 5_000 <= m["kernels_per_step"] <= 6_500  # ~57k kernels over 10 steps
    assert 1.5 <= m["median_kernel_us"] <= 3.0
    assert m["sync_calls_per_step"] > 100  # a nonzero() sync per expert and layer
    assert m["small_grid_kernel_frac"] > 0.5
    assert m["short_kernel_frac"] > 0.5  # most kernels are shorter than their launch call
    assert m["idle_launch_frac"] + m["idle_sync_frac"] > 0.6


def test_the_gap_a_sync_returns_in_is_sync_idle():
    """A gap in which a synchronising call returns is idle after that sync, even when the next
    gap starts within the 20 µs slack after the return (kernels of ~2 µs): each launch-bound
    ``.nonzero()`` sync once left its own gap as launch idle and marked the next one."""
    import numpy as np
    import polars as pl
    from realtraces import trace_path

    from traceclf.ingest.load import load_trace
    from traceclf.measures import host
    from traceclf.measures.window import prepare
    from traceclf.model.taxonomy import bundled
    from traceclf.steps.find import find_steps

    trace = load_trace(trace_path("h100_host_launch_gpumetrics"))
    (pid,) = trace.rank_pids
    taxonomy = bundled()
    steps = find_steps(trace, None, taxonomy)
    w = prepare(trace, steps, trace.gpu_of(pid), taxonomy)
    gaps = host.idle_gaps(w)
    sync_end = w.api.filter(pl.col("is_sync"))["end"].to_numpy()
    start, end = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    returns_inside = np.array(
        [((sync_end >= s) & (sync_end <= e)).any() for s, e in zip(start, end, strict=True)]
    )
    causes = gaps["cause"].to_numpy()[returns_inside]
    assert len(causes) > 100
    assert set(causes) <= {"sync", "other", "input", "host"}  # the causes ranked before sync
    assert (causes == "sync").mean() > 0.9


def test_cuda_graph_run_is_busy_in_both_tracing_modes():
    """Both modes show the device inside replays; only node-level tracing shows that no kernel
    runs in 4% of them (idle: issue 22, where the two modes were held to one busy time)."""
    (graph,) = metrics("h100_host_cudagraph.sqlite")
    (node,) = metrics("h100_host_cudagraph_nodetrace.sqlite")
    assert graph["gpu_busy_frac"] >= 0.97
    assert graph["graph_frac"] >= 0.95 and graph["uses_cuda_graphs"]
    # node-level: busy is the kernels (and copies); the gaps between them are the graph's idle
    assert node["gpu_busy_frac"] == pytest.approx(0.9614, abs=0.002)
    assert node["idle_graph_frac"] == pytest.approx(0.0368, abs=0.002)
    assert node["gpu_busy_frac"] <= graph["gpu_busy_frac"]
    assert node["graph_frac"] >= 0.95 and node["uses_cuda_graphs"]
    ((steps, _),) = measured("h100_host_cudagraph_nodetrace.sqlite")
    assert 2_000 <= node["kernels_per_step"] * steps.used <= 2_800
    assert 3.0 <= node["median_kernel_us"] <= 5.0
    assert 0.4 <= node["small_grid_kernel_frac"] <= 0.6
    # graph-level tracing hides the replays' kernels: the eager ones give the same mix
    assert graph["kernel_stats_outside_window"] and not node["kernel_stats_outside_window"]
    assert graph["small_grid_kernel_frac"] == pytest.approx(
        node["small_grid_kernel_frac"], abs=0.05
    )


def test_input_stall_run():
    (m,) = metrics("h100_host_input_stall.sqlite")
    assert m["gpu_busy_frac"] <= 0.06
    assert m["idle_input_frac"] >= 0.8
    assert m["pageable_copies_per_step"] >= 1


def test_dense_compute_run():
    (m,) = metrics("h100_compute_dense_gpumetrics.sqlite")
    assert m["gpu_busy_frac"] >= 0.98
    assert m["gemm_time_frac"] >= 0.8
    assert m["tensor_active_mean"] >= 0.6
    assert m["sm_active_mean"] >= 0.9


@pytest.mark.parametrize("name", ["h100_comm_ep2.sqlite", "h100_comm_ep2_overlap.sqlite"])
def test_communication_bound_runs_on_both_ranks(name):
    ranks = measured(name)
    assert len(ranks) == 2
    for _, m in ranks:
        assert m.metrics["comm_frac"] >= 0.9
        assert m.metrics["exposed_comm_frac"] >= 0.9
        # NCCL's NVTX ranges say the SendRecv kernels carry an all-to-all
        assert m.comm_by_kind["all_to_all"]["frac"] >= 0.9
        assert m.comm_by_kind["all_to_all"]["libraries"] == ["nccl"]


def test_overlap_is_visible_even_when_it_cannot_hide_communication():
    serial = metrics("h100_comm_ep2.sqlite")
    overlapped = metrics("h100_comm_ep2_overlap.sqlite")
    assert all(m["compute_under_comm_frac"] < 0.05 for m in serial)
    assert all(m["compute_under_comm_frac"] > 0.2 for m in overlapped)


def test_memory_capacity_wall_run():
    (m,) = metrics("h100_memory_offload.sqlite")
    assert 4e9 <= m["h2d_d2h_bytes_per_step"] <= 7e9  # ~45 GB per 8 steps
    assert 0.45 <= m["copy_frac"] <= 0.65
    assert m["recompute_frac"] >= 0.4  # forward GEMMs re-run in backward
    assert m["alloc_calls_per_step"] >= 1  # empty_cache() every step
    assert m["peak_memory_frac"] >= 0.9


def test_no_recompute_without_checkpointing():
    (m,) = metrics("h100_host_launch_gpumetrics.sqlite")
    assert m["recompute_frac"] < 0.1


def test_low_occupancy_graph_run_uses_eager_kernels_for_shapes():
    (m,) = metrics("h100_compute_low_occupancy.sqlite")
    assert m["gpu_busy_frac"] >= 0.97
    assert m["kernel_stats_outside_window"]
    assert m["small_grid_kernel_frac"] >= 0.5


def test_one_rank_all_to_all_is_a_copy_not_communication():
    (m,) = metrics("h100_comm_a2a_gpumetrics.sqlite")
    assert m["comm_frac"] == 0
    assert m["copy_frac"] > 0.05
    assert m["sm_active_mean"] is not None


@pytest.mark.parametrize(
    "name", ["h100_comm_ep2.sqlite", "h100_memory_offload.sqlite", "h100_host_input_stall.sqlite"]
)
def test_wall_time_shares_add_up(name):
    for _, m in measured(name):
        x = m.metrics
        idle = sum(x[f"idle_{c}_frac"] for c in ("launch", "sync", "input", "host", "other"))
        assert idle == pytest.approx(x["gpu_idle_frac"], abs=1e-3)
        assert x["gpu_busy_frac"] + x["gpu_idle_frac"] == pytest.approx(1, abs=1e-6)
        assert x["exposed_comm_frac"] <= x["comm_frac"] + 1e-9
        for step in m.step_breakdown:
            parts = step["compute"] + step["exposed_comm"] + step["copy"] + step["idle"]
            assert parts > 0


def test_every_measure_is_defined_and_documented():
    from pathlib import Path

    from traceclf.measures import MEASURES

    (_, m), *_ = measured("h100_comm_ep2.sqlite")
    assert set(m.metrics) == set(MEASURES)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "measures.md").read_text()
    missing = [name for name in MEASURES if f"`{name}`" not in doc]
    assert not missing, f"docs/measures.md lacks {missing}"


@pytest.mark.parametrize(
    "name", ["h100_host_cudagraph.sqlite", "h100_host_cudagraph_nodetrace.sqlite"]
)
def test_graph_runs_count_the_launches_of_their_steps(name):
    """The host runs whole steps ahead of the GPU when it replays CUDA graphs: the calls made
    while the GPU runs the window are other steps' (they once counted 0 graph launches per
    step). Each steady step of these runs replays its graph once and launches one eager
    kernel, and the calls of a step are the calls made inside its NVTX range."""
    (m,) = metrics(name)
    assert m["launch_calls_per_step"] == 2.0
    assert m["median_launch_us"] is not None


def test_communication_run_launches_each_kernel_once():
    """Every kernel of a steady step was launched by one call of that step (NCCL's too):
    launches per step equal kernel rows per step. Calls clipped to the GPU window by time
    counted 48 of 129 (the host, blocked in NCCL, launched the rest outside the window)."""
    for m in metrics("h100_comm_ep2.sqlite"):
        assert m["launch_calls_per_step"] == m["kernels_per_step"] == 129


def test_a_kernel_of_two_families_is_listed_under_the_one_with_most_time() -> None:
    """Constructed launch rows (no shared trace has a kernel in two families): an elementwise
    kernel that runs inside the optimizer's runs too is listed under the family it spent most
    time in, whatever order the grouped rows come in (a report read the same twice)."""
    import itertools

    import polars as pl

    from traceclf.measures.step_kernels import _family_of

    rows = pl.DataFrame(
        {
            "name": ["fill", "fill", "fill", "gemm", "tie", "tie"],
            "family": ["elementwise", "optimizer", "optimizer", "gemm", "reduction", "copy"],
            "ns": [5, 3, 3, 1, 2, 2],
        }
    )
    for order in itertools.permutations(range(rows.height)):
        picked = dict(_family_of(rows[list(order)]).iter_rows())
        assert picked == {"fill": "optimizer", "gemm": "gemm", "tie": "copy"}


def test_of_nvtx_ranges_starting_together_the_first_to_end_is_the_innermost(monkeypatch) -> None:
    """Constructed ranges (no shared trace has two that start at the same ns over a gap): the
    gap is attributed to the range that starts latest and, of those starting together, ends
    first, in whatever order the ranges come."""
    import itertools
    from types import SimpleNamespace

    import polars as pl

    from traceclf.measures import host_nvtx
    from traceclf.model.taxonomy import bundled

    ranges = pl.DataFrame(
        {
            "text": ["outer", "wide", "narrow"],
            "start": [0, 100, 100],
            "end": [1_000, 900, 400],
        }
    )
    gap = pl.DataFrame({"start": [150], "end": [350], "dur": [200]})
    w = SimpleNamespace(taxonomy=bundled())
    for order in itertools.permutations(range(3)):
        monkeypatch.setattr(
            host_nvtx, "host_ranges", lambda _w, covering=0, o=order: ranges[list(o)]
        )
        cover = host_nvtx.nvtx_cover(gap, w)
        assert cover.select("nvtx", "r_start", "r_end").row(0) == ("narrow", 100, 400)


def test_nvtx_cover_joins_gaps_a_block_at_a_time_with_the_same_answer(monkeypatch) -> None:
    """Constructed: 40 gaps under 30 nested ranges (and a range per gap); joined a few gaps at
    a time (as deep nesting over many gaps is, to bound memory), each gap gets the innermost
    range covering half of it, as in one join."""
    from types import SimpleNamespace

    import polars as pl

    from traceclf.measures import host_nvtx
    from traceclf.model.taxonomy import bundled

    gaps = pl.DataFrame({"start": [i * 100 for i in range(40)]}).with_columns(
        end=pl.col("start") + 50, dur=pl.lit(50, pl.Int64)
    )
    nested = pl.DataFrame({"text": [f"level {d}" for d in range(30)], "start": range(30)})
    nested = nested.with_columns(end=10_000 - pl.col("start"))
    own = gaps.select(
        text=pl.format("gap {}", pl.col("start")), start=pl.col("start") + 10, end="end"
    )
    ranges = pl.concat([nested, own.cast(nested.schema)])
    monkeypatch.setattr(host_nvtx, "host_ranges", lambda _w, covering=0: ranges)
    w = SimpleNamespace(taxonomy=bundled())
    whole = host_nvtx.nvtx_cover(gaps, w).sort("start")
    monkeypatch.setattr(host_nvtx, "JOIN_ROWS", 2 * ranges.height)  # 2 gaps a block
    blocks = host_nvtx.nvtx_cover(gaps, w).sort("start")
    assert blocks.equals(whole) and whole.height == 40
    # a gap's own range (40 of its 50 ns) is innermost; in the first gap, the nested range
    # that starts latest and still covers half of it (level 25, from 25 ns) starts after it
    assert whole["nvtx"].to_list() == ["level 25"] + [f"gap {i * 100}" for i in range(1, 40)]


@pytest.mark.parametrize("name", ["h100_host_launch_gpumetrics", "h100_host_cudagraph_nodetrace"])
def test_fusable_chains_recomputed_kernel_by_kernel(name):
    """The kernel-fusion ceiling's measure, recomputed by a plain loop over each stream's
    kernels in start order: a chain is a run of elementwise/reduction kernels outside the
    optimizer, and each chain of two or more loses all but its longest kernel."""
    from itertools import groupby

    from realtraces import trace_path

    from traceclf.ingest.load import load_trace
    from traceclf.measures.compute import fusable_chain_ms
    from traceclf.measures.window import prepare
    from traceclf.model.taxonomy import bundled
    from traceclf.steps.find import find_steps

    trace = load_trace(trace_path(name))
    (pid,) = trace.rank_pids
    taxonomy = bundled()
    w = prepare(trace, find_steps(trace, None, taxonomy), trace.gpu_of(pid), taxonomy)
    rows = w.kern.select("stream_id", "start", "end", "family", "in_optimizer").to_dicts()
    removable = 0
    for _stream, kernels in groupby(
        sorted(rows, key=lambda r: (r["stream_id"], r["start"])), key=lambda r: r["stream_id"]
    ):
        linked = [
            (r["family"] in ("elementwise", "reduction") and not r["in_optimizer"], r)
            for r in kernels
        ]
        for link, chain in groupby(linked, key=lambda x: x[0]):
            durations = [r["end"] - r["start"] for _, r in chain]
            if link and len(durations) >= 2:
                removable += sum(durations) - max(durations)
    assert removable > 0
    assert fusable_chain_ms(w.kern, w.n_steps) == pytest.approx(removable / 1e6 / w.n_steps)
    (m,) = [r.metrics for _, r in measured(f"{name}.sqlite")]
    assert m["fusable_chain_ms"] == pytest.approx(removable / 1e6 / w.n_steps, abs=1e-6)
