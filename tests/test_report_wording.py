"""Report sentences that must not contradict the numbers beside them, on real traces (and one
CONSTRUCTED copy): the capture's loop evidence, GPU work over several ranks, what the host
line says when there is nothing to attribute, and the fixes section when it lists none."""

from __future__ import annotations

import math
import re
import shutil
import sqlite3

import pytest
from realtraces import trace_path

import traceclf
from traceclf.render.capture_text import capture_rows
from traceclf.render.content import detail_rows, no_fixes_line
from traceclf.render.verdict import verdict_line
from traceclf.report.contract import Report


def rows(report) -> dict[str, str]:
    return dict(capture_rows(report)) | dict(detail_rows(report))


def nvtx_count(name: str, like: str) -> int:
    con = sqlite3.connect(f"file:{trace_path(name)}?mode=ro", uri=True)
    try:
        (n,) = con.execute(
            "SELECT count(*) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId "
            "WHERE coalesce(n.text, s.value) LIKE ?",
            (like,),
        ).fetchone()
    finally:
        con.close()
    return n


def test_loop_line_counts_the_nvtx_ranges_behind_a_training_verdict():
    """h100_host_launch_gpumetrics: its unfused Adam runs elementwise kernels (no optimizer
    kernel by name) inside NVTX 'optimizer' ranges; the loop line must show those ranges and
    count those kernels as the evidence does, not read '0 optimizer kernels' beside 'the
    optimizer step launches 84 kernels' (tests/test_report_consistency.py checks the counts)."""
    r = traceclf.analyze(trace_path("h100_host_launch_gpumetrics"), use_cache=False)
    ranges = nvtx_count("h100_host_launch_gpumetrics", "optimizer")
    assert ranges > 0 and r.capture["training_evidence"]["optimizer_kernels"] == 528
    assert f"{ranges} optimizer NVTX ranges" in rows(r)["Loop"]
    assert "528 optimizer kernels (84 per steady step)" in rows(r)["Loop"]


def test_gpu_work_of_several_ranks_is_said_to_be_summed():
    """ulysses_2gpu_forward_window: 541 ms of GPU work over two ranks in a 300 ms capture."""
    r = traceclf.analyze(trace_path("ulysses_2gpu_forward_window"), use_cache=False)
    c = r.capture
    assert c["gpu_work_ms"] > c["capture_ms"]
    assert "summed over 2 ranks" in rows(r)["Work"]


def test_host_line_without_long_idle_gaps_says_so():
    """h100_host_cudagraph: the GPU is busy ~100%, so there are no gaps to attribute."""
    r = traceclf.analyze(trace_path("h100_host_cudagraph"), use_cache=False)
    assert r.metrics["idle_input_frac"] + r.metrics["idle_host_frac"] == 0
    assert rows(r)["Host"].startswith("no long idle gaps")


def test_no_fixes_line_does_not_deny_the_evidence_shown():
    """A report whose evidence names a finding but which proposes no fix must not say the trace
    shows no evidence. (This used cloverleaf_a100 with no fix; since issue 22 its sync fix is
    proposed beside the bound, tests/test_ceilings.py, so the line is read off its report with
    the fixes taken out.)"""
    r = traceclf.analyze(trace_path("cloverleaf_a100"), use_cache=False)
    assert any("synchronising" in e for e in r.classification["evidence"])
    line = no_fixes_line(Report.from_dict(r.to_dict() | {"fixes": []}))
    assert "evidence for" not in line and "findings above" in line


def test_compute_line_without_kernels_in_the_window(tmp_path):
    """h100_memory_offload with every kernel but the first deleted (CONSTRUCTED: a copy-only
    loop): no family list that starts with ' of kernel time'."""
    path = shutil.copyfile(trace_path("h100_memory_offload"), tmp_path / "copies_only.sqlite")
    con = sqlite3.connect(path)
    con.execute(
        "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL "
        "WHERE rowid != (SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)"
    )
    con.commit()
    con.close()
    r = traceclf.analyze(path, use_cache=False)
    assert rows(r)["Compute"].startswith("no kernel time in the window")
    assert "10 backward NVTX ranges" in rows(r)["Loop"]


@pytest.mark.parametrize("name", ["nvfuser_matmul_test_h100"])
def test_abstaining_report_points_at_its_reason(name):
    r = traceclf.analyze(trace_path(name), use_cache=False)
    assert r.abstained and "abstains" in no_fixes_line(r)


