"""The Markdown report (GitHub-flavoured), for regression tickets.

Same content and order as the terminal report: verdict, where the step goes per rank, details
by wall, top kernels, the fixes with their config, then provenance. The row builders here are
shared with the HTML report so both say the same thing.
"""

from __future__ import annotations

import re
from urllib.parse import quote

from traceclf.render import comm_table
from traceclf.render.capture_text import capture_rows
from traceclf.render.ceilings import contradicted_lines
from traceclf.render.content import (
    CONTRADICTED_NOTE,
    PRECONDITIONS_NOTE,
    RANK_COLUMNS,
    beside_bound_line,
    budget_rows,
    caption,
    config_caption,
    detail_rows,
    details_head,
    fix_facts,
    kernel_columns,
    kernel_rows,
    kernels_title,
    no_fixes_line,
    provenance_rows,
    rank_rows,
    ranks_note,
    ranks_title,
)
from traceclf.render.hostlines import (
    attribution_columns,
    attribution_rows,
    attribution_shown,
    attribution_title,
    option_rows,
    options_title,
)
from traceclf.render.text import input_names, next_wall_text, steps_line
from traceclf.render.timeline import PHASE_COLUMNS, PHASE_NOTE, nsys_rows, phase_rows
from traceclf.render.verdict import verdict_line, verdict_title
from traceclf.report.contract import Report
from traceclf.support.escape import for_markdown, markdown_code, markdown_fence


