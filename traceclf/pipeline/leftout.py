"""Inputs left out of a run (``capture.skipped_inputs``): of several exports, one that holds
no GPU work to judge (a launcher's or a CPU-only process's beside the ranks' exports of a
folder, one that only copied, or another tool's SQLite database) is left out with a warning rather than stopping the run.
Alone, or when every input is one, it is bad input."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import TypeVar

from traceclf.support.errors import NoGpuWork, TraceError, TraceWarning

R = TypeVar("R")
# A filed report that lists inputs left out (a non-empty ``skipped_inputs``)
LEFT_OUT = re.compile(r'"skipped_inputs": \[\s*\{')


def checked_export(path: Path, check_pages: bool) -> NoGpuWork | None:
    """Check an export (:func:`~traceclf.ingest.schema.inspect_export`; ``check_pages``: for
    damaged pages too): why it holds no GPU work, or None."""
    from traceclf.ingest.schema import inspect_export

    try:
        inspect_export(path, check_pages=check_pages)
    except NoGpuWork as e:
        return e
    return None


def kept_and_left_out(
    outcomes: list[tuple[R | NoGpuWork, str]],
) -> tuple[list[tuple[R, str]], list[dict]]:
    """Of each input's outcome (a result, or why it holds no GPU work) and its name as the
    user gave it: the results kept, with their names, and the inputs left out as
    ``{path, problem}`` (each also a warning)."""
    skipped = [
        {"path": str(named), "problem": why.problem}
        for why, named in outcomes
        if isinstance(why, NoGpuWork)
    ]
    kept = [(r, named) for r, named in outcomes if not isinstance(r, NoGpuWork)]
    if not kept:  # (one input without GPU work, or every one: bad input)
        first = skipped[0]
        raise TraceError(first["path"], first["problem"] + _every_other(skipped))
    warn_left_out(skipped)
    return kept, skipped  # type: ignore[return-value]


def warn_left_out(skipped: list[dict]) -> None:
    """A warning per input left out (again for a run whose report was cached)."""
    for entry in skipped:
        warnings.warn(
            f"{entry['path']}: {entry['problem']}; left out, the other inputs analysed",
            TraceWarning,
            stacklevel=3,
        )


def _every_other(skipped: list[dict]) -> str:
    """What the error of a run whose every input was left out adds to the first's problem:
    the others, by name (their own problems are each a line of a run with one of them)."""
    if len(skipped) == 1:
        return ""
    others = ", ".join(str(e["path"]) for e in skipped[1:])
    return f"; nor does any other input hold GPU work to judge ({others})"


def left_out_of(data: dict) -> list[dict]:
    """The inputs a filed report lists as left out: a run set's under ``grouping``, one
    run's under ``capture``."""
    held = data.get("grouping") if "runs" in data else data.get("capture")
    return (held or {}).get("skipped_inputs") or []


def warn_filed(text: str | None) -> str | None:
    """A filed report's JSON text as it is, warned about again if it lists inputs left out
    (decoded only then: an ``--all-steps`` report runs to megabytes)."""
    if text is not None and LEFT_OUT.search(text):
        warn_left_out(left_out_of(json.loads(text)))
    return text
