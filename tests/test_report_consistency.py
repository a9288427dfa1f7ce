"""One report does not contradict itself (issue 28, item 8): the Loop row and the evidence
count the optimizer's kernels alike, and a fix listed above one with a larger ceiling says
why, in every format (terminal at 80 and 200 columns, Markdown, HTML, JSON). Numbers are
checked against sqlite3 reads of the export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.cli import run_cli
from helpers.independent import read_export
from realtraces import trace_path

import traceclf
from traceclf.render.terminal import render_terminal
from traceclf.report.contract import Report

LAUNCH = "h100_host_launch_gpumetrics_trimmed"  # 6 'optimizer' NVTX ranges, per-tensor steps
MOE = "h100_moe_megatron_ep2"


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    return {name: traceclf.analyze(trace_path(name)) for name in (LAUNCH, MOE)}


def launched_in_optimizer(path: Path, window: tuple[int, int] | None = None) -> int:
    """Kernels whose launching call (same process and correlation id) starts inside an NVTX
    range named 'optimizer' (start in ``window`` when given)."""
    ex = read_export(path)
    ranges = [(r["pid"], r["start"], r["end"]) for r in ex["nvtx"] if r["text"] == "optimizer"]
    calls = {(c["pid"], c["corr"]): c["start"] for c in ex["api"]}
    count = 0
    for k in ex["kernels"]:
        if window and not window[0] <= k["start"] < window[1]:
            continue
        t = calls.get((k["pid"], k["corr"]))
        if t is not None and any(p == k["pid"] and s <= t < e for p, s, e in ranges):
            count += 1
    return count


def test_loop_row_and_evidence_count_the_same_optimizer_kernels(reports) -> None:
    report = reports[LAUNCH]
    evidence = report.capture["training_evidence"]
    steps = report.capture["steps_analysed"]
    window = tuple(report.steps["window_ns"])
    per_step = launched_in_optimizer(trace_path(LAUNCH), window) / steps
    assert report.metrics["optimizer_kernels_per_step"] == pytest.approx(per_step) == 84
    assert evidence["optimizer_kernels"] == launched_in_optimizer(trace_path(LAUNCH)) == 528
    sentence = next(e for e in report.classification["evidence"] if "optimizer step" in e)
    assert "launches 84 kernels per step" in sentence
    for width in (80, 200):
        text = " ".join(render_terminal(report, to_string=True, width=width).split())
        assert "528 optimizer kernels (84 per steady step)" in text
        assert "0 optimizer kernels" not in text


def test_a_fix_above_a_larger_ceiling_says_why(tmp_path: Path, reports) -> None:
    report = reports[LAUNCH]
    ids = [f["id"] for f in report.fixes]
    first, graphs = report.fixes[0], report.fixes[ids.index("cuda-graphs")]
    assert first["id"] == "remove-host-syncs"
    assert first["ceiling"]["throughput_gain"] < 0.05 < 4 < graphs["ceiling"]["throughput_gain"]
    assert first["order"] == "ahead of cuda-graphs, which needs it done first"
    # only a fix above a larger ceiling carries a reason
    for i, fix in enumerate(report.fixes):
        mine = (fix.get("ceiling") or {}).get("recoverable_ms") or 0
        later = [(f.get("ceiling") or {}).get("recoverable_ms") or 0 for f in report.fixes[i + 1 :]]
        larger = any(ms > mine for ms in later)
        assert ("order" in fix) <= larger
    moe = reports[MOE]
    overlap = moe.fixes[0]  # a communication fix, a ceiling smaller than cuda-graphs'
    graphs_ms = next(f for f in moe.fixes if f["id"] == "cuda-graphs")["ceiling"]["recoverable_ms"]
    assert overlap["wall"] == "communication"
    assert overlap["ceiling"]["recoverable_ms"] < graphs_ms
    assert overlap["order"].startswith(
        "ahead of cuda-graphs (a larger ceiling): the communication wall comes first in the "
        "workflow, memory → communication → host → compute"
    )
    for width in (80, 200):
        text = " ".join(render_terminal(report, to_string=True, width=width).split())
        assert "order: ahead of cuda-graphs, which needs it done first" in text
    md = run_cli("analyze", trace_path(LAUNCH), "-q", "-f", "md").stdout
    assert "ahead of cuda-graphs, which needs it done first" in md
    html = tmp_path / "r.html"
    assert run_cli("analyze", trace_path(LAUNCH), "-q", "-f", "html", "-o", html).code == 0
    assert "ahead of cuda-graphs, which needs it done first" in html.read_text(encoding="utf-8")
    assert np.isfinite(first["ceiling"]["recoverable_ms"])