def test_megatron_config_is_labelled_and_the_pytorch_hint_shown():
    """The Ulysses window is a plain torchrun job: the fusion fix's ``cfg.model.…`` lines are
    Megatron-Bridge's, so every format says so and gives the PyTorch way beside them."""
    from traceclf.render.content import config_caption, fix_facts
    from traceclf.render.html import render_html
    from traceclf.render.markdown import render_markdown

    r = traceclf.analyze(trace_path("ulysses_2gpu_forward_window"), use_cache=False)
    fusion = next(f for f in r.fixes if f["id"] == "kernel-fusion")
    assert fusion["advice"] == "framework" and fusion["config"].startswith("cfg.model.")
    assert config_caption(fusion) == "Megatron-Bridge config"
    assert dict(fix_facts(fusion))["In PyTorch"].startswith("torch.compile")
    for text in (render_markdown(r), render_html(r)):
        assert "Megatron-Bridge config:" in text and "In PyTorch" in text


def test_a_window_without_steps_is_not_called_a_step():
    """nvFuser's test compiles and runs 19 kernels once: no step is found and the whole GPU
    span is the window, so no format speaks of a steady state or of figures per step (the
    rank table's step column shows '–'); the figures are over the window, and the idle time
    per window in the attribution's title is the window's length times its idle share."""
    import re

    from traceclf.render.html import render_html
    from traceclf.render.markdown import render_markdown
    from traceclf.render.terminal import render_terminal

    r = traceclf.analyze(trace_path("nvfuser_matmul_test_h100"), use_cache=False)
    assert r.steps.get("count") in (0, None)
    lo, hi = r.steps["window_ns"][:2]
    idle_ms = r.metrics["gpu_idle_frac"] * (hi - lo) / 1e6
    for text in (render_terminal(r, True, 200), render_markdown(r), render_html(r)):
        assert not re.search(r"steady.state|/step|per step|of the step|share of step", text)
        assert "Where the window goes" in text and "kernels/window" in text
        assert f"{idle_ms:.0f} ms per window idle" in text


def test_sort_and_routing_kernels_are_named_for_what_they_do():
    """The family ``permute_moe`` (its JSON name) holds MoE routing and any sort, gather or
    scatter: a report calls it 'permute/sort/gather', so a CUDA sample's radix sort is not
    read as MoE. On the all-to-all trace (permute kernels a share of kernel time, recomputed
    here from its top kernels' family) the Compute row and the kernel table say so."""
    from traceclf.render.content import kernel_rows
    from traceclf.render.markdown import render_markdown

    r = traceclf.analyze(trace_path("h100_comm_a2a_gpumetrics"), use_cache=False)
    assert r.metrics["permute_moe_time_frac"] > 0.01
    assert "permute/sort/gather" in rows(r)["Compute"]
    top = r.ranks[0]["top_kernels"][:8]
    shown = [row[1] for row in kernel_rows(r)]
    assert [s == "permute/sort/gather" for s in shown] == [
        k["family"] == "permute_moe" for k in top
    ]
    assert "permute_moe" not in render_markdown(r)


def test_the_host_line_says_what_the_capture_lacks():
    """CloverLeaf holds no NVTX (host sources: CUDA API, OS runtime, samples, scheduling) and
    no long idle gaps. With its long gaps EDITED to 35% of the step (the report's own facts,
    changed here), the host line says no NVTX was captured to name them, not that no NVTX
    range covers them; edited to none, that there are none."""
    r = traceclf.analyze(trace_path("cloverleaf_a100"), use_cache=False)
    assert "nvtx" not in r.capture["host_sources"] and not any(x.get("idle_nvtx") for x in r.ranks)
    r.metrics["idle_host_frac"], r.metrics["idle_input_frac"] = 0.35, 0.0
    assert (
        rows(r)["Host"]
        == "the GPU's long idle gaps (35% of the step): no NVTX captured to name them"
    )
    r.metrics["idle_host_frac"] = 0.0002  # (a 4 ms gap of a 550 ms step is one still)
    assert "(0.0% of the step): no NVTX captured" in rows(r)["Host"]
    r.metrics["idle_host_frac"] = 0.0
    assert rows(r)["Host"].startswith("no long idle gaps")


