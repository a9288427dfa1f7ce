"""traceclf: what bounds a GPU training run, from its Nsight Systems trace.

Python API (stable for notebooks)::

    import traceclf
    trace = traceclf.open("run.sqlite")      # the typed trace model (polars frames)
    report = traceclf.analyze("run.sqlite")  # steady state, measures, bound, fixes
    report.to_dict()                          # the JSON report of report-contract.md
"""

from __future__ import annotations

__version__ = "0.1.0"

from traceclf.api import analyze, open  # mirrors builtins.open on purpose

__all__ = ["__version__", "analyze", "open"]
