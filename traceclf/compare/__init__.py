"""Compare runs: a baseline against candidates, the noise band, measures that moved and what
explains the change."""

from traceclf.compare.regression import compare_many, compare_reports, load_run

__all__ = ["compare_many", "compare_reports", "load_run"]
