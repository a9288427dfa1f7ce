"""Issue 10: judge only what the trace supports. The three public exports nobody here wrote
(fixtures/external/README.md gives what an expert concluded about each) and the defects the
issue found on our own traces, each checked against an independent reading of the export with
sqlite3 (never traceclf's loader)."""

from __future__ import annotations

import json
import re
import sqlite3
from functools import cache
from pathlib import Path

import pytest
from helpers.cli import run_cli
from realtraces import trace_path

MEGATRON_OR_DL_FIXES = {
    "keep-allocator-cache", "selective-recompute", "fine-grained-offload", "pp-layout",
    "deepep", "hybridep", "ep-overlap", "ep-in-nvlink-domain", "dp-tp-overlap",
    "input-pipeline", "manual-gc", "larger-micro-batch", "fused-optimizer", "fp8",
}  # fmt: skip


@cache
def report(name: str) -> dict:
    code, out, err = run_cli("analyze", trace_path(name), "--format", "json", "--no-cache", "-q")
    assert code == 0, err
    return json.loads(out)


def sql(name: str, query: str, *args) -> list[tuple]:
    path = trace_path(name)
    con = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        return con.execute(query, args).fetchall()
    finally:
        con.close()


def union_ns(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


# ---------------------------------------------------------------------------------------------
# nvFuser unit test: abstain, and say the host was compiling


def test_nvfuser_unit_test_abstains_naming_the_facts():
    r = report("nvfuser_matmul_test_h100")
    cls = r["classification"]
    assert cls["bound"] is None and r["fixes"] == [] and r["report_version"] == 2
    kernels = sql("nvfuser_matmul_test_h100", "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    work = union_ns(
        sql(
            "nvfuser_matmul_test_h100",
            'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL '
            'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_MEMCPY UNION ALL '
            'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_MEMSET',
        )
    )
    # Issue 22: the host compiled under nested NVTX ranges (compileFusion, GpuLower, ...,
    # NVRTC::CompileProgram): the idle time under any of them, 347 ms, not the 313 ms under the
    # innermost alone
    spans = sql(
        "nvfuser_matmul_test_h100",
        'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL '
        'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_MEMCPY UNION ALL '
        'SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_MEMSET',
    )
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    compiling = re.compile(r"(?i)compil|nvrtc|\bjit\b|gpulower|inductor|dynamo|triton|autotun")
    ranges = [
        (max(a, lo), min(b, hi))
        for a, b, text in sql(
            "nvfuser_matmul_test_h100",
            'SELECT e.start, e."end", COALESCE(e.text, s.value) FROM NVTX_EVENTS e '
            'LEFT JOIN StringIds s ON s.id = e.textId WHERE e."end" IS NOT NULL',
        )
        if text and compiling.search(text) and b > lo and a < hi
    ]
    compile_ns = union_ns(ranges + spans) - union_ns(spans)  # idle under a compile range
    reason = cls["abstain_reason"]
    assert f"{kernels[0][0]} kernels" in reason  # 19
    assert f"{work / 1e6:.3g} ms of GPU work" in reason  # 0.406 ms
    assert "'KernelExecutor::compileFusion' → 'executor_utils::Nvrtc::CompileProgram'" in reason
    assert "(compile)" in reason
    assert compile_ns / 1e6 == pytest.approx(346.7, abs=0.1)
    assert f"{compile_ns / 1e6:.3g} ms" in reason  # 347 ms: the host was compiling
    assert "load" not in reason  # not "busy loading data"
    assert r["capture"]["training_loop"] == "not_a_loop"


# ---------------------------------------------------------------------------------------------
# CloverLeaf: not training; a sync after every kernel; no DL or allocator fixes


def test_cloverleaf_is_judged_without_dl_fixes_and_names_the_syncs():
    r = report("cloverleaf_a100")
    cls = r["classification"]
    assert cls["bound"] in ("compute", "host")
    assert not MEGATRON_OR_DL_FIXES & {f["id"] for f in r["fixes"]}
    assert all(f["advice"] == "generic" for f in r["fixes"])
    capture = r["capture"]
    assert capture["training_loop"] == "unknown"
    assert capture["step_anchor"]["source"] == "pattern" and capture["step_anchor"]["label"]
    # every launch is followed by a cudaDeviceSynchronize on the same thread
    calls = sql(
        "cloverleaf_a100",
        "SELECT s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
        "ORDER BY r.globalTid, r.start",
    )
    names = [n for (n,) in calls]
    launches = [i for i, n in enumerate(names) if n.startswith("cudaLaunchKernel")]
    followed = sum(names[i + 1].startswith("cudaDeviceSynchronize") for i in launches)
    assert followed == len(launches) == 1312
    m = r["metrics"]
    assert m["sync_calls_per_step"] >= m["launch_calls_per_step"]  # plus blocking cudaMemcpy
    assert 0.05 <= m["idle_sync_frac"] <= 0.1  # ~7.5% idle after syncs (expert)
    evidence = " ".join(cls["evidence"])
    assert "synchronising calls" in evidence and f"{m['idle_sync_frac']:.1%}" in evidence


# ---------------------------------------------------------------------------------------------
# Ulysses window: all-to-all from PyTorch's NVTX, forward only, no layout fixes


def test_ulysses_sendrecv_is_all_to_all_from_pytorch_nvtx():
    r = report("ulysses_2gpu_forward_window")
    assert list(r["comm_by_kind"]) == ["all_to_all"]
    assert r["capture"]["training_loop"] == "forward_only"
    assert r["capture"]["gpu_assignment"] == "own"
    ids = {f["id"] for f in r["fixes"]}
    assert not {"pp-layout", "dp-tp-overlap", "ep-overlap"} & ids
    assert r["classification"]["bound"] == "compute"
    # each rank's share of its window: the SendRecv kernels' union, independently
    for rank in r["ranks"]:
        lo, hi = rank["steps"]["window_ns"]
        pid = rank["pid"]
        rows = sql(
            "ulysses_2gpu_forward_window",
            'SELECT max(k.start, ?), min(k."end", ?) FROM CUPTI_ACTIVITY_KIND_KERNEL k '
            "JOIN StringIds s ON s.id = k.demangledName WHERE s.value LIKE 'ncclDevKernel%' "
            'AND ((k.globalPid >> 24) & 16777215) = ? AND k.start < ? AND k."end" > ?',
            lo, hi, pid, hi, lo,
        )  # fmt: skip
        expected = union_ns(rows) / (hi - lo)
        assert rank["comm_by_kind"]["all_to_all"]["frac"] == pytest.approx(expected, abs=2e-3)
        assert 0.01 < expected < 0.1  # ~4% of each rank's time


# ---------------------------------------------------------------------------------------------
# Our traces: shared GPU, warm-up kernel mix, the optimizer in graph replays


@pytest.mark.parametrize("name", ["h100_comm_ep2", "h100_comm_ep2_overlap"])
def test_ranks_that_share_a_gpu_are_never_stragglers(name):
    r = report(name)
    mapped = sql(name, "SELECT DISTINCT gpuId FROM TARGET_INFO_CUDA_DEVICE")
    assert len(mapped) == 1 and len(r["ranks"]) == 2  # both processes on GPU 0
    assert r["capture"]["ranks_share_gpu"] is True
    assert r["cross_rank"]["straggler_rank"] is None
    assert "share one GPU" in r["cross_rank"]["straggler_note"]
    assert "balance-expert-load" not in {f["id"] for f in r["fixes"]}


def test_graph_level_trace_takes_its_kernel_mix_from_the_warmup_before_capture():
    low = report("h100_compute_low_occupancy")
    assert "warm-up right before graph capture" in low["capture"]["kernel_mix_source"]
    # the initialisation randn (a reduction-family elementwise kernel) is not in the mix
    assert low["metrics"]["reduction_time_frac"] < 0.05
    assert low["metrics"]["gemm_time_frac"] > 0.8


def test_cudagraph_run_acts_on_its_optimizer_not_on_batched_gemms():
    graph, node = report("h100_host_cudagraph"), report("h100_host_cudagraph_nodetrace")
    for r in (graph, node):
        ids = [f["id"] for f in r["fixes"]]
        assert "fused-optimizer" in ids and "grouped-gemm" not in ids
    # the warm-up mix of the graph-level trace matches what the node-level twin shows in graphs
    g, n = graph["metrics"], node["metrics"]
    assert g["optimizer_time_frac"] == pytest.approx(n["optimizer_time_frac"], abs=0.03)
    # foreach Adam with its per-tensor div_ kernels between the foreach kernels: 64% (issue 22;
    # by kernel name alone 38-40%, and kernel-fusion ranked first on the graph-level twin);
    # recomputed from the rows in tests/test_measured_claims.py
    assert 0.63 <= n["optimizer_time_frac"] <= 0.66
    assert graph["fixes"][0]["id"] == node["fixes"][0]["id"] == "fused-optimizer"
    assert node["metrics"]["graph_internal_gap_frac"] == pytest.approx(0.038, abs=0.01)
    # graph replays counted whole as compute: an upper bound, said in the evidence as in the
    # headline (the node trace measures 96%, with gaps inside the replays)
    (busy,) = [e for e in graph["classification"]["evidence"] if e.startswith("compute kernels")]
    hidden = graph["metrics"]["graph_unresolved_frac"]
    assert f"an upper bound: the {hidden:.0%} of the step inside graph-level traced" in busy
    (busy,) = [e for e in node["classification"]["evidence"] if e.startswith("compute kernels")]
    assert node["metrics"]["graph_unresolved_frac"] == 0 and "upper bound" not in busy


def test_a_count_from_the_eager_warm_up_says_it_is_estimated():
    """Graph-level tracing hides the replays' kernels: the small GEMM's launches per step come
    from the eager warm-up's kernels scaled to one replay (1019 where the capture recorded
    1024 nvjet launches), said as an estimate; a node-level count is not."""
    low = report("h100_compute_low_occupancy")
    assert low["metrics"]["kernel_stats_outside_window"] is True
    (small,) = [e for e in low["classification"]["evidence"] if e.startswith("one GEMM shape")]
    assert "times per step (estimated from the eager warm-up's kernels)" in small
    # the capture recorded one cuLaunchKernelEx per nvjet GEMM (the 512 cudaLaunchKernel are
    # the elementwise kernels between them): the estimate is within 1% of it
    ((recorded,),) = sql(
        "h100_compute_low_occupancy",
        "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
        "WHERE s.value LIKE 'cuLaunchKernelEx%' AND r.start > (SELECT min(c.start) FROM "
        "CUPTI_ACTIVITY_KIND_RUNTIME c JOIN StringIds n ON n.id = c.nameId WHERE n.value LIKE "
        "'cudaStreamBeginCapture%') AND r.start < (SELECT min(c.start) FROM "
        "CUPTI_ACTIVITY_KIND_RUNTIME c JOIN StringIds n ON n.id = c.nameId WHERE n.value LIKE "
        "'cudaStreamEndCapture%')",
    )
    assert recorded == 1024
    assert low["metrics"]["small_gemm_repeats_per_step"] == pytest.approx(recorded, rel=0.01)
    # the optimizer's share of a graph-level run comes from the same eager kernels, and says so
    graph, node = report("h100_host_cudagraph"), report("h100_host_cudagraph_nodetrace")
    warm = "of kernel time (in the eager warm-up's kernels, as the graph replays hide theirs):"
    (said,) = [e for e in graph["classification"]["evidence"] if e.startswith("optimizer")]
    assert warm in said
    (said,) = [e for e in node["classification"]["evidence"] if e.startswith("optimizer")]
    assert "eager" not in said
    launch = report("h100_host_launch_gpumetrics")
    (small,) = [e for e in launch["classification"]["evidence"] if e.startswith("one GEMM shape")]
    assert "estimated" not in small
    fill = launch["metrics"]["small_grid_gemm_fill"]
    assert f"which fill {fill:.0%} of the SMs on average" in small


def test_per_tensor_optimizer_is_found_by_its_nvtx_range_not_by_kernel_names():
    """Unfused Adam runs as plain elementwise kernels: only the NVTX optimizer range says they
    are the optimizer's. Its ceiling is then the optimizer phase's compute time (the phase
    table: NVTX ranges projected onto the GPU), not zero, and fusion no longer counts them."""
    r = report("h100_host_launch_gpumetrics_trimmed")
    m = r["metrics"]
    assert m["optimizer_kernels_per_step"] == 84
    phase = next(p for p in r["ranks"][0]["phases"] if p["phase"] == "optimizer")
    fix = next(f for f in r["fixes"] if f["id"] == "fused-optimizer")
    assert fix["ceiling"]["recoverable_ms"] == pytest.approx(phase["compute_ms"], rel=0.05)
    assert fix["ceiling"]["recoverable_ms"] > 1.0
    # every kernel counted once: the family shares still add up to all kernel time
    shares = [v for k, v in m.items() if k.endswith("_time_frac")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-4)


def test_forward_only_ep_run_gets_no_delayed_wgrad():
    r = report("h100_comm_ep2")
    overlap = next(f for f in r["fixes"] if f["id"] == "ep-overlap")
    assert "delay_wgrad_compute" not in overlap["config"]
    assert overlap["evidence"]["a2a_exposed_frac"] == r["metrics"]["a2a_exposed_frac"]


def test_every_fix_says_what_triggered_it():
    for name in ("h100_memory_offload", "h100_host_launch_gpumetrics", "h100_comm_ep2"):
        for fix in report(name)["fixes"]:
            assert fix["evidence"], fix["id"]
            for key, value in fix["evidence"].items():
                if key in report(name)["metrics"] and isinstance(value, float):
                    assert value == pytest.approx(report(name)["metrics"][key], abs=1e-4)


def test_every_fix_shows_its_evidence_ceiling_and_how_to_verify_it():
    """Issue 11's ranked opportunities: evidence, recoverable ms/step and ceiling, action, and
    how to verify it in the next capture — in the JSON and in every rendered format."""
    code, md, _ = run_cli(
        "analyze", trace_path("h100_memory_offload"), "--format", "md", "--no-cache", "-q"
    )
    assert code == 0
    r = report("h100_memory_offload")
    for fix in r["fixes"]:
        assert fix["verify"] and fix["evidence"]
        ceiling = fix["ceiling"]
        assert 0 <= ceiling["recoverable_ms"] <= r["metrics"]["step_time_ms"]
        section = md.split(f"`{fix['id']}`", 1)[1].split("### ", 1)[0]
        assert "**Verify:** in the next capture:" in section
        assert "**At most:**" in section and "**Because:**" in section


def test_fusion_config_shows_moe_and_backward_lines_only_with_their_evidence():
    """Ulysses (forward only, no MoE routing kernels, all-to-all for sequence parallelism):
    no MoE router/permute fusion and no gradient-accumulation fusion (a backward-pass GEMM
    fusion). The Megatron MoE training run (routing kernels, backward) keeps both."""
    uly = next(
        f for f in report("ulysses_2gpu_forward_window")["fixes"] if f["id"] == "kernel-fusion"
    )
    assert "moe_" not in uly["config"] and "gradient_accumulation_fusion" not in uly["config"]
    assert "bias_activation_fusion" in uly["config"]
    moe = report("h100_moe_megatron_ep2")
    fusion = next(f for f in moe["fixes"] if f["id"] == "kernel-fusion")
    assert moe["capture"]["training_loop"] == "training"
    assert moe["capture"]["moe_evidence"] is True  # router / top-k / permute kernels
    assert "moe_permute_fusion" in fusion["config"]
    assert "gradient_accumulation_fusion" in fusion["config"]
    assert fusion["evidence"]["training_loop"] == "training"
    assert fusion["evidence"]["moe_evidence"] is True
    assert report("ulysses_2gpu_forward_window")["capture"]["moe_evidence"] is False


def test_forward_only_needs_a_framework_process():
    """A public CUTLASS benchmark (a C++ program: its kernels all CUTLASS, which the framework
    pattern counts as PyTorch runs put most of their time in cuBLAS/CUTLASS) read 'forward
    passes only'. A loop is a framework's forward only in a Python process (CONSTRUCTED facts:
    the benchmark's loop evidence, with and without Python)."""
    from traceclf.judge.abstention import training_loop
    from traceclf.judge.vocabulary import load_rules

    thresholds = load_rules().thresholds
    evidence = {"backward_kernels": 0, "optimizer_kernels": 0, "framework_kernel_frac": 1.0}
    facts = {"repeating": True, "training_evidence": evidence, "python_process": False}
    assert training_loop(facts, thresholds) == "unknown"
    assert training_loop(facts | {"python_process": True}, thresholds) == "forward_only"
