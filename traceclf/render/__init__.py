"""Report renderers: terminal (rich), JSON, Markdown, HTML, CSV."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from traceclf.report.contract import Report
from traceclf.report.runset import RunSet
from traceclf.support.atomic import Together, written_together


def render(
    report: Report | RunSet, fmt: str, output: Path | None = None, inputs: Iterable[Path] = ()
) -> None:
    """Render ``report`` (one job, or several runs) as ``fmt`` to ``output`` (atomically) or
    stdout. Markdown written to a file gets its figures as PNG files beside it (none on
    stdout), written with the report: all of them or none. csv is the per-rank table
    (report/frames.py). Nothing is written onto ``inputs`` or the report's own inputs."""
    with written_together([*inputs, *report.input_files()]) as files:
        _render(report, fmt, output, files)


def render_json_text(text: str, output: Path | None, inputs: Iterable[Path] = ()) -> None:
    """Write a report that is JSON text already (a cached one:
    :meth:`traceclf.pipeline.analysis.Inputs.cached_json`) as ``render(report, "json", ...)``
    writes it."""
    with written_together(inputs) as files:
        emit(text + "\n", output, files)


def _render(report: Report | RunSet, fmt: str, output: Path | None, files: Together) -> None:
    if fmt == "csv":
        from traceclf.export.files import table_bytes

        emit(table_bytes(report.tables()["ranks"]).decode("utf-8"), output, files)
        return
    if isinstance(report, RunSet):
        _render_runs(report, fmt, output, files)
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
        from traceclf.export.files import figures_beside
        from traceclf.render.markdown import render_markdown

        figures = figures_beside(report, output, files) if output is not None else None
        text = render_markdown(report, figures)
    elif fmt == "html":
        from traceclf.render.html import render_html

        text = render_html(report)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    emit(text, output, files)


def _render_runs(runs: RunSet, fmt: str, output: Path | None, files: Together) -> None:
    from traceclf.render import multirun as r

    if fmt == "terminal":
        if output is None:
            r.runs_terminal(runs)
            return
        text = r.runs_terminal(runs, to_string=True) or ""
    elif fmt == "json":
        text = runs.to_json() + "\n"
    elif fmt == "md":
        from traceclf.export.files import figures_beside

        figures = (
            [figures_beside(run, output, files, f"run{i}.") for i, run in enumerate(runs.runs, 1)]
            if output is not None
            else None
        )
        text = r.runs_markdown(runs, figures)
    elif fmt == "html":
        text = r.runs_html(runs)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    emit(text, output, files)


def notebook_html(report: Report | RunSet) -> str:
    """What a notebook cell shows (``_repr_html_``, wired in traceclf/__init__.py): the HTML
    report with its style scoped to it, or a run set's summary table and then each run."""
    from traceclf.render.html import html_fragment, notebook_html

    if isinstance(report, RunSet):
        from traceclf.render.multirun import runs_html_body

        return html_fragment(runs_html_body(report))
    return notebook_html(report)


def emit(text: str, output: Path | None, files: Together | None = None) -> None:
    """Write rendered text to ``output`` (with ``files``, the others that go with it: see
    traceclf/support/atomic.py), or to stdout."""
    if output is None:
        sys.stdout.write(text)
    elif files is not None:
        files.add(output, text, named=True)
    else:
        with written_together() as alone:
            alone.add(output, text, named=True)
