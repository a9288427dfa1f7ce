"""How a report, or several runs, shows itself in a notebook cell: as the HTML report.

The report objects are data, below the renderers in the layer order (docs/architecture.md),
so they never import one: ``import traceclf`` plugs the HTML renderer in here
(:func:`show_with`), and ``_repr_html_`` asks for it. Importing any module of the package runs
``traceclf/__init__.py`` first, so a report never meets a notebook without it.
"""

from __future__ import annotations

from collections.abc import Callable

_RENDERER: list[Callable[[object], str]] = []


def show_with(renderer: Callable[[object], str]) -> None:
    """Use ``renderer`` (a report or run set -> HTML) for notebook cells."""
    _RENDERER[:] = [renderer]


def notebook_html(report: object) -> str:
    if not _RENDERER:  # (only if traceclf/__init__.py did not run: a broken install)
        raise RuntimeError("no HTML renderer: import traceclf")
    return _RENDERER[0](report)
