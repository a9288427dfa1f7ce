"""``traceclf compare --format html``: one self-contained file (the analysis report's style and
document, no scripts or links to fetch) with what the Markdown shows plus a waterfall of the
step change. Every string from a trace or a saved report is escaped here."""

from __future__ import annotations

import base64
from pathlib import Path

from traceclf.render import compared_inside as parts
from traceclf.render.compared_runs import (
    MANY_COLUMNS,
    bound_line,
    many_rows,
    moved_title,
    run_line,
    step_rows,
)
from traceclf.render.html import html_document
from traceclf.report.comparison import Comparison, MultiComparison
from traceclf.support.escape import for_html as escape

WATERFALL_CAPTION = (
    "The baseline's mean steady step, the change of the kernels that moved most, of the other "
    "kernels, of idle time and what the parts leave unexplained, then the candidate's mean "
    "steady step (ms per step)."
)


def comparison_page(result: Comparison | MultiComparison) -> str:
    if isinstance(result, MultiComparison):
        head = f"<h1>traceclf compare: baseline {escape(Path(result.baseline).name)}</h1>" + _table(
            MANY_COLUMNS, many_rows(result), numeric={1, 2, 3}
        )
        body = head + "".join(_body(c, level=2, n=i) for i, c in enumerate(result.comparisons))
        return html_document(f"traceclf compare: {Path(result.baseline).name}", body)
    title = f"traceclf compare: {result.verdict}"
    return html_document(title, _body(result, level=1, n=0))


def _body(c: Comparison, level: int, n: int) -> str:
    """One comparison's sections, headed at ``level``; ``n`` numbers its figure's id."""
    b, a = c.before, c.after
    h, h2 = f"h{level}", f"h{level + 1}"
    out = [
        f"<{h}>{escape(Path(b.source).name)} → {escape(Path(a.source).name)}: "
        f"{escape(c.verdict)}</{h}>",
        f"<p><b>{escape(c.summary)}</b></p>",
        *([f"<{h2}>Not directly comparable</{h2}>" + _list(c.notes)] if c.notes else []),
        f"<{h2}>Step time</{h2}>",
        _table(("", "before", "after", "change"), step_rows(c), numeric={1, 2, 3}),
        f"<p>{escape(bound_line(c))}</p>",
        f"<{h2}>{escape(moved_title(c))}</{h2}>",
    ]
    moved = [m.cells() for m in c.moved]
    out.append(
        _table(("measure", "before", "after", "change"), moved, numeric={1, 2, 3})
        if moved
        else "<p>No measure moved materially.</p>"
    )
    out.append(f"<{h2}>What changed inside the step (per steady step)</{h2}>")
    breakdown = c.breakdown
    if breakdown.detail_missing:
        out.append(f"<p>No per-step detail: {escape(breakdown.detail_missing)}.</p>")
    out.append(_waterfall(c, n))
    for title, columns, rows in parts.sections(breakdown):
        out.append(f"<h{level + 2}>{escape(title)}</h{level + 2}>")
        if title == "Phases":
            out.append(f"<p>{escape(parts.PHASE_NOTE)}</p>")
        numeric = set() if columns == parts.SHAPE_COLUMNS else set(range(1, len(columns)))
        out.append(_table(columns, rows, numeric=numeric))
    out.append(_list(parts.lines(breakdown)))
    if c.explanations:
        out.append(f"<{h2}>What changed besides the measures</{h2}>" + _list(c.explanations))
    out.append(
        f"<{h2}>Runs</{h2}>"
        + _list(
            [f"{side}: {r.source} ({run_line(r)})" for side, r in (("before", b), ("after", a))]
        )
    )
    return "\n".join(out)


def _waterfall(c: Comparison, n: int) -> str:
    """The step change as a waterfall figure, when the parts reconcile with it."""
    steps = parts.waterfall_steps(c.breakdown)
    if not steps or c.before.step_mean_ms is None or c.after.step_mean_ms is None:
        return ""
    from traceclf.figures.style import figure_png
    from traceclf.figures.waterfall import step_waterfall

    fig = step_waterfall(c.before.step_mean_ms, steps, c.after.step_mean_ms)
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return (
        f'<figure id="fig-step-waterfall-{n}"><img alt="waterfall of the step change" '
        f'src="data:image/png;base64,{data}"><figcaption>{escape(WATERFALL_CAPTION)}'
        "</figcaption></figure>"
    )


def _table(header: tuple[str, ...], rows: list, *, numeric: set[int]) -> str:
    def cell(tag: str, i: int, text: str) -> str:
        cls = ' class="num"' if i in numeric else ""
        return f"<{tag}{cls}>{escape(text)}</{tag}>"

    head = "".join(cell("th", i, col) for i, col in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, text) for i, text in enumerate(row)) + "</tr>"
        for row in rows
    )
    return (
        f'<div class="wide"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in items) + "</ul>"
