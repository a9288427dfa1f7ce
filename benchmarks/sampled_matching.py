"""Collective matching under step sampling against ``--all-steps``, on one multi-rank export.

    python benchmarks/sampled_matching.py EXPORT.sqlite [FRACTION ...]

Analyses EXPORT with every step, then sampled with a row budget of each FRACTION of its event
rows (default 1/4 and 1/8), and prints, per run: steps analysed, collectives matched and
unmatched, late arrivals per step, and how many of the sampled pairs of collective kernels
(rank, start) ``--all-steps`` pairs differently (0: every sampled match is one ``--all-steps``
makes too). A check for captures too big for the tests: run it where the export is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from traceclf.measures import collectives
from traceclf.pipeline.analysis import AnalysisOptions, analyze_inputs
from traceclf.pipeline.twopass import event_rows


def run(path: Path, budget: int | None):
    """The report and the pairs of collective kernels each matched instance holds."""
    caught = []
    original = collectives.matched

    def spy(ranks):
        caught.append(original(ranks))
        return caught[-1]

    collectives.matched = spy
    try:
        opts = (
            AnalysisOptions(use_cache=False, quiet=True, all_steps=True)
            if budget is None
            else AnalysisOptions(use_cache=False, quiet=True, row_budget=budget)
        )
        report = analyze_inputs([str(path)], opts)
    finally:
        collectives.matched = original
    pairs: set = set()
    if caught:
        full = collectives._full(caught[0].instances)
        grouped = full.group_by("ordinal", "kind", "instance").agg(pl.struct("rank", "start"))
        pairs = {frozenset((d["rank"], d["start"]) for d in row) for row in grouped["rank"]}
    return report, pairs


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    fractions = [float(f) for f in argv[1:]] or [0.25, 0.125]
    rows = event_rows(path)
    print(f"{path.name}: {rows:,} event rows")
    everything, all_pairs = run(path, None)
    for label, budget in [("--all-steps", None)] + [
        (f"budget {f:g}", int(rows * f)) for f in fractions
    ]:
        report, pairs = (everything, all_pairs) if budget is None else run(path, budget)
        cross = report.cross_rank or {}
        late = [
            (x["rank"], x["late_ms_per_step"], x["instances"])
            for x in cross.get("late_arrivals", [])
        ]
        print(
            f"{label}: steps {report.steps['analysed']}/{report.steps['used']}, "
            f"matched {cross.get('collectives_matched')}, unmatched {cross.get('collectives_unmatched')}, "
            f"left out {cross.get('late_arrivals_left_out')}, late (rank, ms/step, instances) {late}, "
            f"pairs --all-steps makes otherwise {len(pairs - all_pairs)}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
