"""Report renderers: terminal (rich), JSON, Markdown, HTML."""

from __future__ import annotations

import sys
from pathlib import Path

from traceclf.atomic import write_output
from traceclf.report import Report
from traceclf.runs import RunSet


def render(report: Report | RunSet, fmt: str, output: Path | None = None) -> None:
    """Render ``report`` (one job, or several runs) as ``fmt`` to ``output`` (atomically) or
    stdout."""
    if isinstance(report, RunSet):
        _render_runs(report, fmt, output)
        return
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


def _render_runs(runs: RunSet, fmt: str, output: Path | None) -> None:
    from traceclf.render import runs as r

    if fmt == "terminal":
        if output is None:
            r.runs_terminal(runs)
            return
        text = r.runs_terminal(runs, to_string=True) or ""
    elif fmt == "json":
        text = runs.to_json() + "\n"
    elif fmt == "md":
        text = r.runs_markdown(runs)
    elif fmt == "html":
        text = r.runs_html(runs)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    emit(text, output)


def emit(text: str, output: Path | None) -> None:
    """Write rendered text to ``output`` (traceclf/atomic.py: write_output), or to stdout."""
    if output is None:
        sys.stdout.write(text)
    else:
        write_output(output, text)
