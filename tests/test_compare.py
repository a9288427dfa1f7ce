"""`traceclf compare`: verdicts on real before/after traces, the noise band, exit codes."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sqlite3
from pathlib import Path

import pytest
from helpers.cli import run_cli
from realtraces import trace_path

import traceclf
from traceclf.compare.changes import graph_tracing
from traceclf.compare.regression import compare_reports
from traceclf.render.compared import comparison_markdown
from traceclf.report.contract import WALLS, Report
from traceclf.support.units import fmt_ms

SLOW, FAST = "h100_host_launch_gpumetrics", "h100_host_cudagraph"  # the same model, unfixed/fixed


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    names = (SLOW, FAST, "h100_comm_ep2", "h100_comm_ep2_overlap")
    return {n: traceclf.analyze(trace_path(n), use_cache=False) for n in names}


@pytest.fixture(scope="module")
def saved(reports: dict[str, Report], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reports saved as `traceclf analyze --format json -o` would."""
    folder = tmp_path_factory.mktemp("reports")
    paths = {}
    for name, report in reports.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(report.to_json(), encoding="utf-8")
    return paths


def synthetic(mean_ms: float, cv: float | None, used: int, **changes) -> Report:
    """A minimal report with the given step statistics."""
    data = {
        "report_version": 1,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3"}],
        "steps": {
            "source": "nvtx",
            "label": "step",
            "count": used + 1,
            "used": used,
            "mean_ms": mean_ms,
            "median_ms": mean_ms,
            "cv": cv,
        },
        "ranks": [{"rank": 0, "pid": 1, "metrics": {}}],
        "metrics": {"gpu_busy_frac": 0.9, "kernels_per_step": 100.0},
        "classification": {"bound": "compute", "confidence": 0.8},
    }
    return Report.from_dict(data | changes)


# Real traces, through the command line -------------------------------------------------------


