"""The report as data: the JSON contract (:mod:`.contract`), several runs, comparisons, and the
report's tables as polars frames. Renderers read these objects, never a trace."""

from traceclf.report.contract import Report
from traceclf.report.runset import RunSet

__all__ = ["Report", "RunSet"]
