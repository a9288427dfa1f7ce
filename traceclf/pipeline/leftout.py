"""Inputs left out of a run (``capture.skipped_inputs``): of several exports, one that holds
no GPU work to judge (a launcher's or a CPU-only process's beside the ranks' exports of a
folder, or one that only copied) is left out with a warning rather than stopping the run.
Alone, or when every input is one, it is bad input."""

from __future__ import annotations

import warnings
from typing import TypeVar

from traceclf.support.errors import NoGpuWork, TraceError, TraceWarning

R = TypeVar("R")


def kept_and_left_out(
    outcomes: list[tuple[R | NoGpuWork | None, str]],
) -> tuple[list[tuple[R, str]], list[dict]]:
    """Of each input's outcome (a result, why it holds no GPU work, or None: not analysed)
    and its name as the user gave it: the results kept, with their names, and the inputs left
    out as ``{path, problem}`` (each also a warning)."""
    skipped = [
        {"path": str(named), "problem": why.problem}
        for why, named in outcomes
        if isinstance(why, NoGpuWork)
    ]
    kept = [(r, named) for r, named in outcomes if r is not None and not isinstance(r, NoGpuWork)]
    if not kept:  # (one input without GPU work, or every one: bad input)
        first = skipped[0]
        raise TraceError(first["path"], first["problem"] + _every_other(skipped))
    for entry in skipped:
        warnings.warn(
            f"{entry['path']}: {entry['problem']}; left out, the other inputs analysed",
            TraceWarning,
            stacklevel=3,
        )
    return kept, skipped  # type: ignore[return-value]


def _every_other(skipped: list[dict]) -> str:
    """What the error of a run whose every input was left out adds to the first's problem."""
    if len(skipped) == 1:
        return ""
    return f"; so has every other input (none of the {len(skipped)} exports holds GPU work)"