def test_compute_bound_says_what_limits_the_kernels_is_not_shown():
    """COMPUTE-bound means kernels fill the step. CloverLeaf (stencils, no GPU metrics) is
    told that what limits its kernels, DRAM bandwidth or math, is not in the trace; the dense
    GEMM run, whose GPU metrics show the tensor cores active most of the window (recomputed
    from its GPU_METRICS rows here), is not."""
    clover = traceclf.analyze(trace_path("cloverleaf_a100"), use_cache=False)
    assert clover.classification["bound"] == "compute"
    assert clover.metrics.get("tensor_active_mean") is None
    said = " ".join(clover.classification["evidence"])
    assert "DRAM bandwidth or math, is not in this trace" in said
    path = trace_path("h100_compute_dense_gpumetrics")
    dense = traceclf.analyze(path, use_cache=False)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    (ids,) = zip(
        *con.execute(
            "SELECT metricId FROM TARGET_INFO_GPU_METRICS WHERE metricName LIKE 'Tensor Active%'"
        ),
        strict=True,
    )
    lo, hi = dense.steps["window_ns"][:2]
    (mean,) = con.execute(
        f"SELECT avg(value) FROM GPU_METRICS WHERE metricId IN ({','.join(map(str, set(ids)))})"
        " AND timestamp BETWEEN ? AND ?",
        (lo, hi),
    ).fetchone()
    assert mean / 100 > 0.5 and dense.metrics["tensor_active_mean"] > 0.5
    assert "is not in this trace" not in " ".join(dense.classification["evidence"])


def test_generic_advice_is_fenced_as_text():
    """CloverLeaf (no framework) gets generic advice in prose: Markdown fences it as text, not
    as Python; the MoE run's Megatron-Bridge assignments stay Python."""
    from traceclf.render.markdown import render_markdown

    clover = traceclf.analyze(trace_path("cloverleaf_a100"), use_cache=False)
    assert clover.fixes and all(f["advice"] == "generic" for f in clover.fixes)
    text = render_markdown(clover)
    assert "```text" in text and "```python" not in text
    moe = traceclf.analyze(trace_path("h100_moe_megatron_ep2"), use_cache=False)
    assert "```python" in render_markdown(moe)


CONFIDENCE = re.compile(
    r"confidence \w+: ([\d.]+) = ([\d.]+) of the step explained × ([\d.]+) window reliability"
    r"(?: \((.*)\))?$"
)


@pytest.mark.parametrize(
    "name", ["h100_comm_ep2", "h100_host_launch_gpumetrics", "h100_host_cudagraph"]
)
def test_the_confidence_equation_multiplies_as_printed(name: str) -> None:
    """'0.79 = 1.00 of the step explained × 0.80 window reliability (... ×0.80, ... ×0.99)'
    held for neither product (0.996 × 0.796 printed at two decimals): the figures carry as
    many decimals as the products need."""
    line = verdict_line(traceclf.analyze(trace_path(name)))
    confidence, explained, reliability, factors = CONFIDENCE.search(line).groups()
    d = len(confidence.split(".")[1])
    assert round(float(explained) * float(reliability), d) == float(confidence), line
    shown = [float(v) for v in re.findall(r"×([\d.]+)", factors or "")]
    assert round(math.prod(shown), d) == float(reliability), line


def test_durations_read_as_durations_at_every_scale():
    """Constructed values: a duration reads in the unit its size needs, never in scientific
    notation (a budget row of a 52 µs step read '4.06e-05 ms' for 41 ns of copies)."""
    from traceclf.support.units import fmt_ms, fmt_us

    assert fmt_ms(4.06e-05) == "40.6 ns"
    assert fmt_ms(0.0524) == "0.0524 ms"
    assert fmt_ms(0) == "0 ms"
    assert fmt_ms(2500) == "2.5 s"
    assert fmt_us(6560) == "6.56 ms"
    assert fmt_us(0.5) == "0.5 µs"
    assert fmt_ms(0.0009996) == "0.001 ms"  # (rounds to a µs: not "1e+03 ns")
    for v in (1e-9, 3e-7, 1e-4, 9.994e-4, 9.996e-4, 0.01, 1.0, 123.0, 9.99e5, 9.996e5):
        assert "e" not in fmt_ms(v).split()[0], fmt_ms(v)


