"""The terminal report (rich): verdict first, then where the step goes, then the fixes."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from traceclf.render import comm_table
from traceclf.render.capture_text import capture_rows
from traceclf.render.ceilings import contradicted_lines
from traceclf.render.code_wrap import CodeBlock
from traceclf.render.content import (
    RANK_COLUMNS,
    beside_bound_line,
    budget_rows,
    config_caption,
    detail_rows,
    fix_facts,
    grouping_line,
    kernel_columns,
    kernel_rows,
    kernels_title,
    no_fixes_line,
    rank_rows,
    ranks_title,
)
from traceclf.render.fit import FoldedTable, hanging, new_console, output_of
from traceclf.render.hostlines import (
    attribution_columns,
    attribution_rows,
    attribution_shown,
    attribution_title,
    option_rows,
    options_title,
)
from traceclf.render.text import next_wall_text, provenance, steps_line
from traceclf.render.timeline import PHASE_COLUMNS, PHASE_NOTE, nsys_rows, phase_rows
from traceclf.render.verdict import verdict_line, verdict_title
from traceclf.report.contract import Report
from traceclf.support.escape import for_terminal, visible

WALL_STYLE = {"memory": "magenta", "communication": "cyan", "host": "yellow", "compute": "green"}


def render_terminal(
    report: Report, to_string: bool = False, width: int | None = None
) -> str | None:
    """Print the report (or return it as text with ``to_string``) at ``width`` columns (default:
    the terminal's; piped: $COLUMNS, else 120). Numbers and configs are never cut: tables fold
    into stacked parts, text wraps with its indent kept (render/fit.py)."""
    console = new_console(to_string, width)
    for part in (
        _header(report),
        _verdict(report),
        _capture(report),
        _facts("Timeline", nsys_rows(report)),
        _budget(report),
        _communication(report),
        _ranks_table(report),
        _phases(report),
        _host_attribution(report),
        _details(report),
        _top_kernels(report),
        _fixes(report),
    ):
        if part is not None:
            # (a config line that cannot be broken runs past the width: whole, not cropped)
            console.print(part, crop=False)
    return output_of(console)


def _header(report: Report) -> Text:
    files = ", ".join(Path(i["path"]).name for i in report.inputs)
    text = Text()
    text.append(for_terminal(f"traceclf {report.traceclf_version}", "bold"))
    text.append(for_terminal(f" · {files}"))
    text.append("\n")
    text.append(for_terminal(provenance(report), "dim"))
    if grouping_line(report):
        text.append("\n")
        text.append(for_terminal(grouping_line(report), "dim"))
    text.append("\n")
    text.append(for_terminal(steps_line(report)))
    return text


def _verdict(report: Report) -> Panel:
    cls = report.classification
    bound = cls.get("bound")
    style = WALL_STYLE.get(bound, "white")
    evidence = hanging([("•", for_terminal(line)) for line in cls.get("evidence", [])])
    closing = []
    if report.applied:
        closing.append(
            Text("Already applied: ", style="bold") + for_terminal("; ".join(report.applied))
        )
    if report.next_wall:
        wall = for_terminal(next_wall_text(report), WALL_STYLE.get(report.next_wall, ""))
        closing.append(Text("Next wall once this one is fixed: ", style="bold") + wall)
    title = for_terminal(f" {verdict_title(report)} ", f"bold {style}")
    headline = for_terminal(verdict_line(report), "bold" if report.abstained else "")
    if report.abstained:
        return Panel(headline, title=title, title_align="left", border_style=style)
    headline.append("\n")
    # (no blank lines closing the box when nothing is applied and no next wall is named)
    body = [headline, evidence, *([Text(""), Text("\n").join(closing)] if closing else [])]
    return Panel(Group(*body), title=title, title_align="left", border_style=style)


def _capture(report: Report) -> Table | None:
    return _facts("Capture", capture_rows(report))


def _budget(report: Report) -> Table | None:
    return None if report.abstained else _facts("Per-step budget", budget_rows(report))


def _facts(title: str, rows: list[tuple[str, str]]) -> Table | None:
    if not rows:
        return None
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row(Text(title, style="bold underline"), "")
    for key, value in rows:
        table.add_row(for_terminal(key), for_terminal(value))
    return table


def _ranks_table(report: Report) -> FoldedTable:
    return FoldedTable(
        RANK_COLUMNS,
        [list(map(for_terminal, row)) for row in rank_rows(report)],
        title=f"{ranks_title(report)} (share of wall time)",
    )


def _phases(report: Report) -> Group | None:
    rows = phase_rows(report)
    if not rows:
        return None
    # columns that are zero in every row say nothing here (the other formats keep them all)
    keep = [i for i in range(len(PHASE_COLUMNS)) if i < 3 or any(r[i] not in "0–" for r in rows)]
    table = FoldedTable(
        [PHASE_COLUMNS[i] for i in keep],
        [[for_terminal(row[i]) for i in keep] for row in rows],
        title="NVTX phases (ms per step; all-zero columns left out)",
        keys=2,
        justify=["right", "left", *["right"] * (len(keep) - 2)],
    )
    return Group(table, for_terminal(PHASE_NOTE, "dim"))


def _host_attribution(report: Report) -> Group | None:
    parts: list[RenderableType] = []
    if attribution_shown(report):
        table = Table(title=attribution_title(report), title_justify="left", show_edge=False)
        for col in attribution_columns(report):
            # numbers keep their width; names and evidence wrap (a narrow terminal folds them)
            text = col in ("what", "evidence")
            table.add_column(
                col,
                justify="left" if text or col == "source" else "right",
                no_wrap=not text,
                overflow="fold",
                max_width=48 if col == "what" else None,
                ratio=1 if col == "evidence" else None,
            )
        for row in attribution_rows(report):
            table.add_row(*map(for_terminal, row))
        parts.append(table)
    options = option_rows(report)
    if options:
        parts.append(Text(options_title(report), style="bold"))
        parts.append(hanging([("•", for_terminal(f"{o}: {why}")) for o, why in options]))
    return Group(*parts) if parts else None


def _communication(report: Report) -> Group | None:
    """The communicators table with the evidence for each, what overlap costs compute, and the
    late arrivals with their causes."""
    rows = comm_table.group_rows(report)
    late = comm_table.late_rows(report)
    overlap = comm_table.overlap_line(report)
    if not rows and not late and overlap is None:
        return None
    parts: list[RenderableType] = []
    if rows:
        cols = comm_table.GROUP_COLUMNS
        parts.append(
            FoldedTable(
                cols,
                [list(map(for_terminal, row)) for row in rows],
                title=comm_table.TITLE,
                keys=1,
                justify=["left", "left", "left", "left", *["right"] * (len(cols) - 4)],
            )
        )
        parts.append(for_terminal(comm_table.NOTE, "dim"))
    notes = comm_table.group_notes(report)
    if overlap is not None:
        notes.append(f"Overlap tax: {overlap}")
    if notes:
        parts.append(hanging([("•", for_terminal(note)) for note in notes], style="dim"))
    if late:
        # a list, not a table: each cause's detail names kernels, which no width fits
        parts.append(for_terminal("Late arrivals at matched collectives", "italic"))
        lines = comm_table.late_lines(report)
        parts.append(hanging([(f"{label}:", for_terminal(text)) for label, text in lines]))
        notes = comm_table.late_notes(report)
        parts.append(hanging([("•", for_terminal(n)) for n in notes], style="dim"))
    return Group(*parts)


def _details(report: Report) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for wall, line in detail_rows(report):
        table.add_row(for_terminal(wall), for_terminal(line))
    return table


def _top_kernels(report: Report) -> Table | None:
    rows = kernel_rows(report)
    if not rows:
        return None
    table = Table(title=kernels_title(report), title_justify="left", show_edge=False)
    for col in kernel_columns(report):
        # numbers keep their width; a narrow terminal folds the kernel name onto more lines
        table.add_column(
            col,
            justify="left" if col in ("kernel", "family") else "right",
            overflow="fold",
            no_wrap=col != "kernel",
            max_width=60 if col == "kernel" else None,
        )
    for row in rows:
        table.add_row(*map(for_terminal, row))
    return table


def _fixes(report: Report) -> Group:
    parts: list = [Text("What to change, in order", style="bold underline")]
    if not report.fixes:
        parts.append(Text(no_fixes_line(report)))
    for i, fix in enumerate(report.fixes, 1):
        title = for_terminal(fix.get("title", fix["id"]), "bold")
        title.append(
            for_terminal(
                f"  [{fix['id']} · {fix.get('wall', '')}]",
                WALL_STYLE.get(fix.get("wall", ""), "dim"),
            )
        )
        head = Table.grid()  # a wrapped title hangs under its first word, not under "1."
        head.add_column(width=3, no_wrap=True)
        head.add_column()
        head.add_row(Text(f"{i}.", style="bold"), title)
        parts.append(head)
        if beside_bound_line(fix):
            parts.append(_indented(for_terminal(beside_bound_line(fix), "italic")))
        if fix.get("why"):
            parts.append(_indented(for_terminal(fix["why"].strip())))
        if fix.get("config"):
            caption = config_caption(fix)
            if caption:
                parts.append(_indented(Text(f"{caption}:", style="dim")))
            parts.append(config_block(fix["config"], indent=3))
        labelled = [
            (f"{label[0].lower()}{label[1:]}:", for_terminal(text))
            for label, text in fix_facts(fix)
        ] + [
            (label, for_terminal(item))
            for label, items in (
                ("check first:", fix.get("preconditions") or []),
                ("contradicted:", contradicted_lines(fix)),
                ("watch out:", fix.get("pitfalls") or []),
            )
            for item in items
        ]
        if labelled:
            parts.append(_indented(hanging(labelled, "dim")))
    return Group(*parts)


def config_block(config: str, indent: int = 0) -> CodeBlock:
    """A fix's config as the rule file writes it, folded to the width so that it still pastes
    as the same code (render/code_wrap.py), never cropped; ``indent`` columns deeper (not in a
    Padding, which would crop a line that cannot be broken)."""
    return CodeBlock(visible(config.strip(), multiline=True), indent=indent)


def _indented(renderable: RenderableType, left: int = 3) -> Padding:
    """``renderable`` indented by ``left`` columns on every line, wrapped lines included."""
    return Padding(renderable, (0, 0, 0, left))
