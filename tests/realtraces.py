"""Where the real H100 traces live for tests: fixtures/ first, then ../shared/traces."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEARCH = (REPO / "fixtures", REPO.parent / "shared" / "traces")


def trace_path(name: str) -> Path:
    """Path of a real trace by file name; skips the test when it is nowhere to be found."""
    for folder in SEARCH:
        if (folder / name).exists():
            return folder / name
    pytest.skip(f"real trace {name} not available")


@cache
def measured(name: str, step_regex: str | None = None):
    """(steps, measures) per rank of a real trace, computed once per test session."""
    from traceclf.load import load_trace
    from traceclf.measures import measure_rank
    from traceclf.steps import find_steps

    trace = load_trace(trace_path(name))
    out = []
    for pid in trace.rank_pids:
        rank = trace.for_pid(pid)
        steps = find_steps(rank, step_regex)
        out.append((steps, measure_rank(rank, steps, trace.gpu_of(pid))))
    return out
