"""Report renderers: terminal (rich), JSON, Markdown, HTML."""

from __future__ import annotations

import sys
from pathlib import Path

from traceclf.atomic import write_atomic
from traceclf.report import Report


def render(report: Report, fmt: str, output: Path | None = None) -> None:
    """Render ``report`` as ``fmt`` to ``output`` (atomically) or stdout."""
    if fmt == "terminal":
        from traceclf.render.terminal import render_terminal

        if output is None:
            render_terminal(report)
            return
        text = render_terminal(report, to_string=True)
    elif fmt == "json":
        text = report.to_json() + "\n"
    elif fmt == "md":
        from traceclf.render.markdown import render_markdown

        text = render_markdown(report)
    elif fmt == "html":
        from traceclf.render.html import render_html

        text = render_html(report)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    emit(text, output)


def emit(text: str, output: Path | None) -> None:
    """Write rendered text to ``output`` atomically, or to stdout."""
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
