"""The terminal report at 80 and 200 columns (rich Console width) on real traces: nothing wider
than the width, no number cut ("1…"), every fix config printed verbatim (wrapped, never
cropped), and wrapped lines keep their hanging indent (issue 14, part B)."""

from __future__ import annotations

import re

import pytest
from helpers.cli import run_cli
from realtraces import trace_path
from rich.cells import cell_len

import traceclf
from traceclf.render.content import rank_rows
from traceclf.render.terminal import render_terminal
from traceclf.render.timeline import phase_rows
from traceclf.report.contract import Report

# two ranks with long configs; a host-bound run with NVTX phases and the cuda_graph_scope
# config that was cropped at 120 columns; memory-bound with phases; graph-level traced
TRACES = (
    "h100_comm_ep2",
    "h100_host_launch_gpumetrics",
    "h100_memory_offload",
    "h100_host_cudagraph",
)
WIDTHS = (80, 200)


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    return {name: traceclf.analyze(trace_path(name)) for name in TRACES}


def _cell(value: str) -> re.Pattern:
    """A table cell as a whole: not part of a longer number or word."""
    return re.compile(rf"(?<![\w.%]){re.escape(value)}(?![\w.%])")


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", TRACES)
def test_nothing_wider_than_the_terminal_and_no_number_cut(
    name: str, width: int, reports: dict[str, Report]
) -> None:
    report = reports[name]
    text = render_terminal(report, to_string=True, width=width)
    assert max(cell_len(line) for line in text.splitlines()) <= width
    # kernel names are cut to 60 characters on purpose (the Top kernels table); nothing else
    names = re.escape("Top kernels") + r".*?(?=What to change)"
    assert not re.search(r"\d…|…\d", re.sub(names, "", text, flags=re.S)), "a number was cut"
    for row in rank_rows(report) + phase_rows(report):
        for value in row:
            assert _cell(value).search(text), f"{value!r} missing at {width} columns"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", TRACES)
def test_configs_are_printed_verbatim(name: str, width: int, reports: dict[str, Report]) -> None:
    report = reports[name]
    assert report.fixes, "every trace here proposes fixes"
    text = render_terminal(report, to_string=True, width=width)
    flat = _flat(text)
    for fix in report.fixes:
        for line in (fix.get("config") or "").strip().splitlines():
            assert _flat(line) in flat, f"config line cut or missing: {line!r}"


def test_the_config_that_was_cropped_is_whole_at_80_columns(reports: dict[str, Report]) -> None:
    report = reports["h100_host_launch_gpumetrics"]
    config = next(f["config"] for f in report.fixes if f["id"] == "cuda-graphs")
    assert 'cfg.model.cuda_graph_scope = ["full_iteration"]' in config
    text = render_terminal(report, to_string=True, width=80)
    assert 'cfg.model.cuda_graph_scope = ["full_iteration"]' in _flat(text)
    # its continuation hangs deeper than the line it continues
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "# static shapes only" in line)
    indent = len(lines[start]) - len(lines[start].lstrip())
    assert len(lines[start + 1]) - len(lines[start + 1].lstrip()) > indent


@pytest.mark.parametrize("name", TRACES)
def test_wrapped_lines_keep_their_hanging_indent(name: str, reports: dict[str, Report]) -> None:
    text = render_terminal(reports[name], to_string=True, width=80)
    fixes = text.split("What to change, in order", 1)[1].splitlines()[1:]
    for line in fixes:
        if line.strip():
            # only a fix's number starts at column 0; its why, config and notes are indented
            assert re.match(r"\d+\. |   ", line), line
    labels = ("check first:", "contradicted:", "watch out:")  # (preconditions were "needs:")
    for label in labels:
        lines = [i for i, line in enumerate(fixes) if line.lstrip().startswith(label)]
        for i in lines:
            column = fixes[i].index(label) + len("watch out:") + 1
            nxt = fixes[i + 1] if i + 1 < len(fixes) else ""
            if nxt.strip() and not re.match(rf"\s*({'|'.join(labels)}|\d+\. )", nxt):
                assert len(nxt) - len(nxt.lstrip()) >= column, (fixes[i], nxt)
    panel = text.split("What to change", 1)[0]
    bullets = [i for i, line in enumerate(panel.splitlines()) if line.startswith("│ • ")]
    for i in bullets:
        nxt = panel.splitlines()[i + 1]
        if nxt.startswith("│   ") is False and nxt.strip("│ ") and not nxt.startswith("│ • "):
            pytest.fail(f"evidence bullet lost its hanging indent: {nxt!r}")


def test_the_rank_table_folds_at_80_and_is_one_table_at_200(reports: dict[str, Report]) -> None:
    report = reports["h100_comm_ep2"]
    narrow = render_terminal(report, to_string=True, width=80)
    wide = render_terminal(report, to_string=True, width=200)
    assert "(continued)" in narrow.split("Communication ", 1)[0]
    assert "(continued)" not in wide
    # each part repeats the rank column, so every row keeps its rank
    parts = narrow.split("Where the steady-state step goes", 1)[1].split("(continued)")
    assert all(re.search(r"^\s+rank\s", part, re.M) for part in parts)


def test_piped_output_takes_columns_from_the_environment(monkeypatch) -> None:
    path = trace_path("h100_comm_ep2")
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli("analyze", path, "-q")
    assert result.code == 0, result.stderr
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 80
    monkeypatch.delenv("COLUMNS")
    result = run_cli("analyze", path, "-q")
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 120
    assert "(continued)" not in result.stdout  # 120 columns fit the per-rank table
