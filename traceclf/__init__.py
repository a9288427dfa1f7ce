"""traceclf: what bounds a GPU training run, from its Nsight Systems trace.

Python API (stable for notebooks)::

    import traceclf
    trace = traceclf.open("run.sqlite")      # the typed trace model (polars frames)
    report = traceclf.analyze("run.sqlite")  # steady state, measures, bound, fixes
    report.to_dict()                          # the JSON report of report-contract.md
"""

from __future__ import annotations

from traceclf.api import analyze, open  # mirrors builtins.open on purpose
from traceclf.report import display
from traceclf.support.errors import TraceError
from traceclf.support.version import __version__

__all__ = ["TraceError", "__version__", "analyze", "open"]


def _notebook_html(report: object) -> str:
    from traceclf.render import notebook_html  # (rendering loads on first display)

    return notebook_html(report)  # type: ignore[arg-type]


# A report is data, below the renderers: its notebook display is plugged in here.
display.show_with(_notebook_html)
