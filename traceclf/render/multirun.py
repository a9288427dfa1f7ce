"""The multi-run report (several unrelated runs analysed at once, traceclf/report/runset.py): a summary
table (run | bound | step | busy | exposed comm | top fix), then each run's own report, in
every format."""

from __future__ import annotations

import re

from traceclf.render.capture_text import left_out_text
from traceclf.report.runset import SUMMARY_COLUMNS, RunSet
from traceclf.support.escape import for_html, for_markdown, for_terminal
from traceclf.support.units import fmt_ms, pct

FENCE = re.compile(r"^\s*(```|~~~)")


def summary_cells(runs: RunSet) -> list[list[str]]:
    return [
        [
            row["run"],
            row["bound"] or "abstained",
            fmt_ms(row["step_ms"]),
            pct(row["busy_frac"]),
            pct(row["exposed_comm_frac"]),
            row["top_fix"] or "–",
        ]
        for row in runs.summary_rows()
    ]


def runs_terminal(runs: RunSet, to_string: bool = False, width: int | None = None) -> str | None:
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    from traceclf.render.fit import new_console, output_of
    from traceclf.render.terminal import render_terminal

    console = new_console(to_string, width)
    console.print(Text(f"traceclf: {len(runs.runs)} separate runs", style="bold"))
    console.print(for_terminal(runs.grouping.get("reason", ""), "dim"))
    if left_out(runs):
        console.print(for_terminal(left_out(runs), "dim"))
    table = Table(show_edge=False)
    for i, col in enumerate(SUMMARY_COLUMNS):
        table.add_column(col, justify="right" if 2 <= i <= 4 else "left", overflow="fold")
    for cells in summary_cells(runs):
        table.add_row(*(for_terminal(c) for c in cells))
    console.print(table)
    for i, report in enumerate(runs.runs, 1):
        console.print(Rule(Text(f"run {i} of {len(runs.runs)}")))
        if to_string:
            # laid out already: written as it is (console.out neither wraps nor crops)
            console.out(render_terminal(report, True, console.width) or "", end="")
        else:
            render_terminal(report, width=width)
    return output_of(console)


def runs_markdown(runs: RunSet, figures: list[dict[str, str]] | None = None) -> str:
    from traceclf.render.markdown import render_markdown

    def cell(text: str) -> str:
        return for_markdown(text)

    lines = [
        f"# traceclf: {len(runs.runs)} separate runs",
        "",
        cell(runs.grouping.get("reason", "")),
        "",
        *([cell(left_out(runs)), ""] if left_out(runs) else []),
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "| --- | --- | ---: | ---: | ---: | --- |",
        *("| " + " | ".join(cell(c) for c in cells) + " |" for cells in summary_cells(runs)),
    ]
    parts = ["\n".join(lines)]
    figures = figures or [{} for _ in runs.runs]
    parts += [
        _demote(render_markdown(report, figs)).rstrip("\n")
        for report, figs in zip(runs.runs, figures, strict=True)
    ]
    return "\n\n".join(parts) + "\n"


def _demote(markdown: str) -> str:
    """Each run's headings one level down, under the summary; code blocks stay verbatim (a
    fix's config may hold '#' comments)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        out.append("#" + line if not fenced and line.startswith("#") else line)
    return "\n".join(out) + "\n"


def runs_html(runs: RunSet) -> str:
    from traceclf.render.html import html_document

    return html_document(f"traceclf: {len(runs.runs)} separate runs", runs_html_body(runs))


def runs_html_body(runs: RunSet) -> str:
    from traceclf.render.html import html_body

    head = "".join(f"<th>{for_html(c)}</th>" for c in SUMMARY_COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{for_html(c)}</td>" for c in cells) + "</tr>"
        for cells in summary_cells(runs)
    )
    body = [
        f"<h1>traceclf: {len(runs.runs)} separate runs</h1>",
        f'<p class="sub">{for_html(runs.grouping.get("reason", ""))}</p>',
        *([f'<p class="sub">{for_html(left_out(runs))}</p>'] if left_out(runs) else []),
        f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>",
    ]
    for i, report in enumerate(runs.runs, 1):
        body.append(f'<hr><section id="run-{i}">\n{html_body(report)}\n</section>')
    return "\n".join(body)


def left_out(runs: RunSet) -> str:
    """'Left out: a.sqlite: export has no GPU activity (...)', or "" (every input analysed)."""
    skipped = runs.grouping.get("skipped_inputs") or []
    return f"Left out: {left_out_text(skipped)}" if skipped else ""
