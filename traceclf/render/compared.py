"""`traceclf compare` output: the comparison (traceclf/report/comparison.py) as rich terminal
text, Markdown, HTML (:mod:`traceclf.render.compared_html`) or JSON."""

from __future__ import annotations

from pathlib import Path

from traceclf.render import compared_inside as parts
from traceclf.render import compared_runs as run_rows
from traceclf.render import emit
from traceclf.render.fit import new_console, output_of
from traceclf.report.comparison import Comparison, MultiComparison
from traceclf.support import jsontext
from traceclf.support.escape import for_markdown, for_terminal, markdown_code


def render_comparison(
    result: Comparison | MultiComparison, fmt: str, output: Path | None = None
) -> None:
    """Write the comparison as ``terminal`` (rich), ``md``, ``html`` or ``json`` to ``output``
    (atomically) or stdout."""
    if fmt == "html":
        from traceclf.render.compared_html import comparison_page

        emit(comparison_page(result), output)
        return
    if isinstance(result, MultiComparison):
        _render_many(result, fmt, output)
        return
    if fmt == "terminal":
        text = _terminal(result, to_string=output is not None)
        if text is None:
            return
    elif fmt == "md":
        text = comparison_markdown(result)
    elif fmt == "json":
        text = jsontext.dumps(result.to_dict()) + "\n"
    else:
        raise ValueError(f"unknown format {fmt!r}")
    emit(text, output)


VERDICT_STYLE = {"regression": "bold red", "improvement": "bold green"}


def _terminal(result: Comparison, to_string: bool) -> str | None:
    from rich.table import Table
    from rich.text import Text

    console = new_console(to_string)
    b, a = result.before, result.after
    console.print(for_terminal(f"{Path(b.source).name} → {Path(a.source).name}", "bold"))
    console.print(for_terminal(result.summary, VERDICT_STYLE.get(result.verdict, "bold")))
    # (right under the verdict, which they qualify: two programs on two GPUs are no regression
    # of one another, whatever their step times say)
    for note in result.notes:
        console.print(for_terminal(f"Not directly comparable: {note}", "yellow"))
    steps = Table(show_edge=False, title="Step time", title_justify="left")
    for col in ("", "before", "after", "change"):
        steps.add_column(col, justify="left" if not col else "right")
    for row in run_rows.step_rows(result):
        steps.add_row(*map(for_terminal, row))
    console.print(steps)
    console.print(for_terminal(run_rows.bound_line(result)))
    moved = Table(show_edge=False, title=run_rows.moved_title(result), title_justify="left")
    for col in ("measure", "before", "after", "change"):
        moved.add_column(col, justify="left" if col == "measure" else "right")
    for m in result.moved:
        moved.add_row(*map(for_terminal, m.cells()))
    console.print(moved if result.moved else Text("No measure moved materially."))
    _terminal_inside(console, result)
    if result.explanations:
        console.print(Text("What changed besides the measures", style="bold"))
        for line in result.explanations:
            console.print(for_terminal(f"• {line}"))
    return output_of(console)


def _terminal_inside(console, result: Comparison) -> None:
    """What changed inside the step: kernels, launch shapes, phases, idle, communication,
    the reconciliation and peak memory."""
    from rich.table import Table
    from rich.text import Text

    b = result.breakdown
    console.print(Text("What changed inside the step (per steady step)", style="bold"))
    if b.detail_missing:
        console.print(for_terminal(f"No per-step detail: {b.detail_missing}."))
    for title, columns, rows in parts.sections(b):
        if columns == parts.SHAPE_COLUMNS:  # (two long lists of shapes: as lines, wrapping)
            console.print(Text(title, style="italic"))
            for name, before, after in rows:
                console.print(for_terminal(f"• {name}: {before} → {after}"))
            continue
        table = Table(show_edge=False, title=title, title_justify="left")
        for i, col in enumerate(columns):
            if i:
                table.add_column(col, justify="right", no_wrap=True)
            else:  # (a long kernel or phase name wraps; the numbers never do)
                table.add_column(col, overflow="fold", min_width=12)
        for row in rows:
            table.add_row(*map(for_terminal, row))
        console.print(table)
    for line in parts.lines(b):
        console.print(for_terminal(line))


