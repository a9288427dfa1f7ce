"""Terminal layout that fits the width it prints at: a console sized for where it writes, and
tables that fold into stacked parts rather than cut a number ("1…") when they are too wide.

A number that is cut is worse than none: it reads as another value. So tables here never
shorten a cell; when the columns do not fit, the table is split into several stacked tables
that each repeat the key column (rank), and text that cannot fit is wrapped, never cropped
(code wraps so that it still pastes: render/code_wrap.py).
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 120  # piped or saved output: wide enough for the tables, unless $COLUMNS says


class PipedConsole(Console):
    """A console whose reader may stop early (``traceclf analyze … | head``): that is not an
    error, and the command decides its exit code (``analyze`` 0, ``compare`` its verdict's),
    where rich's own console exits 1, the code of a regression."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        # (what is still buffered for stdout would fail again at exit: it goes nowhere)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise BrokenPipeError


def new_console(to_string: bool = False, width: int | None = None) -> Console:
    """A console for a report: into a string buffer (``console.file.getvalue()``) when
    ``to_string``, else stdout. ``width`` wins; on a terminal rich measures it; piped or saved
    output uses $COLUMNS when set, else PIPED_WIDTH (rich would assume 80)."""
    buffer = io.StringIO() if to_string else None
    console = PipedConsole(
        file=buffer,
        highlight=False,
        force_terminal=False if to_string else None,
        width=width,
    )
    if width is None and not console.is_terminal:
        columns = os.environ.get("COLUMNS", "")
        console.width = int(columns) if columns.isdigit() and int(columns) > 0 else PIPED_WIDTH
    return console


def output_of(console: Console) -> str | None:
    """What a ``new_console(to_string=True)`` console holds (None for one on stdout)."""
    file = console.file
    return file.getvalue() if isinstance(file, io.StringIO) else None


def hanging(rows: Sequence[tuple[str, Text]], style: str = "") -> Table:
    """Label-and-text rows ("•", "needs:") whose text wraps under itself, not under the label."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, style=style)
    table.add_column(style=style)
    for label, text in rows:
        table.add_row(label, text)
    return table


class FoldedTable:
    """A table whose columns, when they do not fit the width, are folded into several stacked
    tables, each repeating the first ``keys`` columns. Cells are never cut or wrapped."""

    def __init__(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Text]],
        *,
        title: str | None = None,
        keys: int = 1,
        justify: Sequence[str] | None = None,
    ) -> None:
        self.columns = list(columns)
        self.rows = [list(r) for r in rows]
        self.title = title
        self.keys = keys
        self.justify = list(justify or ["right"] * len(self.columns))

    def _table(self, indices: Sequence[int], title: str | None) -> Table:
        table = Table(title=title, title_justify="left", show_edge=False)
        for i in indices:
            table.add_column(
                self.columns[i], justify=self.justify[i], no_wrap=True, overflow="fold"
            )
        for row in self.rows:
            table.add_row(*(row[i] for i in indices))
        return table

    def parts(self, console: Console, width: int) -> list[Table]:
        """The stacked tables for ``width`` columns (one table when everything fits)."""
        keys = list(range(min(self.keys, len(self.columns))))
        rest = list(range(len(keys), len(self.columns)))
        # measured unconstrained: Measurement.get clamps to the width it is given
        options = console.options.update_width(10_000)
        groups: list[list[int]] = []
        for i in rest:
            if groups:
                trial = self._table([*keys, *groups[-1], i], None)
                if Measurement.get(console, options, trial).maximum <= width:
                    groups[-1].append(i)
                    continue
            groups.append([i])
        if not groups:
            groups = [[]]
        titles = [self.title] + ["(continued)" if self.title else None for _ in groups[1:]]
        return [self._table([*keys, *g], t) for g, t in zip(groups, titles, strict=True)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.parts(console, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)
