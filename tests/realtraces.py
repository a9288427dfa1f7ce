"""Where the real H100 traces live for tests: fixtures/ first, then ../shared/traces."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEARCH = (
    REPO / "fixtures",
    REPO / "fixtures" / "external",
    REPO.parent / "shared" / "traces",
    REPO.parent / "shared" / "traces" / "external",
)


def trace_path(name: str) -> Path:
    """Path of a real trace by name (``h100_comm_ep2`` or ``h100_comm_ep2.sqlite``): fixtures/
    first, its trimmed copy there if that is what was kept, then the shared folder; skips the
    test when it is nowhere to be found."""
    stem = name.removesuffix(".sqlite")
    for folder in SEARCH:
        for candidate in (f"{stem}.sqlite", f"{stem}_trimmed.sqlite"):
            if (folder / candidate).is_file():
                return folder / candidate
    pytest.skip(f"real trace {name} not available")


@cache
def measured(name: str, step_regex: str | None = None):
    """(steps, measures) per rank of a real trace, computed once per test session."""
    from traceclf.ingest.load import load_trace
    from traceclf.measures import measure_rank
    from traceclf.steps.find import find_steps

    trace = load_trace(trace_path(name))
    out = []
    for pid in trace.rank_pids:
        rank = trace.for_pid(pid)
        steps = find_steps(rank, step_regex)
        out.append((steps, measure_rank(rank, steps, trace.gpu_of(pid))))
    return out
