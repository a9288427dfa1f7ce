"""The HTML report: one self-contained file (inline CSS, figures as base64 PNG, no scripts,
fonts or links to fetch), with the Markdown report's content plus the figures."""

from __future__ import annotations

import base64

from traceclf.figures.draw import report_figures
from traceclf.figures.style import WALL_COLORS, figure_png
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
from traceclf.render.markdown import config_language
from traceclf.render.text import input_names, next_wall_text, steps_line
from traceclf.render.timeline import PHASE_COLUMNS, PHASE_NOTE, nsys_rows, phase_rows
from traceclf.render.verdict import verdict_line, verdict_title
from traceclf.report.contract import Report
from traceclf.support.escape import for_html

# Every rule is scoped to the report's root element, so the same style serves the standalone
# file and a notebook cell (Report._repr_html_) without restyling the notebook around it.
ROOT = "traceclf-report"
STYLE = """
.R { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
     max-width: 1000px; margin: 2em auto; padding: 0 1em; }
.R h1 { font-size: 1.6em; margin-bottom: .2em; } .R h2 { margin-top: 1.8em; border-bottom: 1px
solid #ddd; padding-bottom: .2em; } .R .sub { color: #666; margin-top: 0; }
.R .verdict { border-left: 6px solid var(--wall); background: #fafafa; padding: .6em 1.2em; }
.R .verdict h2 { border: 0; margin: .2em 0 .6em; color: var(--wall); }
.R table { border-collapse: collapse; margin: .6em 0; font-size: .92em; }
.R th, .R td { padding: .25em .7em; border-bottom: 1px solid #e4e4e4; text-align: left;
               vertical-align: top; } .R th { background: #f4f4f4; }
.R td.num, .R th.num { text-align: right; }
.R code, .R pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
                  font-size: .9em; }
.R pre { background: #f6f8fa; border: 1px solid #e1e4e8; padding: .7em 1em;
         white-space: pre-wrap; overflow-wrap: anywhere; }
.R figure { margin: 1.2em 0; } .R figure img { max-width: 100%; height: auto; }
.R figcaption { color: #555; font-size: .9em; }
.R .fix { border-left: 4px solid var(--wall); padding: .1em 1em; margin: 1.2em 0; }
.R .tag { font-size: .8em; color: #fff; background: var(--wall); border-radius: 3px;
          padding: .05em .45em; margin-left: .4em; font-weight: normal; }
.R dt { font-weight: 600; } .R dd { margin: 0 0 .4em 1em; }
.R .wide { overflow-x: auto; }
""".replace(".R", "." + ROOT)


def render_html(report: Report) -> str:
    title = f"traceclf: {verdict_title(report)} · {input_names(report)}"
    return html_document(title, html_body(report))


def html_body(report: Report) -> str:
    """The report's sections, without the document around them (a multi-run report puts
    several in one file)."""
    return "\n".join(
        part
        for part in (
            _header(report),
            _verdict(report),
            _capture(report),
            _facts("Timeline", nsys_rows(report)),
            _budget(report),
            _communication(report),
            _ranks(report),
            _phases(report),
            _host_attribution(report),
            _figures(report),
            _details(report),
            _kernels(report),
            _fixes(report),
            _provenance(report),
        )
        if part
    )


