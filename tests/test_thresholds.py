"""Issue 27: every threshold that decides a verdict, a straggler, an abstention or a fix is rule
data (rules/thresholds.yaml), not a Python constant; a --rules folder overrides it and the
decision follows; a bad override fails in one line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import run_cli

from traceclf.judge.straggler import Limits, cross_rank_block, verdict
from traceclf.judge.vocabulary import JUDGE_THRESHOLDS, load_rules

PACKAGE = Path(__file__).resolve().parents[1] / "traceclf"
# The Python constants these thresholds replaced: none may come back.
RETIRED = (
    "STRAGGLER_MIN_SKEW",
    "WAIT_DOMINATES",
    "WAIT_COST_NOTEWORTHY",
    "FINGERPRINT_TOLERANCE",
    "MIN_GPU_WORK_MS",
    "FRAMEWORK_SHARE",
)


def rules_folder(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "rules"
    folder.mkdir(parents=True)
    (folder / "mine.yaml").write_text(text, encoding="utf-8")
    return folder


def analyze(export: Path, *args: str | Path) -> dict:
    code, out, err = run_cli("analyze", export, "--format", "json", "--no-cache", "-q", *args)
    assert code == 0, err
    return json.loads(out)


def test_the_bundled_rules_hold_every_threshold_the_judge_reads():
    thresholds = load_rules().thresholds
    assert set(JUDGE_THRESHOLDS) <= set(thresholds)
    assert all(isinstance(v, int | float) and v >= 0 for v in thresholds.values())


def test_the_judge_holds_no_numeric_constant():
    """The judge decides from rule data: no module of traceclf/judge/ defines a number at
    module level, and the retired constants are nowhere."""
    numbers = []
    for path in sorted((PACKAGE / "judge").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if isinstance(value, ast.Constant) and type(value.value) in (int, float):
                numbers.append(f"{path.name}: {ast.unparse(node)}")
    assert not numbers
    source = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))
    assert not [name for name in RETIRED if name in source]


def test_min_gpu_work_override_makes_the_judge_abstain(tmp_path: Path):
    export = fixture_trace("h100_host_input_stall")  # 115 ms of GPU work: judged by default
    assert analyze(export)["classification"]["bound"] == "host"
    folder = rules_folder(tmp_path, "thresholds:\n  min_gpu_work_ms: 1000\n")
    classification = analyze(export, "--rules", folder)["classification"]
    assert classification["bound"] is None
    assert classification["abstain_reason"].startswith("too little GPU work to judge")


def test_expert_loop_override_withdraws_the_grouped_gemm_fix(tmp_path: Path):
    export = fixture_trace("h100_compute_low_occupancy")
    before = analyze(export)
    assert [f["id"] for f in before["fixes"]] == ["grouped-gemm"]
    repeats = before["ranks"][0]["metrics"]["small_gemm_repeats_per_step"]
    folder = rules_folder(tmp_path, f"thresholds:\n  expert_loop_repeats: {repeats + 1}\n")
    after = analyze(export, "--rules", folder)
    assert "grouped-gemm" not in [f["id"] for f in after["fixes"]]
    assert "compute-small-gemms" not in [r["id"] for r in after["classification"]["rules"]]


def rank(i: int, compute_frac: float) -> dict:
    """CONSTRUCTED reduce-step input of one rank: like work, different compute."""
    return {
        "rank": i,
        "metrics": {"step_time_ms": 100.0, "compute_frac": compute_frac, "kernels_per_step": 400},
        "comm_by_kind": {"all_reduce": {"kernels": 8}},
        "steps": {"used": 4},
        "clock": {"export": f"r{i}.sqlite", "host": f"node{i}", "gpu": f"GPU-{i}"},
        "collectives": {},
        "window": [0, 1],
    }


def test_straggler_override_changes_who_is_the_straggler(tmp_path: Path):
    ranks = [rank(0, 0.5), rank(1, 0.6)]  # rank 1 computes 18% more
    assert cross_rank_block(ranks)["straggler_rank"] == 1
    folder = rules_folder(tmp_path, "thresholds:\n  straggler_min_skew: 0.3\n")
    block = cross_rank_block(ranks, limits=Limits.of(load_rules(folder)))
    assert block["straggler_rank"] is None
    assert "noise band (30%: 2 x step-time spread, min 30%)" in block["straggler_note"]
    # ranks 7% apart in kernels per step are alike, but not under a 5% tolerance: none compared
    unlike = [
        rank(0, 0.5),
        rank(1, 0.6) | {"metrics": rank(1, 0.6)["metrics"] | {"kernels_per_step": 430}},
    ]
    assert cross_rank_block(unlike)["rank_groups"] == [[0, 1]]
    tight = rules_folder(tmp_path / "t", "thresholds:\n  like_ranks_tolerance: 0.05\n")
    block = cross_rank_block(unlike, limits=Limits.of(load_rules(tight)))
    assert block["rank_groups"] == [[0], [1]] and block["straggler_rank"] is None


def test_wait_dominates_override_changes_the_verdict(tmp_path: Path):
    cr = {"comm_wait_frac": 0.6, "last_arriver_rank": 1, "shared_gpu": []}
    assert "fix the late rank" in verdict(cr, [], 0.3)
    folder = rules_folder(tmp_path, "thresholds:\n  wait_dominates_frac: 0.7\n")
    said = verdict(cr, [], 0.3, Limits.of(load_rules(folder)))
    assert said.startswith("transfer is 40% of collective time")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("thresholds:\n  straggler_min_skw: 0.1\n", "did you mean 'straggler_min_skew'"),
        ("thresholds:\n  min_gpu_work_ms: -1\n", "must be a number, 0 or more"),
        ("thresholds:\n  min_gpu_work_ms: true\n", "must be a number, 0 or more"),
        ("thresholds:\n  min_gpu_work_ms: .nan\n", "must be a number, 0 or more"),
        ("thresholds: [1]\n", "must be a mapping"),
        ("definitions:\n  expert_loop_repeats: 3\n", "definition 'expert_loop_repeats'"),
    ],
)
def test_a_bad_threshold_fails_in_one_line(tmp_path: Path, text: str, problem: str):
    folder = rules_folder(tmp_path, text)
    code, _out, err = run_cli("rules", "--rules", folder)
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, err


def test_conditions_use_thresholds_and_evidence_leaves_them_out():
    """A fix's evidence lists measured facts only: grouped-gemm's names the repeats it saw,
    never the threshold they were compared with."""
    report = analyze(fixture_trace("h100_compute_low_occupancy"))
    evidence = report["fixes"][0]["evidence"]
    assert "small_gemm_repeats_per_step" in evidence and "expert_loop_repeats" not in evidence
    assert "below 16" in report["fixes"][0]["verify"]