def comparison_markdown(result: Comparison) -> str:
    b, a = result.before, result.after
    lines = [
        f"# traceclf compare: {result.verdict}",
        "",
        f"{markdown_code(Path(b.source).name)} → {markdown_code(Path(a.source).name)}",
        "",
        f"**{for_markdown(result.summary)}**",
        "",
        *(
            ["## Not directly comparable", "", *(f"- {for_markdown(n)}" for n in result.notes), ""]
            if result.notes
            else []
        ),
        "## Step time",
        "",
        "|  | before | after | change |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {' | '.join(map(for_markdown, row))} |" for row in run_rows.step_rows(result)),
        "",
        for_markdown(run_rows.bound_line(result)),
        "",
        f"## {run_rows.moved_title(result)}",
        "",
    ]
    if result.moved:
        lines += ["| measure | before | after | change |", "| --- | ---: | ---: | ---: |"]
        lines += ["| " + " | ".join(map(for_markdown, m.cells())) + " |" for m in result.moved]
    else:
        lines.append("No measure moved materially.")
    lines += ["", "## What changed inside the step", ""]
    inside = result.breakdown
    if inside.detail_missing:
        lines += [for_markdown(f"No per-step detail: {inside.detail_missing}."), ""]
    for title, columns, rows in parts.sections(inside):
        # (bold, not a heading: several candidates demote every heading one level)
        lines += [f"**{title}**", ""]
        if title == "Phases":
            lines += [for_markdown(parts.PHASE_NOTE), ""]
        lines += ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
        lines += ["| " + " | ".join(map(for_markdown, row)) + " |" for row in rows]
        lines.append("")
    lines += [for_markdown(line) for line in parts.lines(inside)]
    if result.explanations:
        lines += ["", "## What changed besides the measures", ""]
        lines += [f"- {_md(line)}" for line in result.explanations]
    lines += [
        "",
        "## Runs",
        "",
        *(
            f"- **{side}:** {markdown_code(r.source)} ({for_markdown(run_rows.run_line(r))})"
            for side, r in (("before", b), ("after", a))
        ),
        "",
        f"Noise band: 2 standard errors of the difference of mean step times "
        f"(SE = CV · mean / √steps); threshold {result.threshold:.0%}.",
    ]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """Trace- and rule-derived text as inert Markdown (one line, no HTML, no table breaks)."""
    return for_markdown(text)


def _render_many(result: MultiComparison, fmt: str, output: Path | None) -> None:
    """A baseline against several candidates: one row each, then each comparison's detail."""
    if fmt == "json":
        emit(jsontext.dumps(result.to_dict()) + "\n", output)
        return
    regressed = [Path(c.after.source).name for c in result.comparisons if c.regression]
    head = (
        f"Regression in {len(regressed)} of {len(result.comparisons)} candidates: "
        f"{', '.join(regressed)}"
        if regressed
        else f"No regression in {len(result.comparisons)} candidates"
    )
    if undecided := sum(not c.conclusive for c in result.comparisons):
        head += f" ({undecided} inconclusive: nothing to gate on)"
    if fmt == "md":
        lines = [
            f"# traceclf compare: baseline {markdown_code(Path(result.baseline).name)}",
            "",
            f"**{_md(head)}**",
            "",
            "| " + " | ".join(run_rows.MANY_COLUMNS) + " |",
            "| --- | ---: | ---: | ---: | --- | --- |",
            *("| " + " | ".join(_md(c) for c in row) + " |" for row in run_rows.many_rows(result)),
        ]
        details = [
            "\n".join(
                "#" + line if line.startswith("#") else line
                for line in comparison_markdown(c).splitlines()
            )
            for c in result.comparisons
        ]
        emit("\n\n".join(["\n".join(lines), *details]) + "\n", output)
        return
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    console = new_console(output is not None)
    console.print(for_terminal(f"Baseline: {Path(result.baseline).name}", "bold"))
    console.print(for_terminal(head, "bold red" if regressed else "bold green"))
    table = Table(show_edge=False)
    for i, col in enumerate(run_rows.MANY_COLUMNS):
        table.add_column(col, justify="right" if 1 <= i <= 3 else "left", overflow="fold")
    for row in run_rows.many_rows(result):
        table.add_row(*(for_terminal(c, VERDICT_STYLE.get(c, "")) for c in row))
    console.print(table)
    for c in result.comparisons:
        console.print(Rule(for_terminal(Path(c.after.source).name)))
        console.print(Text(_terminal(c, to_string=True) or ""), end="")
    if output is not None:
        emit(output_of(console) or "", output)