def html_document(title: str, body: str) -> str:
    """One self-contained HTML file around ``body``; ``title`` is escaped here."""
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{for_html(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f'<div class="{ROOT}">\n{body}\n</div>\n</body>\n</html>\n'
    )


def html_fragment(body: str) -> str:
    """``body`` with its scoped style, for a notebook cell (``Report._repr_html_``)."""
    return f'<style>{STYLE}</style>\n<div class="{ROOT}">\n{body}\n</div>\n'


def notebook_html(report: Report) -> str:
    """The HTML report as a notebook shows it: same sections and figures, style scoped."""
    return html_fragment(html_body(report))


def _header(report: Report) -> str:
    return (
        f"<h1>traceclf: {for_html(verdict_title(report))} · {for_html(input_names(report))}</h1>\n"
        f'<p class="sub">{for_html(steps_line(report))}</p>'
    )


def _verdict(report: Report) -> str:
    cls = report.classification
    parts = [
        f"<h2>{for_html(verdict_title(report))}</h2>",
        f"<p><b>{for_html(verdict_line(report))}</b></p>",
    ]
    if cls.get("evidence"):
        parts.append("<h3>Evidence</h3>" + _list(cls["evidence"]))
    if report.applied:
        parts.append(f"<p><b>Already applied:</b> {for_html('; '.join(report.applied))}</p>")
    if report.next_wall:
        parts.append(
            f"<p><b>Next wall once this one is fixed:</b> {for_html(next_wall_text(report))}</p>"
        )
    return (
        f'<section class="verdict" style="--wall:{_wall_color(report.bound)}">'
        + "".join(parts)
        + "</section>"
    )


def _capture(report: Report) -> str | None:
    return _facts("Capture", capture_rows(report))


def _budget(report: Report) -> str | None:
    return None if report.abstained else _facts("Per-step budget", budget_rows(report))


def _facts(title: str, rows: list[tuple[str, str]]) -> str | None:
    if not rows:
        return None
    items = "".join(f"<dt>{for_html(k)}</dt><dd>{for_html(v)}</dd>" for k, v in rows)
    return f"<h2>{for_html(title)}</h2><dl>{items}</dl>"


def _ranks(report: Report) -> str:
    return f"<h2>{ranks_title(report)}</h2><p>{ranks_note(report)}</p>" + _table(
        RANK_COLUMNS, rank_rows(report), numeric=set(range(len(RANK_COLUMNS)))
    )


def _figures(report: Report) -> str:
    figures = report_figures(report.series)
    if not figures:
        return "<h2>Figures</h2><p>No steps or idle gaps were measured, so there is nothing to plot.</p>"
    items = []
    for name, fig in figures.items():
        data = base64.b64encode(figure_png(fig)).decode("ascii")
        items.append(
            f'<figure id="fig-{name}"><img alt="{for_html(name.replace("_", " "))}" '
            f'src="data:image/png;base64,{data}"><figcaption>{for_html(caption(report, name))}'
            "</figcaption></figure>"
        )
    return "<h2>Figures</h2>" + "".join(items)


def _phases(report: Report) -> str | None:
    rows = phase_rows(report)
    if not rows:
        return None
    numeric = set(range(len(PHASE_COLUMNS))) - {1}
    return f"<h2>NVTX phases</h2><p>{for_html(PHASE_NOTE)}</p>" + _table(
        PHASE_COLUMNS, rows, numeric=numeric
    )


def _host_attribution(report: Report) -> str | None:
    parts = []
    if attribution_shown(report):
        parts.append(
            f"<p>{for_html(attribution_title(report))}</p>"
            + _table(attribution_columns(report), attribution_rows(report), numeric={2, 3})
        )
    options = option_rows(report)
    if options:
        items = "".join(
            f"<li><code>{for_html(o)}</code>: {for_html(why)}</li>" for o, why in options
        )
        parts.append(f"<p>{for_html(options_title(report))}:</p><ul>{items}</ul>")
    return "<h2>Host attribution</h2>" + "".join(parts) if parts else None


def _communication(report: Report) -> str | None:
    rows = comm_table.group_rows(report)
    late = comm_table.late_rows(report)
    overlap = comm_table.overlap_line(report)
    if not rows and not late and overlap is None:
        return None
    out = f"<h2>{for_html(comm_table.TITLE)}</h2>"
    if rows:
        cols = comm_table.GROUP_COLUMNS
        out += f"<p>{for_html(comm_table.NOTE)}.</p>"
        out += _table(cols, rows, numeric=set(range(4, len(cols))), code_first=True)
    notes = comm_table.group_notes(report)
    if overlap is not None:
        notes.append(f"Overlap tax: {overlap}")
    if notes:
        out += _list(notes)
    if late:
        out += "<h3>Late arrivals at matched collectives</h3>"
        out += _table(comm_table.LATE_COLUMNS, late, numeric={0, 1, 3})
        out += _list(comm_table.late_notes(report))
    return out


def _details(report: Report) -> str:
    return "<h2>Details</h2>" + _table(
        ("area", details_head(report)), [list(r) for r in detail_rows(report)], bold_first=True
    )


def _kernels(report: Report) -> str | None:
    rows = kernel_rows(report)
    if not rows:
        return None
    return f"<h2>{kernels_title(report)}</h2>" + _table(
        kernel_columns(report), rows, numeric={2, 3, 4}, code_first=True
    )


def _fixes(report: Report) -> str:
    if not report.fixes:
        return f"<h2>What to change, in order</h2><p>{for_html(no_fixes_line(report))}</p>"
    return "<h2>What to change, in order</h2>" + "".join(
        _fix(i, fix) for i, fix in enumerate(report.fixes, 1)
    )


def _fix(i: int, fix: dict) -> str:
    wall = fix.get("wall", "")
    parts = [
        f"<h3>{i}. {for_html(fix.get('title') or fix['id'])}"
        f'<span class="tag">{for_html(fix["id"])} · {for_html(wall)}</span></h3>'
    ]
    if beside_bound_line(fix):
        parts.append(f"<p><i>{for_html(beside_bound_line(fix))}</i></p>")
    if fix.get("why"):
        parts.append(f"<p>{for_html(fix['why'].strip())}</p>")
    if fix.get("config"):
        language = config_language(fix)
        label = config_caption(fix)  # (not ``caption``: the figures' captions, imported)
        if label:
            parts.append(f'<p class="caption">{for_html(label)}:</p>')
        parts.append(
            f'<pre><code class="language-{language}">{for_html(fix["config"].strip(), multiline=True)}</code></pre>'
        )
    facts = fix_facts(fix)
    if facts:
        items = "".join(f"<dt>{for_html(k)}</dt><dd>{for_html(v)}</dd>" for k, v in facts)
        parts.append(f"<dl>{items}</dl>")
    for label, note, items in (
        ("Preconditions", PRECONDITIONS_NOTE, fix.get("preconditions") or []),
        ("Premises", CONTRADICTED_NOTE, contradicted_lines(fix)),
        ("Pitfalls", "", fix.get("pitfalls") or []),
    ):
        if items:
            head = f"<b>{label}</b>" + (f" ({for_html(note)})" if note else "")
            parts.append(f"<p>{head}</p>" + _list(items))
    return (
        f'<section class="fix" style="--wall:{_wall_color(wall)}">' + "".join(parts) + "</section>"
    )


def _provenance(report: Report) -> str:
    items = "".join(
        f"<dt>{for_html(k)}</dt><dd>{for_html(v)}</dd>" for k, v in provenance_rows(report)
    )
    return f"<h2>Provenance</h2><dl>{items}</dl>"


def _table(
    header: tuple[str, ...],
    rows: list[list[str]],
    *,
    numeric: frozenset[int] | set[int] = frozenset(),
    bold_first: bool = False,
    code_first: bool = False,
) -> str:
    def cell(tag: str, i: int, text: str) -> str:
        cls = ' class="num"' if i in numeric else ""
        body = for_html(text)
        if i == 0 and bold_first and tag == "td":
            body = f"<b>{body}</b>"
        if i == 0 and code_first and tag == "td":
            body = f"<code>{body}</code>"
        return f"<{tag}{cls}>{body}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows
    )
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{for_html(item)}</li>" for item in items) + "</ul>"


def _wall_color(wall: str | None) -> str:
    return WALL_COLORS.get(wall, "#666666")