def render_markdown(report: Report, figures: dict[str, str] | None = None) -> str:
    """The report as Markdown; ``figures`` (name -> relative path of a PNG written beside the
    file, render/files.py) are linked under "Figures"."""
    figures = _figures(report, figures) if figures else None
    parts = [
        _title(report),
        _verdict(report),
        _section(
            "Capture",
            _table(("fact", "what the trace holds"), capture_rows(report), bold_first=True),
        )
        if report.capture
        else None,
        _section(
            "Timeline",
            _table(("where", "in the capture"), nsys_rows(report), bold_first=True),
        )
        if nsys_rows(report)
        else None,
        None
        if report.abstained
        else _section(
            "Per-step budget",
            _table(
                ("part", "ms per step, averaged over ranks"), budget_rows(report), bold_first=True
            ),
        ),
        _communication(report),
        _section(ranks_title(report), _ranks_table(report)),
        _phases(report),
        _host_attribution(report),
        figures,
        _section(
            "Details",
            _table(("area", details_head(report)), detail_rows(report), bold_first=True),
        ),
        _top_kernels(report),
        _section("What to change, in order", _fixes(report)),
        _section(
            "Provenance",
            "\n".join(f"- **{_md(k)}:** {_md(v)}" for k, v in provenance_rows(report)),
        ),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


# Markdown assembly ---------------------------------------------------------------------------


def _title(report: Report) -> str:
    return (
        f"# traceclf: {_md(verdict_title(report))} · {_md(input_names(report))}\n\n"
        f"{_md(steps_line(report))}"
    )


def _verdict(report: Report) -> str:
    cls = report.classification
    lines = [f"## Verdict: **{_md(verdict_title(report))}**", "", _prose(verdict_line(report))]
    if report.abstained:
        return "\n".join(lines)
    evidence = cls.get("evidence", [])
    if evidence:
        lines += ["", "**Evidence**", ""] + [f"- {_prose(e)}" for e in evidence]
    if report.applied:
        lines += ["", f"**Already applied:** {_prose('; '.join(report.applied))}"]
    if report.next_wall:
        lines += ["", f"**Next wall once this one is fixed:** {_md(next_wall_text(report))}"]
    return "\n".join(lines)


def _ranks_table(report: Report) -> str:
    return f"{ranks_note(report)}\n\n" + _table(
        RANK_COLUMNS, rank_rows(report), align=("right",) * len(RANK_COLUMNS)
    )


def _phases(report: Report) -> str | None:
    rows = phase_rows(report)
    if not rows:
        return None
    align = ("right", "left", *("right",) * (len(PHASE_COLUMNS) - 2))
    return _section("NVTX phases", f"{PHASE_NOTE}\n\n" + _table(PHASE_COLUMNS, rows, align=align))


def _host_attribution(report: Report) -> str | None:
    parts = []
    if attribution_shown(report):
        parts.append(
            f"{_md(attribution_title(report))}\n\n"
            + _table(
                attribution_columns(report),
                attribution_rows(report),
                align=("left", "left", "right", "right", "left"),
            )
        )
    options = option_rows(report)
    if options:
        parts.append(
            f"{_md(options_title(report))}:\n\n"
            + "\n".join(f"- {markdown_code(o)}: {_md(why)}" for o, why in options)
        )
    return _section("Host attribution", "\n\n".join(parts)) if parts else None


def _communication(report: Report) -> str | None:
    rows = comm_table.group_rows(report)
    late = comm_table.late_rows(report)
    overlap = comm_table.overlap_line(report)
    if not rows and not late and overlap is None:
        return None
    parts = []
    if rows:
        cols = comm_table.GROUP_COLUMNS
        align = ("left",) * 4 + ("right",) * (len(cols) - 4)
        parts += [f"{_md(comm_table.NOTE)}.", _table(cols, rows, align=align)]
    notes = comm_table.group_notes(report)
    if overlap is not None:
        notes.append(f"Overlap tax: {overlap}")
    if notes:
        parts.append("\n".join(f"- {_md(n)}" for n in notes))
    if late:
        align = ("right", "right", "left", "right", "left")
        parts.append("**Late arrivals at matched collectives**")
        parts.append(_table(comm_table.LATE_COLUMNS, late, align=align))
        parts.append("\n".join(f"- {_md(n)}" for n in comm_table.late_notes(report)))
    return _section(comm_table.TITLE, "\n\n".join(parts))


def _figures(report: Report, figures: dict[str, str]) -> str:
    items = [
        f"![{_md(name.replace('_', ' '))}]({quote(path)})\n\n{_md(caption(report, name))}"
        for name, path in figures.items()
    ]
    return _section("Figures", "\n\n".join(items))


def _top_kernels(report: Report) -> str | None:
    rows = kernel_rows(report)
    if not rows:
        return None
    rows = [[Markdown(markdown_code(r[0])), *r[1:]] for r in rows]
    return _section(
        kernels_title(report),
        _table(kernel_columns(report), rows, align=("left", "left", "right", "right", "right")),
    )


def _fixes(report: Report) -> str:
    if not report.fixes:
        return no_fixes_line(report)
    return "\n\n".join(_fix(i, fix) for i, fix in enumerate(report.fixes, 1))


def _fix(i: int, fix: dict) -> str:
    lines = [
        f"### {i}. {_prose(fix.get('title') or fix['id'])}",
        "",
        f"{markdown_code(fix['id'])} · {_md(fix.get('wall', ''))} wall",
    ]
    if beside_bound_line(fix):
        lines += ["", f"*{_prose(beside_bound_line(fix))}*"]
    if fix.get("why"):
        lines += ["", _prose(fix["why"].strip())]
    if fix.get("config"):
        label = config_caption(fix)  # (not ``caption``: the figures' captions, imported)
        if label:
            lines += ["", f"{label}:"]
        lines += ["", markdown_fence(fix["config"].strip(), config_language(fix))]
    facts = fix_facts(fix)
    if facts:
        lines += [""] + [f"- **{label}:** {_prose(text)}" for label, text in facts]
    for label, items in (
        (f"**Preconditions** ({PRECONDITIONS_NOTE})", fix.get("preconditions") or []),
        (f"**Premises** ({CONTRADICTED_NOTE})", contradicted_lines(fix)),
        ("**Pitfalls**", fix.get("pitfalls") or []),
    ):
        if items:
            lines += ["", label, ""] + [f"- {_prose(item)}" for item in items]
    return "\n".join(lines)


def config_language(fix: dict) -> str:
    """Fixes carry Megatron-Bridge Python assignments, or command-line flags and env vars; the
    generic advice of a run of no framework is prose."""
    if fix.get("advice") == "generic":
        return "text"
    config = fix.get("config") or ""
    first = config.strip().splitlines()[0] if config.strip() else ""
    return "bash" if re.match(r"^(--|export |\$ |[A-Z_]+=)", first) else "python"


def _section(title: str, body: str) -> str:
    return f"## {title}\n\n{body}"


def _table(
    header: tuple[str, ...],
    rows: list,
    *,
    align: tuple[str, ...] | None = None,
    bold_first: bool = False,
) -> str:
    align = align or ("left",) * len(header)
    rule = ["---:" if a == "right" else "---" for a in align]
    lines = [_row(header), _row(rule)]
    for row in rows:
        cells = [_cell(c) for c in row]
        if bold_first and cells[0]:
            cells[0] = f"**{cells[0]}**"
        lines.append(_row(cells))
    return "\n".join(lines)


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


class Markdown(str):
    """A table cell that is Markdown already (built here from escaped parts)."""


def _cell(text: str) -> str:
    return text if isinstance(text, Markdown) else _md(text)


def _md(text: str) -> str:
    """Text from a trace, a report or a number: literal, on one line (render/escape.py)."""
    return for_markdown(text)


def _prose(text: str) -> str:
    """Rule-written prose: literal, but its `config names` stay code spans."""
    return for_markdown(text, code_spans=True)