def test_fixing_the_host_wall_is_an_improvement(tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    code, _, err = run_cli(
        "compare", trace_path(SLOW), trace_path(FAST), "-f", "json", "-o", out, "--no-cache", "-q"
    )
    assert code == 0, err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["verdict"] == "improvement" and result["regression"] is False
    assert result["step_change_frac"] < -0.9  # ~200 ms -> ~4.5 ms per step
    assert abs(result["step_change_ms"]) > result["noise_ms"] > 0
    assert result["before"]["bound"] in WALLS and result["after"]["bound"] in WALLS
    assert result["bound_changed"] == (result["before"]["bound"] != result["after"]["bound"])
    moved = {m["key"] for m in result["measures"] if m["material"]}
    assert {"gpu_busy_frac", "kernels_per_step", "sync_calls_per_step"} <= moved
    assert result["comparable"] is True and result["notes"] == []


def test_undoing_the_fix_is_a_regression() -> None:
    code, out, err = run_cli("compare", trace_path(FAST), trace_path(SLOW), "--no-cache", "-q")
    assert code == 1, err
    assert "Regression: step" in out and "beyond the noise band" in out
    assert "Measures that moved" in out


def test_a_run_compared_with_itself_has_no_change(saved: dict[str, Path]) -> None:
    code, out, err = run_cli("compare", saved["h100_comm_ep2"], saved["h100_comm_ep2"], "-f", "md")
    assert code == 0, err
    assert "# traceclf compare: no significant change" in out
    assert "No measure moved materially." in out and "Bound unchanged" in out


def test_saved_reports_and_traces_mix(saved: dict[str, Path]) -> None:
    code, out, err = run_cli(
        "compare", saved[FAST], trace_path(SLOW), "-f", "json", "--no-cache", "-q"
    )
    assert code == 1, err
    assert json.loads(out)["verdict"] == "regression"


def test_threshold_option_moves_the_gate(saved: dict[str, Path]) -> None:
    # ~44x slower clears any sane threshold; a threshold of 100x does not
    code, out, _ = run_cli("compare", saved[FAST], saved[SLOW], "--threshold", "100", "-f", "json")
    assert code == 0
    assert json.loads(out)["verdict"] == "no significant change"


@pytest.mark.parametrize("fmt", ["terminal", "md", "json"])
def test_output_file_is_written_whole(fmt: str, saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / f"cmp.{fmt}"
    code, stdout, err = run_cli("compare", saved[SLOW], saved[FAST], "-f", fmt, "-o", out)
    assert (code, stdout) == (0, ""), err
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    assert "mprovement" in out.read_text(encoding="utf-8")


# Bad input -----------------------------------------------------------------------------------


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    not_report = tmp_path / "not_report.json"
    not_report.write_text('{"hello": 1}', encoding="utf-8")
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    not_sqlite = tmp_path / "notes.sqlite"
    not_sqlite.write_text("not a database", encoding="utf-8")
    return {
        "missing": tmp_path / "missing.sqlite",
        "missing_json": tmp_path / "missing.json",
        "not_report": not_report,
        "broken": broken,
        "not_sqlite": not_sqlite,
    }


@pytest.mark.parametrize("kind", ["missing", "missing_json", "not_report", "broken", "not_sqlite"])
@pytest.mark.parametrize("side", ["before", "after"])
def test_bad_input_exits_2_naming_the_file(
    kind: str, side: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    bad = _bad_inputs(tmp_path)[kind]
    good = saved["h100_comm_ep2"]
    pair = (bad, good) if side == "before" else (good, bad)
    out = tmp_path / "cmp.md"
    code, stdout, err = run_cli("compare", *pair, "-f", "md", "-o", out, "--no-cache", "-q")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and bad.name in err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()


def test_negative_threshold_is_bad_input(saved: dict[str, Path]) -> None:
    code, _, err = run_cli("compare", saved[FAST], saved[SLOW], "--threshold", "-0.1")
    assert code == 2 and "threshold" in err


# The comparison itself -----------------------------------------------------------------------


def test_overlap_change_is_within_noise(reports: dict[str, Report]) -> None:
    result = compare_reports(reports["h100_comm_ep2"], reports["h100_comm_ep2_overlap"])
    assert result.verdict == "no significant change" and not result.regression
    assert abs(result.step_change_frac) < 0.05


def test_noise_band_is_two_standard_errors_of_the_difference() -> None:
    before, after = synthetic(100.0, 0.06, 9), synthetic(104.0, 0.03, 16)
    result = compare_reports(before, after)
    se_b, se_a = 0.06 * 100 / math.sqrt(9), 0.03 * 104 / math.sqrt(16)
    assert result.noise_ms == pytest.approx(2 * math.sqrt(se_b**2 + se_a**2))
    assert result.noise_frac == pytest.approx(result.noise_ms / 100)
    assert result.step_change_frac == pytest.approx(0.04)


@pytest.mark.parametrize(
    ("after_ms", "cv", "verdict"),
    [
        (106.0, 0.001, "regression"),  # past the threshold and the (tiny) noise
        (106.0, 0.20, "no significant change"),  # past the threshold, inside the noise
        (103.0, 0.001, "no significant change"),  # real, but inside the 5% threshold
        (94.0, 0.001, "improvement"),
        (100.0, 0.0, "no significant change"),
    ],
)
def test_verdict_needs_both_threshold_and_noise(after_ms: float, cv: float, verdict: str) -> None:
    result = compare_reports(synthetic(100.0, cv, 10), synthetic(after_ms, cv, 10))
    assert result.verdict == verdict
    assert result.regression is (verdict == "regression")


def test_runs_without_steps_compare_but_say_so() -> None:
    no_steps = {"source": "none", "count": 0, "used": 0, "mean_ms": None, "cv": None}
    result = compare_reports(synthetic(100.0, 0.01, 10), synthetic(100.0, None, 0, steps=no_steps))
    assert result.verdict == "inconclusive" and not result.regression
    assert not result.comparable and any("no steps" in n for n in result.notes)
    assert "Not directly comparable" in comparison_markdown(result)


def test_runs_on_different_gpus_are_not_gated() -> None:
    """Constructed reports: a step twice as long on another GPU is no regression of the code,
    and no CI gate should fail (or pass) on it."""
    b200 = [{"name": "NVIDIA B200"}]
    result = compare_reports(synthetic(100.0, 0.01, 10), synthetic(200.0, 0.01, 10, gpus=b200))
    assert result.verdict == "inconclusive" and not result.regression and not result.comparable
    assert result.notes == ["different GPUs: NVIDIA H100 80GB HBM3 vs NVIDIA B200"]
    assert result.summary == (
        "Inconclusive: the runs are not comparable (different GPUs), so their step 100 ms → "
        "200 ms (+100%) is not gated."
    )


def test_a_change_within_the_threshold_but_beyond_noise_says_both() -> None:
    result = compare_reports(synthetic(100.0, 0.001, 10), synthetic(103.0, 0.001, 10))
    assert result.verdict == "no significant change" and result.noise_ms < 3.0
    assert result.summary.endswith(
        f"beyond the noise band (±{fmt_ms(result.noise_ms)}) but within the 5% threshold (±5 ms)."
    )


def test_measures_compare_in_points_or_relative() -> None:
    after_metrics = {"gpu_busy_frac": 0.85, "kernels_per_step": 130.0}
    result = compare_reports(
        synthetic(100.0, 0.01, 10), synthetic(100.0, 0.01, 10, metrics=after_metrics)
    )
    by_key = {m.key: m for m in result.measures}
    busy, kernels = by_key["gpu_busy_frac"], by_key["kernels_per_step"]
    assert busy.change == pytest.approx(-0.05) and busy.material
    assert busy.cells() == ("GPU busy", "90%", "85%", "-5.0 pp")
    assert busy.describe() == "GPU busy 90% → 85% (-5.0 pp)"  # (docs/api.md)
    assert kernels.change == pytest.approx(0.30) and kernels.material
    assert kernels.cells() == ("kernels/step", "100", "130", "+30%")
    assert [m.key for m in result.moved] == ["gpu_busy_frac", "kernels_per_step"]


# What explains a result (issue 14) ----------------------------------------------------------


def test_overlap_and_applied_fix_changes_are_reported(reports: dict[str, Report]) -> None:
    result = compare_reports(reports["h100_comm_ep2"], reports["h100_comm_ep2_overlap"])
    under = next(m for m in result.moved if m.key == "compute_under_comm_frac")
    m_before = reports["h100_comm_ep2"].metrics["compute_under_comm_frac"]
    m_after = reports["h100_comm_ep2_overlap"].metrics["compute_under_comm_frac"]
    assert (
        (under.before, under.after) == (m_before, m_after) == (0.0, pytest.approx(0.35, abs=0.02))
    )
    assert any(e.startswith("now applied: EP overlap present") for e in result.explanations)
    assert "no longer proposed: ep-overlap" in result.explanations
    md = comparison_markdown(result)
    assert "## What changed besides the measures" in md and "compute under communication" in md


def test_tracing_mode_difference_is_not_gated() -> None:
    """One run traced both ways: node-level tracing lengthens every replay by its own cost
    (the replays' spans, read from the exports here), so a gate on the step time would fail on
    the tracing, not the code; per-kernel measures count different things."""
    graph = traceclf.analyze(trace_path("h100_host_cudagraph"))
    node = traceclf.analyze(trace_path("h100_host_cudagraph_nodetrace"))
    assert (graph.metrics["kernels_per_step"], node.metrics["kernels_per_step"]) == (1.0, 290.0)
    with sqlite3.connect(trace_path("h100_host_cudagraph")) as con:
        (graph_replay,) = con.execute(
            "SELECT avg(end - start) FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE"
        ).fetchone()
    with sqlite3.connect(trace_path("h100_host_cudagraph_nodetrace")) as con:
        (node_replay,) = con.execute(
            "SELECT avg(e - s) FROM (SELECT min(start) AS s, max(end) AS e "
            "FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE graphNodeId IS NOT NULL GROUP BY correlationId)"
        ).fetchone()
    assert node_replay / graph_replay == pytest.approx(1.024, abs=0.005)
    result = compare_reports(graph, node, threshold=0.02)
    assert result.step_change_frac > 0.02 and abs(result.step_change_ms) > result.noise_ms
    assert result.verdict == "inconclusive" and not result.regression and not result.comparable
    assert "not comparable (CUDA graphs traced differently (graph-level → node-level))" in (
        result.summary
    )
    assert "kernels_per_step" not in {m.key for m in result.moved}
    assert (result.before.graph_tracing, result.after.graph_tracing) == ("graph", "node")
    # (what the reports' capture blocks say, and what their measures show without them)
    assert (graph.capture["graph_trace_mode"], node.capture["graph_trace_mode"]) == (
        "graph",
        "node",
    )
    bare = [dataclasses.replace(r, capture={}) for r in (graph, node)]
    assert [graph_tracing(r) for r in bare] == ["graph", "node"]
    assert graph_tracing(dataclasses.replace(graph, capture={"graph_trace_mode": "node"})) == "node"
    assert "graph-level → node-level" in result.explanations[0]
    assert "## Measures that differ (inconclusive comparison" in comparison_markdown(result)
    # the idle between a node-traced replay's kernels is in the replays, not outside them
    inside, outside = (p for p in result.breakdown.phases if p.kind == "graph")
    assert inside.after_ms_per_step == pytest.approx(node_replay / 1e6, rel=0.005)
    with sqlite3.connect(trace_path("h100_host_cudagraph_nodetrace")) as con:
        work = sorted(
            con.execute(
                "SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL "
                "SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY UNION ALL "
                "SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMSET"
            ).fetchall()
        )
        replays = con.execute(
            "SELECT min(start), max(end) FROM CUPTI_ACTIVITY_KIND_KERNEL "
            "WHERE graphNodeId IS NOT NULL GROUP BY correlationId"
        ).fetchall()
    idle = [hi - lo - _covered(work, lo, hi) for lo, hi in replays]
    assert inside.after_idle_ms == pytest.approx(sum(idle) / len(idle) / 1e6, abs=0.003)
    assert inside.after_busy_ms + inside.after_idle_ms == pytest.approx(inside.after_ms_per_step)
    assert min(p.before_busy_ms for p in (inside, outside)) >= 0
    assert min(p.after_busy_ms for p in (inside, outside)) >= 0


def _covered(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """ns of [lo, hi) that the sorted ``intervals`` cover."""
    reach, total = lo, 0
    for start, end in intervals:
        if start >= hi:
            break
        if end > reach:
            total += min(end, hi) - max(start, reach)
            reach = end
    return total


def test_kernel_sizes_from_the_warm_up_are_said_to_be(reports: dict[str, Report]) -> None:
    """The graph-level traced run's kernel sizes come from its eager warm-up (its report says
    so: kernel_stats_outside_window); a comparison that sets them beside the eager run's says
    where they come from."""
    graph = reports[FAST]
    assert graph.metrics["kernel_stats_outside_window"] is True
    result = compare_reports(reports[SLOW], graph, labels=(f"{SLOW}.sqlite", f"{FAST}.sqlite"))
    assert any(
        e.startswith("kernel sizes of h100_host_cudagraph.sqlite") and "eager warm-up" in e
        for e in result.explanations
    )
    eager = compare_reports(reports[SLOW], reports[SLOW])
    assert not any(e.startswith("kernel sizes of") for e in eager.explanations)


def test_graph_launches_count_as_launches(reports: dict[str, Report]) -> None:
    fast = reports[FAST].metrics
    assert fast["launch_calls_per_step"] == 2.0 and fast["graph_launches_per_step"] == 1.0
    result = compare_reports(reports[SLOW], reports[FAST])
    launches = next(m for m in result.measures if m.key == "launches_per_step")
    assert launches.after == 2.0  # the cudaGraphLaunch and one eager kernel per step
    assert launches.before == reports[SLOW].metrics["launch_calls_per_step"]


def test_reports_that_missed_graph_launches_count_the_executions(
    reports: dict[str, Report],
) -> None:
    """A report saved by a traceclf that clipped calls to the GPU window by time read 0 launch
    calls on graph runs: its graph executions per step stand in."""
    from traceclf.compare.changes import metrics_of

    old = copy.deepcopy(reports[FAST])
    old.metrics["launch_calls_per_step"] = 0.0
    assert metrics_of(old)["launches_per_step"] == 1.0


def test_baseline_and_several_candidates(saved: dict[str, Path], tmp_path: Path) -> None:
    code, out, err = run_cli("compare", saved[FAST], saved[FAST], saved[SLOW], "-f", "json")
    assert code == 1, err  # one of the two regresses
    data = json.loads(out)
    assert data["regression"] is True and data["baseline"] == str(saved[FAST])
    assert [c["verdict"] for c in data["comparisons"]] == ["no significant change", "regression"]
    code, out, _ = run_cli("compare", saved[SLOW], saved[FAST], saved[SLOW])
    assert code == 0
    assert "No regression in 2 candidates" in out
    for column in ("candidate", "step before", "step after", "change", "verdict", "bound"):
        assert column in out
    code, out, _ = run_cli("compare", saved[FAST], saved[FAST], saved[SLOW], "-f", "md")
    assert code == 1 and "| candidate | step before |" in out
    assert "\n## traceclf compare: regression" in out  # each comparison below, demoted


def test_saved_report_version_2_that_abstains(saved: dict[str, Path]) -> None:
    v2 = json.loads(saved[FAST].read_text())
    v2 |= {
        "report_version": 2,
        "capture": {"graph_trace_mode": "graph"},
        "classification": v2["classification"]
        | {"bound": None, "abstain_reason": "too few steady steps"},
    }
    candidate = saved[FAST].with_name("v2.json")
    candidate.write_text(json.dumps(v2))
    # a run traceclf abstained on cannot be compared: exit 3, one line on stderr (issue 24)
    code, out, err = run_cli("compare", saved[FAST], candidate, "-f", "json")
    assert code == 3 and err.count("\n") == 1 and "too few steady steps" in err
    assert json.loads(out)["verdict"] == "inconclusive"
    code, out, err = run_cli(
        "compare", saved[FAST], candidate, "-f", "json", "--allow-inconclusive"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["after"]["bound"] is None and data["after"]["report_version"] == 2
    assert any("did not name a bound (too few steady steps)" in n for n in data["notes"])
    code, out, err = run_cli("compare", saved[FAST], candidate, "--allow-inconclusive")
    assert code == 0 and "abstained" in out


def test_saved_report_with_wrong_types_does_not_crash(saved: dict[str, Path]) -> None:
    data = json.loads(saved[FAST].read_text())
    data["steps"] = ["not", "a", "dict"]
    data["metrics"]["kernels_per_step"] = "many"
    data["applied"] = [{"id": 3}, None, "graphs"]
    odd = saved[FAST].with_name("odd.json")
    odd.write_text(json.dumps(data))
    code, out, err = run_cli("compare", saved[FAST], odd, "-f", "json")
    assert code == 3 and "Traceback" not in err
    code, out, err = run_cli("compare", saved[FAST], odd, "-f", "json", "--allow-inconclusive")
    assert code == 0, err
    assert json.loads(out)["verdict"] == "inconclusive"


@pytest.mark.parametrize("threshold", ["nan", "inf"])
def test_threshold_must_be_finite(saved: dict[str, Path], threshold: str) -> None:
    code, _, err = run_cli("compare", saved[FAST], saved[SLOW], "--threshold", threshold)
    assert code == 2 and "threshold" in err


def test_a_folder_of_unrelated_runs_is_not_one_side(saved: dict[str, Path], tmp_path) -> None:
    for name in (FAST, "h100_comm_ep2"):
        (tmp_path / f"{name}.sqlite").write_bytes(trace_path(name).read_bytes())
    code, out, err = run_cli("compare", saved[FAST], tmp_path, "-q")
    assert code == 2 and out == ""
    assert "holds 2 separate runs; compare one run at a time" in err


def test_the_bound_line_names_what_moved_the_confidence(reports: dict[str, Report]) -> None:
    """Host-launch before and after CUDA graphs: the confidence moves, and the line names the
    bound's share and each factor whose value differs at two decimals, as the two reports'
    confidence_basis hold them (a factor one run lacks counts as 1)."""
    from traceclf.render.compared_runs import FACTOR_WORDS, bound_line

    before, after = reports[SLOW], reports[FAST]
    line = bound_line(compare_reports(before, after))
    b, a = (r.classification["confidence_basis"] for r in (before, after))
    assert f"confidence {before.classification['confidence']:.2f} → " in line
    moved = [
        (key, b["factors"].get(key, 1.0), a["factors"].get(key, 1.0))
        for key in dict.fromkeys([*b["factors"], *a["factors"]])
        if round(b["factors"].get(key, 1.0), 2) != round(a["factors"].get(key, 1.0), 2)
    ]
    assert moved  # (graph-level replays and the step spread differ between these runs)
    for key, x, y in moved:
        assert f"{FACTOR_WORDS[key]} ×{x:.2f} → ×{y:.2f}" in line
    assert f"explained {b['explained']:.2f} → {a['explained']:.2f}" in line
    same = compare_reports(before, before)
    conf = f"{before.classification['confidence']:.2f}"
    assert bound_line(same).endswith(f"(confidence {conf} → {conf}).")  # (nothing moved it)


def test_a_saved_reports_confidence_factors_are_read_defensively(saved: dict[str, Path]) -> None:
    """A saved report is untrusted: factors that are no numbers are left out, and of thousands
    of long names only the first few, cut, are read."""
    from traceclf.compare.regression import MAX_FACTOR_NAME, MAX_FACTORS, run_of

    data = json.loads(saved[FAST].read_text())
    basis = data["classification"]["confidence_basis"]
    basis["factors"] = {str(i) + "x" * 10_000: 0.5 for i in range(5000)} | {"odd": "many"}
    run = run_of("odd", Report.from_dict(data))
    assert len(run.confidence_factors) == MAX_FACTORS
    assert all(len(k) == MAX_FACTOR_NAME for k in run.confidence_factors)
    basis["factors"] = {"anchor": "many", "spread": None, "steps": 0.5}
    assert run_of("odd", Report.from_dict(data)).confidence_factors == {"steps": 0.5}
