"""Writing the files that go with a report: every table into a folder (``--export-dir``, CSV or
Parquet), and a Markdown report's figures as PNG files beside it. They are written together
(:func:`traceclf.support.atomic.written_together`: all of them or none, a folder traceclf made
removed again), under names traceclf derives (a link planted there is refused, never
followed), and never onto an input of the run.

Text cells come from traces (kernel, NVTX and file names): in CSV they go through
:func:`traceclf.support.escape.for_csv` (one line, control characters written out, no formula),
in Parquet through :func:`~traceclf.support.escape.visible`; the CSV writer quotes commas, quotes
and the rest (RFC 4180).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from traceclf.support.atomic import Together, check_output, written_together
from traceclf.support.errors import TraceError

if TYPE_CHECKING:
    from traceclf.report.contract import Report
    from traceclf.report.runset import RunSet


def table_bytes(df: pl.DataFrame, fmt: str = "csv") -> bytes:
    """``df`` as a CSV (header, RFC 4180 quoting) or Parquet file, its text cells made safe."""
    from traceclf.support.escape import for_csv, visible

    safe = for_csv if fmt == "csv" else visible
    df = df.with_columns(
        pl.col(c).map_elements(safe, return_dtype=pl.String)
        for c, dtype in df.schema.items()
        if dtype == pl.String
    )
    if fmt == "csv":
        return df.write_csv().encode("utf-8")
    if fmt == "parquet":
        buffer = io.BytesIO()
        df.write_parquet(buffer)
        return buffer.getvalue()
    raise ValueError(f"unknown table format {fmt!r}")


def export_tables(
    report: Report | RunSet, folder: str | Path, fmt: str = "csv", inputs: Iterable[Path] = ()
) -> list[Path]:
    """Write every table of ``report`` (:data:`traceclf.report.frames.TABLES`) into ``folder``
    (created if missing) as ``<table>.csv`` or ``<table>.parquet``; returns the files written.
    Nothing is written onto ``inputs`` or the report's own inputs."""
    folder = Path(folder)
    written = []
    with written_together([*inputs, *report.input_files()]) as files:
        # (on failure, removed with the tables: only the folders made here, if still empty)
        files.made(make_folder(folder))
        for name, df in report.tables().items():
            path = folder / f"{name}.{fmt}"
            files.add(path, table_bytes(df, fmt))
            written.append(path)
    return written


def make_folder(folder: Path) -> list[Path]:
    """Create ``folder`` when missing (refusing anything there that is not a folder); the
    folders created, innermost first."""
    if folder.exists() and not folder.is_dir():
        raise TraceError(folder, "--export-dir: not a folder")
    missing = [p for p in (folder, *folder.absolute().parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TraceError(folder, f"--export-dir: cannot create the folder ({e.strerror})") from None
    return missing


def figures_beside(report: Report, output: Path, files: Together, tag: str = "") -> dict[str, str]:
    """Draw ``report``'s figures into PNG files beside ``output`` (``report.md`` ->
    ``report.step_timeline.png``; ``tag`` goes before the figure name for several runs), staged
    in ``files`` with the report, and return {figure: file name relative to ``output``'s
    folder}. Nothing is drawn when ``output`` is not a regular file to be (a FIFO, a device,
    /dev/stdout)."""
    from traceclf.figures.draw import report_figures
    from traceclf.figures.style import figure_png

    target, st = check_output(output)
    if st is not None and not target.is_file():
        return {}
    stem = re.sub(r"\.(md|markdown)$", "", target.name, flags=re.IGNORECASE)
    out = {}
    for name, fig in report_figures(report.series).items():
        path = target.parent / f"{stem}.{tag}{name}.png"
        files.add(path, figure_png(fig))
        out[name] = path.name
    return out
