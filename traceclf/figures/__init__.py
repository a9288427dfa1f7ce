"""Figures of a report, drawn with matplotlib from the small series the measures computed
(``report.series``: :mod:`traceclf.measures.series`): :mod:`.draw` and :mod:`.views` are the
only modules that import matplotlib, so the analysis never loads it."""
