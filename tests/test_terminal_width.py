"""The terminal report at 80 and 200 columns (rich Console width) on real traces: nothing wider
than the width, no number cut ("1…"), every fix config printed whole and, copied from the
terminal, the same code (issue 28: wrapped so that it pastes), and wrapped lines keep their
hanging indent (issue 14, part B)."""

from __future__ import annotations

import io
import re
import subprocess
import textwrap
import tokenize

import pytest
from helpers.cli import run_cli
from realtraces import trace_path
from rich.cells import cell_len
from rich.console import Console

import traceclf
from traceclf.judge.vocabulary import load_rules
from traceclf.render.content import rank_rows
from traceclf.render.markdown import config_language
from traceclf.render.terminal import config_block, render_terminal
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


# what ends a config block in a fix: the next labelled row or the next fix
AFTER_CONFIG = re.compile(
    r"^\s*(order:|in PyTorch:|because:|at most:|verify:|needs:|watch out:)|^\d+\. "
)


def config_blocks(text: str) -> list[str]:
    """The config blocks of a terminal report as a user copies them: the lines under each
    "Megatron-Bridge config:" up to the next labelled row, their common indent removed (as
    IPython and Jupyter do with pasted code)."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() == "Megatron-Bridge config:":
            end = next(
                (j for j in range(i + 1, len(lines)) if AFTER_CONFIG.match(lines[j])), len(lines)
            )
            blocks.append(textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n")
    return blocks


def code_and_comments(source: str) -> tuple[list[str], list[str]]:
    """Python's tokens of ``source`` without layout (line breaks, indents, joins), and the words
    of its comments in order: equal for two sources that are the same code, commented alike."""
    layout = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    code = [t.string for t in tokens if t.type not in layout | {tokenize.COMMENT}]
    words = [w for t in tokens if t.type == tokenize.COMMENT for w in t.string[1:].split()]
    return code, words


def shell_words(source: str) -> tuple[list[str], list[str]]:
    """The words of a shell command line and of its comments (a word starting with "#"
    starts one), each in order, without line joins."""
    code: list[str] = []
    words: list[str] = []
    for line in source.splitlines():
        parts = line.split()
        cut = next((i for i, w in enumerate(parts) if w.startswith("#")), len(parts))
        code += [w for w in parts[:cut] if w != "\\"]
        words += [w for w in " ".join(parts[cut:]).lstrip("#").split()]
    return code, words


def assert_pastes_as(block: str, config: str) -> None:
    compile(block, "<pasted config>", "exec")  # raises SyntaxError on a broken paste
    assert code_and_comments(block) == code_and_comments(config.strip() + "\n")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", TRACES)
def test_configs_paste_as_the_same_code(name: str, width: int, reports: dict[str, Report]) -> None:
    """Every config block, copied from the terminal at this width, compiles and is the fix's
    config: the same tokens, the same comment words in the same order (a wrapped comment
    continues on lines of its own that start with "#", a statement breaks with a backslash)."""
    report = reports[name]
    assert report.fixes, "every trace here proposes fixes"
    text = render_terminal(report, to_string=True, width=width)
    blocks = config_blocks(text)
    assert len(blocks) == len(report.fixes)
    for block, fix in zip(blocks, report.fixes, strict=True):
        assert_pastes_as(block, fix["config"])
    if width == 80:  # a config that does not fit is the reason for all this
        assert any(len(line) > 80 - 3 for f in report.fixes for line in f["config"].splitlines())


def test_configs_paste_from_the_cli_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli("analyze", trace_path("h100_comm_ep2"), "-q")
    assert result.code == 0, result.stderr
    report = traceclf.analyze(trace_path("h100_comm_ep2"))
    blocks = config_blocks(result.stdout)
    for block, fix in zip(blocks, report.fixes, strict=True):
        assert_pastes_as(block, fix["config"])
    deepep = [f["id"] for f in report.fixes].index("deepep")
    assert "# flag alone does nothing" in blocks[deepep]  # the comment that wrapped into code


@pytest.mark.parametrize("width", WIDTHS)
def test_explain_prints_every_config_to_paste(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`traceclf explain` of every bundled fix: the config between the blank lines after the
    fix's text, no border around it; Python configs compile as the same code, a shell command
    line passes `bash -n`."""
    monkeypatch.setenv("COLUMNS", str(width))
    for fix in load_rules(None).fixes.values():
        result = run_cli("explain", fix.id)
        assert result.code == 0, result.stderr
        block = textwrap.dedent(result.stdout.split("\n\n")[1]) + "\n"
        assert "│" not in block
        # the lines a condition of the trace adds follow, each under a comment naming it
        config = "\n".join(
            [fix.config.strip()]
            + [f"# when {when.source}:\n{lines.strip()}" for when, lines in fix.config_when]
        )
        if config_language({"config": fix.config}) == "python" and not fix.config.startswith(
            "nsys "
        ):
            assert_pastes_as(block, config)
        else:
            done = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
            assert done.returncode == 0, (fix.id, done.stderr)
            assert shell_words(block) == shell_words(config)


def test_code_that_cannot_break_is_printed_whole() -> None:
    """A string longer than the width has nowhere to break: the line runs past the width (the
    terminal soft-wraps it and copies it as one line), never cropped or cut inside the string."""
    config = 'cfg.x = "' + "a" * 120 + '"  # ' + "word " * 30 + "\n" + 'cfg.y = f(1, "b c", 2)'
    for width in (20, 40, 80):
        text = Console(file=io.StringIO(), width=width).file
        console = Console(file=text, width=width, force_terminal=False)
        console.print(config_block(config, indent=3), crop=False)
        block = textwrap.dedent(text.getvalue())
        assert_pastes_as(block, config)
        assert '"' + "a" * 120 + '"' in block


def test_code_printed_without_colour_is_the_coloured_text_without_its_styles() -> None:
    """Piped output (no colour) prints code without building a lexer: the same characters,
    folds and continuations as the highlighted block, checked against it with ANSI removed."""
    config = 'cfg.x = "' + "a" * 90 + '"  # ' + "word " * 30 + "\n" + "cfg.y = f(1, 2)  # ok"
    for width in (40, 80):
        plain = Console(file=io.StringIO(), width=width, force_terminal=False)
        colour = Console(file=io.StringIO(), width=width, force_terminal=True)
        for console in (plain, colour):
            console.print(config_block(config, indent=3), crop=False)
        assert plain.color_system is None and colour.color_system is not None
        ansi = re.compile(r"\x1b\[[0-9;]*m")
        assert plain.file.getvalue() == ansi.sub("", colour.file.getvalue())


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


@pytest.mark.parametrize(
    "name", ["ulysses_2gpu_forward_window", "nvfuser_matmul_test_h100", "h100_memory_offload"]
)
def test_the_verdict_box_ends_on_its_last_line_of_text(name: str) -> None:
    """The verdict box closes on its last line of text: after the evidence where no next wall
    and nothing already applied is named (the Ulysses window: two blank lines were left), after
    the reason for abstaining (nvFuser's test: one was), and after "Next wall" where both are
    named (the offload run)."""
    report = traceclf.analyze(trace_path(name))
    lines = render_terminal(report, to_string=True, width=80).splitlines()
    closing = next(i for i, line in enumerate(lines) if line.startswith("╰"))
    assert lines[closing - 1].strip("│ ")
    if name == "h100_memory_offload":
        assert lines[closing - 1].startswith("│ Next wall once this one is fixed: ")
