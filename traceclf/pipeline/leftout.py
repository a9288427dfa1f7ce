"""Inputs left out of a run (``capture.skipped_inputs``): of several exports, one that holds
no GPU work to judge (a launcher's or a CPU-only process's beside the ranks' exports of a
folder, or one that only copied) is left out with a warning rather than stopping the run.
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
    warn_left_out({"skipped_inputs": skipped})
    return kept, skipped  # type: ignore[return-value]


def warn_left_out(held: dict) -> None:
    """A warning per input a report's block (``capture``, or a run set's ``grouping``) lists
    as left out: again for a run whose report was cached."""
    for entry in held.get("skipped_inputs") or []:
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


def warn_filed(text: str | None) -> str | None:
    """A filed report's JSON text as it is, warned about again if it lists inputs left out
    (decoded only then: an ``--all-steps`` report runs to megabytes)."""
    if text is not None and LEFT_OUT.search(text):
        data = json.loads(text)
        warn_left_out((data.get("grouping") if "runs" in data else data.get("capture")) or {})
    return text