def test_graph_level_launch_line_says_what_it_cannot_see():
    """h100_compute_low_occupancy (graph-level tracing): its GEMMs run inside the replays, so
    the window's own kernels per step are 0; the Launches line read "0 kernels/step, median
    kernel 4 µs vs launch 320 µs" beside "one small GEMM shape runs 1019 times per step" (an
    eager kernel against a whole graph's launch call). It says the replays' kernels are unseen
    and where the median kernel comes from, and the compute line says the small-grid share is
    one of kernels, not of kernel time."""
    r = traceclf.analyze(trace_path("h100_compute_low_occupancy"), use_cache=False)
    assert r.metrics["kernel_stats_outside_window"] is True
    line = rows(r)["Launches"]
    assert "graph launches/step (their kernels unseen: graph-level tracing)" in line
    assert "(the eager warm-up's), median launch call" in line and " vs launch " not in line
    small = r.metrics["small_grid_kernel_frac"]
    assert f"{100 * small:.0f}% of kernels with fewer blocks than SMs" in rows(r)["Compute"]
    eager = traceclf.analyze(trace_path("h100_host_launch_gpumetrics"), use_cache=False)
    assert " vs launch " in rows(eager)["Launches"]
    assert "(84 per steady step)" in rows(eager)["Loop"]
    # the optimizer's kernels per step come from the eager iteration too ("75 per steady step"
    # read beside 153 in the whole capture)
    graphed = traceclf.analyze(trace_path("h100_host_cudagraph"), use_cache=False)
    per_step = graphed.metrics["optimizer_kernels_per_step"]
    said = f"({per_step:.3g} per step in the eager warm-up; the graph replays' unseen)"
    assert said in rows(graphed)["Loop"]


def test_because_row_gives_bytes_in_their_unit():
    """h100_memory_offload: a fix's "Because" row read "d2h_bytes_per_step 2.82e+09"; it gives
    the bytes the run's metrics hold in their unit, and no value in scientific notation."""
    from traceclf.render.content import fix_facts
    from traceclf.support.units import fmt_bytes

    r = traceclf.analyze(trace_path("h100_memory_offload"), use_cache=False)
    (fix,) = [f for f in r.fixes if f["id"] == "fine-grained-offload"]
    because = dict(fix_facts(fix))["Because"]
    d2h = fix["evidence"]["d2h_bytes_per_step"]
    assert 1e9 <= d2h == r.metrics["d2h_bytes_per_step"] < 1e12
    assert f"d2h_bytes_per_step {d2h / 1e9:.3g} GB" in because
    for f in r.fixes:
        assert not re.search(r"\de[+-]\d", dict(fix_facts(f)).get("Because", "")), f["id"]
    # (CONSTRUCTED sizes at the units' edges: as printed, 999,950 B is 1 MB, not "1e+03 KB")
    sizes = {999: "999 B", 999.6: "1 KB", 999_950: "1 MB", 9.996e8: "1 GB", 2.5e15: "2,500 TB"}
    assert {v: fmt_bytes(v) for v in sizes} == sizes
    assert fmt_bytes(float("nan")) == "–"


def test_an_export_without_metadata_says_its_nsys_version_is_unknown():
    """A public OpenACC export has no metadata table: its provenance read "nsys ?, schema ?"
    (constructed input entries, as reports hold them)."""
    from traceclf.render.text import nsys_text

    assert nsys_text({"nsys_version": None, "schema_version": None}) == (
        "nsys version unknown (no export metadata)"
    )
    assert nsys_text({"nsys_version": "2025.3.2.0", "schema_version": "3.20.3"}) == (
        "nsys 2025.3.2.0 (schema 3.20.3)"
    )
    assert nsys_text({"nsys_version": "2021.1.1", "schema_version": None}) == (
        "nsys 2021.1.1 (schema unknown)"
    )


def test_a_bound_its_fixes_leave_the_largest_wall_is_its_own_next_wall():
    """ep2's one fix with a measured ceiling (EP overlap) hides 2% of a step that is 97%
    all-to-all: "Next wall: compute" had rested on DeepEP's "up to the exposed all-to-all",
    which bounds nothing. Every format says the bound stays, and why."""
    from traceclf.render.html import render_html
    from traceclf.render.markdown import render_markdown

    r = traceclf.analyze(trace_path("h100_comm_ep2"))
    assert r.bound == r.next_wall == "communication"
    said = "communication still: its fixes with a measured ceiling leave it the largest wall"
    assert f"**Next wall once this one is fixed:** {said}" in render_markdown(r)
    assert said in render_html(r)
